//! Tables users make in memory (`CREATE TABLE … AS`, `INSERT INTO`, `MemTable`s of any batch
//! size and partition count): the first query merges their small batches into few large ones
//! (`gpu_topk.compact_tables`), keeping the partitions and the rows' order, so every answer is
//! DataFusion's with ties in input order; rows inserted later are seen by the next query and
//! never served from a stale plan or cache entry; on a GPU a repeated query over a CTAS table
//! reads its columns from the column cache.

use std::sync::Arc;

use datafusion::arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
use datafusion_gpu_topk::{Backend, PlanCache};

use crate::common::{
    Rng, Storage, exact_rows, partitioned, physical_plan, plain_session_with, plan_text, register,
    run, run_oracle, run_reporting, session, session_with,
};

/// Partitions of 1-row and 7-row batches (an empty partition and empty batches among them):
/// `rid` (input position), `v` (ties: 13 values), `s` (ties: 29 strings, some NULL), `f`.
fn tiny_batches(seed: u64) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("rid", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("f", DataType::Float64, false),
    ]));
    let mut ones_and_sevens: Vec<usize> = (0..240).map(|i| [1, 7][i % 2]).collect();
    ones_and_sevens.insert(50, 0);
    let sevens = vec![7; 150];
    let ones = vec![1; 400];
    let sizes: [&[usize]; 5] = [&ones_and_sevens, &sevens, &[], &ones, &[0, 3, 0]];
    partitioned(seed, &sizes, |rng: &mut Rng, first, rows| {
        let rid: Vec<i64> = (first..first + rows as i64).collect();
        let v: Vec<i64> = (0..rows).map(|_| rng.below(13) as i64).collect();
        let s: Vec<Option<String>> = (0..rows)
            .map(|_| (!rng.chance(0.1)).then(|| format!("s{:02}", rng.below(29))))
            .collect();
        let f: Vec<f64> = (0..rows).map(|_| rng.unit()).collect();
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(rid)),
                Arc::new(Int64Array::from(v)),
                Arc::new(StringArray::from(s)),
                Arc::new(Float64Array::from(f)),
            ],
        )
        .unwrap()
    })
}

/// Queries over a table of [`tiny_batches`]' columns whose ties our operator breaks by input
/// order, with oracles that break them by `rid` (the input position).
const QUERIES: &[(&str, &str)] = &[
    (
        "SELECT rid, v FROM t ORDER BY v DESC LIMIT 25",
        "SELECT rid, v FROM t ORDER BY v DESC, rid LIMIT 25",
    ),
    (
        "SELECT rid, s FROM t WHERE f < 0.7 ORDER BY s NULLS FIRST LIMIT 30",
        "SELECT rid, s FROM t WHERE f < 0.7 ORDER BY s NULLS FIRST, rid LIMIT 30",
    ),
    (
        "SELECT * FROM t ORDER BY v, s DESC LIMIT 17 OFFSET 3",
        "SELECT * FROM t ORDER BY v, s DESC, rid LIMIT 17 OFFSET 3",
    ),
    (
        "SELECT rid, f FROM t WHERE v > 3 ORDER BY f DESC LIMIT 40",
        "SELECT rid, f FROM t WHERE v > 3 ORDER BY f DESC, rid LIMIT 40",
    ),
];

async fn same(ours: &SessionContext, plain: &SessionContext, name: &str, sql: &str, oracle: &str) {
    let (sql, oracle) = (
        sql.replace(" t ", &format!(" {name} ")),
        oracle.replace(" t ", &format!(" {name} ")),
    );
    let got = exact_rows(
        &run(ours, &sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}")),
    );
    assert_eq!(got, run_oracle(plain, &oracle).await.unwrap(), "{sql}");
}

/// Each partition's batch sizes of the `MemTable` registered as `name`.
async fn batch_sizes(ctx: &SessionContext, name: &str) -> Vec<Vec<usize>> {
    let provider = ctx.table_provider(name).await.unwrap();
    let table = provider.downcast_ref::<MemTable>().expect("a MemTable");
    let mut sizes = Vec::new();
    for partition in &table.batches {
        sizes.push(
            partition
                .read()
                .await
                .iter()
                .map(RecordBatch::num_rows)
                .collect(),
        );
    }
    sizes
}

async fn execute(ctx: &SessionContext, sql: &str) {
    ctx.sql(sql).await.unwrap().collect().await.unwrap();
}

