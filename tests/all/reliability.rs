//! Reliability: the operator never gives an answer DataFusion would not, never loses a query
//! to a device fault, and never holds memory past a query's end.
//!
//! - Device faults: a failure injected at every device allocation, generated-program compile,
//!   kernel launch, upload and read-back of a query (`gpu_topk.inject_fault = 'launch:N'`, one
//!   at a time, every N the query reaches): DataFusion's answer, the fallback counted and
//!   explained, and the query's device and pinned bytes back to zero (GPU only).
//! - Device memory limit: a query that does not fit falls back, with the reason (GPU only).
//! - Host memory: under a `RuntimeEnv` memory limit a large-k query completes with the right
//!   answer or fails with DataFusion's resources-exhausted error.
//! - Cancellation: queries dropped at random points release everything they held, and the
//!   session keeps answering.
//! - Concurrency: 64 queries of mixed shapes at once under a small device memory limit.

use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::collect;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::internal::config::{DeviceOp, FaultPoint};
use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
use datafusion_gpu_topk::{Backend, SessionStateBuilderExt};
use futures::StreamExt;

use crate::common::{
    self, Report, Rng, Storage, count_gpu_topk, exact_rows, partitioned, physical_plan,
    plain_session, register, register_as, report, run, run_oracle, session_with, test_backend,
    test_dir,
};
use crate::differential::table;

/// Whether a GPU is present; says why the test is skipped when not.
fn gpu_or_skip(test: &str) -> bool {
    match gpu_status() {
        GpuStatus::Available(_) => true,
        GpuStatus::Unavailable(why) => {
            eprintln!("SKIP: {test}: no GPU ({why})");
            false
        }
    }
}

/// Runs `sql`, with what its operators report; the rows as `exact_rows`.
async fn run_reporting(ctx: &SessionContext, sql: &str) -> (Result<Vec<String>>, Report) {
    let (result, report) = common::run_reporting(ctx, sql).await;
    (result.map(|b| exact_rows(&b)), report)
}

/// Queries over `differential::table`, each with its oracle (the full sort with `rid` last).
const FAULT_QUERIES: &[(&str, &str)] = &[
    (
        "SELECT rid, f64 FROM t WHERE i16 > -20000 ORDER BY f64 * 2.0 DESC LIMIT 50",
        "SELECT rid, f64 FROM t WHERE i16 > -20000 ORDER BY f64 * 2.0 DESC, rid LIMIT 50",
    ),
    (
        "SELECT rid, i32 FROM t ORDER BY i32, u8 DESC LIMIT 300",
        "SELECT rid, i32 FROM t ORDER BY i32, u8 DESC, rid LIMIT 300",
    ),
];

/// Every device operation of these queries fails in turn, for each algorithm and with and
/// without generated programs: the answer is DataFusion's, the fallback is counted and says
/// which operation failed, and the query holds no device or pinned memory at its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fault_at_any_device_operation_gives_datafusions_answer_and_frees_memory() {
    if !gpu_or_skip("a_fault_at_any_device_operation_gives_datafusions_answer_and_frees_memory") {
        return;
    }
    let data = table(71, &[&[700, 300], &[450], &[1, 900], &[]]);
    let plain = plain_session(4, Storage::Memory);
    register(&plain, "t", data.clone());
    // Points per operation kind over the whole matrix.
    let mut fired = [0usize; 5];
    const MAX_POINTS: usize = 400;
    for (sql, oracle) in FAULT_QUERIES {
        let want = run_oracle(&plain, oracle).await.map_err(|e| e.to_string());
        for algorithm in ["bitonic", "radix", "delegate", "sample"] {
            for fuse in [true, false] {
                for op in DeviceOp::ALL {
                    for n in 1..=MAX_POINTS {
                        let config = crate::sessions::base_config()
                            .with_backend(Backend::Cuda)
                            .with_algorithm(algorithm.parse().unwrap())
                            .with_fuse_expressions(fuse)
                            .with_inject_fault(FaultPoint::Device(op, n));
                        let ctx = session_with(4, 100, config);
                        register(&ctx, "t", data.clone());
                        let label = format!("{sql} [{algorithm}, fused {fuse}, {op}:{n}]");
                        let (got, report) = run_reporting(&ctx, sql).await;
                        assert_eq!(got.map_err(|e| e.to_string()), want, "{label}: {report:?}");
                        assert_eq!(
                            (report.device_bytes_held, report.pinned_bytes_held),
                            (0, 0),
                            "{label}: memory held after the query"
                        );
                        if report.fallbacks == 0 {
                            break; // the query performs fewer than n such operations
                        }
                        assert_eq!(report.fallbacks, report.operators, "{label}");
                        let expected = format!("fault injected at {op} #{n}");
                        assert!(
                            report.reasons.iter().all(|r| r.contains(&expected)),
                            "{label}: reasons {:?}",
                            report.reasons
                        );
                        fired[DeviceOp::ALL.iter().position(|&o| o == op).unwrap()] += 1;
                    }
                }
            }
        }
    }
    let table: Vec<String> = DeviceOp::ALL
        .iter()
        .zip(fired)
        .map(|(op, n)| format!("{op}={n}"))
        .collect();
    eprintln!(
        "device fault matrix: points that fired: {}",
        table.join(" ")
    );
    for (op, n) in DeviceOp::ALL.iter().zip(fired) {
        assert!(n > 0, "no {op} fault ever fired");
    }
}

