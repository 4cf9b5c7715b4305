//! The device path of [`GpuAggregateTopKExec`](super::GpuAggregateTopKExec): one call of the
//! device's top-k over an aggregate ([`crate::device::TopKEngine::aggregate_top_k`]) over
//! the whole in-memory table.
//!
//! # What it takes
//!
//! [`AggregateDevicePlan::of`] translates the spec where the device computes it exactly:
//! an in-memory table or `GpuTable`; a fused filter (the `WHERE` below the aggregation) only
//! where the fusion translates it ([`crate::fusion::aggregate`]: the top-k's translation,
//! string predicates included); `HAVING` where it translates over the keys and the
//! aggregates the device computes exactly (not over a floating-point sum or an average,
//! whose last bits may differ from DataFusion's) and reads 64-bit values only; one or two
//! group keys of integer, date or timestamp types, as columns or expressions the fusion
//! translates (`date_trunc`, arithmetic), or plain string columns (grouped by their
//! order-preserving codes, [`crate::input::codes`]); `COUNT(*)`, `COUNT(x)`, `SUM` of integers
//! (wrapping in i64) or `Float64`, `MIN` and `MAX` of integers, dates, timestamps or
//! `Float64`, and `AVG` (DataFusion's input cast to `Float64`: summed as f64 and divided by
//! its count), over columns or translated expressions (`length(s)`); an order by one
//! aggregate or one group key, then at most the other group keys ascending with NULLs last,
//! in key order (the device orders groups with equal ranking values so). Anything else keeps
//! DataFusion's subtree, and the reason shows in EXPLAIN.
//!
//! Where every key is a plain `Int64` or timestamp column and every aggregate reads a plain
//! `Int64` or `Float64` column, the precompiled pass (or the filter's generated program)
//! reads them as they are; otherwise one generated program evaluates the filter, then the
//! keys and the aggregates' inputs, row by row, and aggregates them in the same pass
//! ([`crate::fusion::aggregate::aggregate_computed`]). Keys and values leave it as i64 (or
//! f64 bits); the host casts the chosen groups' keys and extremes back to their types, and
//! looks a string key's codes up in the dictionary the host kept when it uploaded them.
//!
//! # The run
//!
//! The key and value columns, and the filter's, come from the device column cache, uploaded
//! into it on a miss (as a whole-table selection reads them, [`crate::select::table`]), so
//! that they stay resident for the next query. With a filter, the aggregation's pass is the
//! filter's generated program (compiled by NVRTC once per distinct filter and cached as every
//! generated program is): it skips the rows the predicate rejects in its one read of the
//! table, so no row mask is written or read back. Its first hash table is sized for the
//! groups the rule estimated from a sample. `HAVING`'s program drops groups after the
//! aggregation, before the selection (the one the cost model chose) ranks them. The device
//! returns the best `k` (+ offset) groups, in order, with their keys and accumulators; the
//! host builds them into a batch of the aggregation's output (keys, then aggregates), drops
//! the offset's groups and evaluates the spec's output projection on the rest. A device
//! error, or the device declining the query (a NaN met by an f64 `MIN`/`MAX`; a row of the
//! filter or a group of `HAVING` that DataFusion fails on, or whose NaN bits only the host
//! reproduces), runs DataFusion's subtree instead, which gives DataFusion's answer or error.

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchOptions, new_empty_array,
};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{CastExpr, Column};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, Time,
};

use super::{AggregateKind, AggregateTopKSpec};
use crate::config::FaultPoint;
use crate::device::column_cache::CacheUse;
use crate::device::error::gpu_error;
use crate::device::watch;
use crate::device::{
    AGG_FILTERED_ENTRY, AGG_HAVING_ENTRY, AGG_MAX_ACCUMULATORS, AGG_MAX_KEYS, AGG_MAX_VALUES,
    AggValue, AggregateCall, AggregateColumn, AggregateFilter, AggregateGroup, AggregateHaving,
    AggregateOp, AggregateOrder, AggregateTopK, DeviceAlgorithm, GpuDevice, GpuError, GpuResult,
    HavingColumn, KeyWidth, PooledBuffer, RankBy, contain_panics,
};
use crate::exec::metrics::device_watch;
use crate::fusion::aggregate::{aggregate_computed, aggregate_filter, aggregate_having};
use crate::fusion::is_device_string;
use crate::fusion::{FusedProgram, KernelInput};
use crate::input::TableInput;
use crate::input::codes;
use crate::input::columns::{Reserved, TableColumn};
use crate::input::memory::{memory_input, table_inputs};
use crate::select::TransferMetrics;
use crate::select::table::{cache_uploads, program_args, upload_missing};

/// Groups the device's first hash table is sized for where the rule could not estimate them
/// (it grows fourfold when it fills), and the most an estimate sizes it for.
const GROUPS_UNKNOWN: usize = 1 << 20;
const GROUPS_MOST: usize = 1 << 24;