/// A `MemTable` of 1-row and 7-row batches over five partitions answers as DataFusion does;
/// the first query left each partition one batch, the rows and partitions unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_of_tiny_batches_answers_as_datafusion_with_ties_in_input_order() {
    let data = tiny_batches(5);
    let rows: Vec<usize> = (data.iter())
        .map(|p| p.iter().map(RecordBatch::num_rows).sum())
        .collect();
    let ours = session(true, 4, 8192);
    let plain = plain_session_with(4, 8192, Storage::Memory);
    register(&ours, "t", data.clone());
    register(&plain, "t", data);
    for &(sql, oracle) in QUERIES {
        same(&ours, &plain, "t", sql, oracle).await;
    }
    let compacted = batch_sizes(&ours, "t").await;
    let expected: Vec<Vec<usize>> = (rows.iter())
        .map(|&n| if n == 0 { vec![] } else { vec![n] })
        .collect();
    assert_eq!(compacted, expected);
    // Plain DataFusion (the operator off) leaves its table as it was.
    assert_eq!(batch_sizes(&plain, "t").await[0].len(), 241);
    // Off by the setting, the table keeps its batches too.
    let off = session_with(
        4,
        8192,
        crate::sessions::test_config(true).with_compact_tables(false),
    );
    register(&off, "t", tiny_batches(5));
    for &(sql, oracle) in QUERIES {
        same(&off, &plain, "t", sql, oracle).await;
    }
    assert_eq!(batch_sizes(&off, "t").await[3].len(), 400);
}

/// `CREATE TABLE … AS` tables (one sorted into one partition, one keeping the source's
/// partitions) answer as DataFusion does; rows `INSERT INTO` adds are in the next answer, and
/// a kept plan is reused while the table is unchanged and never after an insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ctas_and_inserted_rows_are_answered_and_never_served_stale() {
    let data = tiny_batches(9);
    // Batches of 64 rows: CTAS writes its tables in many small batches.
    let ours = session(true, 4, 64);
    let plain = plain_session_with(4, 64, Storage::Memory);
    for ctx in [&ours, &plain] {
        register(ctx, "src", data.clone());
        execute(ctx, "CREATE TABLE sorted AS SELECT * FROM src ORDER BY rid").await;
        execute(ctx, "CREATE TABLE copied AS SELECT * FROM src").await;
    }
    // Sorted into batches of 64 rows: compacted by the first query that reads it.
    assert!(batch_sizes(&ours, "sorted").await[0].len() > 10);
    let plans = PlanCache::new();
    for name in ["sorted", "copied"] {
        for &(sql, oracle) in QUERIES {
            // `copied` keeps each source partition's rows in order, but which partition is
            // which is DataFusion's: a key unique per row leaves no tie to break.
            let (sql, oracle) = match name {
                "copied" => (sql.replace(" LIMIT", ", rid LIMIT"), oracle.to_string()),
                _ => (sql.to_string(), oracle.to_string()),
            };
            same(&ours, &plain, name, &sql, &oracle).await;
        }
    }
    assert!(batch_sizes(&ours, "sorted").await.iter().flatten().count() <= 2);

    let top = "SELECT rid, v FROM sorted ORDER BY v DESC LIMIT 5";
    let oracle = "SELECT rid, v FROM sorted ORDER BY v DESC, rid LIMIT 5";
    let kept = exact_rows(&plans.collect(&ours, top).await.unwrap());
    assert_eq!(kept, run_oracle(&plain, oracle).await.unwrap());
    // The table's batches stay the same from query to query: its plan is reused (on a GPU,
    // once its columns are resident, which plans it again).
    let mut reused = false;
    for _ in 0..4 {
        let plan = plans.plan(&ours, top).await.unwrap();
        reused |= plan.reused();
        assert_eq!(exact_rows(&plan.collect().await.unwrap()), kept);
    }
    assert!(reused, "{:?}", plans.stats());

    // New winners (v of 100 and more beats every value), then many small batches of copies;
    // each `rid` above those before it, so that input order stays `rid` order.
    for ctx in [&ours, &plain] {
        execute(
            ctx,
            "INSERT INTO sorted VALUES (50000, 101, 'new', 0.5), (50001, 100, NULL, 0.1)",
        )
        .await;
    }
    let after = exact_rows(&plans.collect(&ours, top).await.unwrap());
    assert_eq!(after, run_oracle(&plain, oracle).await.unwrap());
    assert!(
        after[1].starts_with("50000 | 101") && after[2].starts_with("50001 | 100"),
        "{after:?}"
    );
    for ctx in [&ours, &plain] {
        execute(
            ctx,
            "INSERT INTO sorted SELECT rid + 100000, v + 50, s, f FROM src ORDER BY rid",
        )
        .await;
    }
    let grown = exact_rows(&plans.collect(&ours, top).await.unwrap());
    assert_eq!(grown, run_oracle(&plain, oracle).await.unwrap());
    assert!(grown[2].starts_with("50001 | 100"), "{grown:?}");
    assert!(grown[3].contains("| 62"), "{grown:?}");
    for &(sql, oracle) in QUERIES {
        same(&ours, &plain, "sorted", sql, oracle).await;
    }
}

