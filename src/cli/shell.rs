//! The SQL shell: datafusion-cli's REPL and its `-c` / `-f` execution over a session with the
//! operator installed, its options as datafusion-cli spells them, and the lazily generated
//! `tweets` table.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use clap::Args;
use datafusion::catalog::{SchemaProvider, TableProvider};
use datafusion::datasource::TableType;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::memory_pool::{FairSpillPool, GreedyMemoryPool, MemoryPool};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_cli::catalog::DynamicObjectStoreCatalog;
use datafusion_cli::exec;
use datafusion_cli::functions::ParquetMetadataFunc;
use datafusion_cli::object_storage::instrumented::InstrumentedObjectStoreRegistry;
use datafusion_cli::print_format::PrintFormat;
use datafusion_cli::print_options::{MaxRows, PrintOptions};

use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, SessionStateBuilderExt};

use super::CliResult;

/// datafusion-cli's options (the shell's: they apply where no command is given).
#[derive(Debug, Args)]
pub struct ShellArgs {
    /// Execute the given SQL statement(s) or commands, then exit
    #[arg(short = 'c', long, num_args = 1.., value_name = "SQL")]
    command: Vec<String>,
    /// Execute the statements of file(s), then exit
    #[arg(short = 'f', long, num_args = 1.., value_name = "FILE", value_parser = existing_file)]
    file: Vec<String>,
    /// Run these files on startup instead of ~/.datafusionrc
    #[arg(short = 'r', long, num_args = 1.., value_name = "FILE", value_parser = existing_file,
          conflicts_with = "file")]
    rc: Option<Vec<String>>,
    /// Output format
    #[arg(long, value_enum, default_value_t = PrintFormat::Automatic)]
    format: PrintFormat,
    /// Print only the results
    #[arg(short = 'q', long)]
    quiet: bool,
    /// Rows printed per result in the table format (a number, or inf)
    #[arg(long, default_value = "40", value_name = "N")]
    maxrows: MaxRows,
    /// Syntax highlighting in the REPL
    #[arg(long)]
    color: bool,
    /// Work in this directory (relative paths in statements start there)
    #[arg(short = 'p', long, value_name = "DIR", value_parser = existing_dir)]
    data_path: Option<String>,
    /// Rows per batch (default: DataFusion's)
    #[arg(short = 'b', long, value_name = "N", value_parser = positive)]
    batch_size: Option<usize>,
    /// Memory the queries may use, e.g. 10g (default: no limit)
    #[arg(short = 'm', long, value_name = "SIZE", value_parser = byte_size)]
    memory_limit: Option<usize>,
    /// The memory pool under --memory-limit: greedy or fair
    #[arg(long, default_value = "greedy", value_parser = ["greedy", "fair"])]
    mem_pool_type: String,
}

impl ShellArgs {
    /// An error where a shell option is given with a command, which would ignore it.
    pub fn only_for_the_shell(&self) -> CliResult<()> {
        let given = [
            (!self.command.is_empty(), "-c"),
            (!self.file.is_empty(), "-f"),
            (self.rc.is_some(), "-r"),
            (self.data_path.is_some(), "-p"),
        ];
        match given.iter().find(|(set, _)| *set) {
            Some((_, flag)) => Err(format!("{flag} applies to the shell, not to a command").into()),
            None => Ok(()),
        }
    }
}

fn existing_file(path: &str) -> std::result::Result<String, String> {
    match std::path::Path::new(path).is_file() {
        true => Ok(path.to_string()),
        false => Err(format!("no such file: {path}")),
    }
}

fn existing_dir(path: &str) -> std::result::Result<String, String> {
    match std::path::Path::new(path).is_dir() {
        true => Ok(path.to_string()),
        false => Err(format!("no such directory: {path}")),
    }
}

fn positive(value: &str) -> std::result::Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("'{value}' is not a positive number")),
    }
}

/// `512`, `64k`, `10m`, `2g` (powers of 1024) as bytes.
fn byte_size(value: &str) -> std::result::Result<usize, String> {
    let lower = value.trim().to_ascii_lowercase();
    let (digits, unit) = match lower.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => lower.split_at(at),
        None => (lower.as_str(), ""),
    };
    let shift = match unit.trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("'{value}' is not a size (e.g. 512m, 10g)")),
    };
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("'{value}' is not a size (e.g. 512m, 10g)"))
}

