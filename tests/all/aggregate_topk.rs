//! Top-k over an aggregate (`GROUP BY … ORDER BY … LIMIT k [OFFSET m]`, `gpu_topk.aggregate_topk`):
//! the operator against plain DataFusion over every storage with several partitions, files
//! and row groups (each aggregate, each key type, HAVING, OFFSET, NULL keys and values, one
//! group, every row its own group, k beyond the groups, ties at the k-th, empty input, a
//! filter that fails on a row), and the plans: the operator for each shape it takes, with the
//! groups estimated from a sample and what `auto` weighed, and DataFusion's aggregation, with
//! the reason in EXPLAIN, for those it does not.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, Date32Array, DictionaryArray, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use datafusion::arrow::datatypes::{DataType, Field, Int32Type, Schema, TimeUnit};
use datafusion::physical_plan::{ExecutionPlan, collect};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::{AggregateKind, GpuAggregateTopKExec};

use crate::common::{
    Rng, STORAGES, Storage, exact_rows, partitioned, physical_plan, plain_session, plan_text,
    register, register_as, run_oracle, session, session_with, test_dir,
};
use crate::sessions::test_config;

/// A session with the operator and `gpu_topk.aggregate_topk` on.
fn aggregate_session(partitions: usize, batch_size: usize) -> SessionContext {
    let mut config = test_config(true);
    config.aggregate_topk = true;
    session_with(partitions, batch_size, config)
}

/// Partitions of batches of `t`: a unique `id`, group columns of each key type with NULLs
/// (`g` 40 integers, `s` 12 strings, `d` 20 dates, `ts` 15 timestamps), values `v` (integers
/// with ties and NULLs) and `f` (quarters, so that every sum is exact in any order), and a
/// constant `c`.
fn table(seed: u64) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("d", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("v", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
        Field::new("c", DataType::Int32, false),
    ]));
    let sizes: [&[usize]; 3] = [&[97, 97, 97, 9], &[64, 64, 17], &[128, 50]];
    partitioned(seed, &sizes, |rng: &mut Rng, first, rows| {
        // `rows` draws below `n`, each NULL with chance `p`.
        let mut maybe = |p: f64, n: u64| -> std::vec::IntoIter<Option<u64>> {
            let drawn: Vec<_> = (0..rows)
                .map(|_| (!rng.chance(p)).then(|| rng.below(n)))
                .collect();
            drawn.into_iter()
        };
        let g: Vec<Option<i32>> = maybe(0.05, 40).map(|x| x.map(|x| x as i32)).collect();
        let s: Vec<Option<String>> = maybe(0.08, 12)
            .map(|x| x.map(|x| ["", "en", "es", "日本"][x as usize % 4].repeat(1 + x as usize / 4)))
            .collect();
        let d: Vec<Option<i32>> = maybe(0.05, 20)
            .map(|x| x.map(|x| 18000 + x as i32))
            .collect();
        let ts: Vec<Option<i64>> = (maybe(0.05, 15))
            .map(|x| x.map(|x| 1_600_000_000_000_000 + x as i64 * 3_600_000_000))
            .collect();
        let v: Vec<Option<i64>> = maybe(0.04, 30).map(|x| x.map(|x| x as i64 - 5)).collect();
        let f: Vec<Option<f64>> = maybe(0.04, 50).map(|x| x.map(|x| x as f64 / 4.0)).collect();
        let columns: Vec<Arc<dyn Array>> = vec![
            Arc::new(Int64Array::from_iter_values(first..first + rows as i64)),
            Arc::new(Int32Array::from(g)),
            Arc::new(StringArray::from(s)),
            Arc::new(Date32Array::from(d)),
            Arc::new(TimestampMicrosecondArray::from(ts)),
            Arc::new(Int64Array::from(v)),
            Arc::new(Float64Array::from(f)),
            Arc::new(Int32Array::from(vec![7; rows])),
        ];
        RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
    })
}

/// The operators of `plan`.
fn aggregate_operators(plan: &Arc<dyn ExecutionPlan>) -> Vec<&GpuAggregateTopKExec> {
    let mut found: Vec<&GpuAggregateTopKExec> = plan
        .downcast_ref::<GpuAggregateTopKExec>()
        .into_iter()
        .collect();
    for child in plan.children() {
        found.extend(aggregate_operators(child));
    }
    found
}

