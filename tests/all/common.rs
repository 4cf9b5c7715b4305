//! Shared helpers: sessions with and without the operator, and exact row comparison.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float16Type, Float32Type, Float64Type};
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::physical_plan::display::DisplayableExecutionPlan;
use datafusion::physical_plan::{ExecutionPlan, collect, displayable};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::datasets::tweets;
use datafusion_gpu_topk::{GpuAggregateTopKExec, GpuTopKConfig, GpuTopKExec};

pub use crate::sessions::test_backend;
use crate::sessions::{session_with_config, test_config};

/// A session with the rule (`enabled`) or plain DataFusion (`!enabled`).
pub fn session(enabled: bool, partitions: usize, batch_size: usize) -> SessionContext {
    session_with(partitions, batch_size, test_config(enabled))
}

/// A session with the operator configured as `gpu`.
pub fn session_with(partitions: usize, batch_size: usize, gpu: GpuTopKConfig) -> SessionContext {
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .with_batch_size(batch_size);
    session_with_config(config, gpu)
}

/// What the operator nodes of an executed plan report.
#[derive(Debug, Default)]
pub struct Report {
    pub operators: usize,
    pub fallbacks: usize,
    pub device_bytes_held: usize,
    pub pinned_bytes_held: usize,
    /// Why each operator that fell back did.
    pub reasons: Vec<String>,
    /// Pushes whose columns the device column cache held, pushes that shipped them to it, and
    /// the input bytes of each kind.
    pub cache_hits: usize,
    pub cache_misses: usize,
    pub resident_bytes: usize,
    pub uploaded_bytes: usize,
    /// Chunks of a whole table the pass did not read (their zones let no row pass).
    pub chunks_skipped: usize,
    /// Parquet columns shipped as pages and decoded on the device.
    pub device_decoded_columns: usize,
}

/// The metrics of every `GpuTopKExec` in `plan` (after it ran), summed.
pub fn report(plan: &Arc<dyn ExecutionPlan>) -> Report {
    fn walk(plan: &Arc<dyn ExecutionPlan>, report: &mut Report) {
        if let Some(exec) = plan.downcast_ref::<GpuTopKExec>() {
            let metric = |name: &str| {
                exec.metrics()
                    .and_then(|m| m.sum_by_name(name))
                    .map_or(0, |v| v.as_usize())
            };
            report.operators += 1;
            report.fallbacks += metric("gpu_fallbacks");
            report.device_bytes_held += metric("device_bytes_held");
            report.pinned_bytes_held += metric("pinned_bytes_held");
            report.reasons.extend(exec.fallback_reason());
            report.cache_hits += metric("cache_hits");
            report.cache_misses += metric("cache_misses");
            report.resident_bytes += metric("resident_bytes");
            report.uploaded_bytes += metric("uploaded_bytes");
            report.device_decoded_columns += metric("device_decoded_columns");
            report.chunks_skipped += metric("chunks_skipped");
        }
        plan.children().into_iter().for_each(|c| walk(c, report));
    }
    let mut report = Report::default();
    walk(plan, &mut report);
    report
}

/// Runs `sql`, with what its operators report.
pub async fn run_reporting(ctx: &SessionContext, sql: &str) -> (Result<Vec<RecordBatch>>, Report) {
    let plan = physical_plan(ctx, sql).await.unwrap();
    let result = datafusion::physical_plan::collect(Arc::clone(&plan), ctx.task_ctx()).await;
    (result, report(&plan))
}

/// Plain DataFusion as the oracle over `storage`. Over Parquet its TopK's dynamic filter can
/// prune row groups holding rows that belong in the answer (NaN halves, DataFusion 55), so
/// the oracle sorts without it there.
pub fn plain_session(partitions: usize, storage: Storage) -> SessionContext {
    plain_session_with(partitions, 100, storage)
}

