//! The operator on the inputs users have, checked against plain DataFusion: Parquet and CSV
//! tables of several files and row groups, in-memory tables of several partitions, and inputs
//! that cannot be replayed (an aggregation or a join below the top-k).
//!
//! - Ties: tie-heavy queries, run again and again while a predicate delays partitions at
//!   random, always give the first rows in input order (partition, then row).
//! - Faults: a device failure injected at each step of the selection (`gpu_topk.inject_fault`)
//!   never changes the answer, an error included, whatever the input.
//! - Unbounded inputs: DataFusion's outcome (its sanity check's error).
//! - Concurrency: 64 queries at once, half of them on a session whose GPU selection fails.

use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch,
};
use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};
use datafusion::error::Result;
use datafusion::logical_expr::{
    ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, Volatility,
};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::internal::config::FaultPoint;

use crate::common::{
    STORAGES, Storage, count_gpu_topk, exact_rows, partitioned, physical_plan, plain_session,
    register_as, run, run_oracle, run_reporting, session, session_with, test_backend, test_dir,
};

/// A session with the operator, whose GPU selection fails at `fault`, and the `jitter`
/// function. A top-k over an aggregation stays with
/// `GpuTopKExec` above DataFusion's aggregation (its own operator's faults are tested in
/// `gpu::aggregate_topk`), so that each query's fallbacks are its selections'.
fn session_with_fault(partitions: usize, fault: FaultPoint) -> SessionContext {
    let mut gpu = crate::sessions::base_config()
        .with_backend(test_backend())
        .with_inject_fault(fault);
    gpu.aggregate_topk = false;
    let ctx = session_with(partitions, 100, gpu);
    ctx.register_udf(ScalarUDF::from(Jitter::new()));
    ctx
}

/// `jitter(x)`: true, after sleeping 0–3 ms chosen afresh at every call, so that partitions
/// deliver their batches in a different order on every run.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Jitter {
    signature: Signature,
}

impl Jitter {
    fn new() -> Self {
        Self {
            signature: Signature::any(1, Volatility::Volatile),
        }
    }
}

static JITTER_CALLS: AtomicU64 = AtomicU64::new(0);

impl ScalarUDFImpl for Jitter {
    fn name(&self) -> &str {
        "jitter"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        JITTER_CALLS
            .fetch_add(1, Ordering::Relaxed)
            .hash(&mut hasher);
        std::thread::sleep(std::time::Duration::from_micros(hasher.finish() % 3000));
        let rows = vec![true; args.number_rows];
        Ok(ColumnarValue::Array(Arc::new(BooleanArray::from(rows))))
    }
}

/// A tie-heavy table: `g` (5 values), `c` (40 values, NULLs), `f` (a few floats: ±0.0, NaN,
/// NULL), `w` (wide), `rid` the input position; partitions of several batches, one empty.
pub(crate) fn ties_table(seed: u64) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("rid", DataType::Int64, false),
        Field::new("g", DataType::Int32, true),
        Field::new("c", DataType::Int32, true),
        Field::new("f", DataType::Float64, true),
        Field::new("w", DataType::Int64, true),
    ]));
    let sizes: &[&[usize]] = &[&[150, 90], &[200], &[], &[60, 140, 10], &[300], &[1, 120]];
    partitioned(seed, sizes, |rng, rid, n| {
        let floats = [0.0, -0.0, 1.5, f64::NAN, -2.0];
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(rid..rid + n as i64)),
            Arc::new(Int32Array::from_iter_values(
                (0..n).map(|_| rng.below(5) as i32),
            )),
            Arc::new(Int32Array::from_iter(
                (0..n).map(|_| (!rng.chance(0.05)).then(|| rng.below(40) as i32)),
            )),
            Arc::new(Float64Array::from_iter((0..n).map(|_| {
                (!rng.chance(0.1)).then(|| floats[rng.below(5) as usize])
            }))),
            Arc::new(Int64Array::from_iter_values(
                (0..n).map(|_| rng.next_u64() as i64 >> 8),
            )),
        ];
        RecordBatch::try_new(Arc::clone(&schema), columns).expect("batch")
    })
}

