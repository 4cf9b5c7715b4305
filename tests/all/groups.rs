//! Top-k per group (`ROW_NUMBER()`, `RANK()` or `DENSE_RANK()` `OVER (PARTITION BY … ORDER BY …)` filtered by
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
    Rng, STORAGES, Storage, exact_rows, physical_plan, plain_session, plan_text, register,
    register_as, run, session, test_dir,
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
    let took = same_rows_taken(ours, plain, sql).await;
    assert_eq!(took, taken, "{sql}: taken by the operator");
}

/// [`same_rows`], saying whether the operator took the query.
async fn same_rows_taken(ours: &SessionContext, plain: &SessionContext, sql: &str) -> bool {
    same_rows_placed(ours, plain, sql).await.0
}

/// [`same_rows`], saying whether the operator took the query and whether it ran on the GPU.
async fn same_rows_placed(
    ours: &SessionContext,
    plain: &SessionContext,
    sql: &str,
) -> (bool, bool) {
    let plan = physical_plan(ours, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let taken = match count_group_topk(&plan) {
        0 => false,
        1 => true,
        n => panic!("{sql}: {n} operators:\n{}", plan_text(&plan)),
    };
    let on_device = find_group_topk(&plan)
        .and_then(|p| p.downcast_ref::<GpuGroupTopKExec>())
        .is_some_and(GpuGroupTopKExec::on_device);
    let mut got = exact_rows(&collect(plan, ours.task_ctx()).await.unwrap());
    let mut want = exact_rows(&run(plain, sql).await.unwrap());
    got.sort();
    want.sort();
    assert_eq!(got, want, "{sql}");
    (taken, on_device)
}

const QUERIES: [&str; 16] = [
    "SELECT id, g, v FROM t QUALIFY ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) <= 2",
    "SELECT id, s, c FROM t QUALIFY DENSE_RANK() OVER (PARTITION BY s ORDER BY c) = 1",
    "SELECT id, g, v, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g ORDER BY v DESC) AS r FROM t) WHERE r <= 2",
    "SELECT id, s, c, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY s ORDER BY c NULLS FIRST, v) AS r FROM t) WHERE r = 3",
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

/// Random tables and random per-group queries (functions, keys, directions, NULL order, K and
/// its comparison, filters below and beside), against DataFusion's window plan.
/// `GPU_TOPK_GROUP_QUERIES` sets how many (default 120), `GPU_TOPK_GROUP_SEED` the seed (so
/// that processes in parallel draw different queries).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn random_group_queries_match_datafusion() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let queries = env("GPU_TOPK_GROUP_QUERIES").unwrap_or(120) as usize;
    let seed = env("GPU_TOPK_GROUP_SEED").unwrap_or(0x6a09_e667);
    let dir = test_dir(&format!("groups-random-{seed}"));
    let mut rng = Rng::new(seed);
    let (mut done, mut taken, mut on_device) = (0, 0, 0);
    while done < queries {
        let partitions = 1 + rng.below(4) as usize;
        let n = 1 + rng.below(2500) as usize;
        let groups = 1 + rng.below(600);
        let data = table(n, partitions, groups);
        let storage = STORAGES[rng.below(STORAGES.len() as u64) as usize];
        let ours = session(true, partitions, 1 + rng.below(300) as usize);
        let plain = plain_session(partitions, storage);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        for _ in 0..20 {
            let sql = random_query(&mut rng);
            let (took, device) = same_rows_placed(&ours, &plain, &sql).await;
            taken += usize::from(took);
            on_device += usize::from(device);
            done += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{taken} of {done} random per-group queries taken by the operator, {on_device} on the GPU"
    );
    assert_eq!(taken, done, "every random query has the operator's shape");
}

fn random_query(rng: &mut Rng) -> String {
    let pick =
        |rng: &mut Rng, items: &[&'static str]| items[rng.below(items.len() as u64) as usize];
    let mut partition = vec![pick(rng, &["g", "s", "c"])];
    if rng.chance(0.3) {
        partition.push(pick(rng, &["g", "s", "c"]));
        partition.dedup();
    }
    let function = pick(rng, &["ROW_NUMBER", "ROW_NUMBER", "RANK", "DENSE_RANK"]);
    let rank = function != "ROW_NUMBER";
    let mut order: Vec<String> = (0..1 + rng.below(2))
        .map(|_| {
            format!(
                "{} {} {}",
                pick(rng, &["v", "g", "s", "id"]),
                pick(rng, &["ASC", "DESC"]),
                pick(rng, &["NULLS FIRST", "NULLS LAST"])
            )
        })
        .collect();
    if !rank {
        // Unique order keys: row numbers are then DataFusion's too.
        order.push(format!("id {}", pick(rng, &["ASC", "DESC"])));
    }
    let k = match rng.below(4) {
        0 => 1,
        1 => rng.below(4),
        2 => 1 + rng.below(10),
        _ => 1 + rng.below(3000),
    };
    let keep = match rng.below(5) {
        0 => format!("rn <= {k}"),
        1 => format!("rn < {k}"),
        2 => format!("rn = {k}"),
        3 => format!("{k} >= rn"),
        _ => format!("rn <= {k} AND v > {}", rng.below(10)),
    };
    let below = if rng.chance(0.3) {
        format!("WHERE id % {} <> 0", 2 + rng.below(5))
    } else {
        String::new()
    };
    format!(
        "SELECT id, {p}, rn FROM (SELECT *, {f}() OVER (PARTITION BY {p} ORDER BY {o}) AS rn \
         FROM t {below}) WHERE {keep}",
        p = partition.join(", "),
        f = function,
        o = order.join(", "),
    )
}

/// Per-group queries whose every key the device's composite holds exactly (integer and float
/// groups and order keys): the segmented sort takes them over in-memory tables.
const DEVICE_QUERIES: [&str; 10] = [
    "SELECT id, g, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t WHERE id % 7 <> 0) WHERE rn <= 3",
    "SELECT id, g, v, r FROM (SELECT *, RANK() OVER (PARTITION BY g ORDER BY v) AS r FROM t) WHERE r <= 2",
    "SELECT id, g, c, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g, c ORDER BY v DESC NULLS LAST) AS r FROM t) WHERE r <= 2",
    "SELECT * FROM (SELECT id, c, v, ROW_NUMBER() OVER (PARTITION BY c ORDER BY id DESC) AS rn FROM t) WHERE rn = 1",
    "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY id ORDER BY v) AS rn FROM t) WHERE rn <= 2",
    "SELECT id, g, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY id) AS rn FROM t) WHERE rn <= 100000",
    "SELECT id, g, v, r FROM (SELECT *, RANK() OVER (PARTITION BY g ORDER BY v DESC NULLS FIRST) AS r FROM t) WHERE r <= 3 ORDER BY v DESC, id LIMIT 7",
    "SELECT id, g, v, r FROM (SELECT *, RANK() OVER (PARTITION BY g ORDER BY v) AS r FROM t WHERE id % 5 <> 0) WHERE r = 1",
    "SELECT id, g, c, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g, c ORDER BY v DESC NULLS LAST) AS r FROM t) WHERE r <= 1",
    "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY id / 3 ORDER BY v, id DESC) AS rn FROM t) WHERE rn < 2",
];

/// Groups of strings, over `t` (`Utf8`) and `td` (the same rows, `s` a dictionary per batch):
/// all its values are short (at most 16 bytes, none ending in a zero byte), so the device
/// groups them by their bytes in the composite.
const DEVICE_STRING_QUERIES: [&str; 5] = [
    "SELECT id, s, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY s ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= 3",
    "SELECT id, s, g FROM t QUALIFY RANK() OVER (PARTITION BY s, g ORDER BY v NULLS FIRST) <= 2",
    "SELECT * FROM (SELECT id, s, v, ROW_NUMBER() OVER (PARTITION BY s ORDER BY id DESC) AS rn FROM t) WHERE rn = 1",
    "SELECT id, g, s, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g ORDER BY s DESC NULLS LAST) AS r FROM t WHERE s <> 'es') WHERE r <= 2",
    "SELECT id, s, g, c, r FROM (SELECT *, RANK() OVER (PARTITION BY s, g, c ORDER BY v DESC, id) AS r FROM t) WHERE r = 1",
];

/// `t` with `s` dictionary-encoded, a dictionary per batch.
fn dictionary_table(data: &[Vec<RecordBatch>]) -> Vec<Vec<RecordBatch>> {
    use datafusion::arrow::compute::cast;
    let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    let schema = data[0][0].schema();
    let fields: Vec<Field> = (schema.fields().iter())
        .map(|f| match f.name().as_str() {
            "s" => Field::new("s", dictionary.clone(), true),
            _ => f.as_ref().clone(),
        })
        .collect();
    let schema = Arc::new(Schema::new(fields));
    let index = schema.index_of("s").unwrap();
    (data.iter())
        .map(|batches| {
            (batches.iter())
                .map(|batch| {
                    let mut columns = batch.columns().to_vec();
                    columns[index] = cast(&columns[index], &dictionary).unwrap();
                    RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
                })
                .collect()
        })
        .collect()
}

/// On the GPU (skips without one): the segmented sort selects every group over in-memory
/// tables (EXPLAIN says so) with the CPU path's rows and numbers and DataFusion's, groups of
/// short strings and dictionaries included; an injected device failure runs the CPU path,
/// with the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gpu_selects_per_group_as_the_cpu_path() {
    use datafusion_gpu_topk::Backend;
    use datafusion_gpu_topk::internal::device::gpu;

    if gpu().is_none() {
        eprintln!("SKIP the_gpu_selects_per_group_as_the_cpu_path: no GPU");
        return;
    }
    crate::common::capture_warnings();
    let dir = test_dir("groups-device");
    let config = |backend| crate::sessions::base_config().with_backend(backend);
    // Each query ran on the device to its end (the CPU path answered none of them).
    let no_fallback = |plan: &Arc<dyn ExecutionPlan>, sql: &str| {
        let fallbacks = find_group_topk(plan)
            .and_then(|exec| exec.metrics())
            .and_then(|m| m.sum_by_name("gpu_fallbacks"))
            .map_or(0, |v| v.as_usize());
        assert_eq!(
            fallbacks,
            0,
            "{sql}: fell back to the CPU path; warnings: {:?}",
            crate::common::logged_warnings()
        );
    };
    let mut algorithms = std::collections::HashSet::new();
    for (groups, partitions) in [(40, 3), (1, 2), (5000, 4)] {
        let data = table(20_000, partitions, groups);
        for storage in [Storage::Memory, Storage::GpuTable] {
            let cuda = crate::common::session_with(partitions, 1000, config(Backend::Cuda));
            let cpu = crate::common::session_with(partitions, 1000, config(Backend::Cpu));
            let plain = plain_session(partitions, storage);
            for ctx in [&cuda, &cpu, &plain] {
                register_as(ctx, "t", &data, storage, &dir).await;
                register_as(ctx, "td", &dictionary_table(&data), storage, &dir).await;
            }
            let strings = DEVICE_STRING_QUERIES
                .iter()
                .flat_map(|sql| [sql.to_string(), sql.replace("FROM t", "FROM td")]);
            for sql in DEVICE_QUERIES.iter().map(|s| s.to_string()).chain(strings) {
                let sql = sql.as_str();
                let plan = physical_plan(&cuda, sql).await.unwrap();
                let text = plan_text(&plan);
                let algorithm = ["segmented-sort", "group-threshold", "group-min"]
                    .into_iter()
                    .find(|a| text.contains(&format!("backend=cuda, algorithm={a}")));
                assert!(algorithm.is_some(), "{storage:?} {sql}:\n{text}");
                algorithms.insert(algorithm);
                let mut got =
                    exact_rows(&collect(Arc::clone(&plan), cuda.task_ctx()).await.unwrap());
                no_fallback(&plan, sql);
                let mut host = exact_rows(&run(&cpu, sql).await.unwrap());
                let mut want = exact_rows(&run(&plain, sql).await.unwrap());
                got.sort();
                host.sort();
                want.sort();
                assert_eq!(got, host, "{storage:?} {sql}: CUDA against the CPU path");
                assert_eq!(got, want, "{storage:?} {sql}: against DataFusion");
            }
        }
    }
    // Few large groups drop pairs before the sort; many small ones sort them all; K = 1 keeps
    // each group's smallest.
    assert_eq!(algorithms.len(), 3, "{algorithms:?}");
    // Millions of kept rows come back from the device in pieces.
    let n = 5_000_000i64;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let batches: Vec<RecordBatch> = (0..n)
        .step_by(8192)
        .map(|at| {
            let ids: Vec<i64> = (at..(at + 8192).min(n)).collect();
            let v: Vec<i64> = ids.iter().map(|i| (i * 7919) % 1000).collect();
            let columns: Vec<Arc<dyn datafusion::arrow::array::Array>> = vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(Int64Array::from(v)),
            ];
            RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
        })
        .collect();
    let parts: Vec<Vec<RecordBatch>> = batches.chunks(200).map(<[_]>::to_vec).collect();
    let cuda = crate::common::session_with(4, 8192, config(Backend::Cuda));
    let plain = plain_session(4, Storage::Memory);
    register(&cuda, "big", parts.clone());
    register(&plain, "big", parts);
    // Then 1.7M groups of one row kept each, many sharing their hash slot.
    for sql in [
        "SELECT count(*), sum(id), sum(rn) FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY v ORDER BY id) AS rn FROM big) WHERE rn <= 4000",
        "SELECT count(*), sum(id), sum(r) FROM (SELECT id, RANK() OVER (PARTITION BY id / 3 ORDER BY v DESC) AS r FROM big) WHERE r = 1",
        // No number read above: the filter goes, and the numbers stay on the device; and no
        // column at all.
        "SELECT count(*) FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY v ORDER BY id) AS rn FROM big) WHERE rn <= 2500",
        "SELECT count(*), sum(id) FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY v ORDER BY id DESC) AS rn FROM big) WHERE rn <= 3000",
        // The aggregate above needs the window's hash partitioning by `v`.
        "SELECT v, count(*), sum(id), max(rn) FROM (SELECT id, v, ROW_NUMBER() OVER (PARTITION BY v ORDER BY id) AS rn FROM big) WHERE rn <= 700 GROUP BY v",
    ] {
        let plan = physical_plan(&cuda, sql).await.unwrap();
        assert!(
            plan_text(&plan).contains("backend=cuda"),
            "{}",
            plan_text(&plan)
        );
        let got = exact_rows(&collect(Arc::clone(&plan), cuda.task_ctx()).await.unwrap());
        no_fallback(&plan, sql);
        let mut want = exact_rows(&run(&plain, sql).await.unwrap());
        let mut got = got;
        got.sort();
        want.sort();
        assert_eq!(got, want, "{sql}");
    }
    // The kept rows' columns gathered on the device, over every width (1, 2, 4, 8 and 16
    // bytes) with NULLs, in several pieces; and the host's gather where the output reads a
    // column the program does not.
    let typed = typed_table(3_000_000);
    let cuda = crate::common::session_with(4, 8192, config(Backend::Cuda));
    let plain = plain_session(4, Storage::Memory);
    register(&cuda, "typed", typed.clone());
    register(&plain, "typed", typed.clone());
    let filter = "WHERE b IS NOT NULL OR dt > DATE '1970-03-01' OR f > 0.5";
    for (sql, on_device) in [
        (
            format!(
                "SELECT count(*), count(g), sum(g), count(d), sum(d), count(b), sum(b), min(dt), \
                 max(dt), sum(f), sum(id), sum(rn) FROM (SELECT id, g, d, b, dt, f, \
                 ROW_NUMBER() OVER (PARTITION BY g ORDER BY d DESC, id) AS rn FROM typed \
                 {filter}) WHERE rn <= 2000"
            ),
            true,
        ),
        (
            format!(
                "SELECT * FROM (SELECT g, b, d, dt, RANK() OVER (PARTITION BY g, b ORDER BY d) \
                 AS r FROM typed {filter}) WHERE r <= 2"
            ),
            true,
        ),
        (
            "SELECT count(*), sum(id), sum(b) FROM (SELECT id, b, ROW_NUMBER() OVER \
             (PARTITION BY g ORDER BY id) AS rn FROM typed) WHERE rn <= 5"
                .to_string(),
            false,
        ),
    ] {
        let plan = physical_plan(&cuda, &sql).await.unwrap();
        assert!(
            plan_text(&plan).contains("backend=cuda"),
            "{}",
            plan_text(&plan)
        );
        let mut got = exact_rows(&collect(Arc::clone(&plan), cuda.task_ctx()).await.unwrap());
        let mut want = exact_rows(&run(&plain, &sql).await.unwrap());
        got.sort();
        want.sort();
        assert_eq!(got, want, "{sql}");
        let metric = |name| {
            find_group_topk(&plan)
                .and_then(|exec| exec.metrics())
                .and_then(|m| m.sum_by_name(name))
                .map_or(0, |v| v.as_usize())
        };
        no_fallback(&plan, &sql);
        let gathered = metric("rows_gathered_on_device");
        assert_eq!(
            gathered > 0,
            on_device,
            "{sql}: {gathered} rows gathered on the device"
        );
        if on_device {
            assert_eq!(gathered, metric("rows_kept"), "{sql}");
        }
    }
    // The output's batches keep the pinned pieces they arrived in (two here), up to the
    // limit (then copies), and give them back when dropped.
    let sql = format!(
        "SELECT * FROM (SELECT id, g, d, b, dt, f, ROW_NUMBER() OVER (PARTITION BY g ORDER BY \
         d DESC, id) AS rn FROM typed {filter}) WHERE rn <= 4000"
    );
    let mut want = exact_rows(&run(&plain, &sql).await.unwrap());
    want.sort();
    for lend in [1 << 30, 100 << 20, 0] {
        let lending = crate::common::session_with(
            4,
            8192,
            config(Backend::Cuda).with_pinned_output_bytes(lend),
        );
        register(&lending, "typed", typed.clone());
        let plan = physical_plan(&lending, &sql).await.unwrap();
        let batches = collect(Arc::clone(&plan), lending.task_ctx())
            .await
            .unwrap();
        no_fallback(&plan, &sql);
        let mut got = exact_rows(&batches);
        got.sort();
        assert_eq!(got, want, "{sql} lending {lend} bytes");
        let metrics = find_group_topk(&plan)
            .and_then(|exec| exec.metrics())
            .expect("the operator's metrics");
        let held = || (metrics.sum_by_name("pinned_bytes_held")).map_or(0, |v| v.as_usize());
        assert_eq!(
            held() > 0,
            lend > 0,
            "{sql} lending {lend}: {} held",
            held()
        );
        drop((batches, plan));
        assert_eq!(held(), 0, "{sql} lending {lend} bytes: pinned bytes kept");
    }
    // Groups of strings that are not all short stay on the CPU path, and say why.
    let long = crate::common::session_with(2, 1000, config(Backend::Cuda));
    register_as(&long, "t", &table(2000, 2, 40), Storage::Memory, &dir).await;
    let sql = "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY s || '-a-long-suffix' ORDER BY id) AS rn FROM t) WHERE rn <= 2";
    let text = plan_text(&physical_plan(&long, sql).await.unwrap());
    assert!(
        text.contains("GpuGroupTopKExec") && !text.contains("backend=cuda"),
        "{sql}:\n{text}"
    );
    // A failing launch: the CPU path answers, and the operator counts the fallback.
    let data = table(5000, 2, 30);
    let faulty = crate::common::session_with(
        2,
        500,
        config(Backend::Cuda).with_inject_fault(datafusion_gpu_topk::FaultPoint::Device(
            datafusion_gpu_topk::DeviceOp::Launch,
            1,
        )),
    );
    let plain = plain_session(2, Storage::Memory);
    register_as(&faulty, "t", &data, Storage::Memory, &dir).await;
    register_as(&plain, "t", &data, Storage::Memory, &dir).await;
    let sql = DEVICE_QUERIES[0];
    let plan = physical_plan(&faulty, sql).await.unwrap();
    let mut got = exact_rows(&collect(Arc::clone(&plan), faulty.task_ctx()).await.unwrap());
    let mut want = exact_rows(&run(&plain, sql).await.unwrap());
    got.sort();
    want.sort();
    assert_eq!(got, want, "{sql} with a failing launch");
    let fallbacks = find_group_topk(&plan)
        .and_then(|exec| exec.metrics())
        .and_then(|m| m.sum_by_name("gpu_fallbacks"))
        .map(|v| v.as_usize());
    assert_eq!(fallbacks, Some(1), "{}", plan_text(&plan));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `n` rows of every fixed width in 8192-row batches over 4 partitions: a unique `id`, a
/// group `g` (`Int16`, 700 values, some NULL), a `Decimal128(38, 2)` `d`, an `Int8` `b` and a
/// `Float32` `f` (some NULL), and a `Date32` `dt`.
fn typed_table(n: i64) -> Vec<Vec<RecordBatch>> {
    use datafusion::arrow::array::{
        Date32Array, Decimal128Array, Float32Array, Int8Array, Int16Array,
    };
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Int16, true),
        Field::new("d", DataType::Decimal128(38, 2), true),
        Field::new("b", DataType::Int8, true),
        Field::new("dt", DataType::Date32, false),
        Field::new("f", DataType::Float32, true),
    ]));
    let batches: Vec<RecordBatch> = (0..n)
        .step_by(8192)
        .map(|at| {
            let ids: Vec<i64> = (at..(at + 8192).min(n)).collect();
            let hash = |i: i64, m: i64| (i.wrapping_mul(2_654_435_761) >> 7).rem_euclid(m);
            let g = ids
                .iter()
                .map(|&i| (hash(i, 23) != 0).then(|| hash(i, 700) as i16));
            let d = ids.iter().map(|&i| {
                (hash(i, 11) != 0).then(|| i128::from(hash(i * 3, 5000)) * 10i128.pow(12) + 7)
            });
            let b = ids
                .iter()
                .map(|&i| (hash(i, 5) != 0).then(|| hash(i * 5, 200) as i8 - 100));
            let dt = ids.iter().map(|&i| hash(i * 7, 120) as i32);
            let f = ids
                .iter()
                .map(|&i| (hash(i, 13) != 0).then(|| hash(i * 11, 1000) as f32 / 1000.0));
            let columns: Vec<Arc<dyn datafusion::arrow::array::Array>> = vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(Int16Array::from_iter(g)),
                Arc::new(
                    Decimal128Array::from_iter(d)
                        .with_precision_and_scale(38, 2)
                        .unwrap(),
                ),
                Arc::new(Int8Array::from_iter(b)),
                Arc::new(Date32Array::from_iter_values(dt)),
                Arc::new(Float32Array::from_iter(f)),
            ];
            RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
        })
        .collect();
    batches.chunks(100).map(<[_]>::to_vec).collect()
}