/// [`plain_session`] with batches of `batch_size` rows.
pub fn plain_session_with(
    partitions: usize,
    batch_size: usize,
    storage: Storage,
) -> SessionContext {
    let ctx = session(false, partitions, batch_size);
    if matches!(storage, Storage::Parquet | Storage::Csv) {
        let state = ctx.state_ref();
        let mut state = state.write();
        state
            .config_mut()
            .options_mut()
            .optimizer
            .enable_topk_dynamic_filter_pushdown = false;
    }
    ctx
}

/// The schema of a table given as partitions of batches.
fn schema_of(partitions: &[Vec<RecordBatch>]) -> datafusion::arrow::datatypes::SchemaRef {
    partitions
        .iter()
        .flatten()
        .next()
        .map(|b| b.schema())
        .expect("at least one batch to take the schema from")
}

pub fn register(ctx: &SessionContext, name: &str, partitions: Vec<Vec<RecordBatch>>) {
    let schema = schema_of(&partitions);
    let table = MemTable::try_new(schema, partitions).expect("mem table");
    ctx.register_table(name, Arc::new(table)).expect("register");
}

pub async fn physical_plan(ctx: &SessionContext, sql: &str) -> Result<Arc<dyn ExecutionPlan>> {
    ctx.sql(sql).await?.create_physical_plan().await
}

pub fn plan_text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(true).to_string()
}

/// Number of the operators' nodes in a plan: `GpuTopKExec`s, and `GpuAggregateTopKExec`s,
/// which take a top-k over an aggregation whole.
pub fn count_gpu_topk(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let here = usize::from(
        plan.downcast_ref::<GpuTopKExec>().is_some()
            || plan.downcast_ref::<GpuAggregateTopKExec>().is_some(),
    );
    here + plan
        .children()
        .iter()
        .map(|c| count_gpu_topk(c))
        .sum::<usize>()
}

/// Runs `sql` with the operator (`ours`, one `GpuTopKExec` in its plan) and `oracle` with plain
/// DataFusion, compares the rows one for one (`what` names the case in a failure) and returns
/// the operator's executed plan with its metrics.
pub async fn same_rows_with_metrics(
    ours: &SessionContext,
    plain: &SessionContext,
    (sql, oracle): (&str, &str),
    what: &str,
) -> String {
    let plan = physical_plan(ours, sql).await.unwrap();
    assert_eq!(
        count_gpu_topk(&plan),
        1,
        "{what}: {sql}:\n{}",
        plan_text(&plan)
    );
    let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
    let want = run_oracle(plain, oracle).await.unwrap();
    assert_eq!(got, want, "{what}: {sql}");
    DisplayableExecutionPlan::with_metrics(plan.as_ref())
        .indent(true)
        .to_string()
}

pub async fn run(ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>> {
    ctx.sql(sql).await?.collect().await
}

/// The rows of `oracle` (plain DataFusion) as [`exact_rows`]. A trailing `LIMIT n [OFFSET m]`
/// is applied to the full sort instead of running DataFusion's TopK, which can rank 0.0 rows
/// before −0.0 ones depending on batch arrival (DataFusion 55).
pub async fn run_oracle(ctx: &SessionContext, oracle: &str) -> Result<Vec<String>> {
    let window = oracle.rfind(" LIMIT ").and_then(|at| {
        let words: Vec<&str> = oracle[at..].split_whitespace().collect();
        let number = |w: &str| w.parse::<usize>().ok();
        match words.as_slice() {
            ["LIMIT", n] => Some((at, 0, number(n)?)),
            ["LIMIT", n, "OFFSET", m] => Some((at, number(m)?, number(n)?)),
            _ => None,
        }
    });
    let Some((at, offset, limit)) = window else {
        return Ok(exact_rows(&run(ctx, oracle).await?));
    };
    let rows = exact_rows(&run(ctx, &oracle[..at]).await?);
    let body: Vec<String> = rows.iter().skip(1 + offset).take(limit).cloned().collect();
    // `exact_rows` writes the types' line only above rows.
    Ok(match body.is_empty() {
        true => body,
        false => rows.into_iter().take(1).chain(body).collect(),
    })
}

/// Every row as text, exact: floats also by their bits (so -0.0, NaN payloads and the like
/// must match, not just print alike). Column types are part of the first line.
pub fn exact_rows(batches: &[RecordBatch]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(first) = batches.iter().find(|b| b.num_rows() > 0) {
        let types: Vec<String> = first
            .schema()
            .fields()
            .iter()
            .map(|f| format!("{}:{}", f.name(), f.data_type()))
            .collect();
        out.push(types.join(", "));
    }
    let options = FormatOptions::default().with_null("NULL");
    for batch in batches {
        let formatters: Vec<_> = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options).expect("formatter"))
            .collect();
        for r in 0..batch.num_rows() {
            let cells: Vec<String> = batch
                .columns()
                .iter()
                .zip(&formatters)
                .map(|(col, f)| {
                    if col.is_null(r) {
                        return "NULL".to_string();
                    }
                    let bits = match col.data_type() {
                        DataType::Float16 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float16Type>().value(r).to_bits()
                            )
                        }
                        DataType::Float32 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float32Type>().value(r).to_bits()
                            )
                        }
                        DataType::Float64 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float64Type>().value(r).to_bits()
                            )
                        }
                        _ => String::new(),
                    };
                    format!("{}{bits}", f.value(r))
                })
                .collect();
            out.push(cells.join(" | "));
        }
    }
    out
}

