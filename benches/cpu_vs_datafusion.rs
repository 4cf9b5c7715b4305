//! Our operator (CPU path, and CUDA when a GPU is present: cold, its columns streamed over
//! PCIe on every query; first, a query's first run, its columns shipped into the device's
//! column cache; warm, read from that cache; auto, the default settings) against DataFusion's
//! own TopK on the tweet queries: same machine, same run, same batches (DataFusion reads them
//! as a `MemTable`, ours as a `GpuTable`), end to end through SQL, planning included.
//!
//! ```text
//! cargo bench --bench cpu_vs_datafusion -- [--rows N] [--runs R] [--csv FILE] [--sweep]
//!     [--plots DIR] [--clients C] [--profile] [--parquet DIR]
//! cargo bench --bench cpu_vs_datafusion -- --lineitem DIR [--memory] [--runs R] [--csv FILE]
//! cargo bench --bench cpu_vs_datafusion -- --groups [--rows N] [--runs R]
//! cargo bench --bench cpu_vs_datafusion -- --hits [--rows N] [--runs R] [--parquet DIR]
//! ```
//!
//! Every mode takes `--only 'Q1,Q2 k=50'` (the queries whose names start so) and `--engines
//! 'warm,auto'` (only these of ours; DataFusion always runs, as the reference).
//!
//! `--duckdb` (the tweet queries, top-k or `--groups`, and `--hits`): DuckDB in the same run,
//! through `benches/duckdb_topk.py --sql` (`--duckdb-script PATH`, `--python PYTHON`; needs
//! `pip install duckdb`) over the same rows as Parquet files (the `--parquet` files, else
//! written to a temporary directory): a table loaded from them, and with `--parquet` the files
//! themselves too. Its answers' sort-key values are checked against DataFusion's; its medians
//! follow DataFusion's in each line.
//!
//! `--verbose` prints each engine's checked run as it ends (on stderr), and with `--groups`
//! or `--hits` the warm engine's (without a GPU, the CPU path's) `EXPLAIN ANALYZE` of each
//! query.
//!
//! Each query runs R times per engine (after one checked run), alternating engines; the table
//! shows medians and the ratio ours / DataFusion (`--runs 0`: the checked runs' times, for
//! inputs where one run takes long). Results are checked to be the same rows as
//! DataFusion's (as multisets of the sort-key values, since DataFusion orders ties
//! arbitrarily). `--sweep`: Q1 at selectivities 0 to 1, Q2 at k = 1 to 10^6. `--plots DIR`:
//! Q1 and Q2 as SVG line plots. `--clients C`: C concurrent clients against the warm table,
//! throughput against the same queries back to back. `--profile`: where the time of the
//! first and the warm runs goes (planning, execution, the operator's metrics). `--parquet
//! DIR`: every engine reads the tweets from Parquet files in DIR (written there first, one
//! file per partition, row groups of 1M rows, unless DIR holds them already) instead of
//! memory; there `first host-decoded` is `first` with the columns decoded on the host
//! (`gpu_topk.decode_parquet_on_device = false`) instead of as pages on the device. `auto
//! first` is the default settings with the cache emptied before each run.
//!
//! `--groups`: the per-group top-k queries instead (G1–G3, `ROW_NUMBER() … <= K` per user and
//! per language, with and without a filter), with DataFusion's `PartitionedTopKExec`
//! (`enable_window_topn`) as one more engine.
//!
//! `--hits`: the top-k over an aggregation instead (H01–H13, ClickBench's shapes: `GROUP BY …
//! ORDER BY <aggregate> LIMIT k`, see `datasets::hits::queries`) over `--rows` rows of the
//! ClickBench-shaped `hits` table (`datasets/hits.rs`), in memory or with `--parquet DIR` in
//! Parquet files, our engines with `gpu_topk.aggregate_topk = true`. Answers are checked by
//! their sort key, the last column, so ties at the k-th value may differ in their groups.
//!
//! `--lineitem DIR`: the string top-k queries instead (S1–S4 at k = 10, 1000, 10 000: a
//! string key, a string tie-breaker, a `LIKE` filter, a string key under a selective filter)
//! over TPC-H's `lineitem` read from the Parquet files in `DIR/lineitem` (as
//! `benches/tpch/generate.py` writes them), or with `--memory` from those files loaded into
//! memory first. `benches/duckdb_topk.py` runs the same queries in DuckDB.

mod common;

use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::datasource::MemTable;
use datafusion::error::Result;
use datafusion_gpu_topk::datasets::hits::{self, HitsSpec};
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::internal::device::gpu;
use datafusion_gpu_topk::{Backend, GpuTable, GpuTopKConfig, PlanCache};

