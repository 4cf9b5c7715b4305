//! The device column cache: a repeated query over an in-memory table or Parquet files reads
//! its columns from device memory, with DataFusion's answer; a changed table or rewritten file
//! is never served stale; a small budget (the process's, `set_column_cache_budget`) evicts,
//! and a query larger than it still runs; a session can turn the cache off for its queries
//! (`gpu_topk.column_cache`); concurrent and cancelled queries leave no entry in use. On the
//! CUDA backend only: without a GPU each test says so and passes.

use std::sync::Arc;

use datafusion::arrow::array::{AsArray, Float64Array, Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::internal::device::column_cache::CacheListing;
use datafusion_gpu_topk::internal::device::{GpuDevice, GpuStatus, gpu, gpu_status};
use datafusion_gpu_topk::{Backend, GpuTable, GpuTopKConfig, set_column_cache_budget};
use futures::StreamExt;

use crate::common::Storage;
use crate::common::{
    Report, exact_rows, physical_plan, plain_session_with, plan_text, register, register_as,
    run_oracle, run_reporting, session_with, test_dir,
};

/// The cache is the process's, and its budget is everyone's: the tests that count entries,
/// set a small budget or empty it run one at a time, and so do those whose assertions need it
/// left alone (plan reuse follows residency).
pub(crate) static CACHE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The process's cache budget set to `bytes` until dropped, then the default again.
struct Budget;

impl Budget {
    fn set(bytes: usize) -> Self {
        set_column_cache_budget(Some(bytes));
        Budget
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        set_column_cache_budget(None);
    }
}

fn gpu_or_skip(test: &str) -> bool {
    match gpu_status() {
        GpuStatus::Available(_) => true,
        GpuStatus::Unavailable(why) => {
            eprintln!("SKIP: {test}: no GPU ({why})");
            false
        }
    }
}

/// `partitions` partitions of `batches` batches of `rows` rows: `rid` (input position),
/// `v` (ties every 1000 values), `f` in [0, 1).
pub(crate) fn table(
    partitions: usize,
    batches: usize,
    rows: usize,
    seed: i64,
) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("rid", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
        Field::new("f", DataType::Float64, false),
    ]));
    let mut rid = 0i64;
    (0..partitions)
        .map(|_| {
            (0..batches)
                .map(|_| {
                    let ids: Vec<i64> = (rid..rid + rows as i64).collect();
                    rid += rows as i64;
                    let hash = |i: i64| (i.wrapping_mul(2654435761) ^ seed).rem_euclid(1 << 30);
                    let v: Vec<i64> = ids.iter().map(|&i| hash(i) % 1000).collect();
                    let f: Vec<f64> = ids
                        .iter()
                        .map(|&i| hash(i + 7) as f64 / (1u64 << 30) as f64)
                        .collect();
                    RecordBatch::try_new(
                        Arc::clone(&schema),
                        vec![
                            Arc::new(Int64Array::from(ids)),
                            Arc::new(Int64Array::from(v)),
                            Arc::new(Float64Array::from(f)),
                        ],
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect()
}

/// The entries of a [`table`] of `chunks` batches in all (other tests' queries add theirs
/// to the same cache meanwhile, with other column names or batch counts).
fn ours(device: &GpuDevice, chunks: usize) -> impl Iterator<Item = CacheListing> {
    let listing = device.column_cache.listing().into_iter();
    listing.filter(move |e| (e.column == "f" || e.column == "v") && e.chunks == chunks)
}

const QUERY: &str = "SELECT rid, v FROM t WHERE f < 0.5 ORDER BY v DESC LIMIT 20";
const ORACLE: &str = "SELECT rid, v FROM t WHERE f < 0.5 ORDER BY v DESC, rid LIMIT 20";

/// A CUDA session over `data` as `t` (in memory), using the column cache or not, and plain
/// DataFusion over the same batches.
fn sessions(data: Vec<Vec<RecordBatch>>, use_cache: bool) -> (SessionContext, SessionContext) {
    let partitions = data.len();
    let config = crate::sessions::base_config()
        .with_backend(Backend::Cuda)
        .with_column_cache(use_cache);
    let ctx = session_with(partitions, 8192, config);
    register(&ctx, "t", data.clone());
    let plain = plain_session_with(partitions, 8192, Storage::Memory);
    register(&plain, "t", data);
    (ctx, plain)
}

/// The rows of `sql`'s result as `exact_rows` gives them, without its header line.
async fn values(ctx: &SessionContext, sql: &str) -> Vec<String> {
    let rows = exact_rows(&ctx.sql(sql).await.unwrap().collect().await.unwrap());
    rows[1..].to_vec()
}

async fn check(ctx: &SessionContext, plain: &SessionContext, sql: &str, oracle: &str) -> Report {
    let (result, report) = run_reporting(ctx, sql).await;
    let rows = exact_rows(&result.unwrap_or_else(|e| panic!("{sql}: {e}")));
    assert_eq!(rows, run_oracle(plain, oracle).await.unwrap(), "{sql}");
    assert_eq!(report.fallbacks, 0, "{sql}: {:?}", report.reasons);
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_query_reads_its_columns_from_the_cache() {
    if !gpu_or_skip("a_repeated_query_reads_its_columns_from_the_cache") {
        return;
    }
    let _serial = CACHE.lock().await;
    let (ctx, plain) = sessions(table(3, 4, 100_000, 1), true);
    let cold = check(&ctx, &plain, QUERY, ORACLE).await;
    // One entry per column the program reads: f (the filter) and v (the key).
    assert_eq!(cold.cache_misses, 2, "{cold:?}");
    assert_eq!(cold.uploaded_bytes, 2 * 8 * 12 * 100_000, "{cold:?}");
    assert_eq!(cold.cache_hits, 0, "a new table's buffers: {cold:?}");
    let warm = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!(warm.cache_misses, 0, "{warm:?}");
    assert_eq!(warm.cache_hits, cold.cache_misses, "{warm:?}");
    assert_eq!(warm.uploaded_bytes, 0, "{warm:?}");
    assert_eq!(warm.resident_bytes, cold.uploaded_bytes, "{warm:?}");
    // The cost model knows: its prediction counts no transfer for resident columns.
    let text = plan_text(&physical_plan(&ctx, QUERY).await.unwrap());
    assert!(
        !text.contains("predicted=") || text.contains("resident=100%"),
        "{text}"
    );
    // Another query over the same columns, and one over other columns, still right.
    let other = "SELECT rid FROM t WHERE f < 0.25 ORDER BY v, f DESC LIMIT 7";
    check(&ctx, &plain, other, &other.replace("LIMIT", ", rid LIMIT")).await;
    let device = gpu().expect("checked above");
    assert!(ours(&device, 12).all(|e| !e.in_use));
    let listed = "SELECT count(*) FROM gpu_topk_cache() \
        WHERE column IN ('f', 'v') AND chunks = 12 AND bytes >= 9600000 AND NOT in_use";
    assert_ne!(values(&ctx, listed).await, vec!["0".to_string()]);
    // Cleared from SQL: the next run ships its columns again.
    let cleared = "SELECT evicted > 0 FROM gpu_topk_cache_clear()";
    assert_eq!(values(&ctx, cleared).await, vec!["true".to_string()]);
    let again = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!(again.cache_misses, cold.cache_misses, "{again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_changed_table_is_never_served_stale() {
    if !gpu_or_skip("a_changed_table_is_never_served_stale") {
        return;
    }
    let _serial = CACHE.lock().await;
    let (ctx, plain) = sessions(table(2, 2, 50_000, 2), true);
    check(&ctx, &plain, QUERY, ORACLE).await;
    // New winners: v = 5000 beats every generated value.
    for c in [&ctx, &plain] {
        c.sql("INSERT INTO t VALUES (-1, 5000, 0.1), (-2, 5000, 0.9), (-3, 4999, 0.2)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
    }
    let after = check(&ctx, &plain, QUERY, ORACLE).await;
    assert!(
        after.cache_misses > 0,
        "the inserted batch is new: {after:?}"
    );
    let rows = values(&ctx, QUERY).await;
    assert!(rows[0].starts_with("-1 | 5000"), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_budget_evicts_and_a_query_larger_than_it_still_runs() {
    if !gpu_or_skip("a_small_budget_evicts_and_a_query_larger_than_it_still_runs") {
        return;
    }
    let _serial = CACHE.lock().await;
    // Each column is 8 bytes × 400K rows = 3.2 MB.
    let data = table(1, 4, 100_000, 3);
    // Smaller than one column: nothing is cached, every run streams its columns.
    let budget = Budget::set(1 << 20);
    let (ctx, plain) = sessions(data.clone(), true);
    for _ in 0..2 {
        let report = check(&ctx, &plain, QUERY, ORACLE).await;
        assert_eq!(report.cache_hits, 0, "{report:?}");
        assert!(report.uploaded_bytes > 0, "{report:?}");
    }
    // Room for one column: queries over f and over v take turns evicting each other, the
    // cache stays within its budget, answers stay right.
    drop(budget);
    let budget = 4 << 20;
    let _budget = Budget::set(budget);
    let (ctx, plain) = sessions(data, true);
    let by_f = "SELECT rid, f FROM t ORDER BY f DESC LIMIT 5";
    let by_v = "SELECT rid, v FROM t ORDER BY v DESC LIMIT 5";
    for (sql, rerun) in [(by_f, true), (by_v, false), (by_f, false)] {
        let oracle = sql.replace("LIMIT", ", rid LIMIT");
        check(&ctx, &plain, sql, &oracle).await;
        if rerun {
            let again = check(&ctx, &plain, sql, &oracle).await;
            assert_eq!(again.cache_hits, 1, "{again:?}");
        }
        // This table's entries (other tests' queries may add theirs meanwhile).
        let ours: usize = ours(&gpu().unwrap(), 4).map(|e| e.bytes).sum();
        assert!(ours <= budget, "{ours} > {budget}");
    }
    // Both columns: more than the budget, streamed, still right.
    check(&ctx, &plain, QUERY, ORACLE).await;
}

/// A table larger than one device's budget, split between two devices (GPUs 0 and 1, or two
/// logical devices of GPU 0 on a one-GPU machine), stays resident: each device caches its
/// share of the partitions, and a repeated query ships nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_larger_than_one_devices_budget_stays_resident_on_two() {
    if !gpu_or_skip("a_table_larger_than_one_devices_budget_stays_resident_on_two") {
        return;
    }
    let _serial = CACHE.lock().await;
    use datafusion_gpu_topk::internal::device::{gpu_on, slots};
    // f and v: 2 × 8 bytes × 600K rows = 9.6 MB in 6 partitions of 2 batches; the budget
    // holds 6 MB, so not both columns on one device, but each device's half of them.
    let data = table(6, 2, 50_000, 7);
    let budget = 6 << 20;
    let _budget = Budget::set(budget);
    let (one, plain) = sessions(data.clone(), true);
    for _ in 0..2 {
        let report = check(&one, &plain, QUERY, ORACLE).await;
        assert!(report.uploaded_bytes > 0, "one device: {report:?}");
    }
    let devices = crate::sessions::split_devices();
    // Batches kept as they are: the entries are found by their chunk count.
    let config = GpuTopKConfig::default()
        .with_backend(Backend::Cuda)
        .with_devices(Some(&devices))
        .with_compact_tables(false);
    let split = session_with(6, 8192, config);
    register(&split, "t", data);
    check(&split, &plain, QUERY, ORACLE).await;
    let warm = check(&split, &plain, QUERY, ORACLE).await;
    assert_eq!(warm.operators, 3, "two parts and the merge: {warm:?}");
    assert_eq!(warm.uploaded_bytes, 0, "{devices:?}: {warm:?}");
    assert_eq!(
        warm.resident_bytes,
        2 * 8 * 600_000,
        "{devices:?}: {warm:?}"
    );
    for slot in slots(&devices) {
        let device = gpu_on(slot).expect("opened by the query");
        // Each part's columns are 6 batches (3 partitions of 2) of this table.
        let held: usize = ours(&device, 6).map(|e| e.bytes).sum();
        assert!(held >= 8 * 600_000, "device {slot} holds {held} bytes");
        assert!(device.column_cache.bytes() <= budget, "device {slot}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn concurrent_and_cancelled_queries_leave_no_entry_in_use() {
    if !gpu_or_skip("concurrent_and_cancelled_queries_leave_no_entry_in_use") {
        return;
    }
    let _serial = CACHE.lock().await;
    let (ctx, plain) = sessions(table(4, 3, 60_000, 4), true);
    let want = run_oracle(&plain, ORACLE).await.unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let ctx = ctx.clone();
            tokio::spawn(async move { run_reporting(&ctx, QUERY).await })
        })
        .collect();
    for task in tasks {
        let (result, report) = task.await.unwrap();
        assert_eq!(exact_rows(&result.unwrap()), want);
        assert_eq!(report.fallbacks, 0, "{:?}", report.reasons);
    }
    // Cancelled after the first batch of its output stream is asked for, or before.
    for stop_after in 0..3 {
        let plan = physical_plan(&ctx, QUERY).await.unwrap();
        let mut stream = datafusion::physical_plan::execute_stream(plan, ctx.task_ctx()).unwrap();
        for _ in 0..stop_after {
            let _ = stream.next().await;
        }
        drop(stream);
    }
    let device = gpu().unwrap();
    let settled = (0..100).any(|_| {
        let idle = ours(&device, 12).all(|e| !e.in_use);
        if !idle {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        idle
    });
    assert!(settled, "{:?}", device.column_cache.listing());
    assert_eq!(
        exact_rows(&ctx.sql(QUERY).await.unwrap().collect().await.unwrap()),
        want
    );
}

#[tokio::test]
async fn the_cache_is_used_for_tables_and_parquet_files_and_can_be_turned_off() {
    // Planning only: runs on any machine.
    let data = table(2, 1, 1000, 5);
    let uses_cache = |ctx: SessionContext| async move {
        let plan = physical_plan(&ctx, QUERY).await.unwrap();
        datafusion::physical_plan::displayable(plan.as_ref())
            .indent(true)
            .to_string()
            .contains("cache=on")
    };
    let gpu_present = matches!(gpu_status(), GpuStatus::Available(_));
    let (on, _) = sessions(data.clone(), true);
    assert_eq!(uses_cache(on).await, gpu_present);
    let (off, _) = sessions(data.clone(), false);
    assert!(!uses_cache(off).await);
    let dir = test_dir("cache-planning");
    for (storage, cached) in [(Storage::Parquet, gpu_present), (Storage::Csv, false)] {
        let config = crate::sessions::base_config().with_backend(Backend::Cuda);
        let ctx = session_with(2, 8192, config);
        register_as(&ctx, "t", &data, storage, &dir).await;
        assert_eq!(uses_cache(ctx).await, cached, "{storage:?}");
    }
}

/// Returns once no background load runs (one a run left must not overlap the next).
async fn settled_loads() {
    while datafusion_gpu_topk::internal::exec::warming_up() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// `data` written as Parquet files under `dir`, one per partition, row groups of
/// `group_rows` rows.
fn write_parquet(dir: &std::path::Path, data: &[Vec<RecordBatch>], group_rows: usize) {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    for (p, batches) in data.iter().enumerate() {
        let path = dir.join(format!("part-{p:04}.parquet"));
        let file = std::fs::File::create(path).unwrap();
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(group_rows))
            .build();
        let mut writer = ArrowWriter::try_new(file, batches[0].schema(), Some(properties)).unwrap();
        for batch in batches {
            writer.write(batch).unwrap();
        }
        writer.close().unwrap();
    }
}

/// A CUDA session over the Parquet files in `dir` as `t` (`partitions` target partitions),
/// and plain DataFusion over the same files.
async fn parquet_sessions(
    dir: &std::path::Path,
    partitions: usize,
) -> (SessionContext, SessionContext) {
    use datafusion::prelude::ParquetReadOptions;
    let config = crate::sessions::base_config().with_backend(Backend::Cuda);
    let ctx = session_with(partitions, 8192, config);
    let plain = plain_session_with(partitions, 8192, Storage::Parquet);
    for c in [&ctx, &plain] {
        let path = dir.to_str().unwrap();
        c.register_parquet("t", path, ParquetReadOptions::default())
            .await
            .unwrap();
    }
    (ctx, plain)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parquet_files_are_read_into_the_cache_once() {
    if !gpu_or_skip("parquet_files_are_read_into_the_cache_once") {
        return;
    }
    let _serial = CACHE.lock().await;
    let dir = test_dir("cache-parquet");
    // Three files of 100,000 rows, three row groups each.
    write_parquet(&dir, &table(3, 2, 50_000, 11), 40_000);
    let (ctx, plain) = parquet_sessions(&dir, 3).await;
    // Decoded on the host, the columns' values cross PCIe.
    ctx.sql("SET gpu_topk.decode_parquet_on_device = false")
        .await
        .unwrap();
    let cold = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!(cold.cache_misses, 2, "{cold:?}");
    assert_eq!(cold.uploaded_bytes, 2 * 8 * 300_000, "{cold:?}");
    assert_eq!(cold.device_decoded_columns, 0, "{cold:?}");
    let warm = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!(warm.cache_misses, 0, "{warm:?}");
    assert_eq!(warm.cache_hits, 2, "{warm:?}");
    assert_eq!(warm.uploaded_bytes, 0, "{warm:?}");
    let text = plan_text(&physical_plan(&ctx, QUERY).await.unwrap());
    assert!(
        !text.contains("predicted=") || text.contains("resident=100%"),
        "{text}"
    );
    // Other output columns, OFFSET, and keys read from the cache with the filter's column.
    for sql in [
        "SELECT * FROM t WHERE f < 0.5 ORDER BY v DESC LIMIT 20 OFFSET 5",
        "SELECT f, rid FROM t ORDER BY f, v DESC LIMIT 1000",
        "SELECT rid FROM t WHERE v > 990 ORDER BY f DESC LIMIT 3",
        // Computed in the scan: cached as computed.
        "SELECT rid, f * 2.0 - v AS g FROM t ORDER BY f * 2.0 - v DESC LIMIT 10",
    ] {
        check(&ctx, &plain, sql, &sql.replace(" LIMIT", ", rid LIMIT")).await;
    }
    let listed = "SELECT count(*) FROM gpu_topk_cache() \
        WHERE column IN ('f', 'v') AND chunks = 9 AND bytes >= 2400000 AND NOT in_use";
    assert_eq!(values(&ctx, listed).await, vec!["2".to_string()]);
    // Files split into byte ranges across more partitions: each range reads the row groups
    // DataFusion's scan reads, in the same order.
    let (split, plain) = parquet_sessions(&dir, 7).await;
    split
        .sql("SET datafusion.optimizer.repartition_file_min_size = 1024")
        .await
        .unwrap();
    let plan = plan_text(&physical_plan(&split, QUERY).await.unwrap());
    assert!(plan.contains("cache=on"), "{plan}");
    for _ in 0..2 {
        check(&split, &plain, QUERY, ORACLE).await;
    }
}

/// Parquet columns shipped as their pages and decoded on the device: integers of every width
/// (truncated from INT32), floats, timestamps, with NULLs, without, and NULLs only in later row
/// groups; files with dictionaries (v1 and v2 pages), without (zstd), with a dictionary that
/// overflows into PLAIN pages (lz4), and with DELTA_BINARY_PACKED integers, decoded on the
/// host; many pages a row group; NULLs first and last.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parquet_pages_are_decoded_on_the_device() {
    use datafusion::arrow::array::{
        Float32Array, Int16Array, Int32Array, TimestampMicrosecondArray, UInt32Array,
    };
    use datafusion::arrow::datatypes::TimeUnit;
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::basic::{Compression, ZstdLevel};
    use datafusion::parquet::file::properties::{WriterProperties, WriterVersion};
    if !gpu_or_skip("parquet_pages_are_decoded_on_the_device") {
        return;
    }
    let _serial = CACHE.lock().await;
    let n = 9000usize;
    let v = |i: usize| ((i * 7919) % 1000) as i64 - 500;
    let opt = |i: usize, x: i64| (i % 11 != 3).then_some(x);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("a", DataType::Int16, true),
        Field::new("b", DataType::Int32, false),
        Field::new("c", DataType::UInt32, true),
        Field::new("d", DataType::Float32, true),
        Field::new("e", DataType::Float64, true),
        Field::new("f", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("g", DataType::Int64, true),
    ]));
    let columns: Vec<datafusion::arrow::array::ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(
            (0..n).map(|i| i as i64 * 1_000_003),
        )),
        Arc::new(Int16Array::from_iter(
            (0..n).map(|i| opt(i, v(i) * 60).map(|x| x as i16)),
        )),
        Arc::new(Int32Array::from_iter_values(
            (0..n).map(|i| v(i) as i32 * 4_000_000),
        )),
        Arc::new(UInt32Array::from_iter(
            (0..n).map(|i| opt(i, v(i) << 22).map(|x| x as u32)),
        )),
        Arc::new(Float32Array::from_iter(
            (0..n).map(|i| opt(i, v(i)).map(|x| x as f32 / 3.0)),
        )),
        Arc::new(Float64Array::from_iter(
            (0..n).map(|i| opt(i, i as i64).map(|x| x as f64 * 0.1)),
        )),
        Arc::new(TimestampMicrosecondArray::from_iter(
            (0..n).map(|i| opt(i, v(i) << 30)),
        )),
        Arc::new(Int64Array::from_iter(
            (0..n).map(|i| (i >= n / 2).then_some(v(i))),
        )),
    ];
    let batch = RecordBatch::try_new(Arc::clone(&schema), columns).unwrap();
    let zstd = Compression::ZSTD(ZstdLevel::default());
    // Without a dictionary, v2 pages store integers DELTA_BINARY_PACKED: host-decoded.
    let writers = [
        (
            "dictionary",
            true,
            WriterVersion::PARQUET_1_0,
            Compression::UNCOMPRESSED,
            1 << 20,
        ),
        (
            "plain-zstd",
            false,
            WriterVersion::PARQUET_1_0,
            zstd,
            1 << 20,
        ),
        (
            "dictionary-v2-snappy",
            true,
            WriterVersion::PARQUET_2_0,
            Compression::SNAPPY,
            1 << 20,
        ),
        (
            "overflow-lz4",
            true,
            WriterVersion::PARQUET_1_0,
            Compression::LZ4_RAW,
            512,
        ),
        (
            "delta-v2",
            false,
            WriterVersion::PARQUET_2_0,
            Compression::UNCOMPRESSED,
            1 << 20,
        ),
    ];
    for (name, dictionary, version, compression, dictionary_bytes) in writers {
        let dir = test_dir(&format!("cache-pages-{name}"));
        for file in 0..2 {
            let properties = WriterProperties::builder()
                .set_max_row_group_row_count(Some(2000 + 700 * file))
                .set_data_page_row_count_limit(300)
                .set_write_batch_size(100)
                .set_dictionary_enabled(dictionary)
                .set_dictionary_page_size_limit(dictionary_bytes)
                .set_writer_version(version)
                .set_compression(compression)
                .build();
            let out = std::fs::File::create(dir.join(format!("f{file}.parquet"))).unwrap();
            let mut writer =
                ArrowWriter::try_new(out, Arc::clone(&schema), Some(properties)).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
        }
        let (ctx, plain) = parquet_sessions(&dir, 3).await;
        let mut decoded = 0;
        for column in ["a", "b", "c", "d", "e", "f", "g"] {
            for order in ["NULLS FIRST", "DESC NULLS LAST"] {
                let sql =
                    format!("SELECT id, {column} FROM t ORDER BY {column} {order}, id LIMIT 40");
                let report = check(&ctx, &plain, &sql, &sql).await;
                decoded += report.device_decoded_columns;
            }
        }
        // Each column once, `id` with the first; of DELTA_BINARY_PACKED v2 pages (integers),
        // the floats only.
        let expected = if name == "delta-v2" { 2 } else { 8 };
        assert_eq!(decoded, expected, "{name}");
        let filtered =
            "SELECT id, e FROM t WHERE a > 100 AND g IS NULL ORDER BY f DESC, id LIMIT 25";
        let report = check(&ctx, &plain, filtered, filtered).await;
        assert_eq!(report.cache_misses, 0, "{name}: {report:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewritten_parquet_file_is_never_served_stale() {
    if !gpu_or_skip("a_rewritten_parquet_file_is_never_served_stale") {
        return;
    }
    let _serial = CACHE.lock().await;
    let dir = test_dir("cache-parquet-rewritten");
    let mut data = table(2, 2, 30_000, 12);
    write_parquet(&dir, &data, 25_000);
    let (ctx, plain) = parquet_sessions(&dir, 2).await;
    check(&ctx, &plain, QUERY, ORACLE).await;
    check(&ctx, &plain, QUERY, ORACLE).await;
    // The second file again, with one new winner: v = 5000 beats every generated value.
    let batch = &data[1][0];
    let mut v: Vec<i64> = batch
        .column(1)
        .as_primitive::<datafusion::arrow::datatypes::Int64Type>()
        .values()
        .to_vec();
    let f = batch
        .column(2)
        .as_primitive::<datafusion::arrow::datatypes::Float64Type>();
    let row = (0..v.len()).find(|&i| f.value(i) < 0.5).unwrap();
    v[row] = 5000;
    let columns = vec![
        Arc::clone(batch.column(0)),
        Arc::new(Int64Array::from(v)) as _,
        Arc::clone(batch.column(2)),
    ];
    data[1][0] = RecordBatch::try_new(batch.schema(), columns).unwrap();
    // Timestamps advance by the kernel's clock tick: make sure the files get new ones.
    std::thread::sleep(std::time::Duration::from_millis(50));
    write_parquet(&dir, &data, 25_000);
    // New sessions: DataFusion keeps a session's file listing (sizes, times) for its lifetime;
    // the column cache is the process's.
    let (ctx, plain) = parquet_sessions(&dir, 2).await;
    let after = check(&ctx, &plain, QUERY, ORACLE).await;
    assert!(after.cache_misses > 0, "the file is new: {after:?}");
    let rows = values(&ctx, QUERY).await;
    assert!(rows[0].ends_with("| 5000"), "{rows:?}");
}

#[tokio::test]
async fn the_cache_functions_answer_on_any_machine() {
    let (ctx, _) = sessions(table(1, 1, 10, 6), true);
    let sql = "SELECT count(*) >= 0 FROM gpu_topk_cache()";
    assert_eq!(values(&ctx, sql).await, vec!["true".to_string()]);
    let sql = "SELECT evicted >= 0, bytes_held >= 0 FROM gpu_topk_cache_clear()";
    assert_eq!(values(&ctx, sql).await, vec!["true | true".to_string()]);
    let err = ctx
        .sql("SELECT * FROM gpu_topk_cache(1)")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("take no arguments"), "{err}");
    // DataFusion's own table functions are still there.
    let rows = ctx
        .sql("SELECT * FROM generate_series(1, 2)")
        .await
        .unwrap();
    assert_eq!(rows.collect().await.unwrap()[0].num_rows(), 2);
}

/// A `GpuTable` over `data` as `t` in a CUDA session with the default cache, and plain
/// DataFusion over the same batches as a `MemTable`.
fn gpu_table_sessions(
    data: Vec<Vec<RecordBatch>>,
) -> (SessionContext, SessionContext, Arc<GpuTable>) {
    let partitions = data.len();
    let config = crate::sessions::base_config().with_backend(Backend::Cuda);
    let ctx = session_with(partitions, 8192, config);
    let table = Arc::new(GpuTable::try_new(data[0][0].schema(), data.clone()).unwrap());
    ctx.register_table("t", table.clone()).unwrap();
    let plain = plain_session_with(partitions, 8192, Storage::Memory);
    register(&plain, "t", data);
    (ctx, plain, table)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_table_is_cached_by_identity_pinned_by_load_and_forgotten_when_dropped() {
    if !gpu_or_skip("a_gpu_table_is_cached_by_identity_pinned_by_load_and_forgotten_when_dropped") {
        return;
    }
    let _serial = CACHE.lock().await;
    let (ctx, plain, table) = gpu_table_sessions(table(2, 3, 50_000, 7));
    let device = gpu().unwrap();
    // 300K rows of 8-byte f and v.
    let bytes = table.load(&["f", "v"]).unwrap();
    assert!(bytes >= 2 * 8 * 300_000, "{bytes}");
    let pinned = |device: &GpuDevice| {
        let listing = device.column_cache.listing().into_iter();
        listing
            .filter(|e| e.pinned && e.chunks == 6 && (e.column == "f" || e.column == "v"))
            .count()
    };
    assert_eq!(pinned(&device), 2);
    // The first query finds its columns resident.
    let first = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!((first.cache_hits, first.cache_misses), (2, 0), "{first:?}");
    assert_eq!(first.uploaded_bytes, 0, "{first:?}");
    // Pinned entries survive a clear; unpinned, they go.
    device.column_cache.clear();
    assert_eq!(pinned(&device), 2);
    table.unpin();
    device.column_cache.clear();
    let again = check(&ctx, &plain, QUERY, ORACLE).await;
    assert_eq!(again.cache_misses, 2, "{again:?}");
    // A dropped table's entries leave the cache.
    ctx.deregister_table("t").unwrap();
    let entries = |device: &GpuDevice| {
        let listing = device.column_cache.listing().into_iter();
        listing
            .filter(|e| e.chunks == 6 && (e.column == "f" || e.column == "v"))
            .count()
    };
    assert_eq!(entries(&device), 2);
    drop(table);
    assert_eq!(entries(&device), 0);
}

#[tokio::test]
async fn a_gpu_table_answers_every_query_as_a_mem_table_does() {
    // Any machine: the table is also a plain in-memory table.
    let data = table(3, 2, 1000, 8);
    let (ours, plain, table) = gpu_table_sessions(data);
    assert_eq!(table.num_rows(), 6000);
    for sql in [
        "SELECT count(*), sum(v), min(f) FROM t WHERE f < 0.5",
        "SELECT v, count(*) FROM t GROUP BY v ORDER BY v LIMIT 5",
        "SELECT a.rid FROM t a JOIN t b ON a.rid = b.rid + 1 WHERE a.v = 7 ORDER BY a.rid",
        "SELECT rid, v FROM t WHERE f < 0.5 ORDER BY v DESC, rid LIMIT 20",
    ] {
        assert_eq!(values(&ours, sql).await, values(&plain, sql).await, "{sql}");
    }
    // The operator reads the table's scan directly (nothing wraps it), so a GPU run can read
    // the table itself.
    let plan = plan_text(
        &physical_plan(&ours, "SELECT rid FROM t ORDER BY v LIMIT 3")
            .await
            .unwrap(),
    );
    let lines: Vec<&str> = plan.lines().map(str::trim).collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("GpuTopKExec"))
        .expect("{plan}");
    assert!(lines[at + 1].starts_with("GpuTableExec"), "{plan}");
    // A batch of another schema is refused.
    let other = table_with_schema_of_one_column();
    let err = GpuTable::try_new(data_schema(), other).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    // A batch with only some of the table's columns too.
    let some = vec![vec![data_schema_batch().project(&[0, 1]).unwrap()]];
    let err = GpuTable::try_new(data_schema(), some).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    if gpu().is_none() {
        let err = table.load(&["v"]).unwrap_err();
        assert!(err.to_string().contains("no GPU"), "{err}");
    }
}

fn data_schema() -> datafusion::arrow::datatypes::SchemaRef {
    data_schema_batch().schema()
}

fn data_schema_batch() -> RecordBatch {
    table(1, 1, 3, 0)[0][0].clone()
}

fn table_with_schema_of_one_column() -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
    let batch = RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![1i64]))]).unwrap();
    vec![vec![batch]]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_loads_the_columns_after_a_cold_run_on_the_cpu_path() {
    if !gpu_or_skip("auto_loads_the_columns_after_a_cold_run_on_the_cpu_path") {
        return;
    }
    let _serial = CACHE.lock().await;
    let device = gpu().expect("checked above");
    let data = table(2, 5, 100_000, 13);
    let dir = test_dir("cache-auto");
    write_parquet(&dir, &data, 50_000);
    // In memory: 10 batches; in Parquet files: 20 row groups.
    for (storage, chunks) in [(Storage::Memory, 10), (Storage::Parquet, 20)] {
        // Parquet columns decoded on the host (the model weighs those the device decodes).
        let config = crate::sessions::base_config().with_decode_parquet_on_device(false);
        let ctx = session_with(2, 8192, config);
        let plain = plain_session_with(2, 8192, storage);
        if storage == Storage::Memory {
            register(&ctx, "t", data.clone());
            register(&plain, "t", data.clone());
        } else {
            for c in [&ctx, &plain] {
                let path = dir.to_str().unwrap();
                c.register_parquet("t", path, Default::default())
                    .await
                    .unwrap();
            }
        }
        device.column_cache.clear();
        let cold = plan_text(&physical_plan(&ctx, QUERY).await.unwrap());
        if storage == Storage::Parquet {
            // Decoding every row group first is slower than the scan: the CPU path runs.
            assert!(cold.contains("backend=cpu"), "{cold}");
        }
        check(&ctx, &plain, QUERY, ORACLE).await;
        if cold.contains("backend=cpu") {
            // The CPU path ran; the columns follow in the background.
            assert!(cold.contains("cache=warm-up"), "{storage:?}: {cold}");
            let loaded = || ours(&device, chunks).count() == 2;
            let started = std::time::Instant::now();
            while !loaded() && started.elapsed() < std::time::Duration::from_secs(20) {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            assert!(loaded(), "{storage:?}: {:?}", device.column_cache.listing());
        }
        // Either way the columns are resident now, and the next run knows it.
        let warm = plan_text(&physical_plan(&ctx, QUERY).await.unwrap());
        assert!(warm.contains("resident=100%"), "{storage:?}: {warm}");
        assert!(!warm.contains("cache=warm-up"), "{storage:?}: {warm}");
        let report = check(&ctx, &plain, QUERY, ORACLE).await;
        if warm.contains("backend=cuda") {
            assert_eq!(report.cache_hits, 2, "{storage:?}: {report:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_plan_follows_the_residency_of_its_own_columns() {
    if !gpu_or_skip("a_kept_plan_follows_the_residency_of_its_own_columns") {
        return;
    }
    let _serial = CACHE.lock().await;
    let device = gpu().expect("checked above");
    let data = table(2, 5, 100_000, 17);
    let other = table(2, 5, 100_000, 18);
    let ctx = session_with(2, 8192, crate::sessions::base_config());
    let plain = plain_session_with(2, 8192, Storage::Memory);
    for c in [&ctx, &plain] {
        register(c, "t", data.clone());
        register(c, "u", other.clone());
    }
    let plans = datafusion_gpu_topk::PlanCache::new();
    let run = |sql: &'static str| {
        let (plans, ctx) = (&plans, &ctx);
        async move {
            let planned = plans.plan(ctx, sql).await.unwrap();
            let text = plan_text(planned.plan());
            let reused = planned.reused();
            let rows = exact_rows(&planned.collect().await.unwrap());
            (text, reused, rows)
        }
    };
    let want = run_oracle(&plain, ORACLE).await.unwrap();
    device.column_cache.clear();
    let (cold, _, rows) = run(QUERY).await;
    assert_eq!(rows, want);
    let started = std::time::Instant::now();
    while ours(&device, 10).count() < 2 && started.elapsed() < std::time::Duration::from_secs(20) {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Its columns resident now: planned again where the plan saw them absent.
    let (warm, reused, rows) = run(QUERY).await;
    assert_eq!(rows, want);
    assert!(!reused, "{cold}\n{warm}");
    assert!(warm.contains("resident=100%"), "{warm}");
    assert!(run(QUERY).await.1, "unchanged: reused");
    // Another table's columns loaded: this plan stays, unless a test beside this one changed
    // what every plan reads meanwhile (a calibration, the process's cache budget).
    let generation = datafusion_gpu_topk::internal::device::planning_generation();
    let other_query = "SELECT rid, v FROM u WHERE f < 0.25 ORDER BY v LIMIT 5";
    let cuda = session_with(
        2,
        8192,
        crate::sessions::base_config().with_backend(Backend::Cuda),
    );
    register(&cuda, "u", other.clone());
    cuda.sql(other_query)
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let (_, reused, rows) = run(QUERY).await;
    let changed = datafusion_gpu_topk::internal::device::planning_generation() != generation;
    assert!(reused || changed, "another table's load replanned it");
    assert_eq!(rows, want);
    // Its own columns evicted: planned again.
    device.column_cache.clear();
    let (_, reused, rows) = run(QUERY).await;
    assert!(!reused, "its columns were evicted");
    assert_eq!(rows, want);
}

/// Over Parquet files, the row groups' statistics rule out row groups before any column is
/// read: a filter no row group can pass reads nothing, a first run whose rows lie in the first
/// half of the table reads only those row groups (the whole columns are loaded afterwards, in
/// the background), and warm runs read the cache only up to the last row group that may pass.
/// None is skipped where the session turns Parquet pruning off. Every run has DataFusion's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parquet_row_groups_no_row_can_pass_are_not_read() {
    if !gpu_or_skip("parquet_row_groups_no_row_can_pass_are_not_read") {
        return;
    }
    let _serial = CACHE.lock().await;
    let device = gpu().expect("a GPU");
    let dir = test_dir("cache-parquet-zones");
    // `rid` ascends through three files of 100 000 rows, 12 row groups of 25 000 in all.
    write_parquet(&dir, &table(3, 2, 50_000, 29), 25_000);
    let (ctx, plain) = parquet_sessions(&dir, 4).await;
    // The bytes a first run ships reading every row group.
    settled_loads().await;
    device.column_cache.clear();
    let sql = "SELECT rid, v FROM t WHERE rid >= 0 ORDER BY v DESC LIMIT 20";
    let oracle = "SELECT rid, v FROM t WHERE rid >= 0 ORDER BY v DESC, rid LIMIT 20";
    let whole = check(&ctx, &plain, sql, oracle).await.uploaded_bytes;
    assert!(whole > 0);
    // (filter, row groups skipped, whether a first run reads only the first rows)
    for (filter, skipped, prefix) in [
        ("rid < 0", 12, false),
        ("rid < 1", 11, true),
        ("rid < 150000", 6, true),
        ("rid < 175000 AND v > 500", 5, false),
        ("(rid < 20000 OR rid = 60000) AND v <> 7", 9, true),
        ("rid < 300001 OR v = 3", 0, false),
        ("rid >= 250000", 0, false),
    ] {
        let sql = format!("SELECT rid, v FROM t WHERE {filter} ORDER BY v DESC LIMIT 20");
        let oracle = format!("SELECT rid, v FROM t WHERE {filter} ORDER BY v DESC, rid LIMIT 20");
        settled_loads().await;
        device.column_cache.clear();
        let cold = check(&ctx, &plain, &sql, &oracle).await;
        assert_eq!(cold.chunks_skipped, skipped, "{filter}: {cold:?}");
        let shipped = if skipped == 12 { 0 } else { 2 };
        assert_eq!(cold.cache_misses, shipped, "{filter}: {cold:?}");
        settled_loads().await;
        // The prefix was read for the first run alone; the whole columns are loaded after it.
        let resident = (device.column_cache.listing().into_iter())
            .filter(|e| (e.column == "rid" || e.column == "v") && e.chunks == 12)
            .count();
        assert_eq!(resident, if skipped == 12 { 0 } else { 2 }, "{filter}");
        // Row groups of about the same bytes each.
        let part = whole * (12 - skipped) / 12;
        match (prefix, skipped) {
            (true, _) => assert!(
                cold.uploaded_bytes <= part + whole / 24,
                "{filter}: {cold:?}"
            ),
            (false, 12) => assert_eq!(cold.uploaded_bytes, 0, "{filter}"),
            (false, _) => assert_eq!(cold.uploaded_bytes, whole, "{filter}"),
        }
        let warm = check(&ctx, &plain, &sql, &oracle).await;
        assert_eq!(warm.chunks_skipped, skipped, "{filter}: {warm:?}");
        assert_eq!(warm.cache_misses, 0, "{filter}: {warm:?}");
    }
    // Pruning off (the table's options are the session's when it is registered): the scan
    // reads every row group, and so does the pass.
    let ctx = session_with(
        4,
        8192,
        crate::sessions::base_config().with_backend(Backend::Cuda),
    );
    ctx.sql("SET datafusion.execution.parquet.pruning = false")
        .await
        .unwrap();
    let path = dir.to_str().unwrap();
    let options = datafusion::prelude::ParquetReadOptions::default();
    ctx.register_parquet("t", path, options).await.unwrap();
    let sql = "SELECT rid, v FROM t WHERE rid < 1 ORDER BY v DESC LIMIT 20";
    let oracle = "SELECT rid, v FROM t WHERE rid < 1 ORDER BY v DESC, rid LIMIT 20";
    let report = check(&ctx, &plain, sql, oracle).await;
    assert_eq!(report.chunks_skipped, 0, "{report:?}");
}

/// A dictionary-encoded string column of Parquet files (each row group with its own
/// dictionary, NULLs among its rows and entries) is cached as codes into one dictionary for
/// all the files, so filters on it (`lang = 'en' OR lang = 'es'`, `IN`) run over the cache:
/// the second run ships nothing. With a bound on an ordered column, a first run reads only
/// the first row groups' codes. Every run has DataFusion's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parquet_dictionary_columns_are_cached_as_codes_of_one_dictionary() {
    use datafusion::arrow::array::{DictionaryArray, StringArray};
    use datafusion::arrow::datatypes::Int32Type;
    if !gpu_or_skip("parquet_dictionary_columns_are_cached_as_codes_of_one_dictionary") {
        return;
    }
    let _serial = CACHE.lock().await;
    let device = gpu().expect("a GPU");
    let dir = test_dir("cache-parquet-codes");
    let schema = Arc::new(Schema::new(vec![
        Field::new("rid", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
        Field::new(
            "lang",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            true,
        ),
    ]));
    let words = [
        "en",
        "es",
        "fr",
        "de",
        "ja",
        "pt",
        "it",
        "ko",
        "zz-long-entry-name",
    ];
    let mut rid = 0i64;
    // Three files of 4 row groups of 10 000 rows; each batch (row group) its own vocabulary.
    let data: Vec<Vec<RecordBatch>> = (0..3)
        .map(|_| {
            (0..4)
                .map(|g| {
                    let rows = 10_000i64;
                    let ids: Vec<i64> = (rid..rid + rows).collect();
                    rid += rows;
                    let v: Vec<i64> = ids.iter().map(|&i| (i * 7919) % 1000).collect();
                    let entries: Vec<Option<&str>> = (0..5)
                        .map(|e| {
                            (e != 3).then_some(
                                words[(g * 2 + e + (rid as usize / 30_000)) % words.len()],
                            )
                        })
                        .collect();
                    let keys: Vec<Option<i32>> = ids
                        .iter()
                        .map(|&i| (i % 13 != 0).then_some(((i * 31) % 5) as i32))
                        .collect();
                    let lang = DictionaryArray::<Int32Type>::try_new(
                        keys.into(),
                        Arc::new(StringArray::from(entries)),
                    )
                    .unwrap();
                    RecordBatch::try_new(
                        Arc::clone(&schema),
                        vec![
                            Arc::new(Int64Array::from(ids)),
                            Arc::new(Int64Array::from(v)),
                            Arc::new(lang),
                        ],
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect();
    write_parquet(&dir, &data, 10_000);
    let (ctx, plain) = parquet_sessions(&dir, 4).await;
    for (filter, skipped) in [
        ("lang = 'en' OR lang = 'es'", 0),
        ("lang IN ('fr', 'zz-long-entry-name', 'nowhere')", 0),
        ("rid < 20000 AND lang = 'de'", 10),
        ("lang = 'nowhere'", 0),
    ] {
        let sql = format!("SELECT rid, v, lang FROM t WHERE {filter} ORDER BY v DESC LIMIT 20");
        let oracle =
            format!("SELECT rid, v, lang FROM t WHERE {filter} ORDER BY v DESC, rid LIMIT 20");
        settled_loads().await;
        device.column_cache.clear();
        let cold = check(&ctx, &plain, &sql, &oracle).await;
        assert_eq!(cold.chunks_skipped, skipped, "{filter}: {cold:?}");
        assert!(cold.cache_misses >= 2, "{filter}: {cold:?}");
        settled_loads().await;
        let warm = check(&ctx, &plain, &sql, &oracle).await;
        assert_eq!(warm.cache_misses, 0, "{filter}: {warm:?}");
        assert_eq!(warm.uploaded_bytes, 0, "{filter}: {warm:?}");
        assert!(warm.cache_hits >= 2, "{filter}: {warm:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chunks_no_row_can_pass_are_not_read() {
    if !gpu_or_skip("chunks_no_row_can_pass_are_not_read") {
        return;
    }
    let _serial = CACHE.lock().await;
    // `rid` ascends through the table: 10 chunks of 100 000 rows.
    let data = table(2, 5, 100_000, 19);
    for gpu_table in [false, true] {
        let (ctx, plain) = sessions(data.clone(), true);
        if gpu_table {
            let table = GpuTable::try_new(data[0][0].schema(), data.clone()).unwrap();
            ctx.deregister_table("t").unwrap();
            ctx.register_table("t", Arc::new(table)).unwrap();
        }
        // (bound, extra filter, chunks skipped once the columns are resident)
        for (bound, extra, skipped) in [
            (0, "", 10),
            (1, "", 9),
            (150_000, "", 8),
            (550_000, " AND v > 500", 4),
            (1_000_000, "", 0),
            (1_000_001, " OR v = 3", 0),
        ] {
            let sql =
                format!("SELECT rid, v FROM t WHERE rid < {bound}{extra} ORDER BY v DESC LIMIT 20");
            let oracle = format!(
                "SELECT rid, v FROM t WHERE rid < {bound}{extra} ORDER BY v DESC, rid LIMIT 20"
            );
            // The first run makes the columns resident; a later one starts working out their
            // zones, and the runs after it skip by them. Every run has DataFusion's rows.
            let mut report = check(&ctx, &plain, &sql, &oracle).await;
            let started = std::time::Instant::now();
            while report.chunks_skipped != skipped
                && started.elapsed() < std::time::Duration::from_secs(20)
            {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                report = check(&ctx, &plain, &sql, &oracle).await;
            }
            assert_eq!(
                report.chunks_skipped, skipped,
                "gpu_table={gpu_table}: {sql}"
            );
            if skipped < 10 {
                assert_eq!(report.cache_hits, 2, "{sql}: {report:?}");
            }
        }
        // A bound from the end skips nothing: only a prefix of the table is read.
        let sql = "SELECT rid, v FROM t WHERE rid >= 900000 ORDER BY v DESC LIMIT 20";
        let oracle = "SELECT rid, v FROM t WHERE rid >= 900000 ORDER BY v DESC, rid LIMIT 20";
        let report = check(&ctx, &plain, sql, oracle).await;
        assert_eq!(report.chunks_skipped, 0);
    }
}
