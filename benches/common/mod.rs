//! What the DataFusion benchmarks share: option parsing, the sessions, timing one query.

use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, SessionStateBuilderExt};

/// The value after `name` on the command line, or `default`; panics on a value that does not
/// parse.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("bad value for {name}: {v}"))
        })
        .unwrap_or(default)
}

/// A session with our rule (`ours`) on `backend`, expressions fused or not, or plain
/// DataFusion (`!ours`).
pub fn session(ours: bool, backend: Backend, fuse: bool) -> SessionContext {
    let gpu = GpuTopKConfig::default()
        .with_enabled(ours)
        .with_backend(backend)
        .with_fuse_expressions(fuse);
    session_with(gpu)
}

/// A session on all cores with the operator configured as `gpu`.
pub fn session_with(gpu: GpuTopKConfig) -> SessionContext {
    let state = SessionStateBuilder::new()
        .with_config(SessionConfig::new())
        .with_default_features()
        .with_gpu_topk(gpu)
        .build();
    SessionContext::new_with_state(state)
}

/// Runs `sql` to the end: milliseconds and the result.
pub async fn time_sql(ctx: &SessionContext, sql: &str) -> Result<(f64, Vec<RecordBatch>)> {
    let started = Instant::now();
    let batches = ctx.sql(sql).await?.collect().await?;
    Ok((started.elapsed().as_secs_f64() * 1e3, batches))
}
