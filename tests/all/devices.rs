//! A top-k split between devices (`gpu_topk.devices`): each device takes a contiguous run of
//! a file or in-memory scan's partitions and the host merges their rows. Two logical devices
//! of GPU 0 (and GPUs 0 and 1 where there are two); without a GPU, on the CPU path, the same
//! plan of two parts and a merge.

use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};

use crate::common::{
    ORACLE_QUERIES, Storage, TWEET_QUERIES, exact_rows, physical_plan, plain_session, plan_text,
    register_as, run, run_reporting, session, session_with, test_dir,
};
use crate::files::ties_table;
use crate::sessions::{test_backend, test_config};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_split_between_devices_gives_one_operators_rows() {
    let tweets = tweets::tweets_partitions(&TweetsSpec::new(6_000), 6, 500).expect("tweets");
    let ties = ties_table(23);
    let dir = test_dir("devices");
    let mut device_lists = vec![vec![0, 0]];
    if test_backend() == datafusion_gpu_topk::Backend::Cuda {
        datafusion_gpu_topk::internal::device::gpu_status(); // starts the device
    }
    let gpus = datafusion_gpu_topk::internal::device::started_device_count().unwrap_or(0);
    if gpus >= 2 {
        device_lists.push(vec![0, 1]);
    }
    for devices in &device_lists {
        for storage in [
            Storage::Parquet,
            Storage::Csv,
            Storage::Memory,
            Storage::GpuTable,
        ] {
            let split = session_with(4, 100, test_config(true).with_devices(Some(devices)));
            let one = session(true, 4, 100);
            let plain = plain_session(4, storage);
            for ctx in [&split, &one, &plain] {
                register_as(ctx, "tweets", &tweets, storage, &dir).await;
                register_as(ctx, "t", &ties, storage, &dir).await;
            }
            // A GpuTable is not split: its columns are one table in the column cache.
            let sliced = storage != Storage::GpuTable;
            for (i, sql) in TWEET_QUERIES.iter().enumerate() {
                let text = plan_text(&physical_plan(&split, sql).await.expect("planned"));
                let second = format!("device={}", if devices[1] == 0 { "0#1" } else { "1" });
                // All but the last query read the scan directly; a computed column between
                // (the last one's) leaves the top-k on one device.
                let parts = match sliced && i + 1 < TWEET_QUERIES.len() {
                    true => (3, true),
                    false => (1, false),
                };
                assert_eq!(
                    (text.matches("GpuTopKExec").count(), text.contains(&second)),
                    parts,
                    "{devices:?} {storage:?} {sql}:\n{text}"
                );
                let expected = exact_rows(&run(&one, sql).await.expect("one operator"));
                let got = exact_rows(&run(&split, sql).await.expect("split"));
                assert_eq!(got, expected, "{devices:?} {storage:?} {sql}:\n{text}");
            }
            for (sql, oracle) in ORACLE_QUERIES {
                let expected = exact_rows(&run(&plain, oracle).await.expect("DataFusion"));
                let got = exact_rows(&run(&split, sql).await.expect("split"));
                assert_eq!(got, expected, "{devices:?} {storage:?} {sql}");
            }
        }
    }
}

