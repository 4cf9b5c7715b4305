//! Bad input gives a clear error, never a panic or a wrong answer:
//!
//! - Malformed SQL through a session with the operator: DataFusion's own error.
//! - Bad `SET gpu_topk.*` values and unknown settings: an error naming the setting and the
//!   accepted values; the session keeps working with its old settings.
//! - Unreadable, truncated or malformed Parquet and CSV files, and missing paths: a top-k
//!   query gives the error plain DataFusion gives, at the same step (registration, planning
//!   or execution), never an empty or partial result.
//! - The `gpu-topk` CLI with bad arguments or bad files: a non-zero exit code and a short
//!   error on stderr (with the usage for argument errors), no panic.
//! - A kernel directory (`GPU_TOPK_KERNEL_DIR`) with a broken or missing `.cu` file: on a GPU,
//!   the query still answers, on the CPU path, and the CLI says which file is at fault.
//! - A wrong or broken CUDA library: the GPU is unusable, with the reason; no crash.

use std::path::{Path, PathBuf};
#[cfg(feature = "cli")]
use std::process::{Command, Output};
use std::sync::Arc;

use datafusion::arrow::array::{Float64Array, Int64Array, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::physical_plan::collect;
use datafusion::prelude::{CsvReadOptions, ParquetReadOptions, SessionConfig, SessionContext};
#[cfg(feature = "cli")]
use datafusion_gpu_topk::internal::device::options::KERNEL_DIR_ENV;
#[cfg(feature = "cli")]
use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};

use crate::common::{count_gpu_topk, exact_rows, register, run, session, test_dir};

/// Plain DataFusion, without the operator, configured as [`session`] is.
fn plain_datafusion() -> SessionContext {
    SessionContext::new_with_config(
        SessionConfig::new()
            .with_target_partitions(2)
            .with_batch_size(100),
    )
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
        Field::new("f", DataType::Float64, false),
    ]))
}

/// `rows` rows: `id` the position, `v` a scrambled value with ties, `f` a float.
fn batch(rows: i64) -> RecordBatch {
    let ids: Vec<i64> = (0..rows).collect();
    let v: Vec<i64> = ids.iter().map(|i| (i * 7919) % 997).collect();
    let f: Vec<f64> = ids.iter().map(|&i| i as f64 * 0.5 - 100.0).collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids)),
            Arc::new(Int64Array::from(v)),
            Arc::new(Float64Array::from(f)),
        ],
    )
    .expect("batch")
}

/// `batch(rows)` as a Parquet file of row groups of 100 rows.
fn write_parquet(path: &Path, rows: i64) {
    use datafusion::parquet::arrow::ArrowWriter;
    use datafusion::parquet::file::properties::WriterProperties;
    let properties = WriterProperties::builder()
        .set_max_row_group_row_count(Some(100))
        .build();
    let file = std::fs::File::create(path).expect("create parquet");
    let mut writer = ArrowWriter::try_new(file, schema(), Some(properties)).expect("writer");
    writer.write(&batch(rows)).expect("write parquet");
    writer.close().expect("close parquet");
}

/// `batch(rows)` as CSV text with a header, one line per row.
fn csv_lines(rows: i64) -> Vec<String> {
    let b = batch(rows);
    let (id, v, f) = (
        b.column(0).as_any().downcast_ref::<Int64Array>().unwrap(),
        b.column(1).as_any().downcast_ref::<Int64Array>().unwrap(),
        b.column(2).as_any().downcast_ref::<Float64Array>().unwrap(),
    );
    std::iter::once("id,v,f".to_string())
        .chain((0..b.num_rows()).map(|r| format!("{},{},{}", id.value(r), v.value(r), f.value(r))))
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").expect("write csv");
}

/// The top-k queries run over every bad file: plain, descending with an offset, and on an
/// expression, so that the operator holds rows when the input fails. Each reads `v`, the
/// column the CSV cases spoil (an unread column is not parsed).
const TOPK_QUERIES: &[&str] = &[
    "SELECT id, v FROM t ORDER BY v, id LIMIT 5",
    "SELECT id, v, f FROM t ORDER BY f DESC LIMIT 7 OFFSET 2",
    "SELECT id FROM t WHERE v > 10 ORDER BY v * 2 + id LIMIT 3",
];

// ---- 1. SQL ----------------------------------------------------------------------------------

