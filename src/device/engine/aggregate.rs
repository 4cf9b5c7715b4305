//! Top-k over an aggregate on the device (aggregate.cu): `SELECT keys, aggregates … GROUP BY
//! keys ORDER BY an aggregate LIMIT k`.
//!
//! # Structure
//!
//! One pass (`agg_columns`, or a generated program that runs it over the rows its filter
//! passes, [`AggregateFilter`]) finds every row's group in an open-addressing hash table and
//! updates its accumulators with atomics. The occupied slots are compacted (`agg_compact`;
//! with a `HAVING`, its generated program then keeps the groups it passes,
//! [`AggregateHaving`]), each group's ranking value becomes a composite key with the group's
//! slot as its row id (`agg_rank`), and the selection every per-row top-k takes
//! ([`TopKEngine::select_sorted`]) picks the k best; only those k groups' keys and
//! accumulators come back (`agg_gather`).
//!
//! # Ties
//!
//! Groups with equal ranking values are ordered by their keys, ascending, NULL after every
//! value, the first key column first (the composite's low bits, see aggregate.cu). Distinct
//! groups have distinct composites, so the k groups are the same on every run.
//!
//! # Exactness
//!
//! Counts, integer sums (wrapping, as DataFusion's) and minima and maxima are exact.
//! Floating-point sums (and averages) are added in another order than DataFusion's, so their
//! last bits may differ, and so may a NaN sum's bits (the device's NaN is its own). MIN/MAX over f64 follow DataFusion 55's grouped accumulator
//! (`partial_cmp` from f64::MAX or f64::MIN), except that a zero extreme is +0.0 (DataFusion
//! keeps the first zero it meets); a NaN input, whose result there depends on the rows'
//! order, declines the query ([`AggregateDecline::NanInMinMax`]) for the host to answer.
//!
//! # The table
//!
//! Sized for four times the estimated groups: the sample's estimate of skewed keys runs up to
//! about half the true count, and the load factor should stay at most 0.5. Past half its
//! slots the pass flags the table full (checked as blocks add their claims, aggregate.cuh),
//! and the engine runs it again in a table four times larger.

use super::*;

mod having;
mod reference;

pub use having::{AGG_HAVING_ENTRY, AggregateHaving, HavingColumn};
pub use reference::{HostColumn, aggregate_top_k_host};

/// Threads of a block of aggregate.cu (`AGG_THREADS`).
const AGG_THREADS: u32 = 256;
/// The most value columns and accumulators agg_columns takes (`AGG_MAX_VALUES`,
/// `AGG_MAX_ACCS`).
pub const AGG_MAX_VALUES: usize = 4;
pub const AGG_MAX_ACCUMULATORS: usize = 8;
/// The most key columns (key words) a group has.
pub const AGG_MAX_KEYS: usize = 2;
/// The smallest table, in slots.
const AGG_MIN_SLOTS: usize = 1024;
/// aggregate.cuh's status bits.
const AGG_STATUS_FULL: u64 = 1;
const AGG_STATUS_NAN: u64 = 2;
const AGG_STATUS_HOST: u64 = 4;
/// The entry point of a generated filtered pass (src/fusion/aggregate.rs).
pub const AGG_FILTERED_ENTRY: &str = "agg_filtered";
/// `AGG_NO_COLUMN` (COUNT(*)) and agg_rank's "no count accumulator".
const AGG_NO_COLUMN: u64 = 0xff;
const AGG_NO_ACC: u32 = u32::MAX;

/// A device column of 8-byte values (i64 or f64, by the operation that reads it): `values`
/// the first row's address, `validity` an Arrow validity bitmap (0: no NULLs) whose row 0 is
/// bit `validity_offset`.
///
/// Where a generated pass computes the keys and values ([`AggregateFilter`]), a column only
/// says whether its values may be NULL ([`AggregateColumn::computed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregateColumn {
    pub values: u64,
    pub validity: u64,
    pub validity_offset: u64,
}

