//! `gpu-topk`: run top-k queries through the GPU top-k operator.
//!
//! ```text
//! gpu-topk                                   the four tweet queries on an in-memory table
//! gpu-topk query "SQL" [--table NAME=PATH]… [--rows N] [--explain] [--backend B]
//! gpu-topk gen --rows N --out DIR            write the tweets dataset as Parquet
//! ```

use std::any::Any;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::{ExecutionPlan, collect, displayable};
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionConfig, SessionContext};

use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::internal::cost::SelectionChoice;
use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
use datafusion_gpu_topk::{
    Backend, GpuTopKConfig, GpuTopKExec, GpuTopKRule, SessionStateBuilderExt,
};

const USAGE: &str = "\
gpu-topk: ORDER BY ... LIMIT k on the GPU, inside Apache DataFusion

USAGE:
    gpu-topk [--rows N] [--backend auto|cuda|cpu]
        Run the four tweet queries (Q1-Q4) on an in-memory tweets table and print their
        results, time, and the backend and algorithm that ran.
    gpu-topk query \"SQL\" [--table NAME=PATH]... [--rows N] [--explain] [--backend B]
        Run any SQL. The in-memory `tweets` table is always registered; --table adds a
        Parquet or CSV file, or a directory of them, under NAME.
    gpu-topk gen --rows N --out DIR
        Write the deterministic tweets dataset to DIR as Parquet files.

OPTIONS:
    --rows N        rows of the in-memory tweets table (default 10000000)
    --backend B     auto (GPU if present, else DataFusion's TopK), cuda, or cpu (default auto)
    --explain       print the physical plan instead of running the query
    --show N        result rows printed per query (default: 10 for Q1-Q4, all for `query`)
    --cache-bytes N device memory the GPU's column cache may hold, for the process (default: a
                    quarter of the device's; 0: no cache)
";

const DEFAULT_ROWS: u64 = 10_000_000;

/// Every option the parser knows.
const OPTIONS: &[&str] = &[
    "-h",
    "--help",
    "--rows",
    "--backend",
    "--out",
    "--show",
    "--explain",
    "--table",
    "--cache-bytes",
];

/// A failure after the arguments parsed: DataFusion's error, or a message of the CLI's own
/// (printed as is, without a DataFusion category in front).
type CliResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Debug)]
enum Command {
    Queries,
    Query {
        sql: String,
        tables: Vec<(String, String)>,
        explain: bool,
    },
    Gen {
        out: String,
    },
    Help,
}

#[derive(Debug)]
struct Args {
    command: Command,
    rows: Option<u64>,
    backend: Backend,
    /// Result rows printed per query.
    show: usize,
    /// The process's column cache budget, where given.
    cache_bytes: Option<usize>,
}

