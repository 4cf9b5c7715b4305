//! The device path of `GpuAggregateTopKExec` (skips without a GPU): with `backend = cuda`
//! forced, every shape of the device's slice against plain DataFusion over an in-memory table
//! of several partitions and a `GpuTable` (counts, each aggregate, two keys, NULL keys and
//! values, k beyond the groups, OFFSET, ties at the k-th), with EXPLAIN ANALYZE saying
//! `backend=cuda`, no fallback and the device's time in each phase; the columns stay in the
//! column cache for the next query; under `auto` the plan follows what the cost model
//! weighed; a device failure (injected) runs DataFusion's plan, with its answer; `WHERE`
//! filters run in the device's pass (numbers, strings, NULLs, none passing) and `HAVING`
//! before its selection, the predicate's columns resident for the next query, and a row
//! DataFusion fails on gives DataFusion's error.

use std::collections::HashSet;

use datafusion::arrow::array::{RecordBatch, StringArray, TimestampMicrosecondArray};
use datafusion::arrow::datatypes::{Field, Schema, TimeUnit};
use datafusion::physical_plan::{ExecutionPlan, collect};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::{Backend, GpuAggregateTopKExec};

use super::*;
use crate::common::{
    Rng, Storage, exact_rows, partitioned, physical_plan, plan_text, register_as, run, run_oracle,
    session, session_with,
};

/// Partitions of `t` (`rows` in all): keys `uid` (300 values), `u` (5000 values), `k2`
/// (7 values) and `ts` (20 hours), each with NULLs; values `v` (small integers, some NULL),
/// `w` (mostly NULL, so that some groups of `u` have no value) and `f` (non-negative
/// quarters: every sum exact in any order, no negative zero); `lang`, a string for filters
/// (empty or NULL at times).
fn tweets(seed: u64, rows: usize) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("uid", DataType::Int64, true),
        Field::new("u", DataType::Int64, true),
        Field::new("k2", DataType::Int64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, None), true),
        Field::new("v", DataType::Int64, true),
        Field::new("w", DataType::Int64, true),
        Field::new("f", DataType::Float64, true),
        Field::new("lang", DataType::Utf8, true),
    ]));
    let part = rows / 6;
    let sizes: [&[usize]; 3] = [&[part, part], &[3 * part], &[part, rows - 5 * part]];
    partitioned(seed, &sizes, |rng: &mut Rng, _, n| {
        let mut draw = |null: f64, below: u64, base: i64| -> Vec<Option<i64>> {
            (0..n)
                .map(|_| (!rng.chance(null)).then(|| base + rng.below(below) as i64))
                .collect()
        };
        let uid = draw(0.02, 300, -150);
        let u = draw(0.01, 5000, 0);
        let k2 = draw(0.05, 7, -3);
        let ts: Vec<Option<i64>> = (draw(0.05, 20, 0).into_iter())
            .map(|h| h.map(|h| 1_600_000_000_000_000 + h * 3_600_000_000))
            .collect();
        let v = draw(0.05, 41, -20);
        let w = draw(0.7, 1000, -500);
        let f: Vec<Option<f64>> = (draw(0.05, 200, 0).into_iter())
            .map(|x| x.map(|x| x as f64 / 4.0))
            .collect();
        let lang: Vec<Option<&str>> = (draw(0.05, 5, 0).into_iter())
            .map(|x| x.map(|x| ["en", "es", "", "ja", "eo"][x as usize]))
            .collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(uid)),
            Arc::new(Int64Array::from(u)),
            Arc::new(Int64Array::from(k2)),
            Arc::new(TimestampMicrosecondArray::from(ts)),
            Arc::new(Int64Array::from(v)),
            Arc::new(Int64Array::from(w)),
            Arc::new(Float64Array::from(f)),
            Arc::new(StringArray::from(lang)),
        ];
        RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
    })
}