/// Where an aggregate's value comes from among the device's ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// The op's value.
    Op(usize),
    /// `sum / count` as f64, NULL where the count is 0.
    Avg { sum: usize, count: usize },
}

/// The keys and values a generated pass computes: the values' expressions over the table
/// (the ops' value columns; the keys are the spec's), and whether each may be NULL.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Computed {
    values: Vec<Arc<dyn PhysicalExpr>>,
    keys_nullable: Vec<bool>,
    values_nullable: Vec<bool>,
}

/// The device's plan of a spec (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AggregateDevicePlan {
    /// The table's key columns, then the value columns the ops read (indices into the
    /// table's schema).
    keys: Vec<usize>,
    values: Vec<usize>,
    ops: Vec<AggregateOp>,
    /// Per aggregate of the spec.
    outputs: Vec<Output>,
    order: AggregateOrder,
    /// The generated pass: over the rows the spec's filter passes (its inputs: the columns of
    /// [`reads`](Self::reads), then the predicate's own), or computing the keys and values
    /// (then [`computed`](Self::computed) says so).
    pub(crate) pass: Option<Arc<FusedProgram>>,
    /// Where the pass computes the keys and values (`keys` and `values` are then empty and the
    /// ops read the pass's values).
    computed: Option<Computed>,
    /// The generated program that keeps the groups `HAVING` passes, and the output columns
    /// its inputs are.
    having: Option<(Arc<FusedProgram>, Vec<HavingColumn>)>,
    /// The table's rows at planning.
    pub rows: usize,
    /// The groups the rule estimated from a sample of the table (`None`: unknown).
    pub groups: Option<usize>,
    /// The selection among the groups, as the cost model chose it.
    pub selection: DeviceAlgorithm,
    /// The session's `gpu_topk.device_memory_limit` and `gpu_topk.inject_fault`.
    pub memory_limit: usize,
    pub fault: FaultPoint,
}

impl AggregateDevicePlan {
    /// The device's plan of `spec`, or why the device does not compute it: over the table's
    /// plain 64-bit columns where the keys and the aggregates' inputs are such columns (the
    /// precompiled pass, or the filter's program), else by a generated pass that computes
    /// them.
    pub fn of(spec: &AggregateTopKSpec) -> std::result::Result<Self, String> {
        let Some(memory) = memory_input(&spec.table) else {
            return Err("the device reads in-memory tables and GpuTables only".into());
        };
        if spec.group_keys.len() > AGG_MAX_KEYS {
            return Err(format!("more than {AGG_MAX_KEYS} group keys"));
        }
        let rows = memory.batches().map(|b| b.num_rows()).sum();
        let mut plan = match Self::over_columns(spec, rows) {
            Ok(plan) => plan,
            Err(_) => Self::computing(spec, rows)?,
        };
        if let Some(having) = &spec.having {
            plan.having = Some(plan.having_of(spec, having)?);
        }
        Ok(plan)
    }

    fn empty(rows: usize) -> Self {
        Self {
            keys: Vec::new(),
            values: Vec::new(),
            ops: Vec::new(),
            outputs: Vec::new(),
            order: AggregateOrder {
                by: RankBy::Op(0),
                descending: false,
                nulls_first: false,
            },
            pass: None,
            computed: None,
            having: None,
            rows,
            groups: None,
            selection: DeviceAlgorithm::Radix,
            memory_limit: 0,
            fault: FaultPoint::None,
        }
    }

    /// The plan over plain `Int64`/timestamp key columns and `Int64`/`Float64` value columns.
    fn over_columns(spec: &AggregateTopKSpec, rows: usize) -> std::result::Result<Self, String> {
        let schema = spec.table.schema();
        let mut plan = Self::empty(rows);
        for key in &spec.group_keys {
            let key_64 = matches!(key.data_type, DataType::Int64 | DataType::Timestamp(..));
            if !key_64 {
                return Err(format!(
                    "key type {} runs on the CPU path only",
                    key.data_type
                ));
            }
            let Some(c) = plain_column(&key.expr) else {
                return Err(format!(
                    "the computed key {} runs on the CPU path only",
                    key.expr
                ));
            };
            plan.keys.push(c);
        }
        for item in &spec.aggregates {
            let output = plan.aggregate(item, &schema)?;
            plan.outputs.push(output);
        }
        plan.check_bounds(plan.values.len())?;
        plan.order = plan.order_of(spec)?;
        if let Some(filter) = &spec.filter {
            let program = aggregate_filter(filter, &schema, &plan.reads(), plan.keys.len())
                .map_err(|why| format!("the filter has no device translation: {why}"))?;
            plan.pass = Some(Arc::new(program));
        }
        Ok(plan)
    }