impl AggregateColumn {
    /// A key or value a generated pass computes, `nullable` or not: no address is read, and
    /// a nonzero validity says that NULLs may occur (the NULL counts and the ranking's NULL
    /// bits depend on it).
    pub fn computed(nullable: bool) -> Self {
        Self {
            values: 0,
            validity: u64::from(nullable),
            validity_offset: 0,
        }
    }
}

/// An aggregate over the value column of the given index (none for `CountStar`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggregateOp {
    CountStar,
    /// COUNT(x): the rows whose x is not NULL.
    Count(usize),
    /// SUM of an i64 column, wrapping.
    SumI64(usize),
    /// SUM of an f64 column.
    SumF64(usize),
    /// SUM of an i64 column cast to f64 (DataFusion's AVG of integers sums them so).
    SumI64AsF64(usize),
    MinI64(usize),
    MaxI64(usize),
    MinF64(usize),
    MaxF64(usize),
}

impl AggregateOp {
    /// The value column it reads.
    pub fn column(self) -> Option<usize> {
        match self {
            Self::CountStar => None,
            Self::Count(c)
            | Self::SumI64(c)
            | Self::SumF64(c)
            | Self::SumI64AsF64(c)
            | Self::MinI64(c)
            | Self::MaxI64(c)
            | Self::MinF64(c)
            | Self::MaxF64(c) => Some(c),
        }
    }

    /// aggregate.cuh's accumulator kind (`AGG_*`; 7: aggregate.cu `AGG_SUM_I64_AS_F64`).
    fn device_kind(self) -> u64 {
        match self {
            Self::CountStar | Self::Count(_) => 0,
            Self::SumI64(_) => 1,
            Self::SumF64(_) => 2,
            Self::MinI64(_) => 3,
            Self::MaxI64(_) => 4,
            Self::MinF64(_) => 5,
            Self::MaxF64(_) => 6,
            Self::SumI64AsF64(_) => 7,
        }
    }

    /// Whether it is NULL for a group without a non-NULL value (every op but the counts).
    fn nullable(self) -> bool {
        !matches!(self, Self::CountStar | Self::Count(_))
    }

    fn is_min(self) -> bool {
        matches!(self, Self::MinI64(_) | Self::MinF64(_))
    }
}

/// What ranks the groups: one of the call's ops, an average: the quotient of a sum op and
/// a count op (`CountStar`, or the `Count` of the sum's column) as f64, DataFusion's
/// `sum / count as f64` (DataFusion's AVG of integers sums them as f64: its sum op is
/// `SumI64AsF64`; over `SumI64` the wrapped integer sum is divided), or a group key column
/// (as i64; NULL where the key is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankBy {
    Op(usize),
    Avg { sum: usize, count: usize },
    Key(usize),
}

/// The groups' order: by `by`, descending or not, NULL ranking values first or last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregateOrder {
    pub by: RankBy,
    pub descending: bool,
    pub nulls_first: bool,
}

/// A generated program's pass (src/fusion/aggregate.rs), run in place of `agg_columns` over
/// the rows its filter passes, reading the call's columns or computing the keys and values
/// itself (`agg_rows`): the kernel, and its inputs' arguments (four words an input).
/// A row only the host evaluates declines the call ([`AggregateDecline::HostOnlyRow`]).
#[derive(Debug, Clone, Copy)]
pub struct AggregateFilter<'a> {
    pub kernel: &'a GeneratedKernel,
    pub inputs: &'a [u64],
}

/// A top-k over an aggregate of `rows` device-resident rows.
#[derive(Debug, Clone)]
pub struct AggregateCall<'a> {
    /// The group key columns (i64), one or two.
    pub keys: &'a [AggregateColumn],
    /// The columns the ops read, at most [`AGG_MAX_VALUES`].
    pub values: &'a [AggregateColumn],
    pub ops: &'a [AggregateOp],
    pub rows: usize,
    pub order: AggregateOrder,
    pub k: usize,
    /// The expected number of groups: the first table holds twice as many.
    pub groups_estimate: usize,
    pub algorithm: DeviceAlgorithm,
    /// The rows aggregated: those the program passes (`None`: every row).
    pub filter: Option<AggregateFilter<'a>>,
    /// The groups ranked: those the program keeps (`None`: every group).
    pub having: Option<AggregateHaving<'a>>,
}