/// A small table to join with: `g` → `label`, two rows per value of `g` but one.
pub(crate) fn labels() -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("g", DataType::Int32, false),
        Field::new("label", DataType::Int64, false),
    ]));
    let g = Int32Array::from(vec![0, 1, 2, 3, 4, 0, 1, 2, 3]);
    let label = Int64Array::from(vec![10, 11, 12, 13, 14, 20, 21, 22, 23]);
    let batch = RecordBatch::try_new(schema, vec![Arc::new(g), Arc::new(label)]).unwrap();
    vec![vec![batch.slice(0, 5)], vec![batch.slice(5, 4)]]
}

/// `sql` with the operator and `oracle` without it: the same rows, or the same error.
async fn same_as_datafusion(
    ours: &SessionContext,
    plain: &SessionContext,
    sql: &str,
    oracle: &str,
) {
    let got = run(ours, sql).await.map(|b| exact_rows(&b));
    let want = run_oracle(plain, oracle).await;
    assert_same(
        sql,
        got.map_err(|e| e.to_string()),
        want.map_err(|e| e.to_string()),
    );
}

/// The same rows, or the same error (the failing value a cast names aside: it is the first one
/// read).
pub(crate) fn assert_same(
    sql: &str,
    got: std::result::Result<Vec<String>, String>,
    want: std::result::Result<Vec<String>, String>,
) {
    match (got, want) {
        (Ok(got), Ok(want)) => assert_eq!(got, want, "{sql}"),
        (Err(a), Err(b)) => {
            let strip = |e: String| match (e.find("Can't cast value "), e.find(" to type ")) {
                (Some(at), Some(to)) if to > at => format!("{}…{}", &e[..at], &e[to..]),
                _ => e,
            };
            assert_eq!(strip(a), strip(b), "{sql}");
        }
        (a, b) => panic!("{sql}: ours {a:?}\nDataFusion {b:?}"),
    }
}

/// Registers the tie-heavy table `t` (as `storage`) and the join table `l` in both sessions.
pub(crate) async fn register_tables(
    sessions: &[&SessionContext],
    storage: Storage,
    dir: &Path,
    t: &[Vec<RecordBatch>],
) {
    for &ctx in sessions {
        register_as(ctx, "t", t, storage, dir).await;
        register_as(ctx, "l", &labels(), storage, dir).await;
    }
}