/// A query that needs more device memory than `gpu_topk.device_memory_limit` runs on the CPU
/// path and says why; one within the limit stays on the GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_over_the_device_memory_limit_falls_back_and_says_why() {
    if !gpu_or_skip("a_query_over_the_device_memory_limit_falls_back_and_says_why") {
        return;
    }
    let data = table(72, &[&[800, 200], &[600]]);
    let plain = plain_session(2, Storage::Memory);
    register(&plain, "t", data.clone());
    for (sql, oracle) in FAULT_QUERIES {
        let want = run_oracle(&plain, oracle).await.map_err(|e| e.to_string());
        for (limit, falls_back) in [(64 << 10, true), (1 << 30, false)] {
            let config = crate::sessions::base_config()
                .with_backend(Backend::Cuda)
                .with_device_memory_limit(limit);
            let ctx = session_with(2, 100, config);
            register(&ctx, "t", data.clone());
            let (got, report) = run_reporting(&ctx, sql).await;
            assert_eq!(got.map_err(|e| e.to_string()), want, "{sql} limit {limit}");
            assert_eq!(report.fallbacks > 0, falls_back, "{sql} limit {limit}");
            if falls_back {
                assert!(
                    report.reasons[0].contains("gpu_topk.device_memory_limit"),
                    "{:?}",
                    report.reasons
                );
            }
            assert_eq!((report.device_bytes_held, report.pinned_bytes_held), (0, 0));
        }
    }
}

/// 200,000 rows of ~100-byte strings over four partitions.
fn wide_table() -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("rid", DataType::Int64, false),
        Field::new("x", DataType::Int64, false),
        Field::new("payload", DataType::Utf8, false),
    ]));
    partitioned(
        73,
        &[&[20_000; 2], &[20_000; 3], &[40_000], &[20_000; 4]],
        |rng, first, n| {
            let rid = Int64Array::from_iter_values(first..first + n as i64);
            let x = Int64Array::from_iter_values((0..n).map(|_| rng.below(50_000) as i64));
            let payload = StringArray::from_iter_values(
                (0..n).map(|i| format!("{:0>100}", first + i as i64)),
            );
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(rid), Arc::new(x), Arc::new(payload)],
            )
            .unwrap()
        },
    )
}