use common::{arg, session, session_with, time_sql};

/// The tweet queries: Q1 at a few selectivities, Q2 at a few k, Q3, Q4; with `sweep`, Q1 at
/// selectivities 0 to 1 in steps of 0.1 and Q2 over more k.
fn queries(sweep: bool) -> Vec<(String, String)> {
    let mut q = Vec::new();
    let selectivities: Vec<f64> = if sweep {
        (0..=10).map(|i| f64::from(i) / 10.0).collect()
    } else {
        vec![0.0, 0.1, 0.5, 1.0]
    };
    let ks: &[usize] = if sweep {
        &[1, 50, 1000, 10_000, 100_000, 1_000_000]
    } else {
        &[50, 1000, 100_000]
    };
    for sel in selectivities {
        q.push((
            format!("Q1 sel={sel}"),
            format!(
                "SELECT id, retweet_count FROM tweets WHERE tweet_time < '{}' ORDER BY retweet_count DESC LIMIT 50",
                tweets::time_bound_for_selectivity(sel)
            ),
        ));
    }
    for &k in ks {
        q.push((
            format!("Q2 k={k}"),
            format!("SELECT id, retweet_count + 0.5 * likes_count AS score FROM tweets ORDER BY retweet_count + 0.5 * likes_count DESC LIMIT {k}"),
        ));
    }
    for k in [50, 1000] {
        q.push((
            format!("Q3 k={k}"),
            format!("SELECT id, retweet_count FROM tweets WHERE lang = 'en' OR lang = 'es' ORDER BY retweet_count DESC LIMIT {k}"),
        ));
    }
    q.push(("Q4".into(), tweets::QUERIES[3].1.to_string()));
    q
}

/// The per-group top-k queries over the tweets: G1, the 10 most retweeted tweets of every
/// user (millions of groups); G2, the 3 most retweeted per language (tens of groups); G3,
/// each user's latest tweet (`= 1`); each also over the tweets with a retweet. The result is
/// the number of rows kept and the sum of their ids (the order keys end in the unique id, so
/// both are exact).
fn group_queries() -> Vec<(String, String)> {
    let shapes = [
        ("G1", "uid", "retweet_count DESC, id", "rn <= 10"),
        ("G2", "lang", "retweet_count DESC, id", "rn <= 3"),
        ("G3", "uid", "tweet_time DESC, id", "rn = 1"),
    ];
    let mut q = Vec::new();
    for (filter, tag) in [("", ""), ("WHERE retweet_count > 0", " filtered")] {
        for (name, group, order, keep) in shapes {
            q.push((
                format!("{name}{tag}"),
                format!(
                    "SELECT count(*) AS n, sum(id) AS ids FROM (SELECT id, ROW_NUMBER() OVER                      (PARTITION BY {group} ORDER BY {order}) AS rn FROM tweets {filter})                      WHERE {keep}"
                ),
            ));
        }
    }
    q
}

/// The string top-k queries over TPC-H's `lineitem` (`benches/duckdb_topk.py` has the same).
fn string_queries() -> Vec<(String, String)> {
    let mut q = Vec::new();
    for k in [10, 1000, 10_000] {
        q.push((
            format!("S1 k={k}"),
            format!("SELECT l_orderkey, l_comment FROM lineitem ORDER BY l_comment LIMIT {k}"),
        ));
        q.push((
            format!("S2 k={k}"),
            format!(
                "SELECT l_orderkey, l_extendedprice, l_comment FROM lineitem \
                 ORDER BY l_extendedprice DESC, l_comment LIMIT {k}"
            ),
        ));
        q.push((
            format!("S3 k={k}"),
            format!(
                "SELECT l_orderkey, l_extendedprice FROM lineitem WHERE l_comment LIKE '%special%' \
                 ORDER BY l_extendedprice DESC LIMIT {k}"
            ),
        ));
        q.push((
            format!("S4 k={k}"),
            format!(
                "SELECT l_orderkey, l_comment FROM lineitem WHERE l_quantity < 2 \
                 ORDER BY l_comment DESC LIMIT {k}"
            ),
        ));
    }
    q
}