#[tokio::test]
async fn malformed_sql_fails_as_in_datafusion() {
    let ours = session(true, 2, 100);
    let plain = plain_datafusion();
    for ctx in [&ours, &plain] {
        register(ctx, "t", vec![vec![batch(300)]]);
    }
    // (SQL, a fragment the error must contain.)
    let cases = [
        ("SELEC nonsense", "SELEC"),
        ("SELECT id FROM t ORDER BY LIMIT 3", "found: 3"),
        (
            "SELECT id FROM t ORDER BY v LIMIT 'three'",
            "LIMIT to be an integer",
        ),
        ("SELECT id FROM t ORDER BY v LIMIT -1", "LIMIT"),
        ("SELECT nope FROM t ORDER BY nope LIMIT 3", "nope"),
        ("SELECT id FROM missing ORDER BY id LIMIT 3", "missing"),
        ("SELECT id FROM t ORDER BY v + 'x' LIMIT 3", "Utf8"),
    ];
    for (sql, fragment) in cases {
        let got = run(&ours, sql).await.map(|b| exact_rows(&b));
        let want = run(&plain, sql).await.map(|b| exact_rows(&b));
        let (Err(got), Err(want)) = (got, want) else {
            panic!("{sql}: expected an error from both sessions");
        };
        assert_eq!(got.to_string(), want.to_string(), "{sql}");
        assert!(got.to_string().contains(fragment), "{sql}: {got}");
    }
}

// ---- 2. Settings -----------------------------------------------------------------------------

#[tokio::test]
async fn bad_settings_name_the_setting_and_the_accepted_values() {
    let ctx = session(true, 2, 100);
    register(&ctx, "t", vec![vec![batch(300)]]);
    let sql = "SELECT id, v FROM t ORDER BY v, id LIMIT 4";
    let want = exact_rows(&run(&plain_datafusion_with_t(), sql).await.unwrap());
    // (Statement, fragments its error must contain.)
    let cases: &[(&str, &[&str])] = &[
        (
            "SET gpu_topk.backend = 'x'",
            &["gpu_topk.backend", "'x'", "auto, cuda, cpu"],
        ),
        (
            "SET gpu_topk.algorithm = 'y'",
            &[
                "gpu_topk.algorithm",
                "'y'",
                "auto, bitonic, radix, delegate, sample, cpu",
            ],
        ),
        (
            "SET gpu_topk.max_k = -1",
            &["invalid gpu_topk.max_k '-1'", "as usize"],
        ),
        (
            "SET gpu_topk.device_memory_limit = 'lots'",
            &["invalid gpu_topk.device_memory_limit 'lots'", "as usize"],
        ),
        (
            "SET gpu_topk.enabled = 'maybe'",
            &["invalid gpu_topk.enabled 'maybe'", "not `true` or `false`"],
        ),
        (
            "SET gpu_topk.inject_fault = 'bogus'",
            &["gpu_topk.inject_fault", "'bogus'", "none, create", "N >= 1"],
        ),
        (
            "SET gpu_topk.inject_fault = 'push:0'",
            &["gpu_topk.inject_fault", "'push:0'", "N >= 1"],
        ),
        (
            "SET gpu_topk.no_such_setting = 1",
            &[
                "unknown setting gpu_topk.no_such_setting",
                "enabled, backend, algorithm, max_k",
            ],
        ),
    ];
    for (statement, fragments) in cases {
        let err = run(&ctx, statement).await.expect_err(statement).to_string();
        for fragment in *fragments {
            assert!(
                err.contains(fragment),
                "{statement}: {err:?} lacks {fragment:?}"
            );
        }
        // A rejected value changes nothing: the operator still runs, with the same answer.
        let plan = crate::common::physical_plan(&ctx, sql).await.unwrap();
        assert_eq!(count_gpu_topk(&plan), 1, "after {statement}");
        assert_eq!(
            exact_rows(&run(&ctx, sql).await.unwrap()),
            want,
            "after {statement}"
        );
    }
}

fn plain_datafusion_with_t() -> SessionContext {
    let ctx = plain_datafusion();
    register(&ctx, "t", vec![vec![batch(300)]]);
    ctx
}

// ---- 3. Files --------------------------------------------------------------------------------

