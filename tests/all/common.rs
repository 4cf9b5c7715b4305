//! Shared helpers: sessions with and without the operator, and exact row comparison.

use std::sync::Arc;

use datafusion::arrow::array::{Array, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Float16Type, Float32Type, Float64Type};
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::{ExecutionPlan, displayable};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, GpuTopKExec, SessionStateBuilderExt};

/// The backend the operator is forced to in these tests.
pub fn test_backend() -> Backend {
    std::env::var("GPU_TOPK_TEST_BACKEND")
        .ok()
        .map(|b| b.parse().expect("GPU_TOPK_TEST_BACKEND: auto, cuda or cpu"))
        .unwrap_or(Backend::Cpu)
}

/// A session with the rule (`enabled`) or plain DataFusion (`!enabled`).
pub fn session(enabled: bool, partitions: usize, batch_size: usize) -> SessionContext {
    let config = SessionConfig::new()
        .with_target_partitions(partitions)
        .with_batch_size(batch_size);
    let gpu = GpuTopKConfig::default()
        .with_enabled(enabled)
        .with_backend(test_backend());
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_gpu_topk(gpu)
        .build();
    SessionContext::new_with_state(state)
}

pub fn register(ctx: &SessionContext, name: &str, partitions: Vec<Vec<RecordBatch>>) {
    let schema = partitions
        .iter()
        .flatten()
        .next()
        .map(|b| b.schema())
        .expect("at least one batch to take the schema from");
    let table = MemTable::try_new(schema, partitions).expect("mem table");
    ctx.register_table(name, Arc::new(table)).expect("register");
}

pub async fn physical_plan(ctx: &SessionContext, sql: &str) -> Result<Arc<dyn ExecutionPlan>> {
    ctx.sql(sql).await?.create_physical_plan().await
}

pub fn plan_text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(true).to_string()
}

/// Number of `GpuTopKExec` nodes in a plan.
pub fn count_gpu_topk(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let here = usize::from(plan.downcast_ref::<GpuTopKExec>().is_some());
    here + plan
        .children()
        .iter()
        .map(|c| count_gpu_topk(c))
        .sum::<usize>()
}

pub async fn run(ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>> {
    ctx.sql(sql).await?.collect().await
}

/// Every row as text, exact: floats also by their bits (so -0.0, NaN payloads and the like
/// must match, not just print alike). Column types are part of the first line.
pub fn exact_rows(batches: &[RecordBatch]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(first) = batches.iter().find(|b| b.num_rows() > 0) {
        let types: Vec<String> = first
            .schema()
            .fields()
            .iter()
            .map(|f| format!("{}:{}", f.name(), f.data_type()))
            .collect();
        out.push(types.join(", "));
    }
    let options = FormatOptions::default().with_null("NULL");
    for batch in batches {
        let formatters: Vec<_> = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options).expect("formatter"))
            .collect();
        for r in 0..batch.num_rows() {
            let cells: Vec<String> = batch
                .columns()
                .iter()
                .zip(&formatters)
                .map(|(col, f)| {
                    if col.is_null(r) {
                        return "NULL".to_string();
                    }
                    let bits = match col.data_type() {
                        DataType::Float16 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float16Type>().value(r).to_bits()
                            )
                        }
                        DataType::Float32 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float32Type>().value(r).to_bits()
                            )
                        }
                        DataType::Float64 => {
                            format!(
                                "#{:x}",
                                col.as_primitive::<Float64Type>().value(r).to_bits()
                            )
                        }
                        _ => String::new(),
                    };
                    format!("{}{bits}", f.value(r))
                })
                .collect();
            out.push(cells.join(" | "));
        }
    }
    out
}

/// A tiny deterministic PRNG (xorshift64*), so test data is reproducible without a crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}
