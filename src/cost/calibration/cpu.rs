//! The CPU calibration: the rows per second per core of the CPU paths the decisions weigh
//! against the device, measured without it (the top-k selector, the per-group heaps of
//! `GpuGroupTopKExec`'s CPU path, and DataFusion's hash aggregation, which
//! `GpuAggregateTopKExec`'s CPU path runs), once per process on first need.
//!
//! The rates are kept in memory for the process and written beside the device calibration,
//! to `<cache dir>/cpu-calibration-<key>.txt`, the key hashing the host's CPU model, its
//! cores, the crate version and the build (optimised or not): another host or build measures
//! afresh. A missing or damaged file is measured again and rewritten.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch};
use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, UnboundedMemoryPool};

use crate::device::kernels::{cache_key, default_cache_dir};
use crate::select::groups::{HeldRows, RankFunction};

/// The CPU paths' rates on this host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuRates {
    /// The top-k CPU selector's rows per second on one core.
    pub topk_rows_per_s: f64,
    /// The per-group CPU path's rows per second on one core (each row's keys converted to
    /// arrow's row format, its group looked up, its group's heap offered the row).
    pub group_rows_per_s: f64,
    /// DataFusion's hash aggregation's rows per second on one core (each row's group looked
    /// up, its accumulators updated), into few groups (`FEW_GROUPS`: the table stays in the
    /// core's cache).
    pub aggregate_rows_per_s: f64,
    /// The same into many groups (`MANY_GROUPS`, a group for every other row: the table
    /// leaves the cache and each row's lookup misses).
    pub aggregate_many_rows_per_s: f64,
    /// The host's cores, which run the CPU paths' partitions.
    pub cores: usize,
}

impl CpuRates {
    /// Seconds the top-k CPU selector takes over `rows` rows on every core.
    pub fn topk_time(&self, rows: usize) -> f64 {
        rows as f64 / (self.topk_rows_per_s * self.cores.max(1) as f64)
    }

    /// Seconds the per-group CPU path takes over `rows` rows on every core.
    pub fn group_time(&self, rows: usize) -> f64 {
        rows as f64 / (self.group_rows_per_s * self.cores.max(1) as f64)
    }

    /// Seconds DataFusion's aggregation of `rows` rows into `groups` groups takes on every
    /// core: each partition's partial aggregation of its rows, then the final aggregation of
    /// the partial groups (up to every group from each partition), both at the rate for the
    /// groups a partition holds ([`aggregate_rate`](Self::aggregate_rate)).
    pub fn aggregate_time(&self, rows: usize, groups: usize) -> f64 {
        let cores = self.cores.max(1);
        let partial_groups = groups.saturating_mul(cores).min(rows);
        let per_partition = groups.min(rows.div_ceil(cores));
        (rows + partial_groups) as f64 / (self.aggregate_rate(per_partition) * cores as f64)
    }

    /// Rows per second on one core into `groups` groups: the time per row interpolated in
    /// log(groups) between the two calibrated points, held at each end beyond them.
    pub fn aggregate_rate(&self, groups: usize) -> f64 {
        let (few, many) = (FEW_GROUPS as f64, MANY_GROUPS as f64);
        let at = ((groups.max(1) as f64).ln() - few.ln()) / (many.ln() - few.ln());
        let at = at.clamp(0.0, 1.0);
        let per_row = (1.0 - at) / self.aggregate_rows_per_s + at / self.aggregate_many_rows_per_s;
        1.0 / per_row
    }

    /// One line for logs and reports.
    pub fn describe(&self) -> String {
        format!(
            "CPU top-k {:.1} M rows/s/core, per group {:.1} M rows/s/core, aggregation {:.1} \
             (few groups) to {:.1} (many) M rows/s/core × {}",
            self.topk_rows_per_s / 1e6,
            self.group_rows_per_s / 1e6,
            self.aggregate_rows_per_s / 1e6,
            self.aggregate_many_rows_per_s / 1e6,
            self.cores
        )
    }
}

const FORMAT: &str = "datafusion-gpu-topk cpu calibration 3";