/// Shapes the device takes, each ordered by keys that tell every output row apart.
const TAKEN: &[&str] = &[
    "SELECT uid, COUNT(*) AS n FROM t GROUP BY uid ORDER BY n DESC, uid LIMIT 50",
    "SELECT COUNT(*) AS n, uid FROM t GROUP BY uid ORDER BY n, uid LIMIT 7",
    "SELECT uid, COUNT(v) AS c FROM t GROUP BY uid ORDER BY c, uid LIMIT 20",
    "SELECT u, SUM(w) AS s FROM t GROUP BY u ORDER BY s DESC NULLS FIRST, u LIMIT 20",
    "SELECT u, SUM(w) AS s FROM t GROUP BY u ORDER BY s NULLS LAST, u LIMIT 20",
    "SELECT uid, SUM(f) AS s FROM t GROUP BY uid ORDER BY s DESC, uid LIMIT 15",
    "SELECT u, MIN(w) AS lo FROM t GROUP BY u ORDER BY lo NULLS FIRST, u LIMIT 12",
    "SELECT uid, MAX(v) AS hi, MIN(v) AS lo FROM t GROUP BY uid ORDER BY hi, uid LIMIT 12",
    "SELECT uid, MIN(f) AS lo, MAX(f) AS hi FROM t GROUP BY uid ORDER BY lo DESC, uid LIMIT 12",
    "SELECT uid, MAX(f) AS hi FROM t GROUP BY uid ORDER BY hi, uid LIMIT 12",
    "SELECT uid, AVG(v) AS a FROM t GROUP BY uid ORDER BY a DESC, uid LIMIT 25",
    "SELECT u, AVG(w) AS a, COUNT(w) AS c FROM t GROUP BY u ORDER BY a NULLS FIRST, u LIMIT 25",
    "SELECT ts, COUNT(*) AS n, SUM(v) AS s FROM t GROUP BY ts ORDER BY s DESC, ts LIMIT 6",
    "SELECT k2, ts, COUNT(*) AS n, SUM(v) AS s FROM t GROUP BY k2, ts ORDER BY n DESC, k2, ts LIMIT 30",
    "SELECT uid, k2, AVG(v) AS a, MAX(f) AS m FROM t GROUP BY uid, k2 ORDER BY a, uid, k2 LIMIT 40 OFFSET 7",
    // k beyond the groups (NULL a group of its own).
    "SELECT k2, COUNT(*) AS n FROM t GROUP BY k2 ORDER BY n, k2 LIMIT 1000",
    "SELECT k2, SUM(v) AS s FROM t GROUP BY k2 ORDER BY s DESC, k2 LIMIT 5 OFFSET 3",
    "SELECT uid, COUNT(*) AS n FROM t GROUP BY uid ORDER BY n DESC, uid LIMIT 10 OFFSET 400",
    // String keys (grouped by their codes) and a counted string.
    "SELECT lang, COUNT(*) AS n, SUM(v) AS s FROM t GROUP BY lang ORDER BY n DESC, lang LIMIT 10",
    "SELECT lang, uid, COUNT(*) AS n FROM t WHERE lang <> '' GROUP BY lang, uid ORDER BY n DESC, lang, uid LIMIT 25",
    "SELECT lang, MAX(f) AS hi FROM t GROUP BY lang ORDER BY lang DESC NULLS FIRST LIMIT 4",
    "SELECT uid, COUNT(lang) AS c FROM t GROUP BY uid ORDER BY c DESC, uid LIMIT 15",
];

/// Filtered shapes the device takes, its pass evaluating the filter, and `HAVING`.
const FILTERED: &[&str] = &[
    "SELECT uid, COUNT(*) AS n FROM t WHERE v > 0 GROUP BY uid ORDER BY n DESC, uid LIMIT 20",
    "SELECT u, SUM(w) AS s FROM t WHERE f < 20.0 AND k2 IS NOT NULL GROUP BY u ORDER BY s DESC NULLS FIRST, u LIMIT 20",
    "SELECT k2, ts, AVG(v) AS a FROM t WHERE uid BETWEEN -50 AND 50 GROUP BY k2, ts ORDER BY a, k2, ts LIMIT 25",
    "SELECT uid, MAX(f) AS hi, MIN(v) AS lo FROM t WHERE v % 3 = 1 OR w IS NULL GROUP BY uid ORDER BY hi, uid LIMIT 12",
    "SELECT uid, COUNT(*) AS n FROM t WHERE lang <> '' AND lang LIKE 'e%' GROUP BY uid ORDER BY n DESC, uid LIMIT 15",
    "SELECT k2, SUM(f) AS s FROM t WHERE lang IN ('ja', '') OR lang IS NULL GROUP BY k2 ORDER BY s DESC, k2 LIMIT 10",
    // The filter reads a key; CAST and float arithmetic.
    "SELECT uid, COUNT(v) AS c FROM t WHERE uid > v AND CAST(v AS DOUBLE) * 0.5 < f GROUP BY uid ORDER BY c, uid LIMIT 30",
    // No row passes: no group.
    "SELECT uid, COUNT(*) AS n FROM t WHERE v > 1000 GROUP BY uid ORDER BY n, uid LIMIT 5",
    // HAVING drops groups before the selection: counts, integer sums, extremes, keys.
    "SELECT uid, COUNT(*) AS n FROM t GROUP BY uid HAVING COUNT(*) > 100 ORDER BY n, uid LIMIT 20",
    "SELECT u, SUM(w) AS s FROM t GROUP BY u HAVING SUM(w) IS NOT NULL AND MIN(v) < -10 ORDER BY s DESC, u LIMIT 25",
    "SELECT uid, MAX(f) AS hi FROM t WHERE lang <> 'ja' GROUP BY uid HAVING MAX(f) < 49.5 OR uid IS NULL ORDER BY hi DESC, uid LIMIT 15",
    "SELECT k2, ts, AVG(v) AS a FROM t GROUP BY k2, ts HAVING COUNT(v) BETWEEN 50 AND 80 OR k2 = 2 ORDER BY a, k2, ts LIMIT 30 OFFSET 2",
    // No group passes.
    "SELECT uid, COUNT(*) AS n FROM t GROUP BY uid HAVING COUNT(*) > 1000000 ORDER BY n, uid LIMIT 5",
];

