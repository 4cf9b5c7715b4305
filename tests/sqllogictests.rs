//! Runs `sql-tests/*.slt` twice: with the GPU top-k operator (backend from
//! `GPU_TOPK_TEST_BACKEND`, default `cpu`; label `gpu_topk`) and with the rule disabled (plain
//! DataFusion, label `datafusion`). Every result therefore matches DataFusion's own; records
//! about our plans are marked `onlyif gpu_topk`.
//!
//! Each file runs over in-memory tables, then again with every table it creates stored as
//! Parquet (several files of several row groups) and as CSV (several files), so the operator
//! is checked over file scans as well (`plans.slt`, whose plans name in-memory scans, runs
//! in memory only). A table CSV cannot hold exactly (dictionaries, say) stays in memory.
//! Labels `<label>-<storage>` (e.g. `datafusion-csv`) mark records for one pass only.
//!
//! `cargo test --test sqllogictests -- --complete` rewrites the expected results from the
//! `gpu_topk` run (review the diff: the `datafusion` pass then checks them independently).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::array::RecordBatch;
use datafusion::error::DataFusionError;
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionConfig, SessionContext};
use sqllogictest::{DBOutput, DefaultColumnType};

#[path = "shared/sessions.rs"]
mod sessions;
#[path = "shared/slt_format.rs"]
mod slt_format;
use slt_format::{column_type, format_rows};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Storage {
    Memory,
    Parquet,
    Csv,
}

struct Db {
    ctx: SessionContext,
    storage: Storage,
    /// Where file-backed tables are written.
    dir: PathBuf,
}

/// Rows per file and per Parquet row group of file-backed tables: several of each.
const ROWS_PER_FILE: usize = 7;
const ROWS_PER_ROW_GROUP: usize = 3;

static DB_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Db {
    /// After `CREATE TABLE name …`: the table moved to files (`self.storage`), in its order.
    async fn store_in_files(&self, name: &str) -> Result<(), DataFusionError> {
        let table = self.ctx.table(name).await?;
        let schema = Arc::new(table.schema().as_arrow().clone());
        let partitions = table.collect_partitioned().await?;
        let rows: Vec<RecordBatch> = partitions.into_iter().flatten().collect();
        let all = datafusion::arrow::compute::concat_batches(&schema, &rows)?;
        let n = DB_COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self.dir.join(format!("{name}-{n}"));
        std::fs::create_dir_all(&dir)?;
        for (f, start) in (0..all.num_rows().max(1))
            .step_by(ROWS_PER_FILE)
            .enumerate()
        {
            let chunk = all.slice(start, ROWS_PER_FILE.min(all.num_rows() - start));
            write_file(&dir, f, &schema, &chunk, self.storage)?;
        }
        let path = dir.to_str().expect("utf-8 path");
        let files = SessionContext::new();
        match self.storage {
            Storage::Parquet => {
                files
                    .register_parquet(name, path, ParquetReadOptions::default())
                    .await?
            }
            _ => {
                files
                    .register_csv(name, path, CsvReadOptions::new().schema(&schema))
                    .await?
            }
        }
        // Only a table the files hold exactly replaces the in-memory one.
        let back = match files.table(name).await?.collect().await {
            Ok(back) => back,
            Err(_) => return Ok(()),
        };
        let same = match datafusion::arrow::compute::concat_batches(&schema, &back) {
            Ok(back) => format_rows(&[back])? == format_rows(&[all])?,
            Err(_) => false,
        };
        if !same {
            return Ok(());
        }
        self.ctx.deregister_table(name)?;
        let table = files.table_provider(name).await?;
        self.ctx.register_table(name, table)?;
        Ok(())
    }
}

