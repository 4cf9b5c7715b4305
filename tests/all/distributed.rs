//! The operator under datafusion-distributed: a coordinator and two workers in this process,
//! talking gRPC over localhost as separate machines would, against one process (ours, and
//! plain DataFusion). Tables are Parquet and CSV files, several per table with several row
//! groups each, split between the two workers' tasks; and in-memory tables (`MemTable`,
//! `GpuTable`), which go whole to one task.

use std::sync::{Arc, Mutex};

use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::displayable;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_distributed::{
    DistributedExt, SessionStateBuilderExt as _, Worker, WorkerPlanRewriteEvent,
    WorkerPlanRewriteEventResponse, WorkerQueryContext,
};
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::{SessionStateBuilderExt, StaticWorkers};

use crate::common::{
    ORACLE_QUERIES, Storage, TWEET_QUERIES, exact_rows, physical_plan, plain_session, plan_text,
    register_as, run, session, test_dir,
};
use crate::files::ties_table;
use crate::sessions::{test_backend, test_config};

/// The plans one worker decoded and ran, as text.
type Plans = Arc<Mutex<Vec<String>>>;

/// A worker with the operator installed (as `gpu_worker` builds it) on a free localhost port,
/// recording each plan it runs; its URL.
async fn start_worker(plans: Plans) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a localhost port");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    let worker = Worker::from_session_builder(move |context: WorkerQueryContext| {
        let plans = Arc::clone(&plans);
        async move {
            let record = move |event: WorkerPlanRewriteEvent<'_>| {
                let text = displayable(event.plan.as_ref()).indent(true).to_string();
                plans.lock().unwrap().push(text);
                Ok(WorkerPlanRewriteEventResponse::new(event.plan))
            };
            Ok(context
                .builder
                .with_gpu_topk(test_config(true))
                .with_gpu_topk_cluster()
                .with_distributed_worker_plan_rewrite_handler(record)
                .build())
        }
    });
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(worker.into_worker_server())
            .serve_with_incoming(incoming),
    );
    url
}

/// A coordinator over `workers`, splitting every file scan into as many tasks as workers.
fn coordinator(workers: &[String], partitions: usize) -> SessionContext {
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .with_batch_size(100);
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_gpu_topk(test_config(true))
        .with_gpu_topk_cluster()
        .with_distributed_worker_resolver(StaticWorkers::parse(workers).expect("worker URLs"))
        .with_distributed_planner()
        .with_distributed_file_scan_config_bytes_per_partition(1)
        .expect("a task per byte")
        .build();
    SessionContext::new_with_state(state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_gives_one_processs_rows_over_files() {
    let plans: Vec<Plans> = vec![Plans::default(), Plans::default()];
    let mut urls = Vec::new();
    for recorded in &plans {
        urls.push(start_worker(Arc::clone(recorded)).await);
    }
    // The backend each worker plans its task for (the query's settings go with the plan).
    let backend = match test_backend() {
        datafusion_gpu_topk::Backend::Auto => String::new(),
        forced => format!("backend={forced}"),
    };
    let partitions = 4;
    let tweets = tweets::tweets_partitions(&TweetsSpec::new(6_000), 6, 500).expect("tweets");
    let ties = ties_table(17);
    let dir = test_dir("distributed");
    for storage in [
        Storage::Parquet,
        Storage::Csv,
        Storage::Memory,
        Storage::GpuTable,
    ] {
        // The engine splits file scans; an in-memory table goes whole to one task.
        let files = matches!(storage, Storage::Parquet | Storage::Csv);
        let cluster = coordinator(&urls, partitions);
        let local = session(true, partitions, 100);
        let plain = plain_session(partitions, storage);
        for ctx in [&cluster, &local, &plain] {
            register_as(ctx, "tweets", &tweets, storage, &dir).await;
            register_as(ctx, "t", &ties, storage, &dir).await;
        }
        for sql in TWEET_QUERIES {
            let plan = physical_plan(&cluster, sql).await.expect("planned");
            let text = plan_text(&plan);
            assert!(
                text.contains("GpuTopKExec") && (!files || text.contains("DistributedExec")),
                "{storage:?} {sql}: not distributed with the operator:\n{text}"
            );
            let expected = exact_rows(&run(&local, sql).await.expect("one process"));
            let got = exact_rows(&run(&cluster, sql).await.expect("the cluster"));
            assert_eq!(got, expected, "{storage:?} {sql}:\n{text}");
        }
        for (sql, oracle) in ORACLE_QUERIES {
            let expected = exact_rows(&run(&plain, oracle).await.expect("DataFusion"));
            let got = exact_rows(&run(&cluster, sql).await.expect("the cluster"));
            assert_eq!(got, expected, "{storage:?} {sql}");
        }
        // Each worker ran a task's own top-k of the files.
        for (w, recorded) in plans.iter().enumerate() {
            let recorded = std::mem::take(&mut *recorded.lock().unwrap());
            assert!(
                !files
                    || recorded.iter().any(|p| {
                        p.contains("GpuTopKExec") && p.contains("per_task") && p.contains(&backend)
                    }),
                "{storage:?}: worker {w} ran no per-task GpuTopKExec:\n{}",
                recorded.join("\n")
            );
        }
    }
}

/// What the coordinator's rule leaves to DataFusion under the distributed planner: a
/// per-group top-k (the engine distributes the window plan by its hash repartition). Its
/// rows are still DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_group_top_k_stays_with_datafusion_in_a_cluster() {
    let urls = vec![start_worker(Plans::default()).await];
    let cluster = coordinator(&urls, 3);
    let plain = plain_session(3, Storage::Parquet);
    let dir = test_dir("distributed-groups");
    let ties = ties_table(5);
    for ctx in [&cluster, &plain] {
        register_as(ctx, "t", &ties, Storage::Parquet, &dir).await;
    }
    let sql = "SELECT g, rid FROM (SELECT g, rid, ROW_NUMBER() OVER (PARTITION BY g \
               ORDER BY c DESC, rid) AS rn FROM t) WHERE rn <= 3 ORDER BY g, rid";
    let plan = plan_text(&physical_plan(&cluster, sql).await.expect("planned"));
    assert!(!plan.contains("GpuGroupTopKExec"), "{plan}");
    let expected = exact_rows(&run(&plain, sql).await.expect("DataFusion"));
    assert_eq!(
        exact_rows(&run(&cluster, sql).await.expect("cluster")),
        expected
    );
}