/// A table of partitions of batches of the given sizes, made by `batch(rng, first_rid, rows)`
/// in partition order, so that `rid` (the first row's id, counted across partitions) is the
/// input position.
pub fn partitioned(
    seed: u64,
    sizes: &[&[usize]],
    mut batch: impl FnMut(&mut Rng, i64, usize) -> RecordBatch,
) -> Vec<Vec<RecordBatch>> {
    let mut rng = Rng::new(seed);
    let mut rid = 0i64;
    sizes
        .iter()
        .map(|batches| {
            batches
                .iter()
                .map(|&n| {
                    let b = batch(&mut rng, rid, n);
                    rid += n as i64;
                    b
                })
                .collect()
        })
        .collect()
}

/// A tiny deterministic PRNG (xorshift64*), so test data is reproducible without a crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Uniform in [0, 1), from the top 53 bits of one draw.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() <= p
    }
}

/// Where a test table lives: the kinds of input users query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// A `MemTable`, one partition per input partition.
    Memory,
    /// One Parquet file per input partition, row groups of `ROW_GROUP_ROWS` rows.
    Parquet,
    /// One CSV file per input partition, with a header.
    Csv,
    /// A `GpuTable`, one partition per input partition.
    GpuTable,
}

pub const STORAGES: [Storage; 4] = [
    Storage::Memory,
    Storage::Parquet,
    Storage::Csv,
    Storage::GpuTable,
];

/// Rows per Parquet row group in file-backed test tables (several per file).
pub const ROW_GROUP_ROWS: usize = 64;

/// A directory of its own for one test's files, emptied first.
pub fn test_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gpu-topk-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    dir
}

/// Registers `partitions` as table `name` stored as `storage`. Files go under `dir`, named in
/// partition order, so the table's input order is the partitions' order however DataFusion
/// groups the files.
pub async fn register_as(
    ctx: &SessionContext,
    name: &str,
    partitions: &[Vec<RecordBatch>],
    storage: Storage,
    dir: &std::path::Path,
) {
    use datafusion::prelude::{CsvReadOptions, ParquetReadOptions};
    match storage {
        Storage::Memory => return register(ctx, name, partitions.to_vec()),
        Storage::GpuTable => {
            let table =
                datafusion_gpu_topk::GpuTable::try_new(schema_of(partitions), partitions.to_vec())
                    .expect("gpu table");
            ctx.register_table(name, Arc::new(table)).expect("register");
            return;
        }
        Storage::Parquet | Storage::Csv => {}
    }
    let schema = schema_of(partitions);
    let dir = dir.join(format!("{name}-{storage:?}").to_lowercase());
    if !dir.exists() {
        std::fs::create_dir_all(&dir).expect("table directory");
        for (p, batches) in partitions.iter().enumerate() {
            write_file(&dir, p, &schema, batches, storage);
        }
    }
    let path = dir.to_str().expect("utf-8 path");
    match storage {
        Storage::Parquet => ctx
            .register_parquet(name, path, ParquetReadOptions::default())
            .await
            .expect("register parquet"),
        Storage::Csv => ctx
            .register_csv(name, path, CsvReadOptions::new().schema(&schema))
            .await
            .expect("register csv"),
        Storage::Memory | Storage::GpuTable => unreachable!(),
    }
}