impl AggregateCall<'_> {
    /// The key width of the ranking composites: the engine that runs the call must have it.
    pub fn key_width(&self) -> KeyWidth {
        KeyWidth::for_total_bits(rank_bits(self.keys, self.values, self.ops, self.order))
    }
}

/// One aggregate's value for a group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AggValue {
    Count(u64),
    I64(Option<i64>),
    F64(Option<f64>),
}

/// A chosen group: its key (`None`: NULL) and its ops' values, in the call's order.
#[derive(Debug, Clone, PartialEq)]
pub struct AggregateGroup {
    pub key: Vec<Option<i64>>,
    pub values: Vec<AggValue>,
}

/// Why the device gives no result: the host computes the query instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggregateDecline {
    /// A MIN or MAX over f64 met a NaN (DataFusion's result depends on the rows' order).
    NanInMinMax,
    /// The filter (or `HAVING`) met a row (a group) only the host evaluates (one DataFusion
    /// fails on, or a NaN whose bits the device cannot reproduce).
    HostOnlyRow,
}

/// How the aggregation ran.
#[derive(Debug, Clone, Default)]
pub struct AggregateReport {
    /// Slots of the table that held every group.
    pub slots: usize,
    /// Passes over the rows (more than one where a table filled).
    pub passes: usize,
    pub declined: Option<AggregateDecline>,
    /// The device's milliseconds in the aggregation (every pass, the table's resets included)
    /// and in the selection (the groups' compaction and ranking, the selection, the chosen
    /// groups' read-back), as its events timed them.
    pub phases_ms: [f32; 2],
}

/// A top-k over an aggregate's result: the min(k, groups) best groups in order, and the
/// number of groups.
#[derive(Debug, Clone, Default)]
pub struct AggregateTopK {
    pub top: Vec<AggregateGroup>,
    pub groups: usize,
    pub report: AggregateReport,
}

/// Device columns uploaded from the host (tests, benchmarks), held while the engine reads
/// them.
pub struct DeviceColumns {
    _buffers: Vec<PooledBuffer>,
    pub columns: Vec<AggregateColumn>,
}

/// The device accumulators of a call: its ops, then a COUNT(x) for each nullable column that
/// a SUM, MIN or MAX reads and no op counts; and, per op, the accumulator counting its
/// column's non-NULL values where it can be NULL.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AccumulatorPlan {
    kinds: Vec<AggregateOp>,
    null_count: Vec<Option<usize>>,
}

impl AccumulatorPlan {
    fn new(values: &[AggregateColumn], ops: &[AggregateOp]) -> GpuResult<Self> {
        let mut kinds = ops.to_vec();
        let mut null_count = Vec::with_capacity(ops.len());
        for op in ops {
            let column = op.column();
            if let Some(c) = column.filter(|&c| c >= values.len()) {
                return Err(GpuError(format!(
                    "{op:?} reads value column {c} of {}",
                    values.len()
                )));
            }
            let counted = match column {
                Some(c) if op.nullable() && values[c].validity != 0 => {
                    let at = kinds.iter().position(|k| *k == AggregateOp::Count(c));
                    Some(at.unwrap_or_else(|| {
                        kinds.push(AggregateOp::Count(c));
                        kinds.len() - 1
                    }))
                }
                _ => None,
            };
            null_count.push(counted);
        }
        if kinds.len() > AGG_MAX_ACCUMULATORS {
            return Err(GpuError(format!(
                "{} accumulators (with the NULL counts) for at most {AGG_MAX_ACCUMULATORS}",
                kinds.len()
            )));
        }
        Ok(Self { kinds, null_count })
    }
}

