//! The operator in an application: a session with `with_gpu_topk`, a small in-memory table,
//! one top-k query, and where it ran (on a machine without a GPU, the operator's CPU path).
//!
//! ```sh
//! cargo run --example embed --no-default-features
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::{GpuTopKConfig, SessionStateBuilderExt, topk_report};

#[tokio::main]
async fn main() -> Result<()> {
    let state = SessionStateBuilder::new()
        .with_default_features()
        .with_gpu_topk(GpuTopKConfig::default())
        .build();
    let ctx = SessionContext::new_with_state(state);

    let schema = Arc::new(Schema::new(vec![
        Field::new("user", DataType::Utf8, false),
        Field::new("likes", DataType::Int64, false),
    ]));
    let users = ["ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal"];
    let likes = [120, 7, 431, 56, 431, 3, 98, 250];
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from_iter_values(users)),
            Arc::new(Int64Array::from_iter_values(likes)),
        ],
    )?;
    ctx.register_table(
        "posts",
        Arc::new(MemTable::try_new(schema, vec![vec![batch]])?),
    )?;

    let sql = "SELECT user, likes FROM posts ORDER BY likes DESC, user LIMIT 3";
    let plan = ctx.sql(sql).await?.create_physical_plan().await?;
    let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
    println!("{}", pretty_format_batches(&batches)?);
    // Which backend and algorithm ran the top-k, or why DataFusion's own TopK was kept.
    for line in topk_report(&ctx.state(), &plan) {
        println!("{line}");
    }
    Ok(())
}