fn find_group_topk(plan: &Arc<dyn ExecutionPlan>) -> Option<&Arc<dyn ExecutionPlan>> {
    if plan.downcast_ref::<GpuGroupTopKExec>().is_some() {
        return Some(plan);
    }
    plan.children().into_iter().find_map(find_group_topk)
}

/// With `enable_window_topn`, DataFusion plans the window over its own `PartitionedTopKExec`:
/// the operator takes that plan too, with the rows of DataFusion's window plan either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn datafusions_partitioned_top_k_plan_is_taken_too() {
    const TOPN: &str = "SET datafusion.optimizer.enable_window_topn = true";
    let dir = test_dir("groups-topn");
    let data = table(3000, 3, 40);
    for storage in [Storage::Memory, Storage::Parquet, Storage::Csv] {
        let ours = session(true, 3, 128);
        let topn = plain_session(3, storage);
        let plain = plain_session(3, storage);
        for ctx in [&ours, &topn, &plain] {
            register_as(ctx, "t", &data, storage, &dir).await;
        }
        run(&ours, TOPN).await.unwrap();
        run(&topn, TOPN).await.unwrap();
        let mut seen = 0;
        for sql in QUERIES {
            let datafusions = plan_text(&physical_plan(&topn, sql).await.unwrap());
            seen += usize::from(datafusions.contains("PartitionedTopKExec"));
            let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
            assert!(!text.contains("PartitionedTopKExec"), "{sql}:\n{text}");
            same_rows(&ours, &plain, sql, true).await;
            same_rows(&ours, &topn, sql, true).await;
        }
        assert!(
            seen >= 5,
            "{storage:?}: DataFusion planned PartitionedTopKExec {seen} times"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// EXPLAIN shows the number of groups estimated from a sample of an in-memory table (every
/// second row of 20,000 here): the 40 values and NULL, each row its own group, the groups
/// that pass a filter. Files are not sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_shows_the_groups_estimate() {
    let dir = test_dir("groups-estimate");
    let data = table(20_000, 3, 40);
    let window = |partition: &str, filter: &str| {
        format!(
            "SELECT id, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY {partition} ORDER BY v, id) AS rn FROM t {filter}) WHERE rn <= 2"
        )
    };
    let ours = session(true, 3, 1000);
    register_as(&ours, "t", &data, Storage::Memory, &dir).await;
    for (sql, groups) in [
        (window("g", ""), "groups≈41,"),
        (window("id", ""), "groups≈20000,"),
        (window("g", "WHERE g < 10"), "groups≈10,"),
        (window("g, s", "WHERE g < 10"), "groups≈50,"),
    ] {
        let text = plan_text(&physical_plan(&ours, &sql).await.unwrap());
        assert!(text.contains(groups), "{sql}: {groups}\n{text}");
    }
    let files = session(true, 3, 1000);
    register_as(&files, "t", &data, Storage::Parquet, &dir).await;
    let text = plan_text(&physical_plan(&files, &window("g", "")).await.unwrap());
    assert!(
        text.contains("GpuGroupTopKExec") && !text.contains("groups≈"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The operator takes the place of the projection above the window too, and outputs only
/// the columns the operators above read, under DataFusion's window plan and its
/// `PartitionedTopKExec` plan alike; and of the filter above, where every row it keeps
/// passes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_operator_outputs_only_the_columns_read_above() {
    let dir = test_dir("groups-columns");
    let data = table(3000, 3, 40);
    let ours = session(true, 3, 128);
    let plain = plain_session(3, Storage::Memory);
    for ctx in [&ours, &plain] {
        register_as(ctx, "t", &data, Storage::Memory, &dir).await;
    }
    for topn in ["false", "true"] {
        let set = format!("SET datafusion.optimizer.enable_window_topn = {topn}");
        run(&ours, &set).await.unwrap();
        // The filter goes too where every kept row passes it.
        for (sql, output, filtered) in [
            (
                "SELECT count(*), sum(id) FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= 3",
                "output=[id],",
                false,
            ),
            (
                "SELECT id, v, r FROM (SELECT *, RANK() OVER (PARTITION BY g ORDER BY v) AS r FROM t) WHERE r <= 2",
                "output=[id, v, rank],",
                false,
            ),
            (
                "SELECT count(*) FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v) AS rn FROM t) WHERE rn <= 2",
                "output=[],",
                false,
            ),
            (
                "SELECT id, r FROM (SELECT *, DENSE_RANK() OVER (PARTITION BY g ORDER BY v) AS r FROM t) WHERE r = 1 AND 4 > r",
                "output=[id, dense_rank],",
                false,
            ),
            (
                "SELECT sum(id) FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn = 2",
                "output=[id, row_number],",
                true,
            ),
            (
                "SELECT id, v FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v DESC, id) AS rn FROM t) WHERE rn <= 2 AND v > 10",
                "output=[id, v, row_number],",
                true,
            ),
        ] {
            let text = plan_text(&physical_plan(&ours, sql).await.unwrap());
            let line = (text.lines())
                .position(|l| l.contains("GpuGroupTopKExec"))
                .unwrap_or_else(|| panic!("{sql}:\n{text}"));
            assert!(
                text.lines().nth(line).unwrap().contains(output),
                "{sql}:\n{text}"
            );
            let above = text.lines().nth(line - 1).unwrap();
            assert_eq!(above.contains("FilterExec"), filtered, "{sql}:\n{text}");
            same_rows(&ours, &plain, sql, true).await;
        }
        // The window's hash partitioning stays claimed only where an operator above needs
        // it: here the aggregate by the group key, not the query's output.
        for (sql, hashed) in [
            (
                "SELECT id, g, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v, id) AS rn FROM t) WHERE rn <= 2",
                false,
            ),
            (
                "SELECT g, count(*), max(rn) FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v, id) AS rn FROM t) WHERE rn <= 2 GROUP BY g",
                true,
            ),
        ] {
            let plan = physical_plan(&ours, sql).await.unwrap();
            let exec = find_group_topk(&plan).unwrap_or_else(|| panic!("{sql}"));
            let partitioning = exec.properties().output_partitioning();
            assert_eq!(
                matches!(
                    partitioning,
                    datafusion::physical_plan::Partitioning::Hash(..)
                ),
                hashed,
                "{sql}: {partitioning:?}\n{}",
                plan_text(&plan)
            );
            same_rows(&ours, &plain, sql, true).await;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// On the GPU (skips without one), under the default settings: a per-group top-k over an
/// in-memory table that the device wins once warm runs there by the second run (the first ran
/// there, winning even cold, or ran on the CPU path and loaded the columns after it), with
/// DataFusion's rows each time; a tiny table's query stays on the CPU path, nothing loaded.
/// EXPLAIN shows the times weighed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_auto_a_cold_per_group_query_warms_the_device_for_the_next() {
    use datafusion_gpu_topk::internal::device::gpu;
    if gpu().is_none() {
        eprintln!("SKIP under_auto_a_cold_per_group_query_warms_the_device_for_the_next: no GPU");
        return;
    }
    let dir = test_dir("groups-auto");
    let (rows, partitions) = (1 << 21, 4);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("g", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let mut rng = Rng::new(5);
    let mut batch = |first: usize, n: usize| {
        let ids = Int64Array::from_iter_values((first..first + n).map(|i| i as i64));
        let g = Int64Array::from_iter_values((0..n).map(|_| rng.below(1 << 16) as i64));
        let v = Int64Array::from_iter_values((0..n).map(|_| rng.below(1 << 20) as i64));
        let columns: Vec<Arc<dyn datafusion::arrow::array::Array>> =
            vec![Arc::new(ids), Arc::new(g), Arc::new(v)];
        RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
    };
    let per = rows / partitions;
    let big: Vec<Vec<RecordBatch>> = (0..partitions)
        .map(|p| {
            (0..per / 8192)
                .map(|b| batch(p * per + b * 8192, 8192))
                .collect()
        })
        .collect();
    let tiny = vec![vec![batch(rows, 50)]];
    let ours = crate::common::session_with(partitions, 8192, crate::sessions::base_config());
    let plain = plain_session(partitions, Storage::Memory);
    for ctx in [&ours, &plain] {
        register_as(ctx, "big", &big, Storage::Memory, &dir).await;
        register_as(ctx, "tiny", &tiny, Storage::Memory, &dir).await;
    }
    let sql = |table: &str| {
        format!(
            "SELECT id, g, v, rn FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY g ORDER BY v \
             DESC, id) AS rn FROM {table}) WHERE rn <= 10"
        )
    };
    // Loads other tests started end first: one load runs at a time.
    let settled = || async {
        let started = std::time::Instant::now();
        while datafusion_gpu_topk::internal::exec::warming_up() {
            assert!(
                started.elapsed().as_secs() < 60,
                "a background load never ended"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    let explained = |text: &str| {
        let line = text
            .lines()
            .find(|l| l.contains("GpuGroupTopKExec"))
            .unwrap();
        line.to_string()
    };
    settled().await;
    let mut plans = Vec::new();
    // A run whose load another test's load kept out (`cache=warm-up` again) runs once more.
    for _ in 0..3 {
        let plan = physical_plan(&ours, &sql("big")).await.unwrap();
        let line = explained(&plan_text(&plan));
        let mut got = exact_rows(&collect(plan, ours.task_ctx()).await.unwrap());
        let mut want = exact_rows(&run(&plain, &sql("big")).await.unwrap());
        got.sort();
        want.sort();
        assert_eq!(got, want, "{line}");
        settled().await;
        let warm_up = line.contains("backend=cpu") && line.contains("cache=warm-up");
        assert!(line.contains("backend=cuda") || warm_up, "{line}");
        for weighed in ["predicted_cpu=", "predicted_gpu=", "predicted_gpu_warm="] {
            assert!(line.contains(weighed), "{line}");
        }
        plans.push(line);
        if plans.len() >= 2 && !warm_up {
            break;
        }
    }
    let last = plans.last().unwrap();
    assert!(last.contains("backend=cuda"), "{plans:#?}");
    // The tiny table: the device's launches outlast the heaps.
    let plan = physical_plan(&ours, &sql("tiny")).await.unwrap();
    let line = explained(&plan_text(&plan));
    assert!(line.contains("backend=cpu, predicted_cpu="), "{line}");
    assert!(!line.contains("cache=warm-up"), "{line}");
    let mut got = exact_rows(&collect(plan, ours.task_ctx()).await.unwrap());
    let mut want = exact_rows(&run(&plain, &sql("tiny")).await.unwrap());
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(&dir);
}