/// Registers TPC-H's `lineitem` from `DIR/lineitem` with every engine: the Parquet files,
/// or (`memory`) their rows loaded once, a `MemTable` for DataFusion and a `GpuTable` for ours.
async fn register_lineitem(
    dir: &str,
    memory: bool,
    plain: &datafusion::prelude::SessionContext,
    engines: &[Engine],
) -> Result<String> {
    let path = format!("{dir}/lineitem");
    if !memory {
        for ctx in std::iter::once(plain).chain(engines.iter().map(|e| &e.ctx)) {
            ctx.register_parquet("lineitem", &path, Default::default())
                .await?;
        }
        return Ok(format!("TPC-H lineitem in the Parquet files of {path}"));
    }
    let frame = plain.read_parquet(&path, Default::default()).await?;
    let frame =
        frame.select_columns(&["l_orderkey", "l_quantity", "l_extendedprice", "l_comment"])?;
    let schema = std::sync::Arc::new(frame.schema().as_arrow().clone());
    let parts = frame.collect_partitioned().await?;
    let rows: usize = parts.iter().flatten().map(RecordBatch::num_rows).sum();
    let table = std::sync::Arc::new(MemTable::try_new(schema.clone(), parts.clone())?);
    plain.register_table("lineitem", table)?;
    let table = std::sync::Arc::new(GpuTable::try_new(schema, parts)?);
    for engine in engines {
        engine.ctx.register_table("lineitem", table.clone())?;
    }
    Ok(format!("TPC-H lineitem ({rows} rows of {path}) in memory"))
}