    /// The plan whose generated pass computes the keys (integers, dates and timestamps, as
    /// columns or expressions) and the aggregates' inputs (expressions the fusion translates).
    fn computing(spec: &AggregateTopKSpec, rows: usize) -> std::result::Result<Self, String> {
        let schema = spec.table.schema();
        let mut plan = Self::empty(rows);
        let mut values: Vec<Arc<dyn PhysicalExpr>> = Vec::new();
        for key in &spec.group_keys {
            // A string key is grouped by its column's codes.
            let codes = is_device_string(&key.data_type) && plain_column(&key.expr).is_some();
            if !integer_like(&key.data_type) && !codes {
                return Err(format!(
                    "key type {} runs on the CPU path only",
                    key.data_type
                ));
            }
        }
        for item in &spec.aggregates {
            let output = plan.computed_aggregate(item, &schema, &mut values)?;
            plan.outputs.push(output);
        }
        plan.check_bounds(values.len())?;
        plan.order = plan.order_of(spec)?;
        let keys: Vec<Arc<dyn PhysicalExpr>> = (spec.group_keys.iter())
            .map(|k| Arc::clone(&k.expr))
            .collect();
        let program = aggregate_computed(spec.filter.as_ref(), &keys, &values, &schema)?;
        let nullable = |e: &Arc<dyn PhysicalExpr>| e.nullable(&schema).unwrap_or(true);
        plan.computed = Some(Computed {
            keys_nullable: keys.iter().map(nullable).collect(),
            values_nullable: values.iter().map(nullable).collect(),
            values,
        });
        plan.pass = Some(Arc::new(program));
        Ok(plan)
    }

    /// Whether `values` value columns and the plan's ops fit the device's pass.
    fn check_bounds(&self, values: usize) -> std::result::Result<(), String> {
        if values > AGG_MAX_VALUES || self.ops.len() > AGG_MAX_ACCUMULATORS {
            return Err(format!(
                "more than {AGG_MAX_VALUES} value columns or {AGG_MAX_ACCUMULATORS} accumulators"
            ));
        }
        Ok(())
    }

    /// The program of the spec's `HAVING` over the aggregation's output, where the device
    /// evaluates it exactly: over the keys, and aggregates but floating-point sums and
    /// averages (added in another order than DataFusion's, their last bits may differ).
    fn having_of(
        &self,
        spec: &AggregateTopKSpec,
        having: &Arc<dyn PhysicalExpr>,
    ) -> std::result::Result<(Arc<FusedProgram>, Vec<HavingColumn>), String> {
        let keys = spec.group_keys.iter().map(|k| (&k.name, &k.data_type));
        let aggregates = spec.aggregates.iter().map(|a| (&a.name, &a.output_type));
        let fields: Vec<Field> = (keys.chain(aggregates))
            .map(|(name, data_type)| Field::new(name, data_type.clone(), true))
            .collect();
        let schema = Schema::new(fields);
        let program = aggregate_having(having, &schema)
            .map_err(|why| format!("HAVING has no device translation: {why}"))?;
        let key_count = spec.group_keys.len();
        // agg_outputs writes every output column as 8-byte words.
        let wide = |c: usize| {
            let data_type = schema.field(c).data_type();
            matches!(
                data_type,
                DataType::Int64 | DataType::Float64 | DataType::Timestamp(..)
            )
        };
        let column = |input: &KernelInput| match input {
            KernelInput::Column(c) if !wide(*c) => Err(format!(
                "HAVING reads {}, of type {}",
                schema.field(*c).name(),
                schema.field(*c).data_type()
            )),
            KernelInput::Column(c) if *c < key_count => Ok(HavingColumn::Key(*c)),
            KernelInput::Column(c) => match self.outputs.get(c - key_count) {
                Some(Output::Op(op))
                    if !matches!(
                        self.ops[*op],
                        AggregateOp::SumF64(_) | AggregateOp::SumI64AsF64(_)
                    ) =>
                {
                    Ok(HavingColumn::Op(*op))
                }
                _ => Err(format!(
                    "HAVING reads {}, a floating-point sum or average the device adds in \
                     another order than DataFusion",
                    schema.field(*c).name()
                )),
            },
            other => Err(format!("HAVING reads {other:?}")),
        };
        let columns = (program.inputs.iter().map(column)).collect::<std::result::Result<_, _>>()?;
        Ok((Arc::new(program), columns))
    }