/// On a GPU: the second query over a CTAS table reads every column from the column cache
/// (metrics and EXPLAIN say so), its entries keyed by the few merged batches; an insert makes
/// the next query upload the table's columns again and answer with the new rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ctas_table_is_read_from_the_column_cache_on_the_second_query() {
    if let GpuStatus::Unavailable(why) = gpu_status() {
        eprintln!(
            "SKIP: a_ctas_table_is_read_from_the_column_cache_on_the_second_query: no GPU ({why})"
        );
        return;
    }
    let _serial = crate::cache::CACHE.lock().await;
    let data = crate::cache::table(4, 40, 8192, 41);
    let config = crate::sessions::base_config().with_backend(Backend::Cuda);
    let ours = session_with(4, 8192, config);
    let plain = plain_session_with(4, 8192, Storage::Memory);
    // The source left as it is, so that CTAS writes batches of 8192 rows.
    execute(&ours, "SET gpu_topk.compact_tables = false").await;
    for ctx in [&ours, &plain] {
        register(ctx, "src", data.clone());
        execute(ctx, "CREATE TABLE c AS SELECT * FROM src").await;
    }
    execute(&ours, "SET gpu_topk.compact_tables = true").await;
    assert!(batch_sizes(&ours, "c").await.iter().flatten().count() >= 40);
    let sql = "SELECT rid, v FROM c WHERE f < 0.5 ORDER BY v DESC, rid LIMIT 20";
    let (cold, first) = run_reporting(&ours, sql).await;
    assert_eq!(
        exact_rows(&cold.unwrap()),
        run_oracle(&plain, sql).await.unwrap()
    );
    assert_eq!(first.fallbacks, 0, "{:?}", first.reasons);
    let batches = batch_sizes(&ours, "c").await.iter().flatten().count();
    assert!(batches <= 20, "{batches} batches after the first query");
    // The first query may have run on the CPU path and loaded the columns behind it.
    let started = std::time::Instant::now();
    let warm = loop {
        let (rows, report) = run_reporting(&ours, sql).await;
        assert_eq!(
            exact_rows(&rows.unwrap()),
            run_oracle(&plain, sql).await.unwrap()
        );
        if report.cache_hits > 0 || started.elapsed() > std::time::Duration::from_secs(20) {
            break report;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(warm.cache_hits >= 2, "v and f resident: {warm:?}");
    assert_eq!((warm.cache_misses, warm.uploaded_bytes), (0, 0), "{warm:?}");
    let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
    assert!(
        !text.contains("predicted=") || text.contains("resident=100%"),
        "{text}"
    );
    let device = datafusion_gpu_topk::internal::device::gpu().expect("checked above");
    let entries = device.column_cache.listing();
    assert!(
        entries
            .iter()
            .any(|e| e.column == "v" && e.chunks == batches),
        "{entries:?}"
    );
    // The same batches on the next query: hit again, nothing uploaded.
    let (_, again) = run_reporting(&ours, sql).await;
    assert_eq!(
        (again.cache_misses, again.uploaded_bytes),
        (0, 0),
        "{again:?}"
    );

    for ctx in [&ours, &plain] {
        execute(ctx, "INSERT INTO c VALUES (-1, 5000, 0.25)").await;
    }
    let (rows, inserted) = run_reporting(&ours, sql).await;
    let rows = exact_rows(&rows.unwrap());
    assert_eq!(rows, run_oracle(&plain, sql).await.unwrap());
    assert!(rows[1].starts_with("-1 | 5000"), "{rows:?}");
    assert_eq!(inserted.fallbacks, 0, "{:?}", inserted.reasons);
    // The merged batches changed: no entry of the old ones serves the query.
    assert!(
        inserted.cache_misses > 0 || inserted.cache_hits == 0,
        "{inserted:?}"
    );
}