/// How agg_rank encodes the ranking value: (kind, accumulator or key column, count
/// accumulator, nullable).
fn rank_encoding(
    order: AggregateOrder,
    keys: &[AggregateColumn],
    ops: &[AggregateOp],
    plan: &AccumulatorPlan,
) -> GpuResult<(u32, u32, u32, bool)> {
    let op_at = |i: usize| {
        ops.get(i)
            .copied()
            .ok_or_else(|| GpuError(format!("the ranking reads op {i} of {}", ops.len())))
    };
    match order.by {
        RankBy::Op(i) => {
            let op = op_at(i)?;
            let kind = match op {
                AggregateOp::CountStar | AggregateOp::Count(_) => 0,
                AggregateOp::SumI64(_) => 1,
                AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_) => 2,
                _ => 3,
            };
            let count = plan.null_count[i];
            Ok((
                kind,
                i as u32,
                count.map_or(AGG_NO_ACC, |c| c as u32),
                count.is_some(),
            ))
        }
        RankBy::Avg { sum, count } => {
            let kind = match op_at(sum)? {
                AggregateOp::SumI64(_) => 4,
                AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_) => 5,
                other => return Err(GpuError(format!("an average of {other:?}"))),
            };
            let nullable = match op_at(count)? {
                AggregateOp::CountStar => false,
                AggregateOp::Count(_) => plan.null_count[sum].is_some(),
                other => return Err(GpuError(format!("an average divided by {other:?}"))),
            };
            Ok((kind, sum as u32, count as u32, nullable))
        }
        RankBy::Key(j) => match keys.get(j) {
            Some(key) => Ok((6, j as u32, AGG_NO_ACC, key.validity != 0)),
            None => Err(GpuError(format!(
                "the ranking reads key {j} of {}",
                keys.len()
            ))),
        },
    }
}

/// Bits of a call's ranking composite: each key column's 64 (and a NULL bit where it has
/// NULLs), the ranking value's 64 and its NULL bit where it may be NULL.
fn rank_bits(
    keys: &[AggregateColumn],
    values: &[AggregateColumn],
    ops: &[AggregateOp],
    order: AggregateOrder,
) -> u32 {
    let key_bits: u32 = keys.iter().map(|c| 64 + u32::from(c.validity != 0)).sum();
    let nullable = AccumulatorPlan::new(values, ops)
        .and_then(|plan| rank_encoding(order, keys, ops, &plan))
        .is_ok_and(|(_, _, _, nullable)| nullable);
    key_bits + 64 + u32::from(nullable)
}

/// The first table's slots for `estimate` groups of `rows` rows: four times the estimate, a
/// power of two, never more than a table that cannot fill.
fn agg_table_slots(estimate: usize, rows: usize) -> usize {
    let most = (2 * rows.max(1)).next_power_of_two().max(AGG_MIN_SLOTS);
    (4 * estimate.max(1))
        .next_power_of_two()
        .clamp(AGG_MIN_SLOTS, most)
}