/// A session with the operator on, `backend` forced, partitions of 3.
fn device_session(backend: Backend) -> SessionContext {
    let mut config = crate::sessions::base_config().with_backend(backend);
    config.aggregate_topk = true;
    session_with(3, 1024, config)
}

/// The operator of `plan`.
fn operator(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuAggregateTopKExec> {
    if let Some(exec) = plan.downcast_ref::<GpuAggregateTopKExec>() {
        return Some(exec);
    }
    plan.children().into_iter().find_map(operator)
}

/// The operator's metric `name` after its run.
fn metric(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    let exec = operator(plan).expect("the operator");
    (exec.metrics().and_then(|m| m.sum_by_name(name))).map_or(0, |v| v.as_usize())
}

/// `sql` on the device (EXPLAIN says so, no fallback) with DataFusion's rows in order.
async fn device_answers(ours: &SessionContext, plain: &SessionContext, sql: &str) {
    let plan = physical_plan(ours, sql).await.unwrap();
    let text = plan_text(&plan);
    assert!(text.contains("backend=cuda"), "{sql}:\n{text}");
    let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
    assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{sql}");
    assert_eq!(got, run_oracle(plain, sql).await.unwrap(), "{sql}");
}

/// Every shape of the slice on the device, over memory and a `GpuTable`, with DataFusion's
/// answer; EXPLAIN ANALYZE shows the backend and the groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_device_aggregates_as_datafusion() {
    if gpu_or_skip("the_device_aggregates_as_datafusion").is_none() {
        return;
    }
    let dir = crate::common::test_dir("aggregate-device");
    let data = tweets(71, 30_000);
    for storage in [Storage::Memory, Storage::GpuTable] {
        let ours = device_session(Backend::Cuda);
        let plain = session(false, 3, 1024);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        for sql in TAKEN {
            device_answers(&ours, &plain, sql).await;
        }
        let analyzed = run(&ours, &format!("EXPLAIN ANALYZE {}", TAKEN[0])).await;
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&analyzed.unwrap())
            .unwrap()
            .to_string();
        assert!(text.contains("backend=cuda"), "{text}");
        assert!(text.contains("gpu_fallbacks=0"), "{text}");
        assert!(text.contains("groups=301"), "{text}");
        assert!(text.contains("groups≈301"), "{text}");
        assert!(text.contains("algorithm=hash, selection="), "{text}");
        assert!(text.contains("device_aggregate_time="), "{text}");
        assert!(text.contains("device_select_time="), "{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ordered by one aggregate alone, groups tie at the k-th: the order key's values are
/// DataFusion's, and every group returned is one of DataFusion's whole GROUP BY, with its
/// aggregates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ties_select_datafusions_values_and_true_groups() {
    if gpu_or_skip("ties_select_datafusions_values_and_true_groups").is_none() {
        return;
    }
    let data = tweets(73, 20_000);
    let ours = device_session(Backend::Cuda);
    let plain = session(false, 3, 1024);
    crate::common::register(&ours, "t", data.clone());
    crate::common::register(&plain, "t", data);
    let all = "SELECT uid, COUNT(*) AS n, SUM(v) AS s FROM t GROUP BY uid";
    let groups: HashSet<String> = exact_rows(&run(&plain, all).await.unwrap())
        .into_iter()
        .collect();
    for (order, values) in [
        (
            "n DESC",
            "SELECT COUNT(*) AS n FROM t GROUP BY uid ORDER BY n DESC LIMIT 30",
        ),
        (
            "s",
            "SELECT SUM(v) AS s FROM t GROUP BY uid ORDER BY s LIMIT 30",
        ),
    ] {
        let sql = format!("{all} ORDER BY {order} LIMIT 30");
        let plan = physical_plan(&ours, &sql).await.unwrap();
        assert!(plan_text(&plan).contains("backend=cuda"), "{sql}");
        let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
        assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{sql}");
        let column = if order.starts_with('n') { 1 } else { 2 };
        let picked: Vec<&str> = (got.iter().skip(1))
            .map(|row| row.split(" | ").nth(column).unwrap())
            .collect();
        let want = run_oracle(&plain, values).await.unwrap();
        let want: Vec<&str> = want.iter().skip(1).map(String::as_str).collect();
        assert_eq!(picked, want, "{sql}");
        for row in &got {
            assert!(
                groups.contains(row),
                "{sql}: {row} is no group of DataFusion's"
            );
        }
    }
}

/// A repeated query reads its columns from the column cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn columns_stay_resident_for_the_next_query() {
    if gpu_or_skip("columns_stay_resident_for_the_next_query").is_none() {
        return;
    }
    let data = tweets(79, 1 << 17);
    let plain = session(false, 3, 1024);
    crate::common::register(&plain, "t", data.clone());
    let sql = TAKEN[13];
    let ours = device_session(Backend::Cuda);
    crate::common::register(&ours, "t", data);
    let mut misses = Vec::new();
    for _ in 0..3 {
        let plan = physical_plan(&ours, sql).await.unwrap();
        assert!(plan_text(&plan).contains("backend=cuda"));
        let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
        assert_eq!(got, run_oracle(&plain, sql).await.unwrap());
        assert_eq!(metric(&plan, "gpu_fallbacks"), 0);
        misses.push((metric(&plan, "cache_misses"), metric(&plan, "cache_hits")));
    }
    // The last run finds every column (two keys, one value) resident.
    assert_eq!(misses.last(), Some(&(0, 3)), "{misses:?}");
}

