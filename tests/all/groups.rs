//! Top-k per group (`ROW_NUMBER()` or `RANK()` `OVER (PARTITION BY … ORDER BY …)` filtered by
//! `<= K`, `< K`, `= 1`): the operator against DataFusion's window plan (the rule off), over every
//! storage, several partitions, NULL groups, one group, every row its own group, K beyond every
//! group, extra conjuncts, an outer top-k, and an aggregate and a join below.

use std::sync::Arc;

use datafusion::arrow::array::{Float64Array, Int32Array, Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::GpuGroupTopKExec;

use crate::common::{
    Rng, STORAGES, exact_rows, physical_plan, plain_session, plan_text, register, register_as, run,
    session, test_dir,
};

/// `n` rows over `partitions` partitions: a unique `id`, a group `g` of `groups` values (some
/// NULL), a string group `s` (some NULL), a value `v` with ties and a constant `c`.
fn table(n: usize, partitions: usize, groups: u64) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("v", DataType::Float64, true),
        Field::new("c", DataType::Int32, false),
    ]));
    let mut rng = Rng::new(23);
    let per = n.div_ceil(partitions);
    (0..partitions)
        .map(|p| {
            let ids: Vec<usize> = (p * per..((p + 1) * per).min(n)).collect();
            ids.chunks(97)
                .map(|chunk| {
                    let g: Vec<Option<i32>> = chunk
                        .iter()
                        .map(|_| (!rng.chance(0.05)).then(|| rng.below(groups) as i32))
                        .collect();
                    let s: Vec<Option<String>> = chunk
                        .iter()
                        .map(|_| {
                            (!rng.chance(0.05)).then(|| {
                                ["en", "es", "日本", ""][rng.below(4) as usize].to_string()
                            })
                        })
                        .collect();
                    let v: Vec<Option<f64>> = chunk
                        .iter()
                        .map(|_| (!rng.chance(0.03)).then(|| rng.below(50) as f64 / 4.0))
                        .collect();
                    let columns: Vec<Arc<dyn datafusion::arrow::array::Array>> = vec![
                        Arc::new(Int64Array::from_iter_values(
                            chunk.iter().map(|&i| i as i64),
                        )),
                        Arc::new(Int32Array::from(g)),
                        Arc::new(StringArray::from(s)),
                        Arc::new(Float64Array::from(v)),
                        Arc::new(Int32Array::from(vec![7; chunk.len()])),
                    ];
                    RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
                })
                .collect()
        })
        .collect()
}

fn count_group_topk(plan: &Arc<dyn ExecutionPlan>) -> usize {
    usize::from(plan.downcast_ref::<GpuGroupTopKExec>().is_some())
        + plan
            .children()
            .into_iter()
            .map(count_group_topk)
            .sum::<usize>()
}