/// What the session's runtime is given.
#[derive(Debug, Default)]
pub struct Runtime {
    pub batch_size: Option<usize>,
    pub memory_limit: Option<usize>,
    pub fair_pool: bool,
    /// Plan for these datafusion-distributed workers.
    #[cfg(feature = "cluster")]
    pub workers: Option<datafusion_gpu_topk::StaticWorkers>,
}

/// A session with the operator installed (with `gpu` as its settings), datafusion-cli's
/// object stores and table functions, URL tables (`SELECT * FROM 'file.parquet'`), and a
/// `tweets` table of `rows` rows generated when a statement first names it (`quiet`: without
/// saying so).
pub fn session(
    gpu: GpuTopKConfig,
    rows: u64,
    quiet: bool,
    runtime: &Runtime,
) -> Result<SessionContext> {
    let mut config = SessionConfig::from_env()?.with_information_schema(true);
    if let Some(batch_size) = runtime.batch_size {
        config = config.with_batch_size(batch_size);
    }
    let mut builder = RuntimeEnvBuilder::new()
        .with_object_store_registry(Arc::new(InstrumentedObjectStoreRegistry::new()));
    if let Some(limit) = runtime.memory_limit {
        let pool: Arc<dyn MemoryPool> = match runtime.fair_pool {
            true => Arc::new(FairSpillPool::new(limit)),
            false => Arc::new(GreedyMemoryPool::new(limit)),
        };
        builder = builder.with_memory_pool(pool);
    }
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(builder.build_arc()?)
        .with_default_features()
        .with_gpu_topk(gpu);
    #[cfg(feature = "cluster")]
    let state = match &runtime.workers {
        Some(workers) => {
            use datafusion_distributed::{DistributedExt, SessionStateBuilderExt as _};
            state
                .with_gpu_topk_cluster()
                .with_distributed_worker_resolver(workers.clone())
                .with_distributed_planner()
        }
        None => state,
    };
    let state = state.build();
    let ctx = SessionContext::new_with_state(state);
    let catalog = ctx
        .catalog("datafusion")
        .ok_or_else(|| DataFusionError::Internal("no default catalog".into()))?;
    let public = catalog
        .schema("public")
        .ok_or_else(|| DataFusionError::Internal("no default schema".into()))?;
    let partitions = ctx.copied_config().target_partitions();
    catalog.register_schema(
        "public",
        Arc::new(TweetsSchema {
            inner: public,
            spec: TweetsSpec::new(rows),
            partitions,
            quiet,
            generating: tokio::sync::Mutex::new(()),
        }),
    )?;
    let ctx = ctx.enable_url_table();
    // Object stores (s3://, gs://, https://) registered as statements name them.
    ctx.register_catalog_list(Arc::new(DynamicObjectStoreCatalog::new(
        ctx.state().catalog_list().clone(),
        ctx.state_weak_ref(),
    )));
    ctx.register_udtf("parquet_metadata", Arc::new(ParquetMetadataFunc {}));
    Ok(ctx)
}