/// The agg_columns spec (aggregate.cu `AggSpec`) as little-endian words; the addresses of
/// value columns past `values` are 0, which agg_columns reads as "no column".
fn spec_bytes(
    keys: &[AggregateColumn],
    values: &[AggregateColumn],
    plan: &AccumulatorPlan,
) -> Vec<u8> {
    let mut words = vec![0u64; 6 + 3 * AGG_MAX_VALUES + AGG_MAX_ACCUMULATORS + 1];
    for (j, c) in keys.iter().enumerate() {
        words[j] = c.values;
        words[2 + j] = c.validity;
        words[4 + j] = c.validity_offset;
    }
    for (j, c) in values.iter().enumerate() {
        words[6 + j] = c.values;
        words[6 + AGG_MAX_VALUES + j] = c.validity;
        words[6 + 2 * AGG_MAX_VALUES + j] = c.validity_offset;
    }
    let accs = 6 + 3 * AGG_MAX_VALUES;
    for (a, op) in plan.kinds.iter().enumerate() {
        let column = op.column().map_or(AGG_NO_COLUMN, |c| c as u64);
        words[accs + a] = op.device_kind() | column << 8;
    }
    words[accs + AGG_MAX_ACCUMULATORS] = plan.kinds.len() as u64;
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The hash table of one pass, on the device: `cap` slots of `width` words (aggregate.cuh).
struct AggTable {
    slots: PooledBuffer,
    ctl: PooledBuffer,
    cap: usize,
    width: usize,
    /// The address of slot 0's first accumulator (after its key words and state word).
    acc: u64,
}

/// Words per slot for `kw` key words and `accumulators` accumulators: a power of two, so that
/// no slot straddles two of the memory's 32-byte sectors more than it must.
pub fn agg_slot_width(kw: usize, accumulators: usize) -> usize {
    (kw + 1 + accumulators.max(1)).next_power_of_two()
}

impl TopKEngine {
    /// The min(k, groups) best groups of a top-k over an aggregate (see the module
    /// documentation); the engine's key width must be [`AggregateCall::key_width`].
    pub fn aggregate_top_k(&mut self, call: &AggregateCall<'_>) -> GpuResult<AggregateTopK> {
        let kw = call.keys.len();
        if !(1..=AGG_MAX_KEYS).contains(&kw) || call.values.len() > AGG_MAX_VALUES {
            return Err(GpuError(format!(
                "{kw} key columns and {} value columns for at most {AGG_MAX_KEYS} and \
                 {AGG_MAX_VALUES}",
                call.values.len()
            )));
        }
        let plan = AccumulatorPlan::new(call.values, call.ops)?;
        let rank = rank_encoding(call.order, call.keys, call.ops, &plan)?;
        if call.key_width() != self.kind {
            return Err(GpuError(format!(
                "an aggregate ranked by {:?} keys on an engine of {:?} keys",
                call.key_width(),
                self.kind
            )));
        }
        let mut result = AggregateTopK::default();
        let spec = spec_bytes(call.keys, call.values, &plan);
        let spec_buffer = self.device.pool.alloc(spec.len(), &self.stream)?;
        self.upload_bytes(&spec, spec_buffer.ptr())?;
        let mut cap = agg_table_slots(call.groups_estimate, call.rows);
        let timer = GpuTimer::start(&self.stream)?;
        let (table, groups) = loop {
            result.report.passes += 1;
            let table = self.aggregate_pass(call, &plan, spec_buffer.ptr(), cap)?;
            let ctl = self.read_words(table.ctl.ptr(), 2)?;
            if ctl[1] & AGG_STATUS_HOST != 0 {
                result.report.declined = Some(AggregateDecline::HostOnlyRow);
                return Ok(result);
            }
            if ctl[1] & AGG_STATUS_NAN != 0 {
                result.report.declined = Some(AggregateDecline::NanInMinMax);
                return Ok(result);
            }
            if ctl[1] & AGG_STATUS_FULL == 0 {
                break (table, ctl[0] as usize);
            }
            if cap >= 2 * call.rows.max(1) {
                return Err(GpuError(format!(
                    "a table of {cap} slots filled with {} rows",
                    call.rows
                )));
            }
            cap *= 4;
        };
        result.report.slots = cap;
        result.groups = groups;
        let aggregated = timer.elapsed()?;
        result.report.phases_ms[0] = aggregated;
        if groups == 0 || call.k == 0 {
            return Ok(result);
        }
        let Some(rows) = self.aggregate_select(call, &plan, rank, &table, groups)? else {
            result.report.declined = Some(AggregateDecline::HostOnlyRow);
            return Ok(result);
        };
        result.report.phases_ms[1] = timer.elapsed()? - aggregated;
        let stride = kw + 1 + plan.kinds.len();
        result.top = (rows.chunks_exact(stride))
            .map(|row| decode_group(row, kw, call.ops, &plan))
            .collect();
        Ok(result)
    }

    /// One aggregation pass over the call's rows into a new table of `cap` slots.
    fn aggregate_pass(
        &mut self,
        call: &AggregateCall<'_>,
        plan: &AccumulatorPlan,
        spec: u64,
        cap: usize,
    ) -> GpuResult<AggTable> {
        let kw = call.keys.len();
        let width = agg_slot_width(kw, plan.kinds.len());
        let slots = self.device.pool.alloc(cap * width * 8, &self.stream)?;
        self.memset_zero(slots.ptr(), cap * width * 8)?;
        let acc = slots.ptr() + (kw as u64 + 1) * 8;
        for (a, op) in plan.kinds.iter().enumerate() {
            // A minimum starts at the largest image, every other accumulator at zero.
            if op.is_min() {
                self.memset_words_ones(acc + a as u64 * 8, width * 8, cap)?;
            }
        }
        let ctl = self.device.pool.alloc(16, &self.stream)?;
        self.memset_zero(ctl.ptr(), 16)?;
        let limit = cap / 2;
        if let Some(filter) = call.filter.filter(|_| call.rows > 0) {
            let mut args: Vec<Arg> = filter.inputs.iter().map(|&v| Arg::U64(v)).collect();
            let table = args![
                spec,
                call.rows,
                slots.ptr(),
                acc,
                cap,
                limit,
                ctl.ptr(),
                width
            ];
            args.extend_from_slice(table);
            self.launch_function(
                &filter.kernel.function,
                AGG_FILTERED_ENTRY,
                self.grid_for(call.rows, 4),
                AGG_THREADS,
                0,
                &args,
            )?;
        } else if call.rows > 0 {
            self.launch(
                &format!("agg_columns_w{kw}"),
                self.grid_for(call.rows, 4),
                AGG_THREADS,
                0,
                args![
                    spec,
                    call.rows,
                    slots.ptr(),
                    acc,
                    cap,
                    limit,
                    ctl.ptr(),
                    width
                ],
            )?;
        }
        Ok(AggTable {
            slots,
            ctl,
            cap,
            width,
            acc,
        })
    }

    /// The best min(k, groups) of the table's `groups` groups (those the call's `HAVING`
    /// keeps), read back as rows of key words, state word and accumulators; `None` where a
    /// group sends the query to the host.
    fn aggregate_select(
        &mut self,
        call: &AggregateCall<'_>,
        plan: &AccumulatorPlan,
        (kind, rank_acc, count_acc, nullable): (u32, u32, u32, bool),
        table: &AggTable,
        groups: usize,
    ) -> GpuResult<Option<Vec<u64>>> {
        let kw = call.keys.len();
        let cap = table.cap;
        let dense = self.device.pool.alloc(groups * 8, &self.stream)?;
        let count = self.device.pool.alloc(8, &self.stream)?;
        self.memset_zero(count.ptr(), 8)?;
        self.launch(
            &format!("agg_compact_w{kw}"),
            self.grid_for(cap, 4),
            AGG_THREADS,
            0,
            args![
                table.slots.ptr(),
                cap,
                table.width,
                dense.ptr(),
                count.ptr()
            ],
        )?;
        let (dense, ranked) = match call.having {
            None => (dense, groups),
            Some(having) => {
                match self.aggregate_having(call, plan, having, (table, &dense), groups)? {
                    Some(kept) => kept,
                    None => return Ok(None),
                }
            }
        };
        if ranked == 0 {
            return Ok(Some(Vec::new()));
        }
        let mut pairs = self.alloc_pairs(ranked)?;
        pairs.set_ids_below(cap as u64);
        let flags = u32::from(call.order.descending)
            | u32::from(call.order.nulls_first) << 1
            | u32::from(nullable) << 2;
        let key_nullable = (call.keys.iter().enumerate())
            .fold(0u32, |m, (j, c)| m | u32::from(c.validity != 0) << j);
        let words = (self.kind.key_bytes() / 8) as u32;
        self.launch(
            &format!("agg_rank_w{kw}"),
            self.grid_for(ranked, 4),
            AGG_THREADS,
            0,
            args![
                table.slots.ptr(),
                table.acc,
                table.width,
                dense.ptr(),
                ranked,
                kind,
                rank_acc,
                count_acc,
                flags,
                key_nullable,
                words,
                pairs.key_at(0),
                pairs.id_at(0)
            ],
        )?;
        // The model chose for the groups it estimated: a bitonic selection past its k (more
        // groups than estimated) takes the radix route instead.
        let k = call.k.min(ranked);
        let bitonic_max =
            crate::device::plan::bitonic_max_k(self.device.max_shared_per_block, self.kind);
        let algorithm = match call.algorithm {
            DeviceAlgorithm::Bitonic if k > bitonic_max => DeviceAlgorithm::Radix,
            algorithm => algorithm,
        };
        let (sorted, m) = self.select_sorted(&pairs, ranked, k, algorithm)?;
        let stride = kw + 1 + plan.kinds.len();
        let out = self
            .device
            .pool
            .alloc(m.max(1) * stride * 8, &self.stream)?;
        let n_accs = plan.kinds.len() as u32;
        self.launch(
            &format!("agg_gather_w{kw}"),
            self.grid_for(m, 1),
            AGG_THREADS,
            0,
            args![
                table.slots.ptr(),
                table.acc,
                table.width,
                n_accs,
                sorted.id_at(0),
                m,
                out.ptr()
            ],
        )?;
        let rows = self.read_words(out.ptr(), m * stride)?;
        let compacted = self.read_u64(count.ptr())? as usize;
        if compacted != groups {
            return Err(GpuError(format!(
                "{compacted} occupied slots for {groups} groups"
            )));
        }
        Ok(Some(rows))
    }

    /// Uploads host columns of 8-byte values (little-endian bytes) with their optional Arrow
    /// validity bitmaps, for [`aggregate_top_k`](Self::aggregate_top_k).
    pub fn upload_columns(
        &mut self,
        columns: &[(&[u8], Option<&[u8]>)],
    ) -> GpuResult<DeviceColumns> {
        let mut buffers = Vec::new();
        let mut out = Vec::with_capacity(columns.len());
        for (values, validity) in columns {
            let buffer = self.device.pool.alloc(values.len().max(8), &self.stream)?;
            self.upload_bytes(values, buffer.ptr())?;
            let mut column = AggregateColumn {
                values: buffer.ptr(),
                validity: 0,
                validity_offset: 0,
            };
            buffers.push(buffer);
            if let Some(bits) = validity {
                let buffer = self.device.pool.alloc(bits.len().max(8), &self.stream)?;
                self.upload_bytes(bits, buffer.ptr())?;
                column.validity = buffer.ptr();
                buffers.push(buffer);
            }
            out.push(column);
        }
        Ok(DeviceColumns {
            _buffers: buffers,
            columns: out,
        })
    }
}

/// A group read back: `kw` key words, the state word (its NULL mask from bit 2), then the
/// accumulators.
fn decode_group(
    row: &[u64],
    kw: usize,
    ops: &[AggregateOp],
    plan: &AccumulatorPlan,
) -> AggregateGroup {
    let nulls = row[kw] >> 2;
    let key = (0..kw)
        .map(|j| (nulls >> j & 1 == 0).then_some(row[j] as i64))
        .collect();
    let acc = &row[kw + 1..];
    let values = (ops.iter().enumerate())
        .map(|(i, op)| {
            let present = plan.null_count[i].is_none_or(|c| acc[c] != 0);
            let a = acc[i];
            match op {
                AggregateOp::CountStar | AggregateOp::Count(_) => AggValue::Count(a),
                AggregateOp::SumI64(_) => AggValue::I64(present.then_some(a as i64)),
                AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_) => {
                    AggValue::F64(present.then_some(f64::from_bits(a)))
                }
                AggregateOp::MinI64(_) | AggregateOp::MaxI64(_) => {
                    AggValue::I64(present.then_some((a ^ (1 << 63)) as i64))
                }
                AggregateOp::MinF64(_) | AggregateOp::MaxF64(_) => {
                    AggValue::F64(present.then_some(f64_of_ordered(a)))
                }
            }
        })
        .collect();
    AggregateGroup { key, values }
}