/// The last column's values, sorted: equal for both engines whatever their tie order.
fn key_multiset(batches: &[RecordBatch]) -> Vec<String> {
    let options = FormatOptions::default();
    let mut values = Vec::new();
    for b in batches {
        let col = b.column(b.num_columns() - 1);
        let f = ArrayFormatter::try_new(col.as_ref(), &options).unwrap();
        values.extend((0..b.num_rows()).map(|r| f.value(r).to_string()));
    }
    values.sort();
    values
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One query's DuckDB figures from one source (`memory` or `parquet`): its median and its
/// answer's sort-key values, sorted, as [`key_multiset`] writes them.
struct DuckResult {
    source: String,
    name: String,
    median_ms: f64,
    keys: Vec<String>,
}

/// Runs `queries` in DuckDB over the Parquet files of `table` in `files` (`sources`:
/// `memory`, a table loaded from them; `parquet`, the files) through `benches/duckdb_topk.py
/// --sql`.
fn run_duckdb(
    table: &str,
    files: &str,
    sources: &str,
    queries: &[(String, String)],
    runs: usize,
) -> Result<Vec<DuckResult>> {
    let failed = |why: String| datafusion::error::DataFusionError::Execution(why);
    let script: String = arg("--duckdb-script", "benches/duckdb_topk.py".to_string());
    let python: String = arg("--python", "python3".to_string());
    let dir = std::env::temp_dir().join(format!("gpu-topk-duckdb-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (sql, out) = (dir.join("queries.json"), dir.join("results.json"));
    std::fs::write(
        &sql,
        serde_json::to_string(queries).map_err(|e| failed(e.to_string()))?,
    )?;
    println!("# DuckDB ({python} {script}) over {files}: {sources}");
    let status = std::process::Command::new(&python)
        .arg(&script)
        .args([
            "--tweets",
            files,
            "--table",
            table,
            "--sources",
            sources,
            "--runs",
        ])
        .arg(runs.max(1).to_string())
        .arg("--sql")
        .arg(&sql)
        .arg("--json")
        .arg(&out)
        .status()
        .map_err(|e| failed(format!("cannot run {python} {script}: {e}")))?;
    if !status.success() {
        return Err(failed(format!("{python} {script} failed ({status})")));
    }
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_dir_all(&dir);
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
    println!("# DuckDB {}", json["duckdb"].as_str().unwrap_or("?"));
    let results = json["results"].as_array().cloned().unwrap_or_default();
    let text_of = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    Ok(results
        .iter()
        .map(|r| DuckResult {
            source: text_of(&r["source"]),
            name: text_of(&r["name"]),
            median_ms: r["median_ms"].as_f64().unwrap_or(f64::NAN),
            keys: (r["keys"].as_array().into_iter().flatten())
                .map(text_of)
                .collect(),
        })
        .collect())
}

/// One engine of the comparison: its name, its session, whether the column cache is emptied
/// before each of its runs (the first run of a query over a table: columns shipped), and the
/// plan cache its statements go through, if any (a repeated statement reuses its plan).
struct Engine {
    name: &'static str,
    ctx: datafusion::prelude::SessionContext,
    clear_cache: bool,
    plans: Option<PlanCache>,
}

async fn time_engine(engine: &Engine, sql: &str) -> Result<(f64, Vec<RecordBatch>)> {
    if engine.clear_cache
        && let Some(device) = gpu()
    {
        device.column_cache.clear();
    }
    let timed = match &engine.plans {
        Some(plans) => {
            let started = Instant::now();
            let batches = plans.collect(&engine.ctx, sql).await?;
            Ok((started.elapsed().as_secs_f64() * 1e3, batches))
        }
        None => time_sql(&engine.ctx, sql).await,
    };
    // A run on the CPU path under `auto` loads the columns afterwards: not during the next
    // engine's run.
    while datafusion_gpu_topk::internal::exec::warming_up() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    timed
}

#[tokio::main]
async fn main() -> Result<()> {
    let rows: u64 = arg("--rows", 20_000_000);
    let runs: usize = arg("--runs", 5);
    let csv: String = arg("--csv", String::new());
    let plots: String = arg("--plots", String::new());
    let clients: usize = arg("--clients", 0);
    let sweep = std::env::args().any(|a| a == "--sweep");
    let profile = std::env::args().any(|a| a == "--profile");
    let parquet: String = arg("--parquet", String::new());
    let lineitem: String = arg("--lineitem", String::new());
    let memory = std::env::args().any(|a| a == "--memory");
    let groups = std::env::args().any(|a| a == "--groups");
    let hits = std::env::args().any(|a| a == "--hits");
    let verbose = std::env::args().any(|a| a == "--verbose");
    let duckdb = std::env::args().any(|a| a == "--duckdb") && lineitem.is_empty();
    let plain = session(false, Backend::Cpu, true);
    // With `--hits`, our engines take the top-k over an aggregation too.
    let ours = |gpu: GpuTopKConfig| {
        let mut gpu = gpu;
        gpu.aggregate_topk = hits;
        session_with(gpu)
    };
    // Our operator on the CPU path, and on the GPU when there is one, predicate and keys in
    // generated GPU code: "cold" streams the columns over PCIe on every query (no column
    // cache), "first" is a query's first run (the cache emptied before it: its columns are
    // shipped into the cache), "warm" reads them from the cache.
    let engine = |name, ctx, clear_cache| Engine {
        name,
        ctx,
        clear_cache,
        plans: None,
    };
    let cpu = GpuTopKConfig::default().with_backend(Backend::Cpu);
    let mut engines = vec![engine("cpu", ours(cpu), false)];
    if groups {
        // DataFusion with its own per-group top-k (`PartitionedTopKExec`), off by default.
        let topn = session(false, Backend::Cpu, true);
        topn.state_ref()
            .write()
            .config_mut()
            .options_mut()
            .optimizer
            .enable_window_topn = true;
        engines.insert(0, engine("DF topn", topn, false));
    }
    if let Some(device) = gpu() {
        let cuda = GpuTopKConfig::default().with_backend(Backend::Cuda);
        engines.push(engine(
            "cold",
            ours(cuda.clone().with_column_cache(false)),
            false,
        ));
        engines.push(engine("first", ours(cuda.clone()), true));
        if !parquet.is_empty() {
            // A first run over the files, their columns decoded on the host rather than
            // shipped as pages and decoded on the device.
            engines.push(engine(
                "first host-decoded",
                ours(cuda.clone().with_decode_parquet_on_device(false)),
                true,
            ));
        }
        engines.push(engine("warm", ours(cuda.clone()), false));
        if groups {
            // Warm, the kept rows copied out of the pinned buffers they are read back into
            // rather than kept in them (`gpu_topk.pinned_output_bytes = 0`).
            engines.push(engine(
                "warm copied",
                ours(cuda.clone().with_pinned_output_bytes(0)),
                false,
            ));
        }
        // Warm, each statement's plan reused (`PlanCache`): what is left is the run itself.
        engines.push(Engine {
            plans: Some(PlanCache::new()),
            ..engine("reused", ours(cuda), false)
        });
        // The default settings: the cost model picks the CPU path or the GPU, knowing which
        // columns are resident.
        engines.push(engine("auto", ours(GpuTopKConfig::default()), false));
        engines.push(engine("auto first", ours(GpuTopKConfig::default()), true));
        let rates = datafusion_gpu_topk::internal::device::measure::upload_rates(&device, 1 << 30)
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
        println!(
            "# {}: host to device {:.1} GB/s from pinned memory, {:.1} GB/s staged from \
             pageable memory ({:.0}%), {:.1} GB/s from registered pageable memory ({:.0}%; \
             {:.1} GB/s counting its registration)",
            device.name,
            rates.pinned,
            rates.staged,
            100.0 * rates.staged / rates.pinned,
            rates.registered,
            100.0 * rates.registered / rates.pinned,
            rates.registering
        );
    }
    // `--engines 'warm,auto'`: only these of ours (DataFusion always runs: it checks them).
    let wanted: String = arg("--engines", String::new());
    if !wanted.is_empty() {
        let wanted: Vec<&str> = wanted.split(',').map(str::trim).collect();
        let names: Vec<&str> = engines.iter().map(|e| e.name).collect();
        if let Some(unknown) = wanted.iter().find(|w| !names.contains(w)) {
            return Err(datafusion::error::DataFusionError::Plan(format!(
                "--engines: no engine '{unknown}' here; the engines are {}",
                names.join(", ")
            )));
        }
        engines.retain(|e| wanted.contains(&e.name));
    }
    let partitions = plain.copied_config().target_partitions();
    let started = Instant::now();
    // `--only 'Q1,Q2 k=50'`: the queries whose names start with one of these.
    let only: String = arg("--only", String::new());
    let only: Vec<&str> = only
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let queries = |sweep| {
        let all = match (lineitem.is_empty(), groups) {
            (false, _) => string_queries(),
            (true, true) => group_queries(),
            (true, false) if hits => hits::queries(rows),
            (true, false) => queries(sweep),
        };
        let wanted = |name: &str| only.is_empty() || only.iter().any(|o| name.starts_with(o));
        all.into_iter()
            .filter(|(name, _)| wanted(name))
            .collect::<Vec<_>>()
    };
    // The Parquet files DuckDB reads (`--duckdb`).
    let mut duck_files = String::new();
    // The generated table: the tweets, or with `--hits` the ClickBench-shaped hits.
    let table_name = if hits {
        hits::TABLE_NAME
    } else {
        tweets::TABLE_NAME
    };
    let generate = || -> Result<(SchemaRef, Vec<Vec<RecordBatch>>)> {
        Ok(match hits {
            true => (
                hits::hits_schema(),
                hits::hits_partitions(&HitsSpec::new(rows), partitions, 8192)?,
            ),
            false => (
                tweets::tweets_schema(),
                tweets::tweets_partitions(&TweetsSpec::new(rows), partitions, 8192)?,
            ),
        })
    };
    // The same batches: a MemTable for DataFusion, a GpuTable for our operator.
    let storage = if !lineitem.is_empty() {
        let source = register_lineitem(&lineitem, memory, &plain, &engines).await?;
        println!(
            "# {source} (ready in {:.1} s), {runs} runs each, median ms",
            started.elapsed().as_secs_f64()
        );
        "TPC-H lineitem"
    } else if parquet.is_empty() {
        let (schema, parts) = generate()?;
        if duckdb {
            // DuckDB loads the same rows from Parquet files.
            let dir =
                std::env::temp_dir().join(format!("gpu-topk-{table_name}-{rows}-{partitions}"));
            duck_files = dir.to_string_lossy().into_owned();
            write_parquet(&duck_files, &schema, parts.clone()).await?;
        }
        let table = std::sync::Arc::new(MemTable::try_new(schema.clone(), parts.clone())?);
        plain.register_table(table_name, table)?;
        let table = std::sync::Arc::new(GpuTable::try_new(schema, parts)?);
        for engine in &engines {
            engine.ctx.register_table(table_name, table.clone())?;
        }
        println!(
            "# {rows} {table_name} in memory ({partitions} partitions of 8192-row batches, generated in {:.1} s; \
             DataFusion reads a MemTable, ours a GpuTable of the same batches), {runs} runs each, median ms",
            started.elapsed().as_secs_f64()
        );
        "in memory"
    } else {
        let (schema, parts) = generate()?;
        let written = !std::path::Path::new(&parquet).exists();
        let bytes = write_parquet(&parquet, &schema, parts).await?;
        // Files found in the directory are described by what they are, not by how this writes.
        let written = match written {
            true => "uncompressed, row groups of 1M rows",
            false => "files found in the directory",
        };
        duck_files = parquet.clone();
        for ctx in std::iter::once(&plain).chain(engines.iter().map(|e| &e.ctx)) {
            ctx.register_parquet(table_name, &parquet, Default::default())
                .await?;
        }
        println!(
            "# {rows} {table_name} in Parquet files ({:.1} GB, {written}, ready in {:.1} s), {runs} \
             runs each, median ms",
            bytes as f64 / 1e9,
            started.elapsed().as_secs_f64()
        );
        "in Parquet files"
    };
    let duck = match duckdb {
        true => {
            let sources = if parquet.is_empty() {
                "memory"
            } else {
                "memory,parquet"
            };
            run_duckdb(table_name, &duck_files, sources, &queries(sweep), runs)?
        }
        false => Vec::new(),
    };
    let duck_sources: Vec<String> = duck.iter().fold(Vec::new(), |mut seen, r| {
        if !seen.contains(&r.source) {
            seen.push(r.source.clone());
        }
        seen
    });
    let mut header = format!("{:<14} {:>13}", "query", "DataFusion ms");
    for source in &duck_sources {
        header += &format!(" {:>17}", format!("DuckDB {source} ms"));
    }
    let mut lines = vec!["query,rows,engine,ms,datafusion_ms,ratio".to_string()];
    for engine in &engines {
        let name = engine.name;
        header += &format!(" {:>9} {:>7}", format!("{name} ms"), format!("{name}/DF"));
    }
    println!("{header}  same rows");
    let mut results = Vec::new();
    let mut answers = Vec::new();
    // The engine whose plans `--verbose` shows: the warm GPU's, else the CPU path's.
    let explained = if gpu().is_some() { "warm" } else { "cpu" };
    for (name, sql) in queries(sweep) {
        let (ms, want) = time_sql(&plain, &sql).await?;
        if verbose {
            eprintln!("# {name}: DataFusion checked run {ms:.1} ms");
        }
        let mut checked = vec![ms];
        let want = key_multiset(&want);
        let mut same = true;
        for engine in &engines {
            let (ms, got) = time_engine(engine, &sql).await?;
            checked.push(ms);
            if verbose {
                eprintln!("# {name}: {} checked run {ms:.1} ms", engine.name);
            }
            if verbose && (groups || hits) && engine.name == explained {
                // Where the time goes: the plan's metrics from EXPLAIN ANALYZE.
                let analyzed = engine.ctx.sql(&format!("EXPLAIN ANALYZE {sql}")).await?;
                let text = datafusion::arrow::util::pretty::pretty_format_batches(
                    &analyzed.collect().await?,
                )?
                .to_string();
                for line in text.lines().filter(|l| l.contains("Exec")) {
                    eprintln!("#   {}", line.trim_matches(|c: char| c == '|' || c == ' '));
                }
            }
            same &= key_multiset(&got) == want;
        }
        let mut times = vec![Vec::new(); engines.len() + 1];
        for _ in 0..runs {
            times[0].push(time_sql(&plain, &sql).await?.0);
            for (e, engine) in engines.iter().enumerate() {
                times[e + 1].push(time_engine(engine, &sql).await?.0);
            }
        }
        let medians: Vec<f64> = match runs {
            0 => checked,
            _ => times.into_iter().map(median).collect(),
        };
        let mut line = format!("{name:<14} {:>13.1}", medians[0]);
        for result in duck.iter().filter(|r| r.name == name) {
            line += &format!(" {:>17.1}", result.median_ms);
            lines.push(format!(
                "{name},{rows},duckdb {},{:.3},{:.3},{:.4}",
                result.source,
                result.median_ms,
                medians[0],
                result.median_ms / medians[0]
            ));
            same &= result.keys == want;
        }
        for (e, engine) in engines.iter().enumerate() {
            let (ms, ratio) = (medians[e + 1], medians[e + 1] / medians[0]);
            line += &format!(" {ms:>9.1} {ratio:>7.2}");
            lines.push(format!(
                "{name},{rows},{},{ms:.3},{:.3},{ratio:.4}",
                engine.name, medians[0]
            ));
        }
        println!("{line}  {}", if same { "yes" } else { "NO" });
        assert!(same, "{name}: results differ from DataFusion's");
        answers.push(format!("{name}: {}", want.join(" ")));
        results.push((name, medians));
    }
    if groups {
        // To compare with `benches/duckdb_topk.py --tweets`, which prints the same.
        println!(
            "# answers (sum of the kept rows' ids): {}",
            answers.join("; ")
        );
    }
    if !csv.is_empty() {
        std::fs::write(&csv, lines.join("\n") + "\n")?;
    }
    if !plots.is_empty() {
        let mut names = vec!["DataFusion"];
        names.extend(engines.iter().map(|e| e.name));
        let machine = gpu().map_or("no GPU".to_string(), |d| d.name.clone());
        std::fs::create_dir_all(&plots)?;
        for (prefix, file, title, x_label) in [
            (
                "Q1 sel=",
                "q1.svg",
                "Q1: top 50 by retweets, filtered",
                "selectivity",
            ),
            ("Q2 k=", "q2.svg", "Q2: top k by a computed score", "k"),
        ] {
            let points: Vec<(String, &Vec<f64>)> = results
                .iter()
                .filter_map(|(n, m)| n.strip_prefix(prefix).map(|x| (x.to_string(), m)))
                .collect();
            let title = format!("{title}, {rows} rows {storage}, {machine}");
            std::fs::write(
                format!("{plots}/{file}"),
                svg_plot(&title, x_label, &names, &points),
            )?;
        }
    }
    if profile {
        // Where a query's time goes: its first and its warm runs on the GPU (the CPU path
        // without a GPU).
        let gpu_present = engines.iter().any(|e| e.name == "warm");
        let profiled = engines.iter().filter(|e| match gpu_present {
            true => ["first", "first host-decoded", "warm", "reused"].contains(&e.name),
            false => e.name == "cpu",
        });
        for engine in profiled {
            println!("# where the time goes ({}):", engine.name);
            for (name, sql) in queries(sweep) {
                if engine.clear_cache
                    && let Some(device) = gpu()
                {
                    device.column_cache.clear();
                }
                println!("{name:<14} {}", profile_query(engine, &sql).await?);
            }
        }
    }
    if clients > 0 {
        let warm = engines.iter().find(|e| e.name == "warm");
        if let Some(warm) = warm {
            concurrent(&plain, &warm.ctx, clients, runs).await?;
        }
    }
    Ok(())
}

/// The tweets as Parquet files in `dir`, one per partition (written on all cores, unless
/// the directory holds them already): their bytes.
async fn write_parquet(
    dir: &str,
    schema: &datafusion::arrow::datatypes::SchemaRef,
    parts: Vec<Vec<RecordBatch>>,
) -> Result<u64> {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let dir = std::path::PathBuf::from(dir);
    if !dir.exists() {
        let partial = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial)?;
        let mut writers = tokio::task::JoinSet::new();
        for (p, batches) in parts.into_iter().enumerate() {
            let path = partial.join(format!("part-{p:04}.parquet"));
            let schema = schema.clone();
            writers.spawn_blocking(move || -> Result<()> {
                let properties = WriterProperties::builder()
                    .set_max_row_group_row_count(Some(1 << 20))
                    .build();
                let file = std::fs::File::create(path)?;
                let mut writer = ArrowWriter::try_new(file, schema, Some(properties))?;
                for batch in &batches {
                    writer.write(batch)?;
                }
                writer.close()?;
                Ok(())
            });
        }
        while let Some(written) = writers.join_next().await {
            written.map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))??;
        }
        std::fs::rename(&partial, &dir)?;
    }
    let mut bytes = 0;
    for file in std::fs::read_dir(&dir)? {
        bytes += file?.metadata()?.len();
    }
    Ok(bytes)
}

