//! Fusion benchmark (`PhysicalExpr` → CUDA): the tweet queries on device-resident columns,
//! fused vs unfused vs DataFusion on the CPU, in one run.
//!
//! ```text
//! cargo bench --bench fused -- [--rows N] [--runs R] [--csv FILE] [--quick] [--only PREFIX]
//!     [--sample-rows N] [--device-only]
//! ```
//!
//! Defaults: 20M rows, R = 5. `--quick`: Q1 at selectivity 0, 0.5, 1 and Q2 at k = 50 and 10^5.
//! `--only`: the queries whose name starts with PREFIX (e.g. `"Q2 k=50"`), e.g. under a profiler.
//! `--sample-rows N`: the fused selection's sample size (default `FUSED_SAMPLE_ROWS`).
//! `--device-only`: DataFusion answers once, as the oracle, and is not timed (its column reads
//! NaN): for comparing device variants in a short run.
//!
//! The tweets table (`datasets/`) is generated once: as a DataFusion `MemTable` (one partition
//! per core, 8192-row batches) and, concatenated, as one column per table column. Per query:
//! - our rule plans it (CUDA backend, expressions fused) and its generated program is taken
//!   from the `GpuTopKExec`; the query's input columns (only those it reads) are uploaded once;
//! - **floor**: one read of those columns' bytes (read_floor.cu), after an L2 flush;
//! - **fused**: the program's pass is the first pass of a sampled selection (a strided sample
//!   sets the threshold, the full pass appends only rows beating it; see
//!   `TopKEngine::fused_select`), then the final selection and sort;
//! - **unfused**: the program writes every passing row's (key, row id), then the same
//!   selection runs on them (a filter kernel, then top-k);
//! - **DataFusion**: the SQL on plain DataFusion over the `MemTable`, all cores.
//!
//! Device times are CUDA-event times of the whole selection after an L2 flush, host round
//! trips inside it included, up to the GPU's end of its last kernel (the phase times are read
//! after that, `TopKEngine::fused_phases_ms`); every time is the median of R runs after a
//! warm-up. Before timing, both device results are checked against DataFusion's answer to the
//! query with `, id` appended to its ORDER BY (ids ascend with the row position: our tie
//! order): the same ids in the same order, or the run fails. Q1 sweeps the selectivity 0–1 in
//! steps of 0.1 (k = 50), Q2 sweeps k, Q3 runs at k = 50 and 1000. Without a GPU it says so and
//! exits 0.

mod common;

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::compute::concat;
use datafusion::arrow::datatypes::Int64Type;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use datafusion_gpu_topk::Backend;
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::internal::device::measure::{ReadFloor, median};
use datafusion_gpu_topk::internal::device::{
    DeviceAlgorithm, FUSED_SAMPLE_ROWS, GpuTimer, TopKEngine, gpu,
};
use datafusion_gpu_topk::internal::exec::GpuTopKExec;
use datafusion_gpu_topk::internal::fusion::{ENTRY, Part};
use datafusion_gpu_topk::internal::select::ResidentColumns;

use common::{arg, session, time_sql};

/// One benchmark query: its name, selectivity or k, and the SQL with a tie-break slot.
struct Query {
    name: String,
    sql: Box<dyn Fn(&str) -> String>,
}

fn queries(quick: bool) -> Vec<Query> {
    let mut q = Vec::new();
    let sels: Vec<f64> = if quick {
        vec![0.0, 0.5, 1.0]
    } else {
        (0..=10).map(|i| f64::from(i) / 10.0).collect()
    };
    for sel in sels {
        let bound = tweets::time_bound_for_selectivity(sel);
        q.push(Query {
            name: format!("Q1 sel={sel:.1}"),
            sql: Box::new(move |tie| {
                format!(
                    "SELECT id FROM tweets WHERE tweet_time < '{bound}' \
                     ORDER BY retweet_count DESC{tie} LIMIT 50"
                )
            }),
        });
    }
    let ks: &[usize] = if quick {
        &[50, 100_000]
    } else {
        &[1, 50, 1000, 10_000, 100_000, 1_000_000]
    };
    for &k in ks {
        q.push(Query {
            name: format!("Q2 k={k}"),
            sql: Box::new(move |tie| {
                format!(
                    "SELECT id FROM tweets ORDER BY retweet_count + 0.5 * likes_count DESC{tie} \
                     LIMIT {k}"
                )
            }),
        });
    }
    for k in [50, 1000] {
        q.push(Query {
            name: format!("Q3 k={k}"),
            sql: Box::new(move |tie| {
                format!(
                    "SELECT id FROM tweets WHERE lang = 'en' OR lang = 'es' \
                     ORDER BY retweet_count DESC{tie} LIMIT {k}"
                )
            }),
        });
    }
    q
}

fn find_topk(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuTopKExec> {
    if let Some(exec) = plan.downcast_ref::<GpuTopKExec>() {
        return Some(exec);
    }
    plan.children().into_iter().find_map(find_topk)
}

fn bench_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

/// The `id` column of `batches` (a query's output), as a list.
fn ids_of(batches: &[RecordBatch]) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
        .collect()
}