/// Under a memory limit, a query that keeps many wide rows either completes within it, with
/// DataFusion's answer, or fails with DataFusion's resources-exhausted error: never an abort.
/// A tight limit must fail (the operator's memory is accounted) and a loose one succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_a_memory_limit_large_k_completes_or_reports_resources_exhausted() {
    let data = wide_table();
    let dir = test_dir("memory-limit");
    let sql = "SELECT rid, payload FROM t ORDER BY x DESC LIMIT 60000";
    let oracle = "SELECT rid, payload FROM t ORDER BY x DESC, rid LIMIT 60000";
    for storage in [Storage::Memory, Storage::Parquet] {
        let plain = plain_session(4, storage);
        register_as(&plain, "t", &data, storage, &dir).await;
        let want = run_oracle(&plain, oracle).await.unwrap();
        let mut outcomes = Vec::new();
        for limit in [2 << 20, 16 << 20, 1 << 30] {
            let runtime = RuntimeEnvBuilder::new()
                .with_memory_limit(limit, 1.0)
                .build_arc()
                .unwrap();
            let state = SessionStateBuilder::new()
                .with_config(SessionConfig::new().with_target_partitions(4))
                .with_runtime_env(runtime)
                .with_default_features()
                .with_gpu_topk(crate::sessions::base_config().with_backend(test_backend()))
                .build();
            let ctx = SessionContext::new_with_state(state);
            register_as(&ctx, "t", &data, storage, &dir).await;
            let plan = physical_plan(&ctx, sql).await.unwrap();
            assert_eq!(count_gpu_topk(&plan), 1, "{sql}");
            match collect(plan, ctx.task_ctx()).await {
                Ok(got) => {
                    assert_eq!(exact_rows(&got), want, "{storage:?} limit {limit}");
                    outcomes.push(true);
                }
                Err(e) => {
                    assert!(
                        e.to_string().contains("Resources exhausted"),
                        "{storage:?} limit {limit}: {e}"
                    );
                    outcomes.push(false);
                }
            }
        }
        assert_eq!(outcomes.first(), Some(&false), "{storage:?}: {outcomes:?}");
        assert_eq!(outcomes.last(), Some(&true), "{storage:?}: {outcomes:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Queries dropped at random points (as a `LIMIT` above, a disconnect or a timeout drops
/// them) release their device and pinned memory, and the session answers the next query.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_queries_release_what_they_held() {
    let data = table(74, &[&[3000, 2000], &[4000], &[2500, 2500]]);
    let dir = test_dir("cancel");
    let mut rng = Rng::new(74);
    let sqls = [FAULT_QUERIES[0], FAULT_QUERIES[1]];
    for storage in [Storage::Memory, Storage::Parquet] {
        let plain = plain_session(3, storage);
        let ctx = session_with(
            3,
            100,
            crate::sessions::base_config().with_backend(test_backend()),
        );
        register_as(&plain, "t", &data, storage, &dir).await;
        register_as(&ctx, "t", &data, storage, &dir).await;
        for round in 0..24 {
            let (sql, oracle) = sqls[round % sqls.len()];
            let plan = physical_plan(&ctx, sql).await.unwrap();
            let mut stream =
                datafusion::physical_plan::execute_stream(Arc::clone(&plan), ctx.task_ctx())
                    .unwrap();
            let wait = Duration::from_micros(rng.below(20_000));
            // Dropped after `wait`, or when it ends first.
            let _ = tokio::time::timeout(wait, stream.next()).await;
            drop(stream);
            // The partition tasks stop at their next batch; their buffers go with them.
            let mut held = report(&plan);
            for _ in 0..200 {
                if (held.device_bytes_held, held.pinned_bytes_held) == (0, 0) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                held = report(&plan);
            }
            assert_eq!(
                (held.device_bytes_held, held.pinned_bytes_held),
                (0, 0),
                "{sql} over {storage:?}, cancelled after {wait:?}"
            );
            let want = run_oracle(&plain, oracle).await.unwrap();
            assert_eq!(run(&ctx, sql).await.map(|b| exact_rows(&b)).unwrap(), want);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// 64 queries of mixed shapes at once, on a session whose device memory limit is too small for
/// some of them: every answer DataFusion's, none stuck, nothing held at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_queries_under_a_small_device_budget() {
    let data = table(75, &[&[900, 100], &[700], &[400, 400], &[50]]);
    let plain = plain_session(4, Storage::Memory);
    register(&plain, "t", data.clone());
    let queries = [
        FAULT_QUERIES[0],
        FAULT_QUERIES[1],
        (
            "SELECT rid FROM t WHERE b ORDER BY ts_ns DESC NULLS LAST, f32 LIMIT 700",
            "SELECT rid FROM t WHERE b ORDER BY ts_ns DESC NULLS LAST, f32, rid LIMIT 700",
        ),
        (
            "SELECT rid, ds FROM t ORDER BY i64 % 7, d32 DESC LIMIT 5 OFFSET 10",
            "SELECT rid, ds FROM t ORDER BY i64 % 7, d32 DESC, rid LIMIT 5 OFFSET 10",
        ),
    ];
    let mut wanted = Vec::new();
    for (_, oracle) in &queries {
        wanted.push(run_oracle(&plain, oracle).await.map_err(|e| e.to_string()));
    }
    let config = crate::sessions::base_config()
        .with_backend(test_backend())
        .with_device_memory_limit(96 << 10);
    let ctx = session_with(4, 100, config);
    register(&ctx, "t", data);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let ctx = ctx.clone();
        let (sql, _) = queries[i % queries.len()];
        let want = wanted[i % queries.len()].clone();
        tasks.spawn(async move {
            let (got, report) = run_reporting(&ctx, sql).await;
            assert_eq!(got.map_err(|e| e.to_string()), want, "{sql}");
            assert_eq!(
                (report.device_bytes_held, report.pinned_bytes_held),
                (0, 0),
                "{sql}"
            );
            report.fallbacks
        });
    }
    let mut fallbacks = 0;
    while let Some(done) = tasks.join_next().await {
        fallbacks += done.expect("a concurrent query panicked");
    }
    eprintln!("64 concurrent queries under a 96 KiB device limit: {fallbacks} fell back");
}

#[test]
fn device_fault_settings_parse_and_reject_bad_values() {
    for (text, point) in [
        ("alloc:1", FaultPoint::Device(DeviceOp::Alloc, 1)),
        ("COMPILE:2", FaultPoint::Device(DeviceOp::Compile, 2)),
        ("launch:30", FaultPoint::Device(DeviceOp::Launch, 30)),
        ("upload:4", FaultPoint::Device(DeviceOp::Upload, 4)),
        ("download:5", FaultPoint::Device(DeviceOp::Download, 5)),
        ("push:2", FaultPoint::Push(2)),
    ] {
        assert_eq!(text.parse::<FaultPoint>().unwrap(), point);
        assert_eq!(point.to_string(), text.to_ascii_lowercase());
    }
    for bad in ["launch:0", "launch", "kernel:3", "push:-1", "alloc:x"] {
        let e = bad.parse::<FaultPoint>().unwrap_err().to_string();
        assert!(
            e.contains("gpu_topk.inject_fault") && e.contains("launch"),
            "{e}"
        );
    }
}