fn write_file(
    dir: &Path,
    file: usize,
    schema: &datafusion::arrow::datatypes::SchemaRef,
    batch: &RecordBatch,
    storage: Storage,
) -> Result<(), DataFusionError> {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let extension = if storage == Storage::Csv {
        "csv"
    } else {
        "parquet"
    };
    let out = std::fs::File::create(dir.join(format!("part-{file:04}.{extension}")))?;
    if storage == Storage::Csv {
        let mut writer = datafusion::arrow::csv::WriterBuilder::new()
            .with_header(true)
            .build(out);
        return Ok(writer.write(batch)?);
    }
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(ROWS_PER_ROW_GROUP))
        .build();
    let mut writer = ArrowWriter::try_new(out, Arc::clone(schema), Some(properties))?;
    writer.write(batch)?;
    writer.close()?;
    Ok(())
}

/// The table a `CREATE TABLE name …` statement makes.
fn created_table(sql: &str) -> Option<String> {
    let words: Vec<&str> = sql.split_whitespace().take(3).collect();
    match words.as_slice() {
        [create, table, name]
            if create.eq_ignore_ascii_case("create") && table.eq_ignore_ascii_case("table") =>
        {
            Some(name.trim_end_matches('(').to_string())
        }
        _ => None,
    }
}

#[derive(Debug)]
struct DbError(DataFusionError);

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}
impl std::error::Error for DbError {}

fn new_db(rule_enabled: bool, storage: Storage, dir: PathBuf) -> Db {
    let config = SessionConfig::new()
        .with_target_partitions(4)
        .with_batch_size(64)
        .set_bool("datafusion.explain.physical_plan_only", true);
    Db {
        ctx: sessions::session_with_config(config, sessions::test_config(rule_enabled)),
        storage,
        dir,
    }
}

#[async_trait]
impl sqllogictest::AsyncDB for Db {
    type Error = DbError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, DbError> {
        let frame = self.ctx.sql(sql).await.map_err(DbError)?;
        let schema = frame.schema().inner().clone();
        let mut batches = frame.collect().await;
        // DataFusion's sanity check rejects some of its own plans of `ORDER BY f(x), …` over
        // several partitions from one planning to the next (the fuzzer and the differential
        // tests meet it too): a plan without our operators is planned again.
        for _ in 0..4 {
            match &batches {
                Err(e)
                    if e.to_string().contains("SanityCheckPlan")
                        && !e.to_string().contains("Gpu") =>
                {
                    batches = self.ctx.sql(sql).await.map_err(DbError)?.collect().await;
                }
                _ => break,
            }
        }
        let batches = batches.map_err(DbError)?;
        if self.storage != Storage::Memory
            && let Some(name) = created_table(sql)
        {
            self.store_in_files(&name).await.map_err(DbError)?;
        }
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
    let dir = std::env::temp_dir().join(format!("gpu-topk-slt-{}", std::process::id()));
    for file in slt_files() {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let storages: &[Storage] = if complete || name == "plans.slt" {
            &[Storage::Memory]
        } else {
            &[Storage::Memory, Storage::Parquet, Storage::Csv]
        };
        for &storage in storages {
            for (label, enabled) in [("gpu_topk", true), ("datafusion", false)] {
                let dir = dir.clone();
                let mut runner = sqllogictest::Runner::new(move || {
                    let dir = dir.clone();
                    async move { Ok(new_db(enabled, storage, dir)) }
                });
                runner.add_label(label);
                // e.g. `datafusion-csv`, for records plain DataFusion cannot run over files.
                runner.add_label(&format!("{label}-{storage:?}").to_lowercase());
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
                let what = format!("{name} [{label}, {storage:?}]");
                match result {
                    Ok(()) => {
                        passed += 1;
                        println!("ok   {what}");
                    }
                    Err(e) => {
                        println!("FAIL {what}\n{e}");
                        failures.push(what);
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("sqllogictests: {passed} passed, {} failed", failures.len());
    if !failures.is_empty() {
        eprintln!("failed: {}", failures.join(", "));
        std::process::exit(1);
    }
}