/// The rows of `sql` with the operator and with DataFusion's plan, as sorted lines (the
/// `ROW_NUMBER()` queries' order keys end in the unique `id`, so row numbers are
/// deterministic; ranks are whatever the order of ties).
async fn same_rows(ours: &SessionContext, plain: &SessionContext, sql: &str, taken: bool) {
    let plan = physical_plan(ours, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    assert_eq!(
        count_group_topk(&plan),
        usize::from(taken),
        "{sql}:\n{}",
        plan_text(&plan)
    );
    let mut got = exact_rows(&collect(plan, ours.task_ctx()).await.unwrap());
    let mut want = exact_rows(&run(plain, sql).await.unwrap());
    got.sort();
    want.sort();
    assert_eq!(got, want, "{sql}");
}

const QUERIES: [&str; 12] = [
    "SELECT id, g, v, r FROM (SELECT *, RANK() OVER (PARTITION BY g ORDER BY v DESC) AS r FROM t) WHERE r <= 3",
    "SELECT id, s, v, r FROM (SELECT *, RANK() OVER (PARTITION BY s ORDER BY v NULLS FIRST) AS r FROM t) WHERE r = 1",
    "SELECT id, g, s, r FROM (SELECT *, RANK() OVER (PARTITION BY g, s ORDER BY v, c) AS r FROM t) WHERE r < 4 ORDER BY r DESC, id LIMIT 20",
    "SELECT id, g, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= 3",
    "SELECT id, s, g, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY s, g ORDER BY v NULLS FIRST, id DESC) AS rn FROM t) WHERE rn < 3",
    "SELECT * FROM (SELECT id, s, v, ROW_NUMBER() OVER (PARTITION BY s ORDER BY id DESC) AS rn FROM t) WHERE rn = 1",
    "SELECT id, g, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn FROM t) WHERE rn <= 100000",
    "SELECT id, c, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY c ORDER BY v, id) AS rn FROM t) WHERE rn <= 5",
    "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY id ORDER BY v) AS rn FROM t) WHERE rn <= 2",
    "SELECT id, g, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t WHERE id % 3 <> 0) WHERE 2 >= rn AND v > 3",
    "SELECT id, g, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn FROM t) WHERE rn <= 0",
    "SELECT id, g, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= 2 ORDER BY v DESC, id LIMIT 7",
];

/// Every query shape over every storage, several partitions, many and few groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_number_per_group_matches_datafusion() {
    let dir = test_dir("groups");
    for (groups, partitions) in [(40, 3), (3, 1), (2000, 4)] {
        let data = table(3000, partitions, groups);
        for storage in STORAGES {
            let ours = session(true, partitions, 128);
            let plain = plain_session(partitions, storage);
            register_as(&ours, "t", &data, storage, &dir).await;
            register_as(&plain, "t", &data, storage, &dir).await;
            for sql in QUERIES {
                same_rows(&ours, &plain, sql, true).await;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An aggregate and a join below: inputs read once, as they stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn row_number_per_group_over_an_aggregate_and_a_join() {
    let data = table(2000, 3, 30);
    let ours = session(true, 3, 100);
    let plain = session(false, 3, 100);
    for ctx in [&ours, &plain] {
        register(ctx, "t", data.clone());
        register(ctx, "u", data.clone());
    }
    let queries = [
        "SELECT g, s, n, rn FROM (SELECT g, s, count(*) AS n, ROW_NUMBER() OVER (PARTITION BY g ORDER BY count(*) DESC, s) AS rn FROM t GROUP BY g, s) WHERE rn <= 2",
        "SELECT a, b, rn FROM (SELECT t.id AS a, u.id AS b, ROW_NUMBER() OVER (PARTITION BY t.g ORDER BY u.v, u.id, t.id) AS rn FROM t JOIN u ON t.id = u.id % 500) WHERE rn <= 3",
    ];
    for sql in queries {
        same_rows(&ours, &plain, sql, true).await;
    }
}

/// What the operator does not take stays DataFusion's: other window functions, several in one
/// window, a window without PARTITION BY, a filter not on the row number.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_window_queries_keep_datafusions_plan() {
    let data = table(1000, 2, 10);
    let ours = session(true, 2, 100);
    let plain = session(false, 2, 100);
    register(&ours, "t", data.clone());
    register(&plain, "t", data);
    let queries = [
        "SELECT id, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g ORDER BY v, id) AS r FROM t) WHERE r <= 2",
        // A window over the whole input (a merge of sorted partitions below it).
        "SELECT id, v, rn FROM (SELECT *, ROW_NUMBER() OVER (ORDER BY v DESC NULLS LAST, id) AS rn FROM t) WHERE rn <= 4",
        "SELECT id, rn, m FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn, max(v) OVER (PARTITION BY g ORDER BY id) AS m FROM t) WHERE rn <= 2",
        "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn FROM t) WHERE id > 500",
        "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn FROM t) WHERE rn > 2",
    ];
    for sql in queries {
        same_rows(&ours, &plain, sql, false).await;
    }
}