    /// The ops computing `item` and where its value comes from.
    fn aggregate(
        &mut self,
        item: &super::AggregateItem,
        schema: &Schema,
    ) -> std::result::Result<Output, String> {
        use DataType::{Float64, Int64};
        let described = || {
            let over = item.input.as_ref().map_or("*".into(), |e| e.to_string());
            format!("{}({over})", item.kind.name())
        };
        let column = |e: &Arc<dyn PhysicalExpr>| -> Option<(usize, DataType)> {
            let c = plain_column(e)?;
            Some((c, schema.field(c).data_type().clone()))
        };
        let input = item.input.as_ref();
        let (op, want): (fn(usize) -> AggregateOp, DataType) = match item.kind {
            AggregateKind::CountStar => {
                let at = self.push(AggregateOp::CountStar);
                return self.typed(item, Int64, Output::Op(at), described);
            }
            AggregateKind::CountDistinct => {
                return Err(format!("{} runs on the CPU path only", described()));
            }
            AggregateKind::Avg => {
                // DataFusion averages an Int64 column's values cast to Float64.
                let cast = input.and_then(|e| e.downcast_ref::<CastExpr>());
                let inner = cast.filter(|c| *c.cast_type() == Float64);
                match inner.and_then(|c| column(c.expr())) {
                    Some((c, Int64)) => {
                        let value = self.value(c);
                        let sum = self.push(AggregateOp::SumI64AsF64(value));
                        let count = self.push(AggregateOp::Count(value));
                        return self.typed(item, Float64, Output::Avg { sum, count }, described);
                    }
                    _ => return Err(format!("{} runs on the CPU path only", described())),
                }
            }
            kind => match (kind, input.and_then(column)) {
                (AggregateKind::Count, Some((_, Int64 | Float64 | DataType::Timestamp(..)))) => {
                    (AggregateOp::Count, Int64)
                }
                (AggregateKind::Sum, Some((_, Int64))) => (AggregateOp::SumI64, Int64),
                (AggregateKind::Sum, Some((_, Float64))) => (AggregateOp::SumF64, Float64),
                (AggregateKind::Min, Some((_, Int64))) => (AggregateOp::MinI64, Int64),
                (AggregateKind::Min, Some((_, Float64))) => (AggregateOp::MinF64, Float64),
                (AggregateKind::Max, Some((_, Int64))) => (AggregateOp::MaxI64, Int64),
                (AggregateKind::Max, Some((_, Float64))) => (AggregateOp::MaxF64, Float64),
                _ => return Err(format!("{} runs on the CPU path only", described())),
            },
        };
        let (c, _) = input.and_then(column).expect("matched a plain column");
        let value = self.value(c);
        let at = self.push(op(value));
        self.typed(item, want, Output::Op(at), described)
    }

    /// The ops computing `item` over values the generated pass computes (`values`: their
    /// expressions, each once), and where its value comes from.
    fn computed_aggregate(
        &mut self,
        item: &super::AggregateItem,
        schema: &Schema,
        values: &mut Vec<Arc<dyn PhysicalExpr>>,
    ) -> std::result::Result<Output, String> {
        use DataType::{Float64, Int64};
        let described = || {
            let over = item.input.as_ref().map_or("*".into(), |e| e.to_string());
            format!("{}({over})", item.kind.name())
        };
        let Some(input) = item.input.as_ref() else {
            let at = self.push(AggregateOp::CountStar);
            return self.typed(item, Int64, Output::Op(at), described);
        };
        let input_type = input.data_type(schema).map_err(|e| e.to_string())?;
        let mut value = || match values.iter().position(|v| v.as_ref() == input.as_ref()) {
            Some(at) => at,
            None => {
                values.push(Arc::clone(input));
                values.len() - 1
            }
        };
        let signed = matches!(
            input_type,
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64
        );
        let (op, want): (fn(usize) -> AggregateOp, DataType) = match item.kind {
            AggregateKind::CountDistinct => {
                return Err(format!("{} runs on the CPU path only", described()));
            }
            AggregateKind::Avg if input_type == Float64 => {
                let v = value();
                let sum = self.push(AggregateOp::SumF64(v));
                let count = self.push(AggregateOp::Count(v));
                return self.typed(item, Float64, Output::Avg { sum, count }, described);
            }
            AggregateKind::Count => (AggregateOp::Count, Int64),
            AggregateKind::Sum if signed => (AggregateOp::SumI64, Int64),
            AggregateKind::Sum if input_type == Float64 => (AggregateOp::SumF64, Float64),
            AggregateKind::Min if integer_like(&input_type) => (AggregateOp::MinI64, input_type),
            AggregateKind::Max if integer_like(&input_type) => (AggregateOp::MaxI64, input_type),
            AggregateKind::Min if input_type == Float64 => (AggregateOp::MinF64, Float64),
            AggregateKind::Max if input_type == Float64 => (AggregateOp::MaxF64, Float64),
            _ => return Err(format!("{} runs on the CPU path only", described())),
        };
        let at = self.push(op(value()));
        self.typed(item, want, Output::Op(at), described)
    }

    /// `output` where `item` has DataFusion's output type `want`.
    fn typed(
        &self,
        item: &super::AggregateItem,
        want: DataType,
        output: Output,
        described: impl Fn() -> String,
    ) -> std::result::Result<Output, String> {
        if item.output_type != want {
            return Err(format!(
                "{} outputs {}, not the device's {want}",
                described(),
                item.output_type
            ));
        }
        Ok(output)
    }