/// Under `auto` each plan follows what the cost model weighed: the device where its run is
/// predicted below DataFusion's aggregation; else DataFusion's plan, loading the columns after
/// it where a warm device would win. A table of 2^21 rows the device wins once warm runs there
/// by the second run; a tiny table's query stays on the CPU path, nothing loaded. DataFusion's
/// answer every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_auto_a_cold_aggregate_warms_the_device_for_the_next() {
    if gpu_or_skip("under_auto_a_cold_aggregate_warms_the_device_for_the_next").is_none() {
        return;
    }
    let sql = TAKEN[13];
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
    for rows in [1 << 21, 1 << 10] {
        let ours = device_session(Backend::Auto);
        let plain = session(false, 3, 1024);
        crate::common::register(&ours, "t", tweets(89, rows));
        crate::common::register(&plain, "t", tweets(89, rows));
        settled().await;
        let mut lines = Vec::new();
        // A run whose load another test's load kept out (`cache=warm-up` again) runs once more.
        for _ in 0..3 {
            let plan = physical_plan(&ours, sql).await.unwrap();
            let text = plan_text(&plan);
            let line = (text.lines())
                .find(|l| l.contains("GpuAggregateTopKExec"))
                .unwrap()
                .to_string();
            let (cpu, gpu) = (
                predicted(&line, "predicted_cpu="),
                predicted(&line, "predicted_gpu="),
            );
            let warm = predicted(&line, "predicted_gpu_warm=");
            // EXPLAIN rounds the times to three digits: nearer ones may go either way.
            let apart = |a: f64, b: f64| (a - b).abs() > 0.01 * a.max(b);
            let warm_up = line.contains("cache=warm-up");
            if apart(gpu, cpu) {
                assert_eq!(line.contains("backend=cuda"), gpu < cpu, "{rows}: {line}");
                if apart(warm, cpu) {
                    assert_eq!(warm_up, gpu > cpu && warm < cpu, "{rows}: {line}");
                }
            }
            let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
            assert_eq!(got, run_oracle(&plain, sql).await.unwrap(), "{rows}");
            assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{rows}");
            settled().await;
            lines.push(line);
            if lines.len() >= 2 && !warm_up {
                break;
            }
        }
        let last = lines.last().unwrap();
        match rows {
            1024 => assert!(
                last.contains("backend=cpu") && lines.len() == 2,
                "{lines:#?}"
            ),
            _ => assert!(last.contains("backend=cuda"), "{lines:#?}"),
        }
    }
}