/// One run of `sql`, timed by phase (SQL to logical plan, physical planning, execution; a
/// reused plan's lookup as its physical planning), with the operator's own metrics.
async fn profile_query(engine: &Engine, sql: &str) -> Result<String> {
    use datafusion::physical_plan::{ExecutionPlan, collect};
    let ctx = &engine.ctx;
    let started = Instant::now();
    let (logical, plan, reused) = match &engine.plans {
        Some(plans) => {
            let planned = plans.plan(ctx, sql).await?;
            (0.0, std::sync::Arc::clone(planned.plan()), Some(planned))
        }
        None => {
            let frame = ctx.sql(sql).await?;
            let logical = started.elapsed().as_secs_f64() * 1e3;
            (logical, frame.create_physical_plan().await?, None)
        }
    };
    let physical = started.elapsed().as_secs_f64() * 1e3 - logical;
    let executing = Instant::now();
    match reused {
        Some(planned) => planned.collect().await?,
        None => collect(std::sync::Arc::clone(&plan), ctx.task_ctx()).await?,
    };
    let execute = executing.elapsed().as_secs_f64() * 1e3;
    // A load the run left in the background is not the next run's.
    while datafusion_gpu_topk::internal::exec::warming_up() {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    fn operator(plan: &std::sync::Arc<dyn ExecutionPlan>) -> Option<String> {
        if let Some(exec) = plan.downcast_ref::<datafusion_gpu_topk::GpuTopKExec>() {
            let metrics = plan.metrics()?.aggregate_by_name().sorted_for_display();
            let fell_back = exec.fallback_reason().unwrap_or_default();
            return Some(format!("{} {fell_back}", metrics.timestamps_removed()));
        }
        if plan
            .downcast_ref::<datafusion_gpu_topk::GpuAggregateTopKExec>()
            .is_some()
        {
            let metrics = plan.metrics()?.aggregate_by_name().sorted_for_display();
            return Some(format!("aggregate top-k {}", metrics.timestamps_removed()));
        }
        plan.children().into_iter().find_map(operator)
    }
    Ok(format!(
        "logical {logical:.2} ms, physical {physical:.2} ms, execute {execute:.2} ms; {}",
        operator(&plan).unwrap_or_else(|| "DataFusion's TopK".into())
    ))
}

/// `clients` concurrent clients each running Q1–Q3 `runs` times against one resident table,
/// against the same queries back to back: throughput, answers, and the cache's bytes after.
async fn concurrent(
    plain: &datafusion::prelude::SessionContext,
    ctx: &datafusion::prelude::SessionContext,
    clients: usize,
    runs: usize,
) -> Result<()> {
    let mix: Vec<String> = vec![
        tweets::q1_with_selectivity(0.5),
        "SELECT id, retweet_count + 0.5 * likes_count AS score FROM tweets ORDER BY retweet_count + 0.5 * likes_count DESC LIMIT 50".into(),
        "SELECT id, retweet_count FROM tweets WHERE lang = 'en' OR lang = 'es' ORDER BY retweet_count DESC LIMIT 1000".into(),
    ];
    let mut want = Vec::new();
    for sql in &mix {
        want.push(key_multiset(&time_sql(plain, sql).await?.1));
        time_sql(ctx, sql).await?; // resident
    }
    let started = Instant::now();
    for _ in 0..clients * runs {
        for sql in &mix {
            time_sql(ctx, sql).await?;
        }
    }
    let serial = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (ctx, mix, want) = (ctx.clone(), mix.clone(), want.clone());
            tokio::spawn(async move {
                for _ in 0..runs {
                    for (sql, want) in mix.iter().zip(&want) {
                        let (_, got) = time_sql(&ctx, sql).await?;
                        assert!(
                            key_multiset(&got) == *want,
                            "{sql}: a concurrent answer differs"
                        );
                    }
                }
                Result::<()>::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await
            .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))??;
    }
    let parallel = started.elapsed().as_secs_f64();
    let queries = (clients * runs * mix.len()) as f64;
    let cached = gpu().map_or(0, |d| d.column_cache.bytes());
    println!(
        "# {clients} concurrent clients, Q1 sel=0.5 / Q2 k=50 / Q3 k=1000 warm: {:.0} queries/s \
         ({:.0} back to back, {:.2}x), answers checked; column cache {:.2} GB after",
        queries / parallel,
        queries / serial,
        serial / parallel,
        cached as f64 / 1e9
    );
    Ok(())
}