    /// The value column index of table column `c`, added where new.
    fn value(&mut self, c: usize) -> usize {
        match self.values.iter().position(|&v| v == c) {
            Some(at) => at,
            None => {
                self.values.push(c);
                self.values.len() - 1
            }
        }
    }

    /// The program whose inputs are the columns the device reads (the filter's program, or
    /// [`Self::reads`] without one): what the column cache holds of the table for it, and
    /// what a load after a CPU run loads.
    pub(crate) fn program(&self) -> FusedProgram {
        if let Some(pass) = &self.pass {
            return FusedProgram::clone(pass);
        }
        FusedProgram {
            source: String::new(),
            inputs: self.reads().into_iter().map(KernelInput::Column).collect(),
            key_kind: KeyWidth::W64,
            refines: false,
        }
    }

    /// The key columns and the device's accumulators (the cost model's table slot).
    pub(crate) fn table_words(&self) -> (usize, usize) {
        let keys = (self.computed.as_ref()).map_or(self.keys.len(), |c| c.keys_nullable.len());
        (keys, self.ops.len())
    }

    /// The groups the device's first table is sized for: the estimate with a quarter more
    /// (a sample's estimate runs low), within [`GROUPS_MOST`]; [`GROUPS_UNKNOWN`] without one.
    fn groups_estimate(&self, rows: usize) -> usize {
        let groups = self
            .groups
            .map_or(GROUPS_UNKNOWN, |g| g.saturating_add(g / 4));
        groups.clamp(1, GROUPS_MOST).min(rows.max(1))
    }

    /// The table columns the device aggregates, each once: the keys', then the other values'.
    pub(crate) fn reads(&self) -> Vec<usize> {
        let mut reads = self.keys.clone();
        reads.extend(self.values.iter().filter(|c| !self.keys.contains(c)));
        reads
    }

    fn push(&mut self, op: AggregateOp) -> usize {
        self.ops.push(op);
        self.ops.len() - 1
    }

    /// The device's order of the spec's: by an aggregate or a group key, its ties by the group
    /// keys ascending with NULLs last (a prefix of them in key order may be spelled out, less
    /// the key that ranks).
    fn order_of(&self, spec: &AggregateTopKSpec) -> std::result::Result<AggregateOrder, String> {
        let key_count = spec.group_keys.len();
        let first = &spec.order[0];
        let by = match plain_column(&first.expr) {
            Some(c) if c < key_count => RankBy::Key(c),
            Some(c) if c - key_count < self.outputs.len() => match self.outputs[c - key_count] {
                Output::Op(op) => RankBy::Op(op),
                Output::Avg { sum, count } => RankBy::Avg { sum, count },
            },
            _ => return Err("the first sort key is neither an aggregate nor a group key".into()),
        };
        let ties: Vec<usize> = (0..key_count).filter(|&k| by != RankBy::Key(k)).collect();
        let ties_by_keys = spec.order.len() <= ties.len() + 1
            && (spec.order.iter().skip(1).zip(&ties)).all(|(sort, &key)| {
                plain_column(&sort.expr) == Some(key)
                    && !sort.options.descending
                    && !sort.options.nulls_first
            });
        if !ties_by_keys {
            return Err(
                "ties ordered otherwise than by the group keys ascending, NULLs last".into(),
            );
        }
        Ok(AggregateOrder {
            by,
            descending: first.options.descending,
            nulls_first: first.options.nulls_first,
        })
    }
}

/// Whether the device keeps values of `data_type` as exact i64s (group keys; MIN and MAX):
/// integers that fit, dates and timestamps.
fn integer_like(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | Date32 | Date64 | Timestamp(..)
    )
}

/// `values` (i64s of a key or aggregate) as an array of `data_type`, one of the
/// [`integer_like`] types or `Int64`.
fn from_i64(values: &Int64Array, data_type: &DataType) -> Result<ArrayRef> {
    match data_type {
        // Arrow casts integers to Date32 from Int32 only.
        DataType::Date32 => Ok(cast(&cast(values, &DataType::Int32)?, data_type)?),
        _ => Ok(cast(values, data_type)?),
    }
}

/// The index of the column `expr` is, if it is one.
fn plain_column(expr: &Arc<dyn PhysicalExpr>) -> Option<usize> {
    expr.downcast_ref::<Column>().map(Column::index)
}

/// The device path's counters.
pub(super) struct DeviceMetrics {
    pub(super) gpu_fallbacks: Count,
    /// Groups the aggregation found.
    groups: Count,
    /// Wall time of the device's aggregation and selection, the columns' uploads not included.
    device_time: Time,
    /// The device's time in the aggregation and in the selection of the groups, as its
    /// events timed them.
    device_aggregate_time: Time,
    device_select_time: Time,
    transfers: TransferMetrics,
    device_bytes_held: Gauge,
    device_peak_bytes: Gauge,
    pinned_bytes_held: Gauge,
}

