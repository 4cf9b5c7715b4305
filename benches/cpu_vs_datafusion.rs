//! Our operator (CPU path, and CUDA when a GPU is present: cold, its columns shipped over PCIe
//! on every query, and warm, read from the device's column cache) against DataFusion's own
//! TopK on the tweet queries: same machine, same run, same in-memory table, end to end.
//!
//! ```text
//! cargo bench --bench cpu_vs_datafusion -- [--rows N] [--runs R] [--csv FILE] [--sweep]
//! ```
//!
//! Each query runs R times per engine (after one warm-up), alternating engines; the table shows
//! medians and the ratio ours / DataFusion (CPU path target: ≤ 2). Results are checked to be the same
//! rows as DataFusion's (as multisets of the sort-key values, since DataFusion orders ties
//! arbitrarily).

mod common;

use std::time::Instant;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::error::Result;
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::internal::device::gpu;
use datafusion_gpu_topk::{Backend, GpuTopKConfig};

use common::{arg, session, session_with, time_sql};

/// The tweet queries: Q1 at a few selectivities, Q2 at a few k, Q3, Q4; with `sweep`, Q1 at
/// selectivities 0 to 1 in steps of 0.1 and Q2 over more k.
fn queries(sweep: bool) -> Vec<(String, String)> {
    let mut q = Vec::new();
    let selectivities: Vec<f64> = if sweep {
        (0..=10).map(|i| f64::from(i) / 10.0).collect()
    } else {
        vec![0.1, 0.5, 1.0]
    };
    let ks: &[usize] = if sweep {
        &[1, 50, 1000, 10_000, 100_000]
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

#[tokio::main]
async fn main() -> Result<()> {
    let rows: u64 = arg("--rows", 20_000_000);
    let runs: usize = arg("--runs", 5);
    let csv: String = arg("--csv", String::new());
    let sweep = std::env::args().any(|a| a == "--sweep");
    let plain = session(false, Backend::Cpu, true);
    // Our operator on the CPU path, and on the GPU when there is one, predicate and keys in
    // generated GPU code: "cold" ships the columns over PCIe on every query (no column
    // cache), "warm" reads them from the device's column cache (filled by the checked run).
    let mut engines = vec![("cpu", session(true, Backend::Cpu, true))];
    if gpu().is_some() {
        let cuda = GpuTopKConfig::default().with_backend(Backend::Cuda);
        engines.push(("cold", session_with(cuda.clone().with_cache_bytes(Some(0)))));
        engines.push(("warm", session_with(cuda)));
        // The default settings: the cost model picks the CPU path or the GPU, knowing which
        // columns are resident.
        engines.push(("auto", session_with(GpuTopKConfig::default())));
    }
    let partitions = plain.copied_config().target_partitions();
    let started = Instant::now();
    let table = tweets::tweets_mem_table(&TweetsSpec::new(rows), partitions)?;
    plain.register_table("tweets", table.clone())?;
    for (_, ctx) in &engines {
        ctx.register_table("tweets", table.clone())?;
    }
    println!(
        "# {rows} tweets in memory ({partitions} partitions, generated in {:.1} s), {runs} runs each, median ms",
        started.elapsed().as_secs_f64()
    );
    let mut header = format!("{:<14} {:>13}", "query", "DataFusion ms");
    let mut lines = vec!["query,rows,engine,ms,datafusion_ms,ratio".to_string()];
    for (name, _) in &engines {
        header += &format!(" {:>9} {:>7}", format!("{name} ms"), format!("{name}/DF"));
    }
    println!("{header}  same rows");
    for (name, sql) in queries(sweep) {
        let (_, want) = time_sql(&plain, &sql).await?;
        let want = key_multiset(&want);
        let mut same = true;
        for (_, ctx) in &engines {
            same &= key_multiset(&time_sql(ctx, &sql).await?.1) == want;
        }
        let mut times = vec![Vec::new(); engines.len() + 1];
        for _ in 0..runs {
            times[0].push(time_sql(&plain, &sql).await?.0);
            for (e, (_, ctx)) in engines.iter().enumerate() {
                times[e + 1].push(time_sql(ctx, &sql).await?.0);
            }
        }
        let medians: Vec<f64> = times.into_iter().map(median).collect();
        let mut line = format!("{name:<14} {:>13.1}", medians[0]);
        for (e, (engine, _)) in engines.iter().enumerate() {
            let (ms, ratio) = (medians[e + 1], medians[e + 1] / medians[0]);
            line += &format!(" {ms:>9.1} {ratio:>7.2}");
            lines.push(format!(
                "{name},{rows},{engine},{ms:.2},{:.2},{ratio:.3}",
                medians[0]
            ));
        }
        println!("{line}  {}", if same { "yes" } else { "NO" });
        assert!(same, "{name}: results differ from DataFusion's");
    }
    if !csv.is_empty() {
        std::fs::write(&csv, lines.join("\n") + "\n")?;
    }
    Ok(())
}