/// How a bad input is registered as table `t`.
#[derive(Debug, Clone, Copy)]
enum Format {
    Parquet,
    /// With the schema declared, so nothing is read at registration.
    ParquetWithSchema,
    Csv,
    CsvWithSchema,
}

/// What a user sees: the rows, or the error and the step that failed.
#[derive(Debug, PartialEq)]
enum Outcome {
    Rows(Vec<String>),
    Failed { step: &'static str, error: String },
}

/// Registers `path` as `t` in `ctx` and runs `sql`; `operator` counts the `GpuTopKExec`
/// nodes of the plan, when planning got that far.
async fn outcome(
    ctx: &SessionContext,
    format: Format,
    path: &Path,
    sql: &str,
    operator: &mut Option<usize>,
) -> Outcome {
    let failed = |step, e: datafusion::error::DataFusionError| Outcome::Failed {
        step,
        error: e.to_string(),
    };
    let _ = ctx.deregister_table("t");
    let path = path.to_str().expect("utf-8 path");
    let schema = schema();
    let registered = match format {
        Format::Parquet => {
            ctx.register_parquet("t", path, ParquetReadOptions::default())
                .await
        }
        Format::ParquetWithSchema => {
            ctx.register_parquet("t", path, ParquetReadOptions::default().schema(&schema))
                .await
        }
        Format::Csv => ctx.register_csv("t", path, CsvReadOptions::new()).await,
        Format::CsvWithSchema => {
            ctx.register_csv("t", path, CsvReadOptions::new().schema(&schema))
                .await
        }
    };
    if let Err(e) = registered {
        return failed("registration", e);
    }
    let plan = match crate::common::physical_plan(ctx, sql).await {
        Ok(plan) => plan,
        Err(e) => return failed("planning", e),
    };
    *operator = Some(count_gpu_topk(&plan));
    match collect(plan, ctx.task_ctx()).await {
        Ok(batches) => Outcome::Rows(exact_rows(&batches)),
        Err(e) => failed("execution", e),
    }
}

/// The bad inputs: (name, how it is registered, path, a fragment the error must contain).
fn bad_files(dir: &Path) -> Vec<(&'static str, Format, PathBuf, &'static str)> {
    let good = dir.join("good.parquet");
    write_parquet(&good, 1000);
    let bytes = std::fs::read(&good).expect("read parquet");

    let half = dir.join("half.parquet");
    std::fs::write(&half, &bytes[..bytes.len() / 2]).unwrap();
    let footerless = dir.join("footerless.parquet");
    std::fs::write(&footerless, &bytes[..bytes.len() - 8]).unwrap();
    let random = dir.join("random.parquet");
    let mut rng = crate::common::Rng::new(7);
    let noise: Vec<u8> = (0..4096).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(&random, &noise).unwrap();
    // A directory whose second file is cut short: the first one reads.
    let mixed = dir.join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::copy(&good, mixed.join("a.parquet")).unwrap();
    std::fs::copy(&half, mixed.join("b.parquet")).unwrap();
    // An empty file has no schema: DataFusion infers none, and names the missing column.
    let empty = dir.join("empty.parquet");
    std::fs::write(&empty, b"").unwrap();

    let lines = csv_lines(1000);
    // Bad rows near the end, after several batches have reached the operator.
    let short_row = dir.join("short-row.csv");
    let mut l = lines.clone();
    l[900] = "900,5".into();
    write_lines(&short_row, &l);
    let long_row = dir.join("long-row.csv");
    let mut l = lines.clone();
    l[901] = "901,5,1.5,extra".into();
    write_lines(&long_row, &l);
    let not_a_number = dir.join("not-a-number.csv");
    let mut l = lines.clone();
    l[902] = "902,abc,1.5".into();
    write_lines(&not_a_number, &l);
    // Past the rows schema inference reads (1000): it infers Int64, then meets text.
    let late_text = dir.join("late-text.csv");
    let mut l = csv_lines(1500);
    l[1400] = "1399,abc,1.5".into();
    write_lines(&late_text, &l);
    let missing = dir.join("no-such-file.parquet");

    vec![
        (
            "half parquet",
            Format::Parquet,
            half.clone(),
            "Corrupt footer",
        ),
        (
            "half parquet, schema",
            Format::ParquetWithSchema,
            half,
            "Corrupt footer",
        ),
        (
            "footerless parquet",
            Format::Parquet,
            footerless,
            "Corrupt footer",
        ),
        (
            "random parquet",
            Format::Parquet,
            random.clone(),
            "Corrupt footer",
        ),
        (
            "random parquet, schema",
            Format::ParquetWithSchema,
            random,
            "Corrupt footer",
        ),
        (
            "mixed directory",
            Format::Parquet,
            mixed.clone(),
            "Corrupt footer",
        ),
        (
            "mixed directory, schema",
            Format::ParquetWithSchema,
            mixed,
            "Corrupt footer",
        ),
        ("empty parquet", Format::Parquet, empty, "No field named"),
        (
            "short csv row",
            Format::Csv,
            short_row.clone(),
            "unequal lengths",
        ),
        (
            "short csv row, schema",
            Format::CsvWithSchema,
            short_row,
            "incorrect number of fields for line 901, expected 3 got 2",
        ),
        (
            "long csv row, schema",
            Format::CsvWithSchema,
            long_row,
            "incorrect number of fields for line 902, expected 3 got 4",
        ),
        (
            "text in an int column",
            Format::CsvWithSchema,
            not_a_number,
            "parsing value 'abc' as type 'Int64'",
        ),
        (
            "text after inference",
            Format::Csv,
            late_text,
            "parsing value 'abc' as type 'Int64'",
        ),
        (
            "missing parquet",
            Format::Parquet,
            missing.clone(),
            "No files found",
        ),
        (
            "missing csv",
            Format::Csv,
            dir.join("no-such-file.csv"),
            "No files found",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_files_fail_as_in_datafusion() {
    let dir = test_dir("bad-input-files");
    let ours = session(true, 2, 100);
    let plain = plain_datafusion();
    let mut executed = 0;
    for (name, format, path, fragment) in bad_files(&dir) {
        for sql in TOPK_QUERIES {
            let mut operator = None;
            let got = outcome(&ours, format, &path, sql, &mut operator).await;
            let want = outcome(&plain, format, &path, sql, &mut None).await;
            assert_eq!(got, want, "{name}: {sql}");
            let Outcome::Failed { step, error } = got else {
                panic!("{name}: {sql}: no error: {got:?}");
            };
            assert!(
                error.contains(fragment),
                "{name}: {error:?} lacks {fragment:?}"
            );
            // Where the plan was built, it was the operator's plan that failed.
            if step == "execution" {
                assert_eq!(operator, Some(1), "{name}: {sql}");
                executed += 1;
            }
        }
    }
    assert!(executed > 0, "no bad input got as far as the operator");
}

/// Row groups in the middle of a Parquet file overwritten, its footer intact: reading the rows
/// fails, after the operator has taken the first row groups. DataFusion's own TopK may never
/// read them (it reads row groups in the sort's order and prunes the rest with its dynamic
/// filter), so the oracle is DataFusion reading every row group, as the operator does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_row_groups_fail_as_in_datafusion_reading_them() {
    let dir = test_dir("bad-input-scribbled");
    let good = dir.join("good.parquet");
    write_parquet(&good, 1000);
    let mut bytes = std::fs::read(&good).unwrap();
    let len = bytes.len();
    bytes[len / 3..len / 2].fill(0xff);
    let scribbled = dir.join("scribbled.parquet");
    std::fs::write(&scribbled, &bytes).unwrap();
    let ours = session(true, 2, 100);
    let plain = crate::common::plain_session(2, crate::common::Storage::Parquet);
    for sql in TOPK_QUERIES {
        let mut operator = None;
        let got = outcome(&ours, Format::Parquet, &scribbled, sql, &mut operator).await;
        let want = outcome(&plain, Format::Parquet, &scribbled, sql, &mut None).await;
        assert_eq!(got, want, "{sql}");
        let Outcome::Failed { step, error } = got else {
            panic!("{sql}: no error: {got:?}");
        };
        assert_eq!(step, "execution", "{sql}");
        assert!(error.contains("Parquet error"), "{sql}: {error}");
        assert_eq!(operator, Some(1), "{sql}");
    }
}

/// A declared schema over a path that does not exist: DataFusion lists no files and answers
/// no rows, without an error; the operator gives the same (empty) answer.
#[tokio::test]
async fn a_missing_path_with_a_declared_schema_answers_as_datafusion() {
    let dir = test_dir("bad-input-missing");
    let missing = dir.join("no-such-file.parquet");
    let ours = session(true, 2, 100);
    for sql in TOPK_QUERIES {
        let mut operator = None;
        let got = outcome(
            &ours,
            Format::ParquetWithSchema,
            &missing,
            sql,
            &mut operator,
        )
        .await;
        let want = outcome(
            &plain_datafusion(),
            Format::ParquetWithSchema,
            &missing,
            sql,
            &mut None,
        )
        .await;
        assert_eq!(got, want, "{sql}");
        assert_eq!(got, Outcome::Rows(vec![]), "{sql}");
    }
}

// ---- 4. The CLI ------------------------------------------------------------------------------
// Sections 4 to 6 run the `gpu-topk` binary, which the `cli` feature builds.

/// Runs the CLI with `args` (and extra environment variables); a panic would print its
/// backtrace, which the checks would see.
/// `gpu-topk query TOP4 --table NAME=PATH` over a 1000-row in-memory table, on `backend`.
#[cfg(feature = "cli")]
fn top4_over(table: &str, backend: &str, env: &[(&str, &Path)]) -> Output {
    let args = [
        "query",
        TOP4,
        "--table",
        table,
        "--rows",
        "1000",
        "--backend",
        backend,
    ];
    cli(&args, env)
}

#[cfg(feature = "cli")]
fn cli(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpu-topk"));
    command.args(args).env("RUST_BACKTRACE", "1");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run gpu-topk")
}

/// Checks a failed run: its exit code, that stderr starts with a short `error: …` line
/// containing `fragment`, the usage hint exactly when `usage`, and no panic.
#[cfg(feature = "cli")]
fn assert_fails(args: &[&str], code: i32, fragment: &str, usage: bool) {
    let out = cli(args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let context = format!("gpu-topk {args:?}\nstderr:\n{stderr}\nstdout:\n{stdout}");
    assert_eq!(out.status.code(), Some(code), "{context}");
    assert!(stderr.starts_with("error: "), "{context}");
    let message = stderr.split("\n\n").next().unwrap_or_default();
    assert!(message.contains(fragment), "{context}");
    assert!(message.lines().count() <= 4, "a long error: {context}");
    // Argument errors point at the usage (`Usage: …` or "try '--help'").
    assert_eq!(stderr.contains("--help"), usage, "{context}");
    for panic in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(!stderr.contains(panic), "{context}");
    }
    // Never a partial answer: no result table.
    assert!(!stdout.contains(" rows\n"), "{context}");
}

#[cfg(feature = "cli")]
#[test]
fn cli_argument_errors_exit_2_with_the_usage() {
    let cases: &[(&[&str], &str)] = &[
        (&["--frobnicate"], "unexpected argument '--frobnicate'"),
        (&["frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (&["--rows", "abc"], "invalid value 'abc' for '--rows <N>'"),
        (&["--rows"], "a value is required for '--rows <N>'"),
        (
            &["--backend", "x"],
            "'x' is not a backend (expected one of auto, cuda, cpu)",
        ),
        (&["query"], "<SQL>"),
        (&["query", "--backend", "cpu"], "<SQL>"),
        (
            &["query", "SELECT 1", "--table", "t"],
            "expected NAME=PATH, got 't'",
        ),
        (
            &["query", "SELECT 1", "--table", "=x.parquet"],
            "expected NAME=PATH",
        ),
        (&["gen"], "--out <DIR>"),
        (&["gen", "--rows", "1000"], "--out <DIR>"),
        (&["gen", "--out", "x"], "gen needs --rows N"),
        (&["--table", "t=x.csv"], "unexpected argument '--table'"),
        (
            &["-f", "/no/such/file.sql"],
            "no such file: /no/such/file.sql",
        ),
        (&["-m", "lots"], "'lots' is not a size"),
        (&["--format", "yaml"], "invalid value 'yaml' for '--format"),
    ];
    for (args, fragment) in cases {
        assert_fails(args, 2, fragment, true);
    }
}

#[cfg(feature = "cli")]
#[test]
fn cli_query_errors_exit_1_naming_the_problem() {
    let dir = test_dir("bad-input-cli");
    let good = dir.join("good.parquet");
    write_parquet(&good, 1000);
    let bytes = std::fs::read(&good).unwrap();
    let half = dir.join("half.parquet");
    std::fs::write(&half, &bytes[..bytes.len() / 2]).unwrap();
    let mut lines = csv_lines(1500);
    lines[1400] = "1399,abc,1.5".into();
    let late_text = dir.join("late-text.csv");
    write_lines(&late_text, &lines);
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "hello").unwrap();
    let table = |name: &str, path: &Path| format!("{name}={}", path.display());
    let topk = "SELECT id, v FROM t ORDER BY v, id LIMIT 5";
    let small = ["--rows", "1000", "--backend", "cpu"];
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec!["query".into(), "SELEC nonsense".into()],
            "SELEC".into(),
        ),
        (
            vec![
                "query".into(),
                "SELECT nope FROM tweets ORDER BY 1 LIMIT 2".into(),
            ],
            "nope".into(),
        ),
        (
            vec![
                "query".into(),
                "SELECT 1".into(),
                "--table".into(),
                "t=/no/such/file.parquet".into(),
            ],
            "--table t: no such file or directory: /no/such/file.parquet".into(),
        ),
        (
            vec![
                "query".into(),
                topk.into(),
                "--table".into(),
                table("t", &half),
            ],
            format!("--table t={}: Parquet error", half.display()),
        ),
        (
            vec![
                "query".into(),
                topk.into(),
                "--table".into(),
                table("t", &late_text),
            ],
            "abc".into(),
        ),
        (
            vec![
                "query".into(),
                topk.into(),
                "--table".into(),
                table("t", &notes),
            ],
            "is neither a .parquet nor a .csv file".into(),
        ),
    ];
    for (args, fragment) in &cases {
        let args: Vec<&str> = args
            .iter()
            .map(String::as_str)
            .chain(small.iter().copied())
            .collect();
        assert_fails(&args, 1, fragment, false);
    }
}

/// The rows of the CLI's result table (below its header), cell by cell.
#[cfg(feature = "cli")]
fn table_rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| l.starts_with('|'))
        .skip(1)
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// `SELECT id, v FROM t ORDER BY v DESC, id LIMIT 4` over `batch(rows)`, as text.
#[cfg(feature = "cli")]
fn expected_top4(rows: i64) -> Vec<Vec<String>> {
    let mut pairs: Vec<(i64, i64)> = (0..rows).map(|i| (i, (i * 7919) % 997)).collect();
    pairs.sort_by_key(|&(id, v)| (-v, id));
    pairs
        .iter()
        .take(4)
        .map(|(id, v)| vec![id.to_string(), v.to_string()])
        .collect()
}

#[cfg(feature = "cli")]
const TOP4: &str = "SELECT id, v FROM t ORDER BY v DESC, id LIMIT 4";

#[cfg(feature = "cli")]
#[test]
fn cli_answers_over_good_files() {
    // The happy path these error checks sit beside: exit 0 and the right rows.
    let dir = test_dir("bad-input-cli-good");
    let csv = dir.join("good.csv");
    write_lines(&csv, &csv_lines(1000));
    let parquet = dir.join("good.parquet");
    write_parquet(&parquet, 1000);
    for path in [&csv, &parquet] {
        let t = format!("t={}", path.display());
        let out = top4_over(&t, "cpu", &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
        assert_eq!(table_rows(&stdout), expected_top4(1000), "{stdout}");
        assert!(
            stdout.contains("top-k: GpuTopKExec, backend=cpu"),
            "{stdout}"
        );
    }
}

// ---- 5. Kernel sources -----------------------------------------------------------------------

/// The kernel sources are read once per process (the device keeps its kernels), so a bad
/// kernel directory is tried in a CLI process of its own.
#[cfg(feature = "cli")]
#[test]
fn broken_kernel_sources_fall_back_to_the_cpu_path_and_name_the_file() {
    if let GpuStatus::Unavailable(why) = gpu_status() {
        eprintln!(
            "SKIP: broken_kernel_sources_fall_back_to_the_cpu_path_and_name_the_file: \
             no GPU present ({why})"
        );
        return;
    }
    let dir = test_dir("bad-input-kernels");
    let csv = dir.join("t.csv");
    write_lines(&csv, &csv_lines(1000));
    let t = format!("t={}", csv.display());
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    // (What is wrong, the broken file, what the reason must say.)
    let cases = [
        ("syntax", "encode.cu", "NVRTC could not compile encode.cu"),
        ("missing", "radix.cu", "cannot read kernel source"),
    ];
    for (what, file, says) in cases {
        let kernels = dir.join(format!("kernels-{what}"));
        std::fs::create_dir_all(&kernels).unwrap();
        for entry in std::fs::read_dir(&shipped).unwrap().flatten() {
            std::fs::copy(entry.path(), kernels.join(entry.file_name())).unwrap();
        }
        let broken = kernels.join(file);
        match what {
            "syntax" => {
                let mut text = std::fs::read_to_string(&broken).unwrap();
                text.push_str("\nthis is not CUDA C;\n");
                std::fs::write(&broken, text).unwrap();
            }
            _ => std::fs::remove_file(&broken).unwrap(),
        }
        // A cache of its own: the shared one is not written with these sources.
        let cache = dir.join(format!("cache-{what}"));
        let out = top4_over(
            &t,
            "cuda",
            &[(KERNEL_DIR_ENV, &kernels), ("GPU_TOPK_CACHE_DIR", &cache)],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = format!("{what}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert_eq!(out.status.code(), Some(0), "{context}");
        assert_eq!(table_rows(&stdout), expected_top4(1000), "{context}");
        let reason = stdout
            .lines()
            .skip_while(|l| !l.starts_with("top-k: "))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            reason.starts_with("top-k: GpuTopKExec, backend=cpu"),
            "{context}"
        );
        assert!(reason.contains("the GPU kernels are unusable"), "{context}");
        assert!(reason.contains(says), "{context}");
        assert!(reason.contains(file), "{context}");
    }
}

// ---- 6. The CUDA libraries -------------------------------------------------------------------

/// A shared library this process has loaded, found in `/proc/self/maps`.
#[cfg(feature = "cli")]
fn loaded_library(prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
        })
        .map(PathBuf::from)
}

/// A wrong or broken CUDA library (here another shared library under CUDA's names, first on
/// the library path: it loads, but has none of CUDA's functions) makes the GPU unusable, with
/// the reason: the process neither crashes nor prints a panic, and a query forced onto the
/// GPU answers on the CPU path.
#[cfg(feature = "cli")]
#[test]
fn a_broken_cuda_library_leaves_the_gpu_unusable_with_a_reason() {
    let Some(impostor) = loaded_library("libm.so").or_else(|| loaded_library("libgcc_s.so")) else {
        eprintln!(
            "SKIP: a_broken_cuda_library_leaves_the_gpu_unusable_with_a_reason: no shared library to copy"
        );
        return;
    };
    let dir = test_dir("bad-input-libcuda");
    let csv = dir.join("t.csv");
    write_lines(&csv, &csv_lines(1000));
    let t = format!("t={}", csv.display());
    // (Libraries replaced, what the reason may say: with only the driver replaced, a machine
    // without NVRTC stops at the missing NVRTC first.)
    let cases: [(&str, &[&str], &[&str]); 2] = [
        (
            "both",
            &["libcuda.so", "libcuda.so.1", "libnvrtc.so"],
            &["the CUDA libraries are unusable"],
        ),
        (
            "driver",
            &["libcuda.so", "libcuda.so.1"],
            &["the CUDA libraries are unusable", "no NVRTC library"],
        ),
    ];
    for (what, names, says) in cases {
        let libs = dir.join(format!("lib-{what}"));
        std::fs::create_dir_all(&libs).unwrap();
        for name in names {
            std::fs::copy(&impostor, libs.join(name)).unwrap();
        }
        let out = top4_over(&t, "cuda", &[("LD_LIBRARY_PATH", &libs)]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let context = format!("{what}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert_eq!(out.status.code(), Some(0), "{context}");
        assert!(!stderr.contains("panicked"), "{context}");
        assert_eq!(table_rows(&stdout), expected_top4(1000), "{context}");
        let gpu_line = stdout
            .lines()
            .find(|l| l.starts_with("GPU: "))
            .unwrap_or("");
        assert!(gpu_line.starts_with("GPU: none ("), "{context}");
        assert!(says.iter().any(|s| gpu_line.contains(s)), "{context}");
        let top_k = stdout
            .lines()
            .find(|l| l.starts_with("top-k: "))
            .unwrap_or("");
        assert!(
            top_k.starts_with("top-k: GpuTopKExec, backend=cpu") && top_k.contains("no GPU found"),
            "{context}"
        );
    }
}