/// Runs `sql` with the operator (taken or not, as `taken` says) and with plain DataFusion:
/// the same rows in the same order, or the same error.
async fn same_answer(ours: &SessionContext, plain: &SessionContext, sql: &str, taken: bool) {
    let plan = physical_plan(ours, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    assert_eq!(
        aggregate_operators(&plan).len(),
        usize::from(taken),
        "{sql}:\n{}",
        plan_text(&plan)
    );
    let got = collect(plan, ours.task_ctx()).await.map(|b| exact_rows(&b));
    let want = run_oracle(plain, sql).await;
    match (got, want) {
        (Ok(got), Ok(want)) => assert_eq!(got, want, "{sql}"),
        (Err(got), Err(want)) => assert_eq!(got.to_string(), want.to_string(), "{sql}"),
        (got, want) => panic!("{sql}: ours {got:?}, DataFusion's {want:?}"),
    }
}

/// Queries the operator takes, each ordered by keys that tell every output row apart (but
/// the one that selects only tied values).
const TAKEN: &[&str] = &[
    "SELECT g, COUNT(*) AS n FROM t GROUP BY g ORDER BY n DESC, g NULLS FIRST LIMIT 5",
    "SELECT s, COUNT(v) AS n, SUM(v) AS total FROM t GROUP BY s ORDER BY total DESC NULLS LAST, s LIMIT 3",
    "SELECT g, MIN(v) AS lo, MAX(v) AS hi, AVG(f) AS a FROM t GROUP BY g ORDER BY a, g LIMIT 4 OFFSET 2",
    "SELECT d, COUNT(DISTINCT s) AS u FROM t GROUP BY d ORDER BY u DESC, d NULLS LAST LIMIT 6",
    "SELECT s, COUNT(DISTINCT g % 7) AS u FROM t WHERE v < 20 GROUP BY s ORDER BY u, s LIMIT 4",
    "SELECT g, COUNT(DISTINCT v) AS u, COUNT(*) AS n FROM t GROUP BY g ORDER BY u DESC, n, g LIMIT 5",
    "SELECT g, s, COUNT(*) AS n, SUM(f) AS sf FROM t WHERE v > 3 GROUP BY g, s HAVING COUNT(*) > 2 ORDER BY n DESC, g, s LIMIT 10",
    "SELECT g, AVG(f) AS a FROM t GROUP BY g HAVING MAX(v) > 10 ORDER BY a DESC, g LIMIT 5 OFFSET 1",
    "SELECT ts, MAX(s) AS m, MIN(f) AS lo FROM t GROUP BY ts ORDER BY ts DESC NULLS FIRST LIMIT 5",
    "SELECT g % 5 AS m, COUNT(v) + 1 AS c FROM t GROUP BY g % 5 ORDER BY c DESC, m LIMIT 3",
    "SELECT s, SUM(length(s)) AS l, MIN(d) AS first FROM t GROUP BY s ORDER BY l DESC NULLS LAST, s NULLS FIRST LIMIT 3",
    // Every row its own group.
    "SELECT id, SUM(v) AS sv FROM t GROUP BY id ORDER BY sv DESC NULLS LAST, id LIMIT 7",
    // One group.
    "SELECT c, COUNT(*) AS n, AVG(v) AS a FROM t GROUP BY c ORDER BY n LIMIT 3",
    // k beyond the groups.
    "SELECT g, COUNT(*) AS n FROM t GROUP BY g ORDER BY g NULLS FIRST LIMIT 1000",
    // Ties at the k-th: the values selected are the same, whichever groups hold them.
    "SELECT COUNT(*) AS n FROM t GROUP BY v ORDER BY n DESC LIMIT 4",
    // No row passes.
    "SELECT g, COUNT(*) AS n FROM t WHERE id < 0 GROUP BY g ORDER BY n DESC, g LIMIT 5",
    // The filter fails on one row: DataFusion's error.
    "SELECT g, COUNT(*) AS n FROM t WHERE 1000 / (id - 500) > 0 GROUP BY g ORDER BY n DESC, g LIMIT 3",
];

/// Every shape taken, over every storage, with DataFusion's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aggregate_top_k_matches_datafusion() {
    let dir = test_dir("aggregate-topk");
    let data = table(41);
    for storage in STORAGES {
        for partitions in [1, 3] {
            let ours = aggregate_session(partitions, 64);
            let plain = plain_session(partitions, storage);
            register_as(&ours, "t", &data, storage, &dir).await;
            register_as(&plain, "t", &data, storage, &dir).await;
            for sql in TAKEN {
                same_answer(&ours, &plain, sql, true).await;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Dictionary-encoded string keys (alone and with another key), in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dictionary_keys_match_datafusion() {
    let data: Vec<Vec<RecordBatch>> = (table(43).into_iter())
        .map(|batches| batches.iter().map(with_dictionary).collect())
        .collect();
    let ours = aggregate_session(3, 64);
    let plain = session(false, 3, 64);
    register(&ours, "t", data.clone());
    register(&plain, "t", data);
    for sql in [
        "SELECT ds, COUNT(*) AS n, SUM(v) AS sv FROM t GROUP BY ds ORDER BY n DESC, ds NULLS FIRST LIMIT 4",
        "SELECT ds, g, MAX(f) AS m FROM t GROUP BY ds, g ORDER BY m DESC NULLS LAST, ds, g LIMIT 9 OFFSET 3",
    ] {
        same_answer(&ours, &plain, sql, true).await;
    }
}

/// `batch` with `ds`, its `s` dictionary-encoded, added.
fn with_dictionary(batch: &RecordBatch) -> RecordBatch {
    let s = batch.column_by_name("s").unwrap();
    let s = s.as_any().downcast_ref::<StringArray>().unwrap();
    let ds: DictionaryArray<Int32Type> = s.iter().collect();
    let mut fields: Vec<Field> = (batch.schema().fields().iter())
        .map(|f| f.as_ref().clone())
        .collect();
    fields.push(Field::new("ds", ds.data_type().clone(), true));
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(ds));
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
}

/// What the spec of a taken query holds: keys with their types, each aggregate's kind,
/// types and distinct flag, the fused filter, HAVING, the order, k and offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_spec_is_the_query() {
    let ours = aggregate_session(3, 64);
    register(&ours, "t", table(47));
    let sql = "SELECT s, d, COUNT(*) AS n, COUNT(DISTINCT v) AS u, AVG(v) AS a FROM t \
               WHERE g > 3 GROUP BY s, d HAVING SUM(f) > 1 ORDER BY a DESC, s, d LIMIT 4 OFFSET 2";
    let plan = physical_plan(&ours, sql).await.unwrap();
    let operators = aggregate_operators(&plan);
    let [exec] = operators.as_slice() else {
        panic!("one operator expected:\n{}", plan_text(&plan));
    };
    let spec = exec.spec();
    let keys: Vec<(String, DataType)> = (spec.group_keys.iter())
        .map(|k| (unindexed(&k.expr.to_string()), k.data_type.clone()))
        .collect();
    assert_eq!(
        keys,
        [
            ("s".to_string(), DataType::Utf8),
            ("d".to_string(), DataType::Date32)
        ]
    );
    let aggregates: Vec<_> = (spec.aggregates.iter())
        .map(|a| {
            let input = a.input.as_ref().map(|e| unindexed(&e.to_string()));
            (
                a.kind,
                input,
                a.input_type.clone(),
                a.output_type.clone(),
                a.distinct,
            )
        })
        .collect();
    assert_eq!(aggregates.len(), 4, "{aggregates:?}");
    assert!(aggregates.contains(&(AggregateKind::CountStar, None, None, DataType::Int64, false)));
    let v = Some("v".to_string());
    let int64 = Some(DataType::Int64);
    assert!(aggregates.contains(&(
        AggregateKind::CountDistinct,
        v,
        int64,
        DataType::Int64,
        true
    )));
    // DataFusion averages an integer column as floats: the input is its cast.
    let cast = Some("CAST(v AS Float64)".to_string());
    let float64 = Some(DataType::Float64);
    assert!(
        aggregates.contains(&(AggregateKind::Avg, cast, float64, DataType::Float64, false)),
        "{aggregates:?}"
    );
    assert!(aggregates.iter().any(|a| a.0 == AggregateKind::Sum));
    let filter = spec.filter.as_ref().map(|f| unindexed(&f.to_string()));
    assert_eq!(filter.as_deref(), Some("g > 3"));
    assert!(spec.having.is_some());
    assert_eq!((spec.k, spec.offset), (6, 2));
    assert_eq!(spec.order.len(), 3);
    assert!(spec.order[0].options.descending);
    let names: Vec<&str> = spec.output.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, ["s", "d", "n", "u", "a"]);
    let text = plan_text(&plan);
    assert!(
        text.contains("GpuAggregateTopKExec: k=6, offset=2"),
        "{text}"
    );
    assert!(text.contains("backend=cpu, reason=["), "{text}");
    assert!(text.contains("filter=[g@"), "{text}");
}

/// `expr` as text without its columns' indexes (`g@1 > 3` is `g > 3`): they depend on the
/// columns the scan reads.
fn unindexed(expr: &str) -> String {
    let mut out = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '@' {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What the operator does not take keeps DataFusion's aggregation, with the reason in the
/// top-k's EXPLAIN, and DataFusion's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn untaken_aggregates_keep_datafusions_plan_and_say_why() {
    let ours = aggregate_session(3, 64);
    let plain = session(false, 3, 64);
    register(&ours, "t", table(53));
    register(&plain, "t", table(53));
    let untaken = [
        (
            "SELECT g, bit_and(v) AS b FROM t GROUP BY g ORDER BY b, g LIMIT 3",
            "bit_and is not supported",
        ),
        (
            "SELECT g, SUM(v) FILTER (WHERE v > 1) AS x FROM t GROUP BY g ORDER BY x, g LIMIT 3",
            "FILTER (WHERE …) in an aggregate",
        ),
        (
            "SELECT g, first_value(v ORDER BY id) AS m FROM t GROUP BY g ORDER BY m, g LIMIT 3",
            "is ordered",
        ),
        (
            "SELECT f, COUNT(*) AS n FROM t GROUP BY f ORDER BY n DESC, f LIMIT 3",
            "a group key of type Float64",
        ),
        (
            "SELECT g, SUM(DISTINCT v) AS x FROM t GROUP BY g ORDER BY x, g LIMIT 3",
            "over distinct values",
        ),
        (
            "SELECT g, s, COUNT(*) AS n FROM t GROUP BY GROUPING SETS ((g), (s)) \
             ORDER BY n, g NULLS FIRST, s NULLS FIRST LIMIT 4",
            "GROUPING SETS",
        ),
        (
            "SELECT s, COUNT(g) AS n FROM (SELECT DISTINCT g, s, v FROM t) GROUP BY s \
             ORDER BY n DESC, s NULLS FIRST LIMIT 3",
            "the input AggregateExec is not a table scan",
        ),
    ];
    for (sql, why) in untaken {
        same_answer(&ours, &plain, sql, false).await;
        let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
        assert!(
            text.contains("aggregate=[DataFusion's: aggregate: "),
            "{sql}:\n{text}"
        );
        assert!(text.contains(why), "{sql}: {why}:\n{text}");
    }
}

/// On by default; `SET gpu_topk.aggregate_topk = false` leaves DataFusion's aggregation in
/// place, under the top-k operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_by_default_and_off_when_set() {
    let ours = session(true, 3, 64);
    register(&ours, "t", table(59));
    let sql = "SELECT g, COUNT(*) AS n FROM t GROUP BY g ORDER BY n DESC, g LIMIT 5";
    let plan = physical_plan(&ours, sql).await.unwrap();
    assert_eq!(aggregate_operators(&plan).len(), 1, "{}", plan_text(&plan));
    ours.sql("SET gpu_topk.aggregate_topk = false")
        .await
        .unwrap();
    let plan = physical_plan(&ours, sql).await.unwrap();
    let text = plan_text(&plan);
    assert!(aggregate_operators(&plan).is_empty(), "{text}");
    assert!(
        text.contains("GpuTopKExec") && text.contains("AggregateExec"),
        "{text}"
    );
}

/// Under `auto` the cost model weighs a small table: DataFusion's aggregation, with what was
/// weighed in EXPLAIN (or, without a GPU, why none was weighed), and the groups estimated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_weighs_the_aggregation_and_says_why() {
    let mut config = test_config(true).with_backend(datafusion_gpu_topk::Backend::Auto);
    config.aggregate_topk = true;
    let ours = session_with(3, 64, config);
    let plain = session(false, 3, 64);
    register(&ours, "t", int64_table(61));
    register(&plain, "t", int64_table(61));
    let sql = "SELECT k, COUNT(*) AS n FROM t GROUP BY k ORDER BY n DESC, k LIMIT 5";
    let plan = physical_plan(&ours, sql).await.unwrap();
    let text = plan_text(&plan);
    assert!(text.contains("backend=cpu, reason=["), "{text}");
    let groups = group_count(&plain, "SELECT k FROM t GROUP BY k").await;
    assert!(text.contains(&format!("groups≈{groups}, ")), "{text}");
    let no_gpu = text.contains("reason=[no GPU found (");
    let weighed = text.contains("predicted_cpu=");
    assert!(no_gpu != weighed, "{text}");
    same_answer(&ours, &plain, sql, true).await;
}