/// The rates, measured or read once per process. Process-wide: the host does not change while
/// it runs, and every session plans with the same figures.
static RATES: Mutex<Option<CpuRates>> = Mutex::new(None);

/// The host's CPU rates: from memory, else from the file in `cache_dir` (the default cache
/// directory where `None`), else measured now and written there.
pub fn cpu_rates(cache_dir: Option<&Path>) -> CpuRates {
    let mut held = RATES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rates) = *held {
        return rates;
    }
    let rates = read_or_measure(rates_file(cache_dir).as_deref());
    *held = Some(rates);
    rates
}

/// The rates' file in `cache_dir` (the default cache directory where `None`; `None` where
/// there is none).
fn rates_file(cache_dir: Option<&Path>) -> Option<PathBuf> {
    let dir = cache_dir
        .map(Path::to_path_buf)
        .or_else(default_cache_dir)?;
    Some(dir.join(file_name()))
}

/// Whether [`cpu_rates`] would measure the host now: neither this process nor the file in
/// `cache_dir` holds its rates.
pub(crate) fn must_measure(cache_dir: Option<&Path>) -> bool {
    if RATES.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        return false;
    }
    rates_file(cache_dir).is_none_or(|path| read_file(&path, cpu_cores()).is_none())
}

/// The rates in the file at `path`, else measured (and written there).
pub fn read_or_measure(path: Option<&Path>) -> CpuRates {
    let cores = cpu_cores();
    if let Some(rates) = path.and_then(|p| read_file(p, cores)) {
        return rates;
    }
    let started = Instant::now();
    let rates = measure(cores);
    log::info!(
        "calibrated the CPU in {:.3} s: {}",
        started.elapsed().as_secs_f64(),
        rates.describe()
    );
    if let Some(path) = path
        && let Err(e) = write_file(path, &rates)
    {
        log::warn!(
            "cannot write the CPU calibration to {}: {e}",
            path.display()
        );
    }
    rates
}

/// `cpu-calibration-<key>.txt`, the key hashing what the rates depend on.
pub fn file_name() -> PathBuf {
    let cores = cpu_cores().to_string();
    let model = cpu_model();
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "optimised"
    };
    let parts: [&[u8]; 6] = [
        FORMAT.as_bytes(),
        env!("CARGO_PKG_VERSION").as_bytes(),
        model.as_bytes(),
        cores.as_bytes(),
        std::env::consts::ARCH.as_bytes(),
        build.as_bytes(),
    ];
    PathBuf::from(format!("cpu-calibration-{:032x}.txt", cache_key(&parts)))
}

pub(crate) fn cpu_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPU's model name, as the system reports it (Linux), else empty.
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    (info.lines())
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or_else(String::new, |(_, name)| name.trim().to_string())
}

/// The rates from conservative figures, where a measurement cannot run: the top-k selector,
/// the per-group path, the aggregation into few and into many groups.
pub(crate) const FALLBACK: (f64, f64, f64, f64) = (100e6, 5e6, 10e6, 5e6);

/// Each rate on one core. With cores to spare, the four measurements run at once, one a
/// core: the first query of a fresh host waits for the slowest, not the sum.
fn measure(cores: usize) -> CpuRates {
    let (topk, group, few, many) = if cores >= 8 {
        std::thread::scope(|s| {
            let topk = s.spawn(topk_rows_per_second);
            let group = s.spawn(group_rows_per_second);
            let few = s.spawn(|| aggregate_rows_per_second(FEW_GROUPS));
            let many = aggregate_rows_per_second(MANY_GROUPS);
            let joined =
                |h: std::thread::ScopedJoinHandle<'_, Option<f64>>| h.join().ok().flatten();
            (joined(topk), joined(group), joined(few), many)
        })
    } else {
        (
            topk_rows_per_second(),
            group_rows_per_second(),
            aggregate_rows_per_second(FEW_GROUPS),
            aggregate_rows_per_second(MANY_GROUPS),
        )
    };
    CpuRates {
        topk_rows_per_s: topk.unwrap_or(FALLBACK.0),
        group_rows_per_s: group.unwrap_or(FALLBACK.1),
        aggregate_rows_per_s: few.unwrap_or(FALLBACK.2),
        aggregate_many_rows_per_s: many.unwrap_or(FALLBACK.3),
        cores,
    }
}

