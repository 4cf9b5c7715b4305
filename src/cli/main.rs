//! `gpu-topk`: DataFusion's command line (datafusion-cli's REPL, `-c`, `-f`, print formats,
//! `\d` commands, `CREATE EXTERNAL TABLE`, object stores) with the GPU top-k operator
//! installed, and the tweets dataset at hand.
//!
//! ```text
//! gpu-topk [OPTIONS]                          a REPL; with -c SQL or -f FILE, runs them and exits
//! gpu-topk tweets [--rows N] [--show N]       the four tweet queries on an in-memory table
//! gpu-topk query SQL [--table NAME=PATH]… [--explain]   one statement, with where it ran
//! gpu-topk gen --rows N --out DIR [--dataset hits]   write the tweets (or hits) as Parquet
//! gpu-topk worker --listen HOST:PORT          serve as a datafusion-distributed worker
//! gpu-topk --workers URL,URL … [command]      plan as a distributed coordinator
//! ```
//!
//! `worker` and `--workers` exist in builds with the `cluster` feature (a default one).
//!
//! The in-memory `tweets` table is generated (`--rows`, default 10M) the first time a
//! statement names it, not before.

mod shell;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use datafusion::physical_plan::{ExecutionPlan, collect, displayable};
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionContext};

use datafusion_gpu_topk::datasets::hits::{self, HitsSpec};
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, GpuTopKExec, gpu_summary, topk_report};
#[cfg(feature = "cluster")]
use datafusion_gpu_topk::{StaticWorkers, gpu_worker};

/// Rows of the generated tweets table unless `--rows` says.
const DEFAULT_ROWS: u64 = 10_000_000;

/// ORDER BY ... LIMIT k on the GPU, inside Apache DataFusion: DataFusion's SQL shell with the
/// GPU top-k operator installed.
#[derive(Debug, Parser)]
#[command(name = "gpu-topk", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    shell: shell::ShellArgs,
}

/// Options of every command.
#[derive(Debug, Args)]
struct Common {
    /// auto (the GPU where the cost model says so, else the CPU path), cuda or cpu
    #[arg(long, global = true, default_value = "auto", value_parser = parse_backend)]
    backend: Backend,
    /// Rows of the in-memory `tweets` table, generated when a statement names it
    #[arg(long, global = true, value_name = "N")]
    rows: Option<u64>,
    /// Device memory the GPU's column cache may hold, for the process (default: a quarter of
    /// the device's; 0: no cache)
    #[arg(long, global = true, value_name = "BYTES")]
    cache_bytes: Option<usize>,
    /// Run queries on these datafusion-distributed workers (started with `gpu-topk worker`),
    /// this process planning and merging: comma-separated URLs such as http://host:50051
    #[cfg(feature = "cluster")]
    #[arg(long, global = true, value_name = "URL,...", value_delimiter = ',')]
    workers: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the four tweet queries (Q1-Q4) on an in-memory tweets table: each result, its
    /// time, a second (warm) run's time, and the backend and algorithm that ran
    Tweets {
        /// Result rows printed per query
        #[arg(long, default_value_t = 10, value_name = "N")]
        show: usize,
    },
    /// Run one statement and say where its top-k ran (or why DataFusion's TopK was kept)
    Query {
        /// The SQL statement
        sql: String,
        /// A Parquet or CSV file, or a directory of them, registered as NAME
        #[arg(long = "table", value_name = "NAME=PATH", value_parser = parse_table)]
        tables: Vec<(String, String)>,
        /// Print the physical plan instead of running the statement
        #[arg(long)]
        explain: bool,
        /// Result rows printed (default: all)
        #[arg(long, value_name = "N")]
        show: Option<usize>,
    },
    /// Write the deterministic tweets dataset (or the ClickBench-shaped hits) as Parquet files
    Gen {
        /// The directory to write
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Which dataset: `tweets` or `hits`
        #[arg(long, value_name = "NAME", default_value = "tweets", value_parser = ["tweets", "hits"])]
        dataset: String,
    },
    /// Serve as a datafusion-distributed worker with the operator installed, until
    /// interrupted; a coordinator (`--workers`) sends it its tasks with their settings
    #[cfg(feature = "cluster")]
    Worker {
        /// The address to listen on
        #[arg(long, value_name = "HOST:PORT", default_value = "0.0.0.0:50051")]
        listen: std::net::SocketAddr,
    },
}