impl DeviceMetrics {
    pub(super) fn new(set: &ExecutionPlanMetricsSet) -> Self {
        let builder = || MetricBuilder::new(set);
        Self {
            gpu_fallbacks: builder().global_counter("gpu_fallbacks"),
            groups: builder().global_counter("groups"),
            device_time: builder().subset_time("device_time", 0),
            device_aggregate_time: builder().subset_time("device_aggregate_time", 0),
            device_select_time: builder().subset_time("device_select_time", 0),
            transfers: TransferMetrics {
                cache_hits: builder().global_counter("cache_hits"),
                cache_misses: builder().global_counter("cache_misses"),
                resident_bytes: builder().global_counter("resident_bytes"),
                uploaded_bytes: builder().global_counter("uploaded_bytes"),
                upload_time: builder().subset_time("upload_time", 0),
            },
            device_bytes_held: builder().global_gauge("device_bytes_held"),
            device_peak_bytes: builder().global_gauge("device_peak_bytes"),
            pinned_bytes_held: builder().global_gauge("pinned_bytes_held"),
        }
    }
}

/// The operator's output computed on the device (`schema`: the operator's), or `None` where
/// the device declined the query.
pub(super) fn run(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
    schema: SchemaRef,
    metrics: &DeviceMetrics,
) -> Result<Option<RecordBatch>> {
    let memory = memory_input(&spec.table)
        .ok_or_else(|| DataFusionError::Execution("the table is not in memory".into()))?;
    let names: Vec<String> = (spec.table.schema().fields().iter())
        .map(|f| f.name().clone())
        .collect();
    // The filter's program reads the aggregation's columns first, then the predicate's.
    let unfiltered = FusedProgram {
        source: String::new(),
        inputs: plan.reads().into_iter().map(KernelInput::Column).collect(),
        key_kind: KeyWidth::W64,
        refines: false,
    };
    let program = plan.pass.as_deref().unwrap_or(&unfiltered);
    // No rows, no groups (and no chunks to type the columns by).
    if memory.batches().all(|b| b.num_rows() == 0) {
        let none = vec![None; spec.group_keys.len()];
        return output_batch(spec, plan, &[], &none, schema).map(Some);
    }
    let inputs = table_inputs(&memory, program, &names)?
        .ok_or_else(|| DataFusionError::Execution("the table's columns are unreadable".into()))?;
    // The per-row inputs (dictionaries' lookup tables ship with the call): the aggregation's
    // columns come first.
    let columns = (inputs.iter().filter(|i| i.lookup.is_none()))
        .map(TableColumn::new)
        .collect::<Result<Vec<_>>>()?;
    let rows = columns.first().map_or(0, |c| c.rows);
    // The precompiled pass and a filter's read the aggregation's columns as 8-byte values.
    let aggregated = &columns[..plan.reads().len().min(columns.len())];
    if columns.iter().any(|c| c.rows != rows) || aggregated.iter().any(|c| c.width != Some(8)) {
        return Err(DataFusionError::Execution(
            "the device aggregates columns of 8-byte values of equal length".into(),
        ));
    }
    let top = if rows == 0 {
        AggregateTopK::default()
    } else {
        let device = crate::device::gpu()
            .ok_or_else(|| DataFusionError::Execution("no GPU to run on".into()))?;
        // The query's device memory and injected faults, as the other operators count them.
        let watch = device_watch(
            plan.memory_limit,
            plan.fault,
            &metrics.device_bytes_held,
            &metrics.device_peak_bytes,
            &metrics.pinned_bytes_held,
        );
        let _entered = watch.enter();
        match aggregate_resident(spec, plan, &device, (&inputs, &columns), metrics)? {
            Some(top) => top,
            None => return Ok(None),
        }
    };
    let Some(dictionaries) = key_dictionaries(spec, program, &columns)? else {
        return Ok(None);
    };
    metrics.groups.add(top.groups);
    let phases = [&metrics.device_aggregate_time, &metrics.device_select_time];
    for (time, ms) in phases.into_iter().zip(top.report.phases_ms) {
        time.add_duration(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) / 1e3,
        ));
    }
    output_batch(spec, plan, &top.top, &dictionaries, schema).map(Some)
}