/// The next of a xorshift sequence.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Rows per second of the CPU selector on one core: 2^22 rows of an Int32 column, k = 32.
fn topk_rows_per_second() -> Option<f64> {
    use datafusion::arrow::array::Int32Array;

    use crate::keys::{KeyLayout, KeySpec};
    use crate::select::{RowIds, SelectInput, SelectionSpec, cpu};

    const ROWS: usize = 1 << 22;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let column: ArrayRef = Arc::new(Int32Array::from_iter_values(
        (0..ROWS).map(|_| next(&mut x) as i32),
    ));
    let layout = KeyLayout::try_new(vec![KeySpec {
        data_type: DataType::Int32,
        descending: true,
        nulls_first: true,
        nullable: false,
    }])
    .ok()?;
    let spec = SelectionSpec::new(layout, 32);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let selector = cpu::new_selector(&spec);
        let started = Instant::now();
        selector
            .push(SelectInput {
                keys: std::slice::from_ref(&column),
                row_ids: RowIds::Range(0),
            })
            .ok()?;
        selector.finish().ok()?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    Some(ROWS as f64 / best)
}

/// The calibration's grouped rows: 2^20 rows in batches of 8192, an Int64 group `g` of
/// `FEW_GROUPS` values (or `MANY_GROUPS`, for the aggregation's second rate) and an Int64
/// value `v`.
const ROWS: usize = 1 << 20;
pub(crate) const FEW_GROUPS: u64 = 1 << 14;
pub(crate) const MANY_GROUPS: u64 = 1 << 19;
const BATCH: usize = 8192;

/// `count` batches of `rows` rows: `g` drawn below `groups`, `v` spread.
fn grouped_batches(count: usize, rows: usize, groups: u64) -> Option<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("g", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..count)
        .map(|_| {
            let g = Int64Array::from_iter_values((0..rows).map(|_| (next(&mut x) % groups) as i64));
            let v = Int64Array::from_iter_values((0..rows).map(|_| next(&mut x) as i64 >> 8));
            let columns: Vec<ArrayRef> = vec![Arc::new(g), Arc::new(v)];
            RecordBatch::try_new(Arc::clone(&schema), columns).ok()
        })
        .collect()
}

