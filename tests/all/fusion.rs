//! Fusion planning: which parts of a query the generated GPU program evaluates, and that every
//! generated program compiles (NVRTC for sm_90, no GPU needed; skipped without NVRTC). The
//! programs' *results* are checked by the differential tests, which run them on the GPU
//! machine with the CUDA backend forced.

use std::sync::Arc;

use datafusion::execution::SessionStateBuilder;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_gpu_topk::datasets::{QUERIES, TABLE_NAME, TweetsSpec, tweets_mem_table};
use datafusion_gpu_topk::internal::device::kernels::{
    GENERATED_MIN_BLOCKS, GENERATED_SPILL_ALLOWANCE, GeneratedCompile, KernelSources,
    compile_generated, kernels_without_dependency_wait, nvrtc_available,
};
use datafusion_gpu_topk::internal::fusion::{FusedProgram, KernelInput, Part};
use datafusion_gpu_topk::{Backend, GpuTopKConfig, GpuTopKExec, SessionStateBuilderExt};

use crate::common::{physical_plan, register};
use crate::differential::{schema, table};

/// A session that always plans the operator (CPU backend): fusion is planned regardless.
fn planning_session() -> SessionContext {
    let state = SessionStateBuilder::new()
        .with_config(SessionConfig::new().with_target_partitions(2))
        .with_default_features()
        .with_gpu_topk(planning_config())
        .build();
    SessionContext::new_with_state(state)
}

/// The CPU backend, with the top-k over an aggregate left to `GpuTopKExec` above
/// DataFusion's aggregation: these tests place its fusion over the aggregation's output.
fn planning_config() -> GpuTopKConfig {
    let mut config = crate::sessions::base_config().with_backend(Backend::Cpu);
    config.aggregate_topk = false;
    config
}

