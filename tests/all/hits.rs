//! The ClickBench-shaped aggregate top-k queries (`datasets::hits::queries`) with
//! `gpu_topk.aggregate_topk` on, against plain DataFusion, over the generated `hits` table in
//! memory, as a `GpuTable` and in Parquet files (several partitions, files and row groups): the
//! benchmark's queries give DataFusion's answers on the backend under test.

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::datasets::hits::{self, HitsSpec};

use crate::common::{
    Storage, physical_plan, plain_session, plan_text, register_as, session_with, test_dir,
};
use crate::sessions::test_config;

/// The result's row count and its last column's values (each query's sort key), sorted:
/// groups tied at the k-th value may differ between engines, their values may not.
fn sort_keys(batches: &[RecordBatch]) -> Vec<String> {
    let options = FormatOptions::default();
    let mut values = Vec::new();
    for b in batches {
        let column = b.column(b.num_columns() - 1);
        let format = ArrayFormatter::try_new(column.as_ref(), &options).unwrap();
        values.extend((0..b.num_rows()).map(|r| format.value(r).to_string()));
    }
    values.sort();
    values
}

async fn run(ctx: &SessionContext, sql: &str) -> Vec<String> {
    let frame = ctx.sql(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    sort_keys(
        &frame
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hits_queries_match_datafusion() {
    // Enough rows that H09's two days of counter 62 pass its OFFSET 1000.
    let rows = 150_000;
    let data = hits::hits_partitions(&HitsSpec::new(rows), 3, 4096).unwrap();
    let dir = test_dir("hits");
    for storage in [Storage::Memory, Storage::GpuTable, Storage::Parquet] {
        let mut config = test_config(true);
        config.aggregate_topk = true;
        let ours = session_with(3, 4096, config);
        let plain = plain_session(3, storage);
        register_as(&ours, hits::TABLE_NAME, &data, storage, &dir).await;
        register_as(&plain, hits::TABLE_NAME, &data, storage, &dir).await;
        for (name, sql) in hits::queries(rows) {
            if name == "H01" {
                // The simplest shape, top users by COUNT(*), is the operator's.
                let plan = plan_text(&physical_plan(&ours, &sql).await.unwrap());
                assert!(
                    plan.contains("GpuAggregateTopKExec"),
                    "{storage:?}:\n{plan}"
                );
            }
            let want = run(&plain, &sql).await;
            assert!(!want.is_empty(), "{name}: no rows");
            assert_eq!(run(&ours, &sql).await, want, "{storage:?} {name}: {sql}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