/// A line plot of milliseconds (log scale) against the points' labels, one line per engine
/// (`points[i].1[e]`: engine `e`'s median at point `i`), as SVG.
fn svg_plot(
    title: &str,
    x_label: &str,
    engines: &[&str],
    points: &[(String, &Vec<f64>)],
) -> String {
    const COLOURS: [&str; 6] = [
        "#444444", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#d62728",
    ];
    let (width, height, left, right, top, bottom) = (760.0, 440.0, 70.0, 150.0, 40.0, 50.0);
    let values = points.iter().flat_map(|(_, m)| m.iter().copied());
    let values: Vec<f64> = values.filter(|v| v.is_finite() && *v > 0.0).collect();
    let lo = values
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-3);
    let hi = values.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
    let (lo_exp, hi_exp) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let plot_w = width - left - right;
    let plot_h = height - top - bottom;
    let x = |i: usize| left + plot_w * (i as f64 + 0.5) / points.len().max(1) as f64;
    let y = |v: f64| {
        let t = (v.log10() - lo_exp as f64) / f64::from((hi_exp - lo_exp).max(1));
        top + plot_h * (1.0 - t)
    };
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\n",
        width / 2.0
    );
    for e in lo_exp..=hi_exp {
        let v = 10f64.powi(e);
        svg += &format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#dddddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v} ms</text>\n",
            left + plot_w,
            left - 6.0,
            y(v) + 4.0,
            y = y(v)
        );
    }
    for (i, (label, _)) in points.iter().enumerate() {
        svg += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>\n",
            x(i),
            top + plot_h + 18.0
        );
    }
    svg += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x_label}</text>\n",
        left + plot_w / 2.0,
        height - 8.0
    );
    for (e, engine) in engines.iter().enumerate() {
        let colour = COLOURS[e % COLOURS.len()];
        let line: Vec<String> = (points.iter().enumerate())
            .filter(|(_, (_, m))| m[e] > 0.0)
            .map(|(i, (_, m))| format!("{:.1},{:.1}", x(i), y(m[e])))
            .collect();
        svg += &format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>\n",
            line.join(" ")
        );
        for point in &line {
            let (px, py) = point.split_once(',').unwrap_or(("0", "0"));
            svg += &format!("<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"{colour}\"/>\n");
        }
        let ly = top + 16.0 * e as f64 + 8.0;
        svg += &format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\"/>\
             <text x=\"{}\" y=\"{}\">{engine}</text>\n",
            width - right + 12.0,
            width - right + 36.0,
            width - right + 42.0,
            ly + 4.0
        );
    }
    svg + "</svg>\n"
}