/// The seconds EXPLAIN shows after `name` (`1.5µs`, `2.25ms`, `1.20s`).
fn predicted(text: &str, name: &str) -> f64 {
    let at = text.find(name).unwrap_or_else(|| panic!("{name}:\n{text}")) + name.len();
    let value: String = (text[at..].chars())
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let unit = &text[at + value.len()..];
    let scale = match () {
        _ if unit.starts_with("µs") => 1e-6,
        _ if unit.starts_with("ms") => 1e-3,
        _ => 1.0,
    };
    value.parse::<f64>().unwrap() * scale
}

/// A device operation that fails (an upload, a launch, a read-back, injected) runs
/// DataFusion's plan instead, counted in `gpu_fallbacks`, with DataFusion's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_device_failure_runs_datafusions_plan() {
    use datafusion_gpu_topk::{DeviceOp, FaultPoint};
    if gpu_or_skip("a_device_failure_runs_datafusions_plan").is_none() {
        return;
    }
    let data = tweets(83, 20_000);
    let plain = session(false, 3, 1024);
    crate::common::register(&plain, "t", data.clone());
    for fault in [
        FaultPoint::Device(DeviceOp::Launch, 1),
        FaultPoint::Device(DeviceOp::Download, 1),
        FaultPoint::Device(DeviceOp::Alloc, 2),
    ] {
        let mut config = crate::sessions::base_config().with_backend(Backend::Cuda);
        config.aggregate_topk = true;
        config.inject_fault = fault;
        let ours = session_with(3, 1024, config);
        crate::common::register(&ours, "t", data.clone());
        let sql = TAKEN[14];
        let plan = physical_plan(&ours, sql).await.unwrap();
        assert!(plan_text(&plan).contains("backend=cuda"), "{fault}");
        let got = exact_rows(&collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap());
        assert_eq!(metric(&plan, "gpu_fallbacks"), 1, "{fault}");
        assert_eq!(got, run_oracle(&plain, sql).await.unwrap(), "{fault}");
    }
}

/// Each filtered shape on the device (EXPLAIN says `backend=cuda`, no fallback), over memory
/// and a `GpuTable`, with DataFusion's answer; a repeated filtered query finds the predicate's
/// columns resident; a filter that fails on a row (an integer division by zero) gives
/// DataFusion's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filters_run_in_the_devices_pass() {
    if gpu_or_skip("filters_run_in_the_devices_pass").is_none() {
        return;
    }
    let dir = crate::common::test_dir("aggregate-device-filters");
    let data = tweets(89, 30_000);
    for storage in [Storage::Memory, Storage::GpuTable] {
        let ours = device_session(Backend::Cuda);
        let plain = session(false, 3, 1024);
        register_as(&ours, "t", &data, storage, &dir).await;
        register_as(&plain, "t", &data, storage, &dir).await;
        for sql in FILTERED {
            device_answers(&ours, &plain, sql).await;
        }
        // Every column of the string filter (the key and `lang`) is resident now.
        let plan = physical_plan(&ours, FILTERED[4]).await.unwrap();
        collect(Arc::clone(&plan), ours.task_ctx()).await.unwrap();
        assert_eq!(metric(&plan, "cache_misses"), 0, "{storage:?}");
        assert_eq!(metric(&plan, "cache_hits"), 2, "{storage:?}");
        // v = -20 divides by zero: the device sends the query to DataFusion, which fails.
        let sql = "SELECT uid, COUNT(*) AS n FROM t WHERE 100 / (v + 20) > 3 GROUP BY uid \
                   ORDER BY n DESC, uid LIMIT 5";
        let plan = physical_plan(&ours, sql).await.unwrap();
        assert!(plan_text(&plan).contains("backend=cuda"), "{sql}");
        let ours = collect(plan, ours.task_ctx())
            .await
            .unwrap_err()
            .to_string();
        let plain = run(&plain, sql).await.unwrap_err().to_string();
        assert!(ours.contains("Divide by zero"), "{ours}");
        assert_eq!(ours, plain);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