/// The shell: the REPL, or the statements of `-f` files and `-c`, then exit; `runtime` as
/// the shell's options complete it.
pub async fn run(
    args: ShellArgs,
    backend: Backend,
    rows: u64,
    mut runtime: Runtime,
) -> CliResult<()> {
    runtime.batch_size = args.batch_size;
    runtime.memory_limit = args.memory_limit;
    runtime.fair_pool = args.mem_pool_type == "fair";
    if let Some(dir) = &args.data_path {
        std::env::set_current_dir(dir).map_err(|e| format!("-p {dir}: {e}"))?;
    }
    let repl = args.command.is_empty() && args.file.is_empty();
    if !args.quiet {
        // Statements from the command line start the device only if a query needs it.
        let gpu = match repl {
            true => format!(", GPU: {}", datafusion_gpu_topk::gpu_summary()),
            false => String::new(),
        };
        println!(
            "gpu-topk {} (DataFusion CLI {}), backend {backend}{gpu}",
            env!("CARGO_PKG_VERSION"),
            datafusion_cli::DATAFUSION_CLI_VERSION
        );
    }
    // A lone statement has no next query for the column cache to serve.
    let lone = args.file.is_empty() && args.command.len() == 1 && {
        let dialect = datafusion::sql::sqlparser::dialect::GenericDialect {};
        datafusion::sql::sqlparser::parser::Parser::parse_sql(&dialect, &args.command[0])
            .is_ok_and(|statements| statements.len() <= 1)
    };
    let gpu = GpuTopKConfig::default()
        .with_backend(backend)
        .with_load_after_cpu(!lone);
    let ctx = session(gpu, rows, args.quiet, &runtime)?;
    let mut print_options = PrintOptions {
        format: args.format,
        quiet: args.quiet,
        maxrows: args.maxrows,
        color: args.color,
        instrumented_registry: Arc::new(InstrumentedObjectStoreRegistry::new()),
    };
    if repl {
        let rc = match args.rc {
            Some(files) => files,
            None => (std::env::var_os("HOME").map(std::path::PathBuf::from))
                .map(|home| home.join(".datafusionrc"))
                .filter(|rc| rc.is_file())
                .map(|rc| rc.to_string_lossy().into_owned())
                .into_iter()
                .collect(),
        };
        if !rc.is_empty() {
            exec::exec_from_files(&ctx, rc, &print_options).await?;
        }
        exec::exec_from_repl(&ctx, &mut print_options).await?;
        return Ok(());
    }
    if !args.file.is_empty() {
        exec::exec_from_files(&ctx, args.file, &print_options).await?;
    }
    // A `-c` statement after a run that is loading the column cache (a first run on the CPU
    // path) waits for the load: a repeated query then runs warm instead of racing it.
    for command in args.command {
        cache_loaded().await;
        exec::exec_from_commands(&ctx, vec![command], &print_options).await?;
    }
    Ok(())
}

/// Returns once no column-cache load started by a run on the CPU path is in progress.
pub(crate) async fn cache_loaded() {
    while datafusion_gpu_topk::internal::exec::warming_up() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The default schema, with a `tweets` table generated the first time a statement names it
/// (a `GpuTable`: the columns its top-k queries read stay on the GPU between queries). A
/// table the user registers under that name comes first.
#[derive(Debug)]
struct TweetsSchema {
    inner: Arc<dyn SchemaProvider>,
    spec: TweetsSpec,
    partitions: usize,
    quiet: bool,
    /// Held while the table is generated: one generation however many statements ask.
    generating: tokio::sync::Mutex<()>,
}

const TWEETS: &str = "tweets";

#[async_trait]
impl SchemaProvider for TweetsSchema {
    fn table_names(&self) -> Vec<String> {
        let mut names = self.inner.table_names();
        if !names.iter().any(|n| n == TWEETS) {
            names.push(TWEETS.to_string());
        }
        names
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        if let Some(table) = self.inner.table(name).await? {
            return Ok(Some(table));
        }
        if name != TWEETS {
            return Ok(None);
        }
        let _generating = self.generating.lock().await;
        if let Some(table) = self.inner.table(name).await? {
            return Ok(Some(table));
        }
        let started = Instant::now();
        let table: Arc<dyn TableProvider> = tweets::tweets_gpu_table(&self.spec, self.partitions)?;
        self.inner
            .register_table(TWEETS.to_string(), Arc::clone(&table))?;
        if !self.quiet {
            println!(
                "tweets: {} rows generated in memory (a GpuTable) in {:.2} s",
                self.spec.rows,
                started.elapsed().as_secs_f64()
            );
        }
        Ok(Some(table))
    }

    async fn table_type(&self, name: &str) -> Result<Option<TableType>> {
        match self.inner.table_type(name).await? {
            Some(kind) => Ok(Some(kind)),
            None if name == TWEETS => Ok(Some(TableType::Base)),
            None => Ok(None),
        }
    }

    fn register_table(
        &self,
        name: String,
        table: Arc<dyn TableProvider>,
    ) -> Result<Option<Arc<dyn TableProvider>>> {
        self.inner.register_table(name, table)
    }

    fn deregister_table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        self.inner.deregister_table(name)
    }

    fn table_exist(&self, name: &str) -> bool {
        name == TWEETS || self.inner.table_exist(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_powers_of_1024() {
        assert_eq!(byte_size("512"), Ok(512));
        assert_eq!(byte_size("64k"), Ok(64 << 10));
        assert_eq!(byte_size("10G"), Ok(10 << 30));
        assert_eq!(byte_size("2mb"), Ok(2 << 20));
        assert!(byte_size("ten").is_err());
        assert!(byte_size("5x").is_err());
        assert!(byte_size("").is_err());
    }
}