fn find_exec(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuTopKExec> {
    plan.downcast_ref::<GpuTopKExec>()
        .or_else(|| plan.children().into_iter().find_map(|c| find_exec(c)))
}

/// (filter part, keys part) as "gpu" / "host" / "-" (no filter).
async fn placement(ctx: &SessionContext, sql: &str) -> (String, String, Option<String>) {
    let plan = physical_plan(ctx, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let exec = find_exec(&plan).unwrap_or_else(|| panic!("{sql}: no GpuTopKExec"));
    let fusion = &exec.spec().fusion;
    let name = |p: &Part| p.to_string();
    let filter = fusion.filter.as_ref().map_or("-".to_string(), name);
    assert_eq!(
        fusion.program.is_some(),
        fusion.keys == Part::Gpu,
        "{sql}: a program exactly when the keys run on the GPU"
    );
    if let Some(program) = &fusion.program {
        let missing = kernels_without_dependency_wait(&program.source);
        assert!(
            missing.is_empty(),
            "{sql}: no grid_dependency_wait first in {missing:?}"
        );
    }
    (
        filter,
        name(&fusion.keys),
        fusion.program.as_ref().map(|p| p.source.clone()),
    )
}

/// The program compiled as the engine compiles it (with the occupancy hint unless that
/// spills); `None` without NVRTC.
fn compile_or_skip(sql: &str, source: &str) -> Option<GeneratedCompile> {
    if !nvrtc_available() {
        eprintln!("SKIP: compiling the generated program of {sql}: no NVRTC library");
        return None;
    }
    if std::env::var_os("GPU_TOPK_TEST_PRINT_SOURCE").is_some() {
        eprintln!("=== {sql}\n{source}");
    }
    let sources = KernelSources::load().expect("kernel sources");
    let compiled = compile_generated(source, &sources.headers(), "sm_90").unwrap_or_else(|e| {
        panic!("{sql}: the generated program does not compile:\n{e}\n{source}")
    });
    eprintln!(
        "{sql}: min blocks {}, {} bytes spilled, pipelined: {}",
        compiled.min_blocks, compiled.spill_bytes, compiled.pipelined
    );
    // For reading its SASS (cuobjdump -sass): one file per query.
    if let Some(dir) = std::env::var_os("GPU_TOPK_TEST_DUMP_CUBIN") {
        let name: String = sql
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(40)
            .collect();
        let path = std::path::Path::new(&dir).join(format!("{name}.cubin"));
        std::fs::write(&path, &compiled.cubin).expect("writing the CUBIN");
    }
    Some(compiled)
}

#[tokio::test]
async fn each_part_runs_where_it_translates_and_every_program_compiles() {
    let ctx = planning_session();
    register(&ctx, "t", table(7, &[&[10]]));
    assert!(schema().fields().len() > 20);
    let cases = [
        // (where, order by, filter part, keys part)
        ("", "i32 DESC", "-", "gpu"),
        ("", "b, u8 DESC NULLS LAST, ts_us", "-", "gpu"),
        ("WHERE i32 > 0 AND b", "i32 DESC", "gpu", "gpu"),
        ("WHERE f64 < 0.5 OR g = 3", "f64", "gpu", "gpu"),
        ("WHERE i8 IS NULL", "u32 DESC", "gpu", "gpu"),
        (
            "WHERE NOT (i16 >= -3) OR i8 IS NOT NULL",
            "-f64, g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE ts_ns < TIMESTAMP '2000-01-01 00:00:00'",
            "ts_ns DESC",
            "gpu",
            "gpu",
        ),
        ("WHERE d32 >= DATE '1970-01-10'", "d32", "gpu", "gpu"),
        ("WHERE nan_only = nan_only", "f32 * 0.5 + g", "gpu", "gpu"),
        (
            "WHERE nan_only = nan_only AND f64 <> -0.0",
            "-f64, ts_ns",
            "gpu",
            "gpu",
        ),
        ("", "i16 + g * 2 DESC", "-", "gpu"),
        ("", "CAST(i16 AS DOUBLE) / 3.0 DESC", "-", "gpu"),
        ("", "CAST(f32 AS DOUBLE) * f64", "-", "gpu"),
        ("", "i64 / 7, i64 % 5 DESC", "-", "gpu"),
        ("", "u8 - u8 DESC, i8 * i8", "-", "gpu"),
        ("WHERE rid % 3 = 0", "g", "gpu", "gpu"),
        // IN lists, CASE, exact math functions
        (
            "WHERE i32 IN (1, -5, 7) OR g NOT IN (2, 3)",
            "g",
            "gpu",
            "gpu",
        ),
        ("WHERE i8 IN (1, NULL, -128)", "i64", "gpu", "gpu"),
        (
            "WHERE f64 IN (0.0, 1.5) AND f32 NOT IN (-0.0)",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE b IN (true) AND d32 IN (DATE '1970-01-02')",
            "g",
            "gpu",
            "gpu",
        ),
        ("", "CASE WHEN b THEN g ELSE -g END", "-", "gpu"),
        (
            "",
            "CASE g WHEN 1 THEN f64 WHEN 2 THEN -f64 END DESC",
            "-",
            "gpu",
        ),
        (
            "WHERE CASE WHEN i8 IS NULL THEN b ELSE i8 > 0 END",
            "i16",
            "gpu",
            "gpu",
        ),
        ("", "floor(f64) DESC, ceil(f32), g", "-", "gpu"),
        ("", "round(f64), round(f32 * 10.0) DESC", "-", "gpu"),
        ("", "round(f64, 2) DESC, round(f32, -1)", "-", "gpu"),
        ("", "abs(f64) DESC, abs(u8), abs(f32)", "-", "gpu"),
        ("WHERE floor(i16 / 3.0) > 1.0", "g", "gpu", "gpu"),
        (
            "WHERE i32 BETWEEN -5 AND 7 OR f64 NOT BETWEEN 0.0 AND 1.0",
            "g",
            "gpu",
            "gpu",
        ),
        ("WHERE ds = 'en' OR ds IN ('es', NULL)", "g", "gpu", "gpu"),
        (
            "WHERE ds <> 'x' AND ds NOT IN ('a', 'b')",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE ts_ns + INTERVAL '1 day' < TIMESTAMP '2000-01-01 00:00:00'",
            "ts_ms - INTERVAL '90 minutes' DESC, ts_us + INTERVAL '2 days 3 hours'",
            "gpu",
            "gpu",
        ),
        ("WHERE ts_s - INTERVAL '1 second' > ts_s", "g", "gpu", "gpu"),
        // host parts
        (
            "WHERE ts_ns + INTERVAL '1 month' > ts_ns",
            "g",
            "host",
            "gpu",
        ),
        ("", "ts_s + INTERVAL '1 millisecond'", "-", "host"),
        ("WHERE ds LIKE 'e%'", "g", "host", "gpu"),
        // string predicates over a whole table: each row's bytes
        ("WHERE s LIKE 'a%'", "g DESC", "gpu", "gpu"),
        ("WHERE s = 'a' OR s = 'b'", "i64", "gpu", "gpu"),
        (
            "WHERE sv LIKE '%b_c%' OR s NOT LIKE '%x' OR sv LIKE 'a\\%%'",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE s IN ('a', NULL, 'ab') AND sv NOT IN ('', 'é')",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE s >= 'b' AND 'c' > sv AND s <> 'bb'",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE length(s) > 2 OR octet_length(sv) < 3 OR char_length(sv) = 1",
            "g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE starts_with(s, 'ab') OR ends_with(sv, 'z') OR s IS NULL",
            "s DESC",
            "gpu",
            "gpu",
        ),
        ("WHERE sv IS NOT NULL AND sv LIKE 'a%'", "sv", "gpu", "gpu"),
        ("WHERE s ILIKE 'a%'", "g", "host", "gpu"),
        ("WHERE upper(s) = 'A'", "g", "host", "gpu"),
        ("WHERE s = sv", "g", "host", "gpu"),
        ("", "abs(i16) DESC, g", "-", "gpu"),
        ("", "sqrt(f64), sqrt(f32) DESC", "-", "gpu"),
        ("WHERE i32 / g > 1 OR i8 % i8 = 0", "i64 / g", "gpu", "gpu"),
        ("", "ln(f64) DESC", "-", "host"),
        ("", "exp(f64), power(f32, 2)", "-", "host"),
        // a float remainder (fmod); narrowing and float-to-integer casts (DataFusion errors
        // where a value does not fit: the row goes to the host; TRY_CAST gives NULL)
        ("WHERE f64 % 2.0 > 0.5", "f32 % -1.5", "gpu", "gpu"),
        (
            "",
            "CAST(i64 AS INT) DESC, CAST(i8 AS TINYINT UNSIGNED)",
            "-",
            "gpu",
        ),
        ("", "TRY_CAST(i64 AS INT), TRY_CAST(u32 AS INT)", "-", "gpu"),
        (
            "WHERE CAST(f64 AS BIGINT) > 0",
            "CAST(f32 AS INT), TRY_CAST(f64 AS SMALLINT)",
            "gpu",
            "gpu",
        ),
        (
            "",
            "CAST(f64 AS INT UNSIGNED), TRY_CAST(f32 AS BIGINT UNSIGNED)",
            "-",
            "gpu",
        ),
        ("", "CASE f64 WHEN 1.0 THEN g END", "-", "host"),
        ("WHERE i32 IN (g, 3)", "g", "host", "gpu"),
        // a Decimal128 as an i64 (a row that does not fit goes to the host); its arithmetic
        // and casts stay on the host
        ("", "dec DESC", "-", "gpu"),
        (
            "WHERE dec > CAST(1.5 AS DECIMAL(20, 3))",
            "dec, g",
            "gpu",
            "gpu",
        ),
        (
            "WHERE dec IS NOT NULL",
            "g, dec DESC NULLS FIRST, sv",
            "gpu",
            "gpu",
        ),
        ("WHERE dec * 2 > dec", "g", "host", "gpu"),
        ("", "CAST(dec AS DOUBLE)", "-", "host"),
        ("", "-dec", "-", "host"),
        ("", "f16", "-", "host"),
        ("WHERE i32 > 0", "abs(i32)", "gpu", "gpu"),
        ("WHERE i32 > 0", "ln(f64)", "gpu", "host"),
        // string keys: a plain column's first bytes (its prefix words); what follows a string
        // key is compared on the host, but evaluated on the device for its guards (DataFusion
        // fails where any row's key fails): an untranslated one keeps the host path
        ("", "s", "-", "gpu"),
        ("WHERE i32 > 0", "sv DESC NULLS LAST, i32 % g", "gpu", "gpu"),
        (
            "WHERE i32 > 0",
            "sv DESC NULLS LAST, ln(f64)",
            "gpu",
            "host",
        ),
        ("", "g, s DESC", "-", "gpu"),
        ("", "i64, i32, sv", "-", "gpu"),
        ("", "arrow_cast(s, 'LargeBinary') DESC, g", "-", "host"),
        ("", "ds, g", "-", "gpu"),
        // keys past 256 bits: the last field holds the high bits of `i64 % 7`
        ("", "dec, i64 DESC, i64 % 7, g", "-", "gpu"),
        ("", "dec DESC NULLS FIRST, i64, i32, rid, g", "-", "gpu"),
        ("", "upper(s)", "-", "host"),
    ];
    let mut min_blocks = Vec::new();
    for (filter, order, want_filter, want_keys) in cases {
        let sql = format!("SELECT rid FROM t {filter} ORDER BY {order} LIMIT 10");
        let (f, k, source) = placement(&ctx, &sql).await;
        assert_eq!((f.as_str(), k.as_str()), (want_filter, want_keys), "{sql}");
        if let Some(compiled) = source.and_then(|source| compile_or_skip(&sql, &source)) {
            if compiled.min_blocks == GENERATED_MIN_BLOCKS {
                assert!(compiled.spill_bytes <= GENERATED_SPILL_ALLOWANCE, "{sql}");
            }
            min_blocks.push(compiled.min_blocks);
        }
    }
    // Most programs take the occupancy hint. (Which ones spill past the allowance depends on
    // the machine: 11 here with NVRTC 13.0.88, none on the H100 machine with the
    // same NVRTC.)
    let hinted = min_blocks
        .iter()
        .filter(|&&b| b == GENERATED_MIN_BLOCKS)
        .count();
    assert!(2 * hinted >= min_blocks.len(), "{min_blocks:?}");
}

#[tokio::test]
async fn tweet_queries_run_their_predicates_and_keys_on_the_gpu() {
    let ctx = planning_session();
    let table = tweets_mem_table(&TweetsSpec::new(1000), 2).unwrap();
    ctx.register_table(TABLE_NAME, table).unwrap();
    // Q3's `lang = 'en' OR lang = 'es'` on a dictionary column: codes looked up on the GPU.
    let want = [("gpu", "gpu"), ("-", "gpu"), ("gpu", "gpu"), ("-", "gpu")];
    for ((name, sql), (want_filter, want_keys)) in QUERIES.iter().zip(want) {
        let (f, k, source) = placement(&ctx, sql).await;
        assert_eq!(
            (f.as_str(), k.as_str()),
            (want_filter, want_keys),
            "{name}: {sql}"
        );
        // Q1's and Q2's programs take the occupancy hint, Q2's with its pass pipelined (32 and
        // 10 bytes of spills under NVRTC 13.0, within the allowance); Q3's spill count has moved
        // between 0 and 56 bytes with its code (40, pipelined, since the write buffer's key span
        // went to each lane's own words), near the allowance, so only the rule is checked.
        if let Some(compiled) = compile_or_skip(name, &source.expect("keys on the GPU")) {
            if matches!(*name, "Q1" | "Q2") {
                assert_eq!(compiled.min_blocks, GENERATED_MIN_BLOCKS, "{name}: {sql}");
            }
            if *name == "Q2" {
                assert!(compiled.pipelined, "{name}: {sql}");
            }
            if compiled.min_blocks == GENERATED_MIN_BLOCKS {
                assert!(
                    compiled.spill_bytes <= GENERATED_SPILL_ALLOWANCE,
                    "{name}: {sql}"
                );
            }
        }
    }
}

/// An OR of equalities and IN lists on one dictionary column becomes one mask of the entries
/// (one lookup per row); a negated list or an operand that is not a membership test stays
/// separate.
#[tokio::test]
async fn an_or_of_string_equalities_on_one_dictionary_column_is_one_lookup() {
    let ctx = planning_session();
    let table = tweets_mem_table(&TweetsSpec::new(1000), 2).unwrap();
    ctx.register_table(TABLE_NAME, table).unwrap();
    let masks = |program: &FusedProgram| -> Vec<Vec<String>> {
        program
            .inputs
            .iter()
            .filter_map(|i| match i {
                KernelInput::DictionaryMatch { values, .. } => Some(values.clone()),
                _ => None,
            })
            .collect()
    };
    for (predicate, want) in [
        ("lang = 'en' OR lang = 'es'", vec![vec!["en", "es"]]),
        (
            "lang = 'ja' OR lang IN ('es', 'en') OR 'fr' = lang",
            vec![vec!["en", "es", "fr", "ja"]],
        ),
        (
            "lang = 'en' OR lang NOT IN ('es')",
            vec![vec!["en"], vec!["es"]],
        ),
        (
            "lang = 'en' OR (lang = 'es' AND retweet_count > 3)",
            vec![vec!["en"], vec!["es"]],
        ),
    ] {
        let sql = format!(
            "SELECT id FROM {TABLE_NAME} WHERE {predicate} ORDER BY retweet_count DESC LIMIT 5"
        );
        let plan = physical_plan(&ctx, &sql).await.unwrap();
        let exec = find_exec(&plan).unwrap_or_else(|| panic!("{sql}: no GpuTopKExec"));
        let fusion = &exec.spec().fusion;
        assert_eq!(fusion.filter, Some(Part::Gpu), "{sql}");
        let program = fusion.program.as_ref().expect("keys on the GPU");
        let want: Vec<Vec<String>> = want
            .iter()
            .map(|v| v.iter().map(|s| s.to_string()).collect())
            .collect();
        assert_eq!(masks(program), want, "{sql}");
    }
}

#[test]
fn the_generated_nan_is_the_hosts() {
    let (f32_nan, f64_nan) = datafusion_gpu_topk::internal::fusion::host_default_nan();
    let zero = std::hint::black_box(0.0f64);
    assert_eq!(f64_nan, (zero / zero).to_bits());
    assert!(f32::from_bits(f32_nan).is_nan() && f64::from_bits(f64_nan).is_nan());
}

/// A string predicate reads each row's bytes from the column cache, so it runs on the device
/// over whole tables only: over a streamed input (an aggregate below, or with the session's
/// column cache off) it stays on the host, with the reason.
#[tokio::test]
async fn string_predicates_run_on_the_device_over_whole_tables_only() {
    let sql = "SELECT rid FROM t WHERE s LIKE '%ab%' ORDER BY g LIMIT 10";
    let grouped = "SELECT g, max(s) AS m FROM t GROUP BY g HAVING max(s) LIKE '%ab%' \
                   ORDER BY g DESC LIMIT 10";
    let uncached = {
        let state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(2))
            .with_default_features()
            .with_gpu_topk(
                crate::sessions::base_config()
                    .with_backend(Backend::Cpu)
                    .with_column_cache(false),
            )
            .build();
        SessionContext::new_with_state(state)
    };
    let ctx = planning_session();
    for ctx in [&ctx, &uncached] {
        register(ctx, "t", table(7, &[&[10]]));
    }
    for (ctx, sql, want) in [
        (&ctx, sql, "gpu"),
        (&ctx, grouped, "host"),
        (&uncached, sql, "host"),
    ] {
        let plan = physical_plan(ctx, sql).await.unwrap();
        let exec = find_exec(&plan).unwrap_or_else(|| panic!("{sql}: no GpuTopKExec"));
        let fusion = &exec.spec().fusion;
        let filter = fusion.filter.as_ref().expect("a filter");
        assert_eq!(filter.to_string(), want, "{sql}");
        if let Part::Host(why) = filter {
            assert!(why.contains("whole tables only"), "{sql}: {why}");
        }
        assert_eq!(fusion.keys, Part::Gpu, "{sql}");
    }
}