/// Each group key's dictionary: a string key's, whose codes the program's `StringCodes`
/// input read (kept since its image was uploaded, else interned again from the column's
/// chunks); `None` for the other keys. `None` in all where a string key's column is neither
/// kept nor given (DataFusion's subtree then answers).
fn key_dictionaries(
    spec: &AggregateTopKSpec,
    program: &FusedProgram,
    columns: &[TableColumn<'_, '_>],
) -> Result<Option<Vec<Option<ArrayRef>>>> {
    let mut dictionaries = Vec::with_capacity(spec.group_keys.len());
    for key in &spec.group_keys {
        let codes = plain_column(&key.expr).map(KernelInput::StringCodes);
        let mut per_row = program.inputs.iter().filter(|i| !i.per_dictionary_entry());
        let at = match codes {
            Some(codes) if is_device_string(&key.data_type) => per_row.position(|i| *i == codes),
            _ => None,
        };
        let Some(column) = at.and_then(|at| columns.get(at)) else {
            dictionaries.push(None);
            continue;
        };
        let dictionary = match codes::kept(&column.key) {
            Some(dictionary) => dictionary,
            None if !column.input.chunks.is_empty() => {
                let dictionary = codes::intern(&column.input.chunks)?.dictionary;
                codes::keep(&column.key, column.owners(), Arc::clone(&dictionary));
                dictionary
            }
            None => return Ok(None),
        };
        dictionaries.push(Some(dictionary));
    }
    Ok(Some(dictionaries))
}