fn parse_backend(value: &str) -> std::result::Result<Backend, String> {
    value.parse().map_err(|_| {
        format!(
            "'{value}' is not a backend (expected one of {})",
            Backend::NAMES.join(", ")
        )
    })
}

fn parse_table(value: &str) -> std::result::Result<(String, String), String> {
    value
        .split_once('=')
        .filter(|(name, path)| !name.is_empty() && !path.is_empty())
        .map(|(name, path)| (name.to_string(), path.to_string()))
        .ok_or_else(|| format!("expected NAME=PATH, got '{value}'"))
}

/// A failure after the arguments parsed: DataFusion's error, or a message of the CLI's own
/// (printed as is, without a DataFusion category in front).
type CliResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[tokio::main]
async fn main() -> ExitCode {
    env_logger::init();
    // Argument errors: clap's message and usage, exit code 2.
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> CliResult<()> {
    let Cli {
        command,
        common,
        shell,
    } = cli;
    if common.cache_bytes.is_some() {
        datafusion_gpu_topk::set_column_cache_budget(common.cache_bytes);
    }
    let rows = common.rows.unwrap_or(DEFAULT_ROWS);
    let runtime = shell::Runtime {
        #[cfg(feature = "cluster")]
        workers: match common.workers.is_empty() {
            true => None,
            false => {
                Some(StaticWorkers::parse(&common.workers).map_err(|e| format!("--workers: {e}"))?)
            }
        },
        ..Default::default()
    };
    let Some(command) = command else {
        return shell::run(shell, common.backend, rows, runtime).await;
    };
    shell.only_for_the_shell()?;
    match command {
        Command::Gen { out, dataset } => {
            let Some(rows) = common.rows else {
                use clap::CommandFactory;
                Cli::command()
                    .error(
                        clap::error::ErrorKind::MissingRequiredArgument,
                        "gen needs --rows N",
                    )
                    .exit();
            };
            let summary = match dataset.as_str() {
                "hits" => hits::write_parquet(&HitsSpec::new(rows), &out, 10_000_000, true)?,
                _ => tweets::write_parquet(&TweetsSpec::new(rows), &out, 10_000_000, true)?,
            };
            println!(
                "wrote {} rows in {} files ({:.1} MiB) to {}",
                summary.rows,
                summary.files,
                summary.bytes as f64 / (1 << 20) as f64,
                out.display()
            );
            Ok(())
        }
        Command::Tweets { show } => {
            let gpu = GpuTopKConfig::default().with_backend(common.backend);
            let ctx = shell::session(gpu, rows, false, &runtime)?;
            print_gpu_status();
            for (name, sql) in tweets::QUERIES {
                println!("\n== {name}: {sql}");
                run_query(&ctx, sql, false, show).await?;
                warm_run(&ctx, sql).await?;
            }
            Ok(())
        }
        Command::Query {
            sql,
            tables,
            explain,
            show,
        } => {
            // Paths are checked before anything runs.
            let kinds = tables
                .iter()
                .map(|(name, path)| table_kind(name, path))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            // One statement: nothing for the column cache to serve afterwards.
            let gpu = GpuTopKConfig::default()
                .with_backend(common.backend)
                .with_load_after_cpu(false);
            let ctx = shell::session(gpu, rows, false, &runtime)?;
            for ((name, path), kind) in tables.iter().zip(kinds) {
                // DataFusion's message (a corrupt footer, a short row) does not say which table.
                let registered = match kind {
                    TableKind::Csv => ctx.register_csv(name, path, CsvReadOptions::new()).await,
                    TableKind::Parquet => {
                        ctx.register_parquet(name, path, ParquetReadOptions::default())
                            .await
                    }
                };
                registered.map_err(|e| format!("--table {name}={path}: {e}"))?;
            }
            let result = run_query(&ctx, &sql, explain, show.unwrap_or(usize::MAX)).await;
            // The query starts the device only where it needs it.
            match datafusion_gpu_topk::internal::device::probed_status() {
                Some(_) => print_gpu_status(),
                None => println!("GPU: not started (the query did not need it)"),
            }
            Ok(result?)
        }
        #[cfg(feature = "cluster")]
        Command::Worker { listen } => {
            if runtime.workers.is_some() {
                return Err("a worker takes no --workers: its coordinator has them".into());
            }
            let worker = gpu_worker(GpuTopKConfig::default().with_backend(common.backend));
            let incoming = tonic::transport::server::TcpIncoming::bind(listen)
                .map_err(|e| format!("worker: cannot listen on {listen}: {e}"))?
                .with_nodelay(Some(true));
            println!(
                "gpu-topk worker listening on {listen} (GPU: {}); Ctrl-C or SIGTERM stops it",
                gpu_summary()
            );
            tonic::transport::Server::builder()
                .add_service(worker.into_worker_server())
                .serve_with_incoming_shutdown(incoming, stop_signal())
                .await
                .map_err(|e| format!("worker on {listen}: {}", error_chain(&e)))?;
            Ok(())
        }
    }
}

/// Completes at Ctrl-C or, on Unix, SIGTERM (how service managers stop a worker).
#[cfg(feature = "cluster")]
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// An error and its causes, `: `-separated (a transport error says little on its own).
#[cfg(feature = "cluster")]
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

fn print_gpu_status() {
    println!("GPU: {}", gpu_summary());
}

#[derive(Debug, Clone, Copy)]
enum TableKind {
    Csv,
    Parquet,
}

/// How `--table NAME=PATH` is read, or why it cannot be.
fn table_kind(name: &str, path: &str) -> std::result::Result<TableKind, String> {
    let p = Path::new(path);
    if !p.exists() {
        return Err(format!("--table {name}: no such file or directory: {path}"));
    }
    let lower = path.to_ascii_lowercase();
    let is_csv = lower.ends_with(".csv")
        || (p.is_dir()
            && std::fs::read_dir(p)
                .map_err(|e| format!("--table {name}: cannot read directory {path}: {e}"))?
                .flatten()
                .any(|e| {
                    e.path()
                        .extension()
                        .is_some_and(|x| x.eq_ignore_ascii_case("csv"))
                }));
    if is_csv {
        Ok(TableKind::Csv)
    } else if lower.ends_with(".parquet") || p.is_dir() {
        Ok(TableKind::Parquet)
    } else {
        Err(format!(
            "--table {name}: '{path}' is neither a .parquet nor a .csv file, nor a directory"
        ))
    }
}

async fn run_query(ctx: &SessionContext, sql: &str, explain: bool, max_rows: usize) -> Result<()> {
    let frame = ctx.sql(sql).await?;
    let plan = frame.create_physical_plan().await?;
    if explain {
        println!("{}", displayable(plan.as_ref()).indent(true));
        report_operators(ctx, &plan);
        return Ok(());
    }
    let started = Instant::now();
    let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
    let elapsed = started.elapsed();
    print_batches(&batches, max_rows)?;
    println!("time: {:.1} ms", elapsed.as_secs_f64() * 1e3);
    report_operators(ctx, &plan);
    Ok(())
}

/// Runs `sql` again and prints its time and where its input came from: a repeated query over
/// an in-memory table or Parquet files reads its columns from the GPU's column cache.
async fn warm_run(ctx: &SessionContext, sql: &str) -> Result<()> {
    // A first run on the CPU path loads its columns into the GPU's cache after it.
    shell::cache_loaded().await;
    let plan = ctx.sql(sql).await?.create_physical_plan().await?;
    let started = Instant::now();
    collect(Arc::clone(&plan), ctx.task_ctx()).await?;
    let elapsed = started.elapsed();
    let sum = |name: &str| {
        let mut total = 0;
        visit(&plan, &mut |node| {
            if let Some(exec) = node.downcast_ref::<GpuTopKExec>() {
                total += exec
                    .metrics()
                    .and_then(|m| m.sum_by_name(name))
                    .map_or(0, |v| v.as_usize());
            }
        });
        total
    };
    let (resident, shipped) = (sum("resident_bytes"), sum("uploaded_bytes"));
    let input = match resident + shipped {
        0 => String::new(),
        _ => format!(
            " (input: {:.1} MB resident on the GPU, {:.1} MB shipped to it)",
            resident as f64 / 1e6,
            shipped as f64 / 1e6
        ),
    };
    println!("warm: {:.1} ms{input}", elapsed.as_secs_f64() * 1e3);
    Ok(())
}

fn print_batches(batches: &[RecordBatch], max_rows: usize) -> Result<()> {
    let total: usize = batches.iter().map(|b| b.num_rows()).sum();
    let mut shown = Vec::new();
    let mut left = max_rows;
    for b in batches {
        if left == 0 {
            break;
        }
        let n = b.num_rows().min(left);
        shown.push(b.slice(0, n));
        left -= n;
    }
    println!("{}", pretty_format_batches(&shown)?);
    if total > max_rows {
        println!("... {} more rows", total - max_rows);
    }
    println!("{total} rows");
    Ok(())
}

/// Says which backend and algorithm ran, or why DataFusion's own TopK was kept.
fn report_operators(ctx: &SessionContext, plan: &Arc<dyn ExecutionPlan>) {
    for line in topk_report(&ctx.state(), plan) {
        println!("{line}");
    }
}

fn visit(plan: &Arc<dyn ExecutionPlan>, f: &mut dyn FnMut(&Arc<dyn ExecutionPlan>)) {
    f(plan);
    for child in plan.children() {
        visit(child, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Cli, String> {
        Cli::try_parse_from(std::iter::once("gpu-topk").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn parses_commands_and_rejects_bad_options() {
        let cli = parse(&[
            "query",
            "SELECT 1",
            "--table",
            "t=x.parquet",
            "--backend",
            "cpu",
        ]);
        let cli = cli.unwrap();
        assert_eq!(cli.common.backend, Backend::Cpu);
        match cli.command {
            Some(Command::Query { sql, tables, .. }) => {
                assert_eq!(sql, "SELECT 1");
                assert_eq!(tables, vec![("t".to_string(), "x.parquet".to_string())]);
            }
            other => panic!("{other:?}"),
        }
        // Options before or after the command; none at all is the shell.
        let cli = parse(&["--rows", "5", "tweets", "--show", "3"]).unwrap();
        assert_eq!(cli.common.rows, Some(5));
        assert!(parse(&[]).unwrap().command.is_none());
        assert!(parse(&["query"]).unwrap_err().contains("<SQL>"));
        assert!(
            parse(&["--backend", "tpu"])
                .unwrap_err()
                .contains("not a backend")
        );
        assert!(
            parse(&["--rows", "many"])
                .unwrap_err()
                .contains("invalid digit")
        );
        assert_eq!(
            parse(&["--cache-bytes", "1024"])
                .unwrap()
                .common
                .cache_bytes,
            Some(1024)
        );
        assert!(
            parse(&["query", "x", "--table", "noequals"])
                .unwrap_err()
                .contains("NAME=PATH")
        );
        assert!(parse(&["frobnicate"]).unwrap_err().contains("frobnicate"));
        assert!(parse(&["gen"]).unwrap_err().contains("--out"));
        match parse(&["gen", "--out", "d", "--dataset", "hits"])
            .unwrap()
            .command
        {
            Some(Command::Gen { dataset, .. }) => assert_eq!(dataset, "hits"),
            other => panic!("{other:?}"),
        }
        assert!(
            parse(&["gen", "--out", "d", "--dataset", "lineitem"])
                .unwrap_err()
                .contains("lineitem")
        );
    }
}