/// Tie-heavy queries (`jitter` delays partitions at random) and their oracles: the same order
/// with `rid` (the input position) breaking ties, which is what the operator promises.
const TIE_QUERIES: &[(&str, &str)] = &[
    (
        "SELECT g, rid FROM t WHERE jitter(rid) ORDER BY g LIMIT 400",
        "SELECT g, rid FROM t ORDER BY g, rid LIMIT 400",
    ),
    (
        "SELECT c, rid FROM t WHERE jitter(rid) ORDER BY c DESC LIMIT 90 OFFSET 25",
        "SELECT c, rid FROM t ORDER BY c DESC, rid LIMIT 90 OFFSET 25",
    ),
    (
        "SELECT f, g, rid FROM t WHERE jitter(rid) AND g <> 2 ORDER BY f NULLS FIRST, g DESC \
         LIMIT 300",
        "SELECT f, g, rid FROM t WHERE g <> 2 ORDER BY f NULLS FIRST, g DESC, rid LIMIT 300",
    ),
    (
        "SELECT rid, c FROM t ORDER BY c NULLS FIRST LIMIT 700",
        "SELECT rid, c FROM t ORDER BY c NULLS FIRST, rid LIMIT 700",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ties_are_deterministic_over_every_input_and_arrival_order() {
    let data = ties_table(41);
    let dir = test_dir("ties");
    for storage in STORAGES {
        for partitions in [2, 3, 8] {
            let ours = session_with_fault(partitions, FaultPoint::None);
            let plain = plain_session(partitions, storage);
            register_tables(&[&ours, &plain], storage, &dir, &data).await;
            // DataFusion spreads an in-memory table's batches over more partitions than it
            // has, largest first: the input order is then that plan's, not `rid`'s.
            let rebalanced = storage == Storage::Memory && partitions > data.len();
            for (sql, oracle) in TIE_QUERIES {
                let mut want = run_oracle(&plain, oracle).await.unwrap();
                for attempt in 0..5 {
                    let got = exact_rows(&run(&ours, sql).await.unwrap());
                    if rebalanced && attempt == 0 {
                        assert_eq!(got.len(), want.len(), "{sql}");
                        want = got.clone();
                    }
                    assert!(
                        got == want,
                        "{sql} over {storage:?}, {partitions} partitions, run {attempt}: \
                         {} rows, first difference {:?}",
                        got.len(),
                        got.iter().zip(&want).find(|(a, b)| a != b)
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Queries over file tables and non-replayable inputs (an aggregation, a join), some of which
/// DataFusion fails on; with their oracles (rid breaks the ties).
const FAULT_QUERIES: &[(&str, &str)] = &[
    (
        "SELECT g, rid FROM t ORDER BY g DESC LIMIT 350",
        "SELECT g, rid FROM t ORDER BY g DESC, rid LIMIT 350",
    ),
    (
        "SELECT rid, w FROM t WHERE c > 10 ORDER BY w * 2 LIMIT 30 OFFSET 3",
        "SELECT rid, w FROM t WHERE c > 10 ORDER BY w * 2, rid LIMIT 30 OFFSET 3",
    ),
    (
        "SELECT rid FROM t ORDER BY c / 0 LIMIT 5",
        "SELECT rid FROM t ORDER BY c / 0, rid LIMIT 5",
    ),
    (
        "SELECT rid FROM t WHERE g > 0 ORDER BY sqrt(c - 20.0) LIMIT 5",
        // (DataFusion's sanity check rejects `ORDER BY sqrt(…), rid` over partitions.)
        "SELECT rid FROM (SELECT rid, sqrt(c - 20.0) AS key FROM t WHERE g > 0) \
         ORDER BY key, rid LIMIT 5",
    ),
    (
        "SELECT rid FROM t ORDER BY CAST(w AS INT) LIMIT 10",
        "SELECT rid FROM t ORDER BY CAST(w AS INT), rid LIMIT 10",
    ),
    // Below the top-k, inputs that cannot be read twice.
    (
        "SELECT c, n FROM (SELECT c, count(*) AS n FROM t GROUP BY c) ORDER BY n DESC, c LIMIT 7",
        "SELECT c, n FROM (SELECT c, count(*) AS n FROM t GROUP BY c) ORDER BY n DESC, c LIMIT 7",
    ),
    (
        "SELECT c, s FROM (SELECT c, sum(g) AS s FROM t GROUP BY c) ORDER BY s / 0 LIMIT 3",
        "SELECT c, s FROM (SELECT c, sum(g) AS s FROM t GROUP BY c) ORDER BY s / 0, c LIMIT 3",
    ),
    (
        "SELECT t.rid, l.label FROM t JOIN l ON t.g = l.g WHERE t.c < 30 \
         ORDER BY t.w, l.label LIMIT 60",
        "SELECT t.rid, l.label FROM t JOIN l ON t.g = l.g WHERE t.c < 30 \
         ORDER BY t.w, l.label LIMIT 60",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_gpu_never_changes_the_answer_over_any_input() {
    let data = ties_table(43);
    let dir = test_dir("faults");
    let faults = [
        FaultPoint::None,
        FaultPoint::Create,
        FaultPoint::Push(1),
        FaultPoint::Push(2),
        FaultPoint::Push(5),
        FaultPoint::Finish,
    ];
    for storage in STORAGES {
        let plain = plain_session(4, storage);
        let contexts: Vec<_> = faults.iter().map(|&f| session_with_fault(4, f)).collect();
        register_tables(&[&plain], storage, &dir, &data).await;
        register_tables(&contexts.iter().collect::<Vec<_>>(), storage, &dir, &data).await;
        for (sql, oracle) in FAULT_QUERIES {
            let plan = physical_plan(&contexts[0], sql).await.unwrap();
            assert!(
                count_gpu_topk(&plan) >= 1,
                "{sql}: the operator should run it"
            );
            for (fault, ours) in faults.iter().zip(&contexts) {
                let label = format!("{sql} over {storage:?} with fault {fault}");
                same_as_datafusion(ours, &plain, sql, oracle).await;
                let (result, report) = run_reporting(ours, sql).await;
                let fallbacks = report.fallbacks;
                // A fault at creation always fires; one at the end fires when the query
                // reaches its end (no error of its own before).
                // (DataFusion stacks two top-ks for some keys: each operator falls back once.
                // Without a fault, the GPU hands a row DataFusion fails on to the host.)
                let operators = count_gpu_topk(&plan);
                match fault {
                    FaultPoint::None if result.is_ok() => assert_eq!(fallbacks, 0, "{label}"),
                    FaultPoint::Create => assert_eq!(fallbacks, operators, "{label}"),
                    FaultPoint::Finish if result.is_ok() => {
                        assert_eq!(fallbacks, operators, "{label}")
                    }
                    _ => assert!(fallbacks <= operators, "{label}: {fallbacks} fallbacks"),
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A top-k over an unbounded source never finishes: DataFusion rejects the plan, and so must
/// a session with the operator.
#[tokio::test]
async fn an_unbounded_input_gets_datafusions_outcome() {
    let dir = test_dir("unbounded");
    let file = dir.join("ab.csv");
    std::fs::write(&file, "a,b\n1,30\n2,10\n3,20\n4,40\n").unwrap();
    let create = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE u (a INT, b INT) STORED AS CSV LOCATION '{}' \
         OPTIONS ('format.has_header' 'true')",
        file.display()
    );
    let mut outcomes = Vec::new();
    for enabled in [true, false] {
        let ctx = session(enabled, 2, 100);
        ctx.sql(&create).await.unwrap().collect().await.unwrap();
        let outcome = run(&ctx, "SELECT a FROM u ORDER BY b LIMIT 2").await;
        outcomes.push(outcome.map(|b| exact_rows(&b)).map_err(|e| e.to_string()));
    }
    assert!(
        outcomes[1]
            .as_ref()
            .is_err_and(|e| e.contains("SanityCheckPlan")),
        "DataFusion: {:?}",
        outcomes[1]
    );
    // The same error, up to the plan's debug text (which numbers its dynamic filters).
    let head = |o: &std::result::Result<Vec<String>, String>| {
        o.as_ref()
            .map_err(|e| e.split(" {").next().unwrap_or("").to_string())
            .err()
    };
    assert!(head(&outcomes[0]).is_some(), "ours: {:?}", outcomes[0]);
    assert_eq!(head(&outcomes[0]), head(&outcomes[1]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ties table's row ids are its input order, over every storage: the oracle's premise.
#[tokio::test]
async fn file_tables_keep_the_partitions_order() {
    let data = ties_table(47);
    let dir = test_dir("order");
    for storage in [Storage::Parquet, Storage::Csv] {
        let ctx = session(false, 1, 100);
        register_as(&ctx, "t", &data, storage, &dir).await;
        let batches = run(&ctx, "SELECT rid FROM t").await.unwrap();
        let rids: Vec<i64> = batches
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
            .collect();
        assert!(
            rids.len() > 1000 && rids.windows(2).all(|w| w[0] + 1 == w[1]),
            "{storage:?}"
        );
        assert_eq!(
            batches
                .iter()
                .map(|b| b.column(0).null_count())
                .sum::<usize>(),
            0
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Many queries at once on one session (and as many on a session whose GPU selection fails at
/// its second push): every answer DataFusion's, none stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_queries_of_mixed_shapes_all_get_their_answer() {
    let data = ties_table(53);
    let dir = test_dir("concurrent");
    let plain = plain_session(4, Storage::Parquet);
    let sessions = [
        session_with_fault(4, FaultPoint::None),
        session_with_fault(4, FaultPoint::Push(2)),
    ];
    register_tables(&[&plain], Storage::Parquet, &dir, &data).await;
    register_tables(
        &sessions.iter().collect::<Vec<_>>(),
        Storage::Parquet,
        &dir,
        &data,
    )
    .await;
    let queries: Vec<(&str, &str)> = TIE_QUERIES
        .iter()
        .chain(FAULT_QUERIES)
        .copied()
        .filter(|(sql, _)| !sql.contains("jitter"))
        .collect();
    let mut wanted = Vec::new();
    for (_, oracle) in &queries {
        wanted.push(run_oracle(&plain, oracle).await.map_err(|e| e.to_string()));
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let ctx = sessions[i % 2].clone();
        let (sql, _) = queries[i % queries.len()];
        let want = wanted[i % queries.len()].clone();
        tasks.spawn(async move {
            let got = run(&ctx, sql).await.map(|b| exact_rows(&b));
            assert_same(sql, got.map_err(|e| e.to_string()), want);
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a concurrent query panicked");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `CREATE EXTERNAL TABLE … STORED AS GPU` reads Parquet or CSV files into a `GpuTable`
/// (pinning columns where there is a GPU): queries over it answer as DataFusion's over the
/// files; a missing source or an unknown column to pin is a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn files_stored_as_gpu_answer_as_the_files_do() {
    let data = ties_table(43);
    let dir = test_dir("stored-as-gpu");
    let plain = plain_session(3, Storage::Parquet);
    register_as(&plain, "t", &data, Storage::Parquet, &dir).await;
    register_as(&plain, "c", &data, Storage::Csv, &dir).await;
    let ours = session_with_fault(3, FaultPoint::None);
    let create = |name: &str, kind: &str, options: &str| {
        let location = dir.join(format!("{name}-{kind}"));
        format!(
            "CREATE EXTERNAL TABLE {name} STORED AS GPU LOCATION '{}/' OPTIONS ({options})",
            location.display()
        )
    };
    let parquet = create("t", "parquet", "'source' 'parquet', 'pin' 'c, g'");
    run(&ours, &parquet).await.unwrap();
    for (sql, oracle) in TIE_QUERIES {
        let want = run_oracle(&plain, oracle).await.unwrap();
        assert_eq!(exact_rows(&run(&ours, sql).await.unwrap()), want, "{sql}");
    }
    let plan = crate::common::plan_text(
        &physical_plan(&ours, "SELECT rid FROM t ORDER BY c LIMIT 3")
            .await
            .unwrap(),
    );
    assert!(plan.contains("GpuTableExec"), "{plan}");
    // CSV, with the format's own options, against DataFusion reading the same files.
    let csv = create("c", "csv", "'source' 'csv', 'has_header' 'true'");
    run(&ours, &csv).await.unwrap();
    let plain_csv = csv
        .replace("STORED AS GPU", "STORED AS CSV")
        .replace("'source' 'csv', ", "");
    let reference = plain_session(3, Storage::Csv);
    run(&reference, &plain_csv).await.unwrap();
    let sql = "SELECT rid, f FROM c WHERE g > 2 ORDER BY f DESC, rid LIMIT 40";
    assert_eq!(
        exact_rows(&run(&ours, sql).await.unwrap()),
        exact_rows(&run(&reference, sql).await.unwrap())
    );
    // Clear errors.
    let err = run(&ours, &create("x", "parquet", "'pin' 'c'"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("OPTIONS ('source'"), "{err}");
    let bad_pin = create("t", "parquet", "'source' 'parquet', 'pin' 'nope'");
    let err = run(&ours, &bad_pin.replace("TABLE t ", "TABLE y "))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot pin 'nope'"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