#[tokio::main]
async fn main() -> Result<()> {
    let rows: u64 = arg("--rows", 20_000_000);
    let runs: usize = arg("--runs", 5);
    let csv: String = arg("--csv", String::new());
    let quick = std::env::args().any(|a| a == "--quick");
    let only: String = arg("--only", String::new());
    let sample_rows: usize = arg("--sample-rows", FUSED_SAMPLE_ROWS);
    let device_only = std::env::args().any(|a| a == "--device-only");
    let Some(device) = gpu() else {
        println!("no GPU: the fusion benchmark runs on device-resident columns");
        return Ok(());
    };
    let plain = session(false, Backend::Cuda, true);
    let ours = session(true, Backend::Cuda, true);
    let partitions = plain.copied_config().target_partitions();
    let started = Instant::now();
    let spec = TweetsSpec::new(rows);
    let parts = tweets::tweets_partitions(&spec, partitions, 8192)?;
    let table = Arc::new(datafusion::datasource::MemTable::try_new(
        tweets::tweets_schema(),
        parts.clone(),
    )?);
    plain.register_table("tweets", table.clone())?;
    ours.register_table("tweets", table)?;
    // The whole table as one batch: row i is the i-th row of the partitions in order.
    let batches: Vec<&RecordBatch> = parts.iter().flatten().collect();
    let schema = tweets::tweets_schema();
    let columns: Vec<ArrayRef> = (0..schema.fields().len())
        .map(|c| {
            let chunks: Vec<&dyn Array> = batches.iter().map(|b| b.column(c).as_ref()).collect();
            concat(&chunks)
        })
        .collect::<std::result::Result<_, _>>()?;
    drop(batches);
    drop(parts);
    let whole = RecordBatch::try_new(schema.clone(), columns)?;
    let table_ids = whole
        .column_by_name("id")
        .expect("the tweets table has ids")
        .as_primitive::<Int64Type>()
        .clone();
    println!(
        "# {rows} tweets ({partitions} partitions for DataFusion, generated in {:.1} s), \
         {runs} runs each, median ms; device: {}",
        started.elapsed().as_secs_f64(),
        device.name
    );
    println!(
        "{:<13} {:>10} {:>8} {:>8} {:>12} {:>14} {:>9} {:>8} {:>11} {:>7}  fused phases, device ms",
        "query",
        "passed",
        "read GB",
        "floor ms",
        "fused ms (×)",
        "unfused ms (×)",
        "DF ms",
        "DF/fused",
        "candidates",
        "reruns"
    );
    println!("{:>124}", "sample pass/sample select/pass/select");
    let mut lines = vec![
        "query,rows,passed,read_bytes,floor_ms,fused_ms,unfused_ms,datafusion_ms,candidates,reruns,\
         sample_pass_ms,sample_select_ms,pass_ms,select_ms,packed_bits"
            .to_string(),
    ];
    let mut engine_cache: Vec<(datafusion_gpu_topk::internal::device::KeyWidth, TopKEngine)> =
        Vec::new();
    for query in queries(quick) {
        if !query.name.starts_with(&only) {
            continue;
        }
        let sql = (query.sql)("");
        let plan = ours.sql(&sql).await?.create_physical_plan().await?;
        let exec = find_topk(&plan)
            .ok_or_else(|| bench_error(format!("{}: our rule did not plan it", query.name)))?;
        let topk = exec.spec();
        let fusion = &topk.fusion;
        if fusion.keys != Part::Gpu || fusion.filter.as_ref().is_some_and(|f| *f != Part::Gpu) {
            return Err(bench_error(format!(
                "{}: not fully fused ({})",
                query.name,
                fusion.describe(true)
            )));
        }
        let program = fusion
            .program
            .clone()
            .expect("keys on the GPU have a program");
        let input_schema = exec.input().schema();
        let projection: Vec<usize> = input_schema
            .fields()
            .iter()
            .map(|f| schema.index_of(f.name()))
            .collect::<std::result::Result<_, _>>()?;
        let input = whole.project(&projection)?;
        let (kernel, _) = device
            .generated_kernel(&program.source, ENTRY)
            .map_err(|e| bench_error(e.to_string()))?;
        let kind = program.key_kind;
        if !engine_cache.iter().any(|(k, _)| *k == kind) {
            let engine = TopKEngine::new(&device, kind).map_err(|e| bench_error(e.to_string()))?;
            engine_cache.push((kind, engine));
        }
        let engine = &mut engine_cache
            .iter_mut()
            .find(|(k, _)| *k == kind)
            .expect("added above")
            .1;
        let arrays = ResidentColumns::program_inputs(&program, &input)?;
        let resident = ResidentColumns::upload(engine, &program, &arrays)?;
        drop(arrays);
        let k = topk.k;
        let algorithm = DeviceAlgorithm::Sample;

        // Correctness first: both device paths against DataFusion with the tie order made
        // explicit.
        let (_, want) = time_sql(&plain, &(query.sql)(", id")).await?;
        let want = ids_of(&want);
        // The oracle's memory is freed after it returns (see DataFusion's timed runs below).
        std::thread::sleep(std::time::Duration::from_millis(1000));
        let mut report = None;
        for fused in [true, false] {
            let sample = if fused { sample_rows } else { 0 };
            let (positions, r) = resident.top_k(engine, &kernel, k, algorithm, sample)?;
            let got: Vec<i64> = positions
                .iter()
                .skip(topk.skip)
                .map(|&p| table_ids.value(p as usize))
                .collect();
            if got != want {
                return Err(bench_error(format!(
                    "{} ({}): the device result differs from DataFusion's: {} vs {} rows, \
                     first difference at {:?}",
                    query.name,
                    if fused { "fused" } else { "unfused" },
                    got.len(),
                    want.len(),
                    got.iter().zip(&want).position(|(a, b)| a != b)
                )));
            }
            if fused {
                report = Some(r);
            }
        }
        let report = report.expect("the fused run sets it");

        let floor = ReadFloor::new(&device, engine).map_err(|e| bench_error(e.to_string()))?;
        let mut floor_ms = Vec::new();
        let mut fused_ms = Vec::new();
        let mut unfused_ms = Vec::new();
        let mut df_ms = Vec::new();
        let mut phase_ms: [Vec<f64>; 4] = Default::default();
        for rep in 0..=runs {
            let timed = |engine: &mut TopKEngine, fused: bool| -> Result<(f64, [f64; 4])> {
                floor
                    .flush_l2(engine)
                    .map_err(|e| bench_error(e.to_string()))?;
                let timer =
                    GpuTimer::start(engine.stream()).map_err(|e| bench_error(e.to_string()))?;
                let sample = if fused { sample_rows } else { 0 };
                resident.run(engine, &kernel, k, algorithm, sample)?;
                let ms = f64::from(timer.stop().map_err(|e| bench_error(e.to_string()))?);
                let phases = engine
                    .fused_phases_ms()
                    .map_err(|e| bench_error(e.to_string()))?;
                Ok((ms, phases))
            };
            floor
                .flush_l2(engine)
                .map_err(|e| bench_error(e.to_string()))?;
            floor
                .zero_out(engine)
                .map_err(|e| bench_error(e.to_string()))?;
            let timer = GpuTimer::start(engine.stream()).map_err(|e| bench_error(e.to_string()))?;
            for &(ptr, bytes) in resident.row_buffers() {
                floor
                    .launch(engine, ptr, bytes / 4, 4)
                    .map_err(|e| bench_error(e.to_string()))?;
            }
            let f = f64::from(timer.stop().map_err(|e| bench_error(e.to_string()))?);
            let (a, phases) = timed(engine, true)?;
            let (b, _) = timed(engine, false)?;
            if rep > 0 {
                floor_ms.push(f);
                fused_ms.push(a);
                unfused_ms.push(b);
                for (p, t) in phase_ms.iter_mut().zip(phases) {
                    p.push(t);
                }
            }
        }
        // DataFusion's runs after the device's: its threads free a run's memory after it
        // returns, and that work (page unmapping shoots down TLBs on every core of the process)
        // stalls the host thread of a device run right after it and, even after a pause, slows
        // the device's short selections.
        if !device_only {
            for rep in 0..=runs {
                let (d, _) = time_sql(&plain, &sql).await?;
                if rep > 0 {
                    df_ms.push(d);
                }
            }
        }
        let (f, a, b, d) = (
            median(&mut floor_ms),
            median(&mut fused_ms),
            median(&mut unfused_ms),
            median(&mut df_ms),
        );
        let bytes = resident.row_bytes();
        let phases: Vec<f64> = phase_ms.iter_mut().map(|p| median(p)).collect();
        println!(
            "{:<13} {:>10} {:>8.2} {:>8.3} {:>7.3} ({:.2}) {:>8.3} ({:.2}) {:>9.1} {:>8.0} {:>11} {:>7}  \
             {:.3}/{:.3}/{:.3}/{:.3}",
            query.name,
            report.passed,
            bytes as f64 / 1e9,
            f,
            a,
            a / f,
            b,
            b / f,
            d,
            d / a,
            report.candidates,
            report.reruns,
            phases[0],
            phases[1],
            phases[2],
            phases[3]
        );
        lines.push(format!(
            "{},{rows},{},{bytes},{f:.4},{a:.4},{b:.4},{d:.2},{},{},{:.4},{:.4},{:.4},{:.4},{}",
            query.name,
            report.passed,
            report.candidates,
            report.reruns,
            phases[0],
            phases[1],
            phases[2],
            phases[3],
            report.packed_bits
        ));
    }
    if !csv.is_empty() {
        std::fs::write(&csv, lines.join("\n") + "\n")?;
    }
    Ok(())
}