fn parse_args(raw: Vec<String>) -> std::result::Result<Args, String> {
    let mut it = raw.into_iter().peekable();
    let mut command = match it.peek().map(String::as_str) {
        Some("query") => {
            it.next();
            // An option right after `query` means the SQL was left out; taking the option as
            // the SQL would report its value as an unknown option instead.
            let sql = it
                .next()
                .filter(|s| !OPTIONS.contains(&s.as_str()))
                .ok_or("`query` needs the SQL text")?;
            Command::Query {
                sql,
                tables: vec![],
                explain: false,
            }
        }
        Some("gen") => {
            it.next();
            Command::Gen { out: String::new() }
        }
        Some("help" | "-h" | "--help") => Command::Help,
        Some(other) if !other.starts_with("--") => {
            return Err(format!("unknown command '{other}' (expected query or gen)"));
        }
        _ => Command::Queries,
    };
    let (mut rows, mut backend, mut out, mut show) = (None, Backend::Auto, None, None);
    let mut cache_bytes = None;
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => command = Command::Help,
            "--rows" => {
                let v = value("--rows")?;
                rows = Some(
                    v.parse()
                        .map_err(|_| format!("--rows: '{v}' is not a row count"))?,
                );
            }
            "--backend" => {
                // Named after the flag: the parser's own message names the SQL setting.
                let v = value("--backend")?;
                backend = v.parse().map_err(|_| {
                    format!(
                        "--backend: '{v}' is not a backend (expected one of {})",
                        Backend::NAMES.join(", ")
                    )
                })?;
            }
            "--out" => out = Some(value("--out")?),
            "--cache-bytes" => {
                let v = value("--cache-bytes")?;
                cache_bytes = Some(
                    v.parse()
                        .map_err(|_| format!("--cache-bytes: '{v}' is not a byte count"))?,
                );
            }
            "--show" => {
                let v = value("--show")?;
                show = Some(
                    v.parse()
                        .map_err(|_| format!("--show: '{v}' is not a row count"))?,
                );
            }
            "--explain" => match &mut command {
                Command::Query { explain, .. } => *explain = true,
                _ => return Err("--explain applies to `query`".into()),
            },
            "--table" => {
                let v = value("--table")?;
                let Some((name, path)) = v
                    .split_once('=')
                    .filter(|(n, p)| !n.is_empty() && !p.is_empty())
                else {
                    return Err(format!("--table expects NAME=PATH, got '{v}'"));
                };
                match &mut command {
                    Command::Query { tables, .. } => tables.push((name.into(), path.into())),
                    _ => return Err("--table applies to `query`".into()),
                }
            }
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if let Command::Gen { out: o } = &mut command {
        *o = out.ok_or("gen needs --out DIR")?;
        if rows.is_none() {
            return Err("gen needs --rows N".into());
        }
    } else if out.is_some() {
        return Err("--out applies to `gen`".into());
    }
    let show = show.unwrap_or(match command {
        Command::Queries => 10,
        _ => usize::MAX,
    });
    Ok(Args {
        command,
        rows,
        backend,
        show,
        cache_bytes,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1).collect()) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("error: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> CliResult<()> {
    let rows = args.rows.unwrap_or(DEFAULT_ROWS);
    if args.cache_bytes.is_some() {
        datafusion_gpu_topk::set_column_cache_budget(args.cache_bytes);
    }
    match args.command {
        Command::Help => {
            print!("{USAGE}");
            Ok(())
        }
        Command::Gen { out } => {
            let summary =
                tweets::write_parquet(&TweetsSpec::new(rows), Path::new(&out), 10_000_000, true)?;
            println!(
                "wrote {} rows in {} files ({:.1} MiB) to {out}",
                summary.rows,
                summary.files,
                summary.bytes as f64 / (1 << 20) as f64
            );
            Ok(())
        }
        Command::Queries => {
            let ctx = context(rows, args.backend, &[]).await?;
            print_gpu_status();
            for (name, sql) in tweets::QUERIES {
                println!("\n== {name}: {sql}");
                run_query(&ctx, sql, false, args.show).await?;
                warm_run(&ctx, sql).await?;
            }
            Ok(())
        }
        Command::Query {
            sql,
            tables,
            explain,
        } => {
            let ctx = context(rows, args.backend, &tables).await?;
            print_gpu_status();
            Ok(run_query(&ctx, &sql, explain, args.show).await?)
        }
    }
}

fn print_gpu_status() {
    match gpu_status() {
        GpuStatus::Available(device) => println!("GPU: {}", device.describe()),
        GpuStatus::Unavailable(why) => println!("GPU: none ({why})"),
    }
}

/// A session with the operator and the tables registered.
async fn context(
    rows: u64,
    backend: Backend,
    tables: &[(String, String)],
) -> CliResult<SessionContext> {
    // Paths are checked before the tweets table is generated, which takes seconds at the
    // default size.
    let kinds = tables
        .iter()
        .map(|(name, path)| table_kind(name, path))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let config = GpuTopKConfig::default().with_backend(backend);
    let state = SessionStateBuilder::new()
        .with_config(SessionConfig::new())
        .with_default_features()
        .with_gpu_topk(config)
        .build();
    let ctx = SessionContext::new_with_state(state);
    let started = Instant::now();
    let partitions = ctx.copied_config().target_partitions();
    // A GpuTable: the columns its top-k queries read stay on the GPU between queries.
    ctx.register_table(
        "tweets",
        tweets::tweets_gpu_table(&TweetsSpec::new(rows), partitions)?,
    )?;
    println!(
        "tweets: {rows} rows generated in memory (a GpuTable) in {:.2} s",
        started.elapsed().as_secs_f64()
    );
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
    Ok(ctx)
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
    while datafusion_gpu_topk::internal::exec::warming_up() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
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
    let mut found = false;
    visit(plan, &mut |node| {
        if let Some(exec) = node.downcast_ref::<GpuTopKExec>() {
            found = true;
            let spec = exec.spec();
            let fallbacks = exec
                .metrics()
                .and_then(|m| m.sum_by_name("gpu_fallbacks"))
                .map(|v| v.as_usize())
                .unwrap_or(0);
            let choice = spec.plan.choice();
            let eval = match choice {
                SelectionChoice::Cpu => String::new(),
                SelectionChoice::Cuda(_) => format!(", eval=[{}]", spec.fusion.describe(true)),
            };
            // The model's prediction beside the measured selection time.
            let timing = match &spec.prediction {
                Some(p) => {
                    let measured = exec
                        .metrics()
                        .and_then(|m| m.sum_by_name("operator_time"))
                        .map_or(f64::NAN, |v| v.as_usize() as f64 / 1e9);
                    format!(
                        ", {}, operator_time={}",
                        p.describe(false),
                        datafusion_gpu_topk::internal::cost::format_seconds(measured)
                    )
                }
                None => String::new(),
            };
            println!(
                "top-k: GpuTopKExec, backend={}, algorithm={}{eval}{timing} ({}){}",
                choice.backend(),
                choice.algorithm(),
                spec.reason,
                if fallbacks > 0 {
                    ", GPU failed: fell back to the CPU path"
                } else {
                    ""
                }
            );
        }
    });
    if !found {
        let state = ctx.state();
        let reasons = state
            .physical_optimizers()
            .iter()
            .find_map(|rule| {
                (rule.as_ref() as &dyn Any)
                    .downcast_ref::<GpuTopKRule>()
                    .map(|r| r.last_decisions())
            })
            .unwrap_or_default();
        if reasons.is_empty() {
            println!("top-k: no GpuTopKExec in this plan (not an ORDER BY ... LIMIT query)");
        }
        for reason in reasons {
            println!("top-k: DataFusion's TopK kept: {reason}");
        }
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

    fn args(s: &[&str]) -> std::result::Result<Args, String> {
        parse_args(s.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn parses_commands_and_rejects_bad_options() {
        assert!(matches!(args(&[]).unwrap().command, Command::Queries));
        let a = args(&[
            "query",
            "SELECT 1",
            "--table",
            "t=x.csv",
            "--explain",
            "--backend",
            "cpu",
        ])
        .unwrap();
        assert_eq!(a.backend, Backend::Cpu);
        assert!(
            matches!(a.command, Command::Query { explain: true, ref tables, .. } if tables.len() == 1)
        );
        assert!(args(&["query"]).unwrap_err().contains("SQL"));
        assert!(
            args(&["query", "--backend", "cpu"])
                .unwrap_err()
                .contains("SQL")
        );
        assert!(
            args(&["query", "x", "--table", "=t.csv"])
                .unwrap_err()
                .contains("NAME=PATH")
        );
        assert!(
            args(&["--backend", "tpu"])
                .unwrap_err()
                .contains("auto, cuda, cpu")
        );
        assert!(args(&["--rows", "many"]).unwrap_err().contains("row count"));
        assert_eq!(
            args(&["--cache-bytes", "1024"]).unwrap().cache_bytes,
            Some(1024)
        );
        assert!(
            args(&["--cache-bytes", "1G"])
                .unwrap_err()
                .contains("byte count")
        );
        assert!(
            args(&["gen", "--rows", "10"])
                .unwrap_err()
                .contains("--out")
        );
        assert!(
            args(&["query", "x", "--table", "noequals"])
                .unwrap_err()
                .contains("NAME=PATH")
        );
        assert!(
            args(&["frobnicate"])
                .unwrap_err()
                .contains("unknown command")
        );
        assert!(args(&["--explain"]).is_err());
    }
}
