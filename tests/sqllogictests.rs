//! Runs `sql-tests/*.slt` twice: with the GPU top-k operator (backend from
//! `GPU_TOPK_TEST_BACKEND`, default `cpu`; label `gpu_topk`) and with the rule disabled (plain
//! DataFusion, label `datafusion`). Every result therefore matches DataFusion's own; records
//! about our plans are marked `onlyif gpu_topk`.
//!
//! `cargo test --test sqllogictests -- --complete` rewrites the expected results from the
//! `gpu_topk` run (review the diff: the `datafusion` pass then checks them independently).

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use datafusion::arrow::array::{Array, RecordBatch};
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, SessionStateBuilderExt};
use sqllogictest::{DBOutput, DefaultColumnType};

struct Db {
    ctx: SessionContext,
}

#[derive(Debug)]
struct DbError(DataFusionError);

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
impl std::error::Error for DbError {}

fn backend() -> Backend {
    std::env::var("GPU_TOPK_TEST_BACKEND")
        .ok()
        .map(|b| b.parse().expect("GPU_TOPK_TEST_BACKEND: auto, cuda or cpu"))
        .unwrap_or(Backend::Cpu)
}

fn new_db(rule_enabled: bool) -> Db {
    let config = SessionConfig::new()
        .with_target_partitions(4)
        .with_batch_size(64)
        .set_bool("datafusion.explain.physical_plan_only", true);
    let gpu = GpuTopKConfig::default()
        .with_enabled(rule_enabled)
        .with_backend(backend());
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_default_features()
        .with_gpu_topk(gpu)
        .build();
    Db {
        ctx: SessionContext::new_with_state(state),
    }
}

fn column_type(dt: &DataType) -> DefaultColumnType {
    match dt {
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64 => DefaultColumnType::Integer,
        DataType::Float16 | DataType::Float32 | DataType::Float64 | DataType::Decimal128(..) => {
            DefaultColumnType::FloatingPoint
        }
        _ => DefaultColumnType::Text,
    }
}

fn format_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, DataFusionError> {
    let options = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        for r in 0..batch.num_rows() {
            let mut row = Vec::with_capacity(formatters.len());
            for (c, f) in formatters.iter().enumerate() {
                let text = if batch.column(c).is_null(r) {
                    "NULL".to_string()
                } else {
                    f.value(r).to_string()
                };
                row.push(if text.is_empty() {
                    "(empty)".into()
                } else {
                    text
                });
            }
            // Multi-line cells (EXPLAIN plans) become one row per line.
            if row.iter().any(|cell| cell.contains('\n')) {
                for cell in row {
                    rows.extend(cell.lines().map(|l| vec![l.to_string()]));
                }
            } else {
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

#[async_trait]
impl sqllogictest::AsyncDB for Db {
    type Error = DbError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, DbError> {
        let frame = self.ctx.sql(sql).await.map_err(DbError)?;
        let schema = frame.schema().inner().clone();
        let batches = frame.collect().await.map_err(DbError)?;
        if schema.fields().is_empty() {
            return Ok(DBOutput::StatementComplete(0));
        }
        let types = schema
            .fields()
            .iter()
            .map(|f| column_type(f.data_type()))
            .collect();
        let rows = format_rows(&batches).map_err(DbError)?;
        Ok(DBOutput::Rows { types, rows })
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "datafusion-gpu-topk"
    }
}

fn slt_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sql-tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "slt"))
        .collect();
    files.sort();
    files
}

#[tokio::main]
async fn main() {
    let complete = std::env::args().any(|a| a == "--complete");
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let mut failures = Vec::new();
    let mut passed = 0;
    for file in slt_files() {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        for (label, enabled) in [("gpu_topk", true), ("datafusion", false)] {
            let mut runner = sqllogictest::Runner::new(move || async move { Ok(new_db(enabled)) });
            runner.add_label(label);
            let result = if complete && enabled {
                runner
                    .update_test_file(
                        &file,
                        " ",
                        sqllogictest::default_validator,
                        sqllogictest::default_normalizer,
                        sqllogictest::default_column_validator,
                    )
                    .await
                    .map_err(|e| e.to_string())
            } else {
                runner
                    .run_file_async(&file)
                    .await
                    .map_err(|e| e.to_string())
            };
            match result {
                Ok(()) => {
                    passed += 1;
                    println!("ok   {name} [{label}]");
                }
                Err(e) => {
                    println!("FAIL {name} [{label}]\n{e}");
                    failures.push(format!("{name} [{label}]"));
                }
            }
        }
    }
    println!("sqllogictests: {passed} passed, {} failed", failures.len());
    if !failures.is_empty() {
        eprintln!("failed: {}", failures.join(", "));
        std::process::exit(1);
    }
}