fn write_file(
    dir: &std::path::Path,
    partition: usize,
    schema: &datafusion::arrow::datatypes::SchemaRef,
    batches: &[RecordBatch],
    storage: Storage,
) {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let extension = if storage == Storage::Csv {
        "csv"
    } else {
        "parquet"
    };
    let file = std::fs::File::create(dir.join(format!("part-{partition:04}.{extension}")))
        .expect("create test file");
    if storage == Storage::Csv {
        let mut writer = datafusion::arrow::csv::WriterBuilder::new()
            .with_header(true)
            .build(file);
        for batch in batches {
            writer.write(batch).expect("write csv");
        }
        return;
    }
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .build();
    let mut writer =
        ArrowWriter::try_new(file, Arc::clone(schema), Some(properties)).expect("parquet writer");
    for batch in batches {
        writer.write(batch).expect("write parquet");
    }
    writer.close().expect("close parquet");
}

/// The warnings the library logged since [`capture_warnings`] was first called (a GPU
/// fallback says why it fell back), across all tests of the process.
pub fn logged_warnings() -> Vec<String> {
    WARNINGS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Keeps the library's warnings for [`logged_warnings`] from now on.
pub fn capture_warnings() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        if log::set_logger(&CAPTURE).is_ok() {
            log::set_max_level(log::LevelFilter::Warn);
        }
    });
}

static WARNINGS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static CAPTURE: Capture = Capture;

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Warn
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let mut warnings = WARNINGS.lock().unwrap_or_else(|e| e.into_inner());
            warnings.push(record.args().to_string());
        }
    }

    fn flush(&self) {}
}

/// Queries of the tweets table whose every tie the operator breaks by input position, for the
/// tests that split a top-k (between devices, between a cluster's tasks); their oracle is the
/// same query run by one operator.
pub const TWEET_QUERIES: &[&str] = &[
    tweets::QUERIES[0].1,
    tweets::QUERIES[1].1,
    tweets::QUERIES[2].1,
    "SELECT id, retweet_count FROM tweets ORDER BY retweet_count DESC LIMIT 25 OFFSET 10",
    "SELECT uid, likes_count + retweet_count AS score FROM tweets WHERE lang <> 'en' \
     ORDER BY score DESC, uid LIMIT 40",
];

/// Tie-free queries of the tie-heavy table `t` (`files::ties_table`) for the same tests, with
/// plain DataFusion's answer as the oracle: the table in input order (`rid`), and an aggregate
/// below the top-k.
pub const ORACLE_QUERIES: &[(&str, &str)] = &[
    (
        "SELECT g, rid FROM t ORDER BY g LIMIT 400",
        "SELECT g, rid FROM t ORDER BY g, rid LIMIT 400",
    ),
    (
        "SELECT c, rid FROM t ORDER BY c DESC LIMIT 90 OFFSET 25",
        "SELECT c, rid FROM t ORDER BY c DESC, rid LIMIT 90 OFFSET 25",
    ),
    (
        "SELECT f, g, rid FROM t WHERE g <> 2 ORDER BY f NULLS FIRST, g DESC LIMIT 300",
        "SELECT f, g, rid FROM t WHERE g <> 2 ORDER BY f NULLS FIRST, g DESC, rid LIMIT 300",
    ),
    (
        "SELECT g, COUNT(*) AS n, MAX(rid) AS last FROM t GROUP BY g ORDER BY n DESC, g LIMIT 3",
        "SELECT g, COUNT(*) AS n, MAX(rid) AS last FROM t GROUP BY g ORDER BY n DESC, g LIMIT 3",
    ),
];