/// The f64 whose order-preserving image (fused.cuh `ord_f64`) is `u`.
fn f64_of_ordered(u: u64) -> f64 {
    f64::from_bits(if u >> 63 == 1 { u ^ (1 << 63) } else { !u })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(nullable: bool) -> AggregateColumn {
        AggregateColumn {
            values: 0x1000,
            validity: if nullable { 0x2000 } else { 0 },
            validity_offset: 0,
        }
    }

    /// Nullable columns that a SUM, MIN or MAX reads get one NULL count each, shared with a
    /// COUNT(x) of the call where it has one; the composite's width follows the NULL bits.
    #[test]
    fn plans_count_the_nullable_columns_once() {
        let values = [column(true), column(false), column(true)];
        let ops = [
            AggregateOp::SumI64(0),
            AggregateOp::MinF64(1),
            AggregateOp::Count(2),
            AggregateOp::MaxI64(2),
            AggregateOp::MinI64(0),
        ];
        let plan = AccumulatorPlan::new(&values, &ops).unwrap();
        assert_eq!(plan.kinds.len(), 6);
        assert_eq!(plan.kinds[5], AggregateOp::Count(0));
        assert_eq!(plan.null_count, vec![Some(5), None, None, Some(2), Some(5)]);
        let order = |by| AggregateOrder {
            by,
            descending: true,
            nulls_first: true,
        };
        let keys = [column(false)];
        assert_eq!(rank_bits(&keys, &values, &ops, order(RankBy::Op(1))), 128);
        assert_eq!(rank_bits(&keys, &values, &ops, order(RankBy::Op(0))), 129);
        let two = [column(true), column(false)];
        assert_eq!(rank_bits(&two, &values, &ops, order(RankBy::Op(2))), 193);
        assert!(AccumulatorPlan::new(&values, &[AggregateOp::SumF64(3)]).is_err());
        let many = [AggregateOp::CountStar; 9];
        assert!(AccumulatorPlan::new(&values, &many).is_err());
        let rank = |by| rank_encoding(order(by), &two, &ops, &plan);
        let avg = |sum, count| rank(RankBy::Avg { sum, count });
        assert_eq!(avg(0, 2).unwrap(), (4, 0, 2, true));
        assert!(avg(1, 2).is_err() && avg(0, 3).is_err() && avg(0, 9).is_err());
        // By a key: its column, NULL where the column may be.
        assert_eq!(rank(RankBy::Key(0)).unwrap(), (6, 0, AGG_NO_ACC, true));
        assert_eq!(rank(RankBy::Key(1)).unwrap(), (6, 1, AGG_NO_ACC, false));
        assert!(rank(RankBy::Key(2)).is_err());
        assert_eq!(rank_bits(&two, &values, &ops, order(RankBy::Key(0))), 194);
    }

    /// The spec's words where aggregate.cu's `AggSpec` reads them.
    #[test]
    fn specs_place_each_column_and_accumulator() {
        let keys = [column(true)];
        let values = [column(false), column(true)];
        let ops = [AggregateOp::CountStar, AggregateOp::MaxF64(1)];
        let plan = AccumulatorPlan::new(&values, &ops).unwrap();
        let bytes = spec_bytes(&keys, &values, &plan);
        let words: Vec<u64> = (bytes.chunks_exact(8))
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words.len(), 27);
        assert_eq!(words[..6], [0x1000, 0, 0x2000, 0, 0, 0]);
        assert_eq!(words[6..8], [0x1000, 0x1000]);
        assert_eq!(words[10..12], [0, 0x2000]);
        assert_eq!(words[18..21], [0xff << 8, 6 | 1 << 8, 1 << 8]);
        assert_eq!(words[26], 3);
    }

    #[test]
    fn tables_hold_four_times_the_estimate_within_what_the_rows_can_fill() {
        assert_eq!(agg_table_slots(0, 10), AGG_MIN_SLOTS);
        assert_eq!(agg_table_slots(3000, 1 << 20), 16384);
        assert_eq!(agg_table_slots(1 << 30, 5000), 16384);
        for u in [0, 1, 1 << 63, u64::MAX, 0x7ff0_0000_0000_0000 ^ (1 << 63)] {
            let f = f64_of_ordered(u);
            let b = f.to_bits();
            let back = if b >> 63 == 1 { !b } else { b ^ (1 << 63) };
            assert_eq!(back, u);
        }
    }
}