/// The device's top-k over the aggregate of the program's `inputs` (those of
/// [`AggregateDevicePlan::reads`], then the filter's), whose per-row `columns` are read from
/// the column cache or uploaded into it; `None` where it declined.
fn aggregate_resident(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
    device: &Arc<GpuDevice>,
    (inputs, columns): (&[TableInput<'_>], &[TableColumn<'_, '_>]),
    metrics: &DeviceMetrics,
) -> Result<Option<AggregateTopK>> {
    let cache = &device.column_cache;
    let lookups: Vec<Option<CacheUse>> = columns.iter().map(|c| cache.acquire(&c.key)).collect();
    let missing: usize = (columns.iter().zip(&lookups))
        .filter(|(_, hit)| hit.is_none())
        .map(|(c, _)| c.layout().0)
        .sum();
    if missing > 0 && !cache.reserve(missing) {
        return Err(DataFusionError::Execution(
            "the columns do not fit the column cache's budget".into(),
        ));
    }
    let reserved = Reserved {
        device,
        bytes: missing,
    };
    let work = || aggregate_on(spec, plan, device, (inputs, columns), &lookups, metrics);
    let (top, uploaded) = contain_panics(work)
        .unwrap_or_else(|panic| Err(GpuError(format!("the CUDA bindings panicked: {panic}"))))
        .map_err(gpu_error)?;
    let hit_bytes: Vec<usize> = (lookups.iter())
        .map(|hit| hit.as_ref().map_or(0, |h| h.entry().bytes()))
        .collect();
    drop(lookups);
    cache_uploads(
        &metrics.transfers,
        device,
        columns,
        uploaded,
        hit_bytes,
        reserved,
    );
    Ok(top.report.declined.is_none().then_some(top))
}

/// The device work of [`aggregate_resident`]: the missing columns' uploads (their new
/// buffers, `None` where resident), then the aggregation (by the filter's program where the
/// plan has one) and selection.
#[allow(clippy::type_complexity)]
fn aggregate_on(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
    device: &Arc<GpuDevice>,
    (inputs, columns): (&[TableInput<'_>], &[TableColumn<'_, '_>]),
    lookups: &[Option<CacheUse>],
    metrics: &DeviceMetrics,
) -> GpuResult<(AggregateTopK, Vec<Option<(PooledBuffer, Vec<usize>)>>)> {
    let compiled =
        |program: &FusedProgram, entry: &str| device.generated_kernel(&program.source, entry);
    let kernel = match &plan.pass {
        Some(program) => Some(compiled(program, AGG_FILTERED_ENTRY)?.0),
        None => None,
    };
    let having = match &plan.having {
        Some((program, _)) => Some(compiled(program, AGG_HAVING_ENTRY)?.0),
        None => None,
    };
    // Engines outlive the query (they idle for the next): not its memory.
    let mut engine = watch::outside(|| device.engine(KeyWidth::W64))?;
    let (uploaded, args) =
        upload_missing(&metrics.transfers, device, &mut engine, columns, lookups)?;
    // The program's arguments: the columns', and its lookup tables', held until it ran.
    let (program_args, _lookup_tables) = match kernel {
        Some(_) => program_args(device, &mut engine, inputs, args.clone())?,
        None => (Vec::new(), Vec::new()),
    };
    device.idle_engine(engine);
    let column = |a: &[u64; 4]| AggregateColumn {
        values: a[0],
        validity: a[2],
        validity_offset: 0,
    };
    let reads = plan.reads();
    let of = |c: &usize| column(&args[reads.iter().position(|r| r == c).expect("read")]);
    let (keys, values): (Vec<AggregateColumn>, Vec<AggregateColumn>) = match &plan.computed {
        Some(computed) => (
            computed
                .keys_nullable
                .iter()
                .map(|&n| AggregateColumn::computed(n))
                .collect(),
            computed
                .values_nullable
                .iter()
                .map(|&n| AggregateColumn::computed(n))
                .collect(),
        ),
        None => (
            plan.keys.iter().map(of).collect(),
            plan.values.iter().map(of).collect(),
        ),
    };
    let rows = columns.first().map_or(0, |c| c.rows);
    let call = AggregateCall {
        keys: &keys,
        values: &values,
        ops: &plan.ops,
        rows,
        order: plan.order,
        k: spec.k,
        groups_estimate: plan.groups_estimate(rows),
        algorithm: plan.selection,
        filter: (kernel.as_deref()).map(|kernel| AggregateFilter {
            kernel,
            inputs: &program_args,
        }),
        having: (having.as_deref().zip(plan.having.as_ref())).map(|(kernel, (_, columns))| {
            AggregateHaving {
                kernel,
                columns: columns.as_slice(),
            }
        }),
    };
    let timer = metrics.device_time.timer();
    let started = Instant::now();
    let mut engine = watch::outside(|| device.engine(call.key_width()))?;
    let top = engine.aggregate_top_k(&call)?;
    engine.synchronize()?;
    device.idle_engine(engine);
    timer.done();
    log::debug!(
        "gpu-topk: aggregated {rows} rows into {} groups on the device in {:?}",
        top.groups,
        started.elapsed()
    );
    Ok((top, uploaded))
}

/// The operator's output of the device's `top` groups: the aggregation's output rows (keys,
/// then aggregates), less the offset's, through the spec's output projection.
fn output_batch(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
    top: &[AggregateGroup],
    dictionaries: &[Option<ArrayRef>],
    schema: SchemaRef,
) -> Result<RecordBatch> {
    let top = &top[spec.offset.min(top.len())..];
    let groups = groups_batch(spec, plan, top, dictionaries)?;
    let options = RecordBatchOptions::new().with_row_count(Some(top.len()));
    let columns = (spec.output.iter())
        .map(|(expr, _)| expr.evaluate(&groups)?.into_array(groups.num_rows()))
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new_with_options(
        schema, columns, &options,
    )?)
}

/// The aggregation's output rows of the groups `top`: keys (a string key's codes decoded by
/// its dictionary), then aggregates.
fn groups_batch(
    spec: &AggregateTopKSpec,
    plan: &AggregateDevicePlan,
    top: &[AggregateGroup],
    dictionaries: &[Option<ArrayRef>],
) -> Result<RecordBatch> {
    let mut fields = Vec::new();
    let mut arrays: Vec<ArrayRef> = Vec::new();
    for (i, key) in spec.group_keys.iter().enumerate() {
        let keys: Vec<Option<i64>> = top.iter().map(|g| g.key[i]).collect();
        arrays.push(match dictionaries.get(i).and_then(Option::as_ref) {
            Some(dictionary) => codes::decode(dictionary, &keys)?,
            None if is_device_string(&key.data_type) => match top.is_empty() {
                true => new_empty_array(&key.data_type),
                false => {
                    return Err(DataFusionError::Internal(format!(
                        "no dictionary of the string key {}",
                        key.name
                    )));
                }
            },
            None => from_i64(&keys.into_iter().collect(), &key.data_type)?,
        });
        fields.push(Field::new(&key.name, key.data_type.clone(), true));
    }
    for (item, output) in spec.aggregates.iter().zip(&plan.outputs) {
        arrays.push(aggregate_array(top, *output, &item.output_type)?);
        fields.push(Field::new(&item.name, item.output_type.clone(), true));
    }
    let options = RecordBatchOptions::new().with_row_count(Some(top.len()));
    let schema = Arc::new(Schema::new(fields));
    Ok(RecordBatch::try_new_with_options(schema, arrays, &options)?)
}

/// One aggregate's column over `top` (`data_type`: Float64, or an i64 the plan checked
/// [`from_i64`] takes).
fn aggregate_array(
    top: &[AggregateGroup],
    output: Output,
    data_type: &DataType,
) -> Result<ArrayRef> {
    let value = |g: &AggregateGroup| -> (Option<i64>, Option<f64>) {
        match output {
            Output::Op(op) => match g.values[op] {
                AggValue::Count(n) => (Some(n as i64), None),
                AggValue::I64(v) => (v, None),
                AggValue::F64(v) => (None, v),
            },
            Output::Avg { sum, count } => match (g.values[sum], g.values[count]) {
                (AggValue::F64(Some(s)), AggValue::Count(n)) if n > 0 => (None, Some(s / n as f64)),
                _ => (None, None),
            },
        }
    };
    if *data_type == DataType::Float64 {
        Ok(Arc::new(
            top.iter().map(|g| value(g).1).collect::<Float64Array>(),
        ))
    } else {
        from_i64(&top.iter().map(|g| value(g).0).collect(), data_type)
    }
}

#[cfg(test)]
mod tests;