/// The groups of `sql`'s rows (a `GROUP BY` query) in `plain`.
async fn group_count(plain: &SessionContext, sql: &str) -> usize {
    let batches = crate::common::run(plain, sql).await.unwrap();
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// EXPLAIN shows the groups the rule estimated from a sample of an in-memory table or
/// `GpuTable` (exact here: the sample is the whole table), among the rows that pass the
/// filter, on the CPU path as on the device; files have no sample: `groups=?`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_shows_the_groups_estimated_from_a_sample() {
    let dir = test_dir("aggregate-groups");
    let data = table(71);
    let queries = [
        (
            "SELECT g, COUNT(*) AS n FROM t GROUP BY g ORDER BY n DESC, g LIMIT 5",
            "SELECT g FROM t GROUP BY g",
        ),
        (
            "SELECT s, SUM(v) AS sv FROM t WHERE v > 3 GROUP BY s ORDER BY sv DESC, s LIMIT 3",
            "SELECT s FROM t WHERE v > 3 GROUP BY s",
        ),
        (
            "SELECT g, d, COUNT(DISTINCT v) AS u FROM t GROUP BY g, d ORDER BY u DESC, g, d LIMIT 4",
            "SELECT g, d FROM t GROUP BY g, d",
        ),
        (
            "SELECT id, MAX(f) AS m FROM t GROUP BY id ORDER BY m DESC, id LIMIT 3",
            "SELECT id FROM t GROUP BY id",
        ),
    ];
    for storage in STORAGES {
        let ours = aggregate_session(3, 64);
        let plain = plain_session(3, storage);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        let sampled = matches!(storage, Storage::Memory | Storage::GpuTable);
        for (sql, groups) in queries {
            let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
            let groups = group_count(&plain, groups).await;
            assert!(groups > 1, "{sql}");
            let want = match sampled {
                true => format!("groups≈{groups}, backend="),
                false => "groups=?, backend=".to_string(),
            };
            assert!(text.contains(&want), "{storage:?}: {sql}: {want}:\n{text}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `t` of [`table`] with `k` and `k2`, Int64 group keys with NULLs (40 and 6 values).
fn int64_table(seed: u64) -> Vec<Vec<RecordBatch>> {
    let keys = |batch: &RecordBatch, modulo: i64| -> Int64Array {
        let id = batch.column_by_name("id").unwrap();
        let id = id.as_any().downcast_ref::<Int64Array>().unwrap();
        let g = batch.column_by_name("g").unwrap();
        let g = g.as_any().downcast_ref::<Int32Array>().unwrap();
        (id.iter().zip(g.iter()))
            .map(|(id, g)| g.and(id).map(|id| (id * 7919) % modulo - modulo / 2))
            .collect()
    };
    (table(seed).into_iter())
        .map(|batches| {
            (batches.iter())
                .map(|b| {
                    let mut fields: Vec<Field> = b
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.as_ref().clone())
                        .collect();
                    fields.push(Field::new("k", DataType::Int64, true));
                    fields.push(Field::new("k2", DataType::Int64, true));
                    let mut columns = b.columns().to_vec();
                    columns.push(Arc::new(keys(b, 40)));
                    columns.push(Arc::new(keys(b, 6)));
                    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
                })
                .collect()
        })
        .collect()
}

/// With `backend = cuda` the device's slice plans `backend=cuda` (and answers as DataFusion:
/// on the device, or without a GPU by DataFusion's plan after the device failed), and every
/// other shape says why it stays on the CPU; `cpu` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_device_slice_plans_cuda_and_the_rest_says_why() {
    let mut config = test_config(true).with_backend(datafusion_gpu_topk::Backend::Cuda);
    config.aggregate_topk = true;
    let ours = session_with(3, 64, config);
    let plain = session(false, 3, 64);
    register(&ours, "t", int64_table(67));
    register(&plain, "t", int64_table(67));
    let taken = [
        "SELECT k, COUNT(*) AS n FROM t GROUP BY k ORDER BY n DESC, k LIMIT 5",
        "SELECT k, COUNT(v) AS c, SUM(v) AS s FROM t GROUP BY k ORDER BY s DESC NULLS FIRST, k LIMIT 4",
        "SELECT k, k2, SUM(f) AS s, MIN(v) AS lo FROM t GROUP BY k, k2 ORDER BY s, k, k2 LIMIT 6 OFFSET 2",
        "SELECT ts, MAX(f) AS m, AVG(v) AS a FROM t GROUP BY ts ORDER BY a DESC, ts LIMIT 3",
        "SELECT id, MAX(v) AS m FROM t GROUP BY id ORDER BY m DESC NULLS LAST, id LIMIT 3",
        // Filters the fusion translates, strings' included, run in the aggregation's pass.
        "SELECT k, COUNT(*) AS n FROM t WHERE v > 0 GROUP BY k ORDER BY n, k LIMIT 3",
        "SELECT k, SUM(v) AS total FROM t WHERE s <> '' AND s LIKE 'e%' GROUP BY k ORDER BY total, k LIMIT 4",
        "SELECT k, k2, MAX(f) AS m FROM t WHERE v % 4 = 1 OR g IS NULL GROUP BY k, k2 ORDER BY m DESC, k, k2 LIMIT 5",
        // HAVING over exact aggregates and the keys, before the selection.
        "SELECT k, COUNT(*) AS n FROM t GROUP BY k HAVING SUM(v) > 0 ORDER BY n, k LIMIT 3",
        "SELECT k, MAX(f) AS m FROM t WHERE v > 2 GROUP BY k HAVING COUNT(*) > 3 OR k IS NULL ORDER BY m, k LIMIT 4",
        // Keys and inputs the generated pass computes: narrow integers, dates, casts.
        "SELECT g, COUNT(*) AS n FROM t GROUP BY g ORDER BY n, g LIMIT 3",
        "SELECT d, COUNT(*) AS n FROM t GROUP BY d ORDER BY n, d LIMIT 3",
        "SELECT k, SUM(c) AS s FROM t GROUP BY k ORDER BY s, k LIMIT 3",
        "SELECT k, AVG(f) AS a FROM t GROUP BY k ORDER BY a, k LIMIT 3",
        "SELECT k % 7 AS r, MIN(g) AS lo, COUNT(*) AS n FROM t WHERE s <> '' GROUP BY k % 7 ORDER BY n DESC, r LIMIT 4",
        // Ordered by a group key (the groups' first or last minutes, ClickBench's shape).
        "SELECT k, COUNT(*) AS n FROM t GROUP BY k ORDER BY k LIMIT 3",
        "SELECT date_trunc('day', ts) AS m, COUNT(*) AS n FROM t WHERE v > 0 GROUP BY date_trunc('day', ts) ORDER BY m DESC NULLS FIRST LIMIT 5 OFFSET 1",
        "SELECT date_trunc('minute', ts) AS m, COUNT(*) AS n FROM t GROUP BY date_trunc('minute', ts) ORDER BY m LIMIT 4 OFFSET 2",
        "SELECT k, k2, SUM(v) AS s FROM t GROUP BY k, k2 ORDER BY k2 DESC, k LIMIT 6",
        // String keys, grouped by their codes.
        "SELECT s, COUNT(*) AS n FROM t GROUP BY s ORDER BY n, s LIMIT 3",
        "SELECT s, k, SUM(v) AS t FROM t WHERE s <> '' GROUP BY s, k ORDER BY t DESC, s, k LIMIT 5",
        "SELECT s, MAX(g) AS hi FROM t GROUP BY s ORDER BY s DESC NULLS FIRST LIMIT 4",
        "SELECT k, COUNT(s) AS c FROM t GROUP BY k ORDER BY c DESC, k LIMIT 4",
    ];
    // Without a GPU the device fails at once and DataFusion's plan answers.
    let fallbacks = usize::from(datafusion_gpu_topk::internal::device::gpu().is_none());
    for sql in taken {
        let plan = physical_plan(&ours, sql).await.unwrap();
        let text = plan_text(&plan);
        assert!(text.contains("backend=cuda"), "{sql}:\n{text}");
        collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap();
        let [exec] = aggregate_operators(&plan)[..] else {
            panic!("{sql}: one operator expected");
        };
        let fell_back = exec.metrics().and_then(|m| m.sum_by_name("gpu_fallbacks"));
        assert_eq!(fell_back.map_or(0, |v| v.as_usize()), fallbacks, "{sql}");
        same_answer(&ours, &plain, sql, true).await;
    }
    let untaken: [(&str, &[&str]); 10] = [
        (
            "SELECT k, COUNT(*) AS n FROM t WHERE ln(f) > 1.0 GROUP BY k ORDER BY n, k LIMIT 3",
            &["the filter has no device translation", "ln"],
        ),
        (
            "SELECT k, COUNT(*) AS n FROM t GROUP BY k HAVING SUM(f) > 0 ORDER BY n, k LIMIT 3",
            &["HAVING reads sum(t.f)", "floating-point sum"],
        ),
        (
            "SELECT lower(s) AS l, COUNT(*) AS n FROM t GROUP BY lower(s) ORDER BY n, l LIMIT 3",
            &["key type Utf8 runs on the CPU path only"],
        ),
        (
            "SELECT k, k2, g, COUNT(*) AS n FROM t GROUP BY k, k2, g ORDER BY n, k, k2, g LIMIT 3",
            &["more than 2 group keys"],
        ),
        (
            "SELECT k, COUNT(DISTINCT v) AS u FROM t GROUP BY k ORDER BY u, k LIMIT 3",
            &["count_distinct(v@", "runs on the CPU path only"],
        ),
        (
            "SELECT k, MAX(s) AS c FROM t GROUP BY k ORDER BY c, k LIMIT 3",
            &["(s@", "runs on the CPU path only"],
        ),
        (
            "SELECT g, COUNT(*) AS n FROM t GROUP BY g HAVING MIN(g) > 0 ORDER BY n, g LIMIT 3",
            &["HAVING reads min(t.g), of type Int32"],
        ),
        (
            "SELECT k, COUNT(*) AS n FROM t GROUP BY k ORDER BY k + 1 LIMIT 3",
            &["the first sort key is neither an aggregate nor a group key"],
        ),
        (
            "SELECT k, COUNT(*) AS n FROM t GROUP BY k ORDER BY n, k DESC LIMIT 3",
            &["ties ordered otherwise than by the group keys ascending, NULLs last"],
        ),
        (
            "SELECT k, k2, COUNT(*) AS n FROM t GROUP BY k, k2 ORDER BY n, k2, k LIMIT 3",
            &["ties ordered otherwise"],
        ),
    ];
    for (sql, why) in untaken {
        let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
        assert!(text.contains("backend=cpu, reason=["), "{sql}:\n{text}");
        for why in why {
            assert!(text.contains(why), "{sql}: {why}:\n{text}");
        }
        same_answer(&ours, &plain, sql, true).await;
    }
    // Files are not read by the device path.
    let dir = test_dir("aggregate-device-plans");
    let files = session_with(3, 64, {
        let mut config = test_config(true).with_backend(datafusion_gpu_topk::Backend::Cuda);
        config.aggregate_topk = true;
        config
    });
    register_as(
        &files,
        "t",
        &int64_table(67),
        crate::common::Storage::Parquet,
        &dir,
    )
    .await;
    let text = plan_text(&physical_plan(&files, taken[0]).await.unwrap());
    assert!(
        text.contains("reason=[the device reads in-memory tables and GpuTables only]"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    // `cpu` keeps the device out.
    let mut config = test_config(true).with_backend(datafusion_gpu_topk::Backend::Cpu);
    config.aggregate_topk = true;
    let cpu = session_with(3, 64, config);
    register(&cpu, "t", int64_table(67));
    let text = plan_text(&physical_plan(&cpu, taken[0]).await.unwrap());
    assert!(
        text.contains("backend=cpu, reason=[CPU path forced by settings]"),
        "{text}"
    );
    // Nor does the device run without the column cache, which it reads the columns from.
    let mut config = test_config(true).with_backend(datafusion_gpu_topk::Backend::Cuda);
    config.aggregate_topk = true;
    config.column_cache = false;
    let uncached = session_with(3, 64, config);
    register(&uncached, "t", int64_table(67));
    let text = plan_text(&physical_plan(&uncached, taken[0]).await.unwrap());
    assert!(text.contains("gpu_topk.column_cache = false]"), "{text}");
}