/// Every part publishes its k-th key to the parts' shared threshold, and the best of them
/// prunes every part's scans: by `id` (increasing with the input), the second part holds the
/// answer, and its threshold becomes the first part's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_devices_share_their_threshold() {
    let tweets = tweets::tweets_partitions(&TweetsSpec::new(6_000), 6, 500).expect("tweets");
    let dir = test_dir("devices-threshold");
    let sql = "SELECT id FROM tweets ORDER BY id DESC LIMIT 25";
    for storage in [Storage::Parquet, Storage::Csv, Storage::Memory] {
        let split = session_with(4, 100, test_config(true).with_devices(Some(&[0, 0])));
        register_as(&split, "tweets", &tweets, storage, &dir).await;
        let plan = physical_plan(&split, sql).await.expect("planned");
        let ctx = split.task_ctx();
        let rows = datafusion::physical_plan::collect(std::sync::Arc::clone(&plan), ctx).await;
        let rows = exact_rows(&rows.expect("ran"));
        let kth = rows.last().expect("25 rows").clone();
        let text = plan_text(&plan);
        let parts: Vec<&str> = text.lines().filter(|l| l.contains("device=")).collect();
        assert_eq!(parts.len(), 2, "{storage:?}:\n{text}");
        // The device's streamed selection (over CSV) keeps its candidates on the device and
        // publishes no threshold; the CPU path's does, and so does a whole table's selection
        // with its last row.
        let published = parts.iter().filter(|p| p.contains("threshold=")).count();
        if test_backend() == datafusion_gpu_topk::Backend::Cpu || storage != Storage::Csv {
            assert_eq!(published, 2, "{storage:?}:\n{text}");
        }
        // Ids are unique and the first part's all smaller than the second's: the first part
        // shows a threshold of the second's rows only if it was shared. It is never tighter
        // than the answer's k-th id.
        let thresholds: Vec<i64> = (parts.iter())
            .filter_map(|p| p.split(" >= ").nth(1))
            .map(|rest| rest[..rest.find(']').expect("]")].parse().expect("an id"))
            .collect();
        assert!(
            thresholds.windows(2).all(|w| w[0] == w[1]),
            "{storage:?}: {thresholds:?}:\n{text}"
        );
        let kth: i64 = kth.parse().expect("an id");
        assert!(
            thresholds.iter().all(|&t| t <= kth),
            "{storage:?} {kth}:\n{text}"
        );
    }
}

#[tokio::test]
async fn a_bad_device_list_is_refused_naming_it() {
    let ctx = session(true, 2, 100);
    for bad in ["x", "0,,1", "-1", ""] {
        let err = ctx
            .sql(&format!("SET gpu_topk.devices = '{bad}'"))
            .await
            .expect_err(bad)
            .to_string();
        assert!(err.contains("invalid gpu_topk.devices"), "{bad}: {err}");
    }
    ctx.sql("SET gpu_topk.devices = '1,0'")
        .await
        .expect("a list");
    ctx.sql("SET gpu_topk.devices = 'ALL'").await.expect("all");
}

/// A device that fails (here every part's, as its selection starts or at its final
/// selection, which the device reaches on every path) moves that part to the CPU path; the
/// answer stays one operator's. GPUs 0 and 1 where there are two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_device_leaves_the_split_answer_unchanged() {
    use datafusion_gpu_topk::FaultPoint;
    let tweets = tweets::tweets_partitions(&TweetsSpec::new(6_000), 6, 500).expect("tweets");
    let dir = test_dir("devices-faults");
    let devices = crate::sessions::split_devices();
    for storage in [Storage::Parquet, Storage::Memory] {
        let one = session(true, 4, 100);
        register_as(&one, "tweets", &tweets, storage, &dir).await;
        for fault in [FaultPoint::Create, FaultPoint::Finish] {
            let config = test_config(true)
                .with_devices(Some(&devices))
                .with_inject_fault(fault);
            let split = session_with(4, 100, config);
            register_as(&split, "tweets", &tweets, storage, &dir).await;
            // Queries without a filter: both parts read rows (the first half of the table
            // holds every row of Q1's time range).
            for sql in [TWEET_QUERIES[1], TWEET_QUERIES[3]] {
                let expected = exact_rows(&run(&one, sql).await.expect("one operator"));
                let (got, report) = run_reporting(&split, sql).await;
                assert_eq!(exact_rows(&got.expect("split")), expected, "{fault} {sql}");
                assert_eq!(report.operators, 3, "{storage:?} {fault} {sql}");
                // Each device's part fell back; the merge never runs on a device.
                assert_eq!(report.fallbacks, 2, "{storage:?} {fault} {sql}: {report:?}");
            }
        }
    }
}