/// Rows per second of the per-group CPU path on one core: 2^20 rows in batches of 8192, an
/// Int64 group of 2^14 values and an Int64 order key (descending), K = 10 by `ROW_NUMBER()`,
/// from the rows' conversion to arrow's row format to the kept rows numbered in order.
fn group_rows_per_second() -> Option<f64> {
    const K: usize = 10;
    let batches = grouped_batches(ROWS / BATCH, BATCH, FEW_GROUPS)?;
    let descending = SortOptions::new(true, false);
    let sort = RowConverter::new(vec![
        SortField::new(DataType::Int64),
        SortField::new_with_options(DataType::Int64, descending),
    ])
    .ok()?;
    let group = RowConverter::new(vec![SortField::new(DataType::Int64)]).ok()?;
    let pool: Arc<dyn MemoryPool> = Arc::new(UnboundedMemoryPool::default());
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        let reservation = MemoryConsumer::new("cpu calibration").register(&pool);
        let started = Instant::now();
        let mut held = HeldRows::default();
        let mut position = 0;
        for batch in &batches {
            let columns = batch.columns();
            let keys = sort.convert_columns(columns).ok()?;
            let groups = group.convert_columns(&columns[..1]).ok()?;
            let function = RankFunction::RowNumber;
            held.offer(
                batch.clone(),
                (keys, &groups),
                position,
                function,
                K,
                &reservation,
            )
            .ok()?;
            position += batch.num_rows() as u64;
        }
        let kept = held.in_sort_order(false);
        let numbers = held.numbers(&kept, RankFunction::RowNumber);
        if numbers.len() != kept.len() || held.groups() == 0 {
            return None;
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    Some(ROWS as f64 / best)
}

/// Rows per second of DataFusion's hash aggregation on one core: the grouped rows (`groups`
/// groups) in one partition, `GROUP BY g` with `COUNT(*)` and `SUM(v)` in a single step, from
/// the first batch read to the groups' output. It runs on a thread of its own with a runtime
/// of one thread, so that it neither needs nor blocks the caller's.
fn aggregate_rows_per_second(groups: u64) -> Option<f64> {
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::execution::TaskContext;
    use datafusion::functions_aggregate::count::count_udaf;
    use datafusion::functions_aggregate::sum::sum_udaf;
    use datafusion::physical_expr::aggregate::AggregateExprBuilder;
    use datafusion::physical_expr::expressions::{col, lit};
    use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
    use datafusion::physical_plan::{ExecutionPlan, collect};

    let batches = grouped_batches(ROWS / BATCH, BATCH, groups)?;
    let schema = batches.first()?.schema();
    let input = MemorySourceConfig::try_new_exec(&[batches], Arc::clone(&schema), None).ok()?;
    let group_by = PhysicalGroupBy::new_single(vec![(col("g", &schema).ok()?, "g".into())]);
    let count = AggregateExprBuilder::new(count_udaf(), vec![lit(1i64)])
        .schema(Arc::clone(&schema))
        .alias("n")
        .build()
        .ok()?;
    let sum = AggregateExprBuilder::new(sum_udaf(), vec![col("v", &schema).ok()?])
        .schema(Arc::clone(&schema))
        .alias("s")
        .build()
        .ok()?;
    let aggregate = AggregateExec::try_new(
        AggregateMode::Single,
        group_by,
        vec![Arc::new(count), Arc::new(sum)],
        vec![None, None],
        input,
        schema,
    )
    .ok()?;
    let plan: Arc<dyn ExecutionPlan> = Arc::new(aggregate);
    let run = move || -> Option<f64> {
        let runtime = tokio::runtime::Builder::new_current_thread().build().ok()?;
        let mut best = f64::INFINITY;
        for _ in 0..2 {
            let started = Instant::now();
            let output = runtime
                .block_on(collect(Arc::clone(&plan), Arc::new(TaskContext::default())))
                .ok()?;
            let found: usize = output.iter().map(RecordBatch::num_rows).sum();
            // Drawn at random, many groups for twice the rows leave about e^-2 of them empty.
            if found as u64 > groups || (found as u64) < groups / 2 {
                return None;
            }
            best = best.min(started.elapsed().as_secs_f64());
        }
        Some(ROWS as f64 / best)
    };
    std::thread::scope(|s| s.spawn(run).join().ok().flatten())
}

fn write_file(path: &Path, rates: &CpuRates) -> std::io::Result<()> {
    let mut text = String::new();
    let _ = writeln!(text, "{FORMAT}");
    let _ = writeln!(text, "cores {}", rates.cores);
    let _ = writeln!(text, "topk_rows_per_s {:e}", rates.topk_rows_per_s);
    let _ = writeln!(text, "group_rows_per_s {:e}", rates.group_rows_per_s);
    let _ = writeln!(
        text,
        "aggregate_rows_per_s {:e}",
        rates.aggregate_rows_per_s
    );
    let _ = writeln!(
        text,
        "aggregate_many_rows_per_s {:e}",
        rates.aggregate_many_rows_per_s
    );
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Parses a file written for a host of `cores` cores; `None` when missing, malformed or for
/// another number of cores (the caller measures again).
fn read_file(path: &Path, cores: usize) -> Option<CpuRates> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut lines = text.lines();
    if lines.next()? != FORMAT {
        return None;
    }
    let mut values = std::collections::HashMap::new();
    for line in lines {
        let (name, value) = line.split_once(' ')?;
        let value: f64 = value.parse().ok()?;
        if !value.is_finite() || value <= 0.0 {
            return None;
        }
        values.insert(name, value);
    }
    let rates = CpuRates {
        topk_rows_per_s: *values.get("topk_rows_per_s")?,
        group_rows_per_s: *values.get("group_rows_per_s")?,
        aggregate_rows_per_s: *values.get("aggregate_rows_per_s")?,
        aggregate_many_rows_per_s: *values.get("aggregate_many_rows_per_s")?,
        cores: *values.get("cores")? as usize,
    };
    (rates.cores == cores).then_some(rates)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A written file reads back as it was; a damaged, truncated or foreign one is measured
    /// again and rewritten, and the rewritten one reads back.
    #[test]
    fn a_cpu_calibration_file_round_trips_and_a_damaged_one_is_measured_again() {
        let dir = std::env::temp_dir().join(format!("gpu-topk-cpu-rates-{}", std::process::id()));
        let path = dir.join(file_name());
        let cores = cpu_cores();
        let rates = CpuRates {
            topk_rows_per_s: 2.5e8,
            group_rows_per_s: 1.25e7,
            aggregate_rows_per_s: 3.5e7,
            aggregate_many_rows_per_s: 1.5e7,
            cores,
        };
        write_file(&path, &rates).unwrap();
        assert_eq!(read_file(&path, cores), Some(rates));
        assert_eq!(read_or_measure(Some(&path)), rates);
        assert_eq!(read_file(&path, cores + 1), None);
        let text = std::fs::read_to_string(&path).unwrap();
        let damaged = [
            text.replace("group_rows_per_s 1.25e7", "group_rows_per_s x"),
            text.replace("topk_rows_per_s 2.5e8", "topk_rows_per_s -1"),
            text.replace("group_rows_per_s", "groups_rows_per_s"),
            text.replace("aggregate_rows_per_s 3.5e7\n", ""),
            text.replace("aggregate_many_rows_per_s 1.5e7\n", ""),
            text.replace(FORMAT, "datafusion-gpu-topk cpu calibration 2"),
            text[..text.len() / 2].to_string(),
        ];
        for damaged in &damaged {
            std::fs::write(&path, damaged).unwrap();
            assert_eq!(read_file(&path, cores), None, "{damaged}");
        }
        let measured = read_or_measure(Some(&path));
        assert_ne!(measured, rates);
        assert_eq!(measured.cores, cores);
        // Measured, not the fallback figures: the selector, the heaps and the aggregation ran.
        assert_ne!(measured.topk_rows_per_s, FALLBACK.0);
        assert_ne!(measured.group_rows_per_s, FALLBACK.1);
        assert_ne!(measured.aggregate_rows_per_s, FALLBACK.2);
        assert_ne!(measured.aggregate_many_rows_per_s, FALLBACK.3);
        assert!(measured.topk_rows_per_s > measured.group_rows_per_s);
        assert_eq!(read_file(&path, cores), Some(measured), "rewritten");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The aggregation's rate is the calibrated one at each point, in between them, and
    /// held beyond them; a time over many groups a partition prices the slower rate.
    #[test]
    fn the_aggregation_rate_follows_the_groups() {
        let rates = CpuRates {
            topk_rows_per_s: 1e8,
            group_rows_per_s: 1e7,
            aggregate_rows_per_s: 100e6,
            aggregate_many_rows_per_s: 10e6,
            cores: 4,
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b;
        assert!(close(rates.aggregate_rate(FEW_GROUPS as usize), 100e6));
        assert!(close(rates.aggregate_rate(1), 100e6));
        assert!(close(rates.aggregate_rate(MANY_GROUPS as usize), 10e6));
        assert!(close(rates.aggregate_rate(1 << 30), 10e6));
        let between = rates.aggregate_rate(1 << 16);
        assert!(between < 100e6 && between > 10e6, "{between}");
        assert!(rates.aggregate_rate(1 << 17) < between);
        // 4M rows into 4 groups: every row at the fast rate, 4 partial groups a core.
        assert!(close(
            rates.aggregate_time(4_000_000, 4),
            4_000_016.0 / 400e6
        ));
        // 4M rows, each its own group: a partition's 1M groups at the slow rate.
        assert!(close(
            rates.aggregate_time(4_000_000, 4_000_000),
            8e6 / 40e6
        ));
    }
}
