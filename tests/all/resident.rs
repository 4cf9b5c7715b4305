//! Top-k over device-resident columns (`select::ResidentColumns`): the fused selection (the sampled
//! threshold inside the generated program's pass) and the unfused one against DataFusion, on
//! the tweet queries and on data built to make the sampled threshold miss both ways. Planning
//! runs everywhere (every query must be fully fused); the device part skips without a GPU.

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, AsArray, Float64Array, Int32Array, Int64Array, RecordBatch,
};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::datasets::tweets::{self, TweetsSpec};
use datafusion_gpu_topk::internal::device::plan::{FUSED_SAMPLE_ROWS, RANK_SORT_MAX};
use datafusion_gpu_topk::internal::device::{
    DeviceAlgorithm, FUSED_SAMPLE_CLUSTER, FusedReport, KeyWidth, TopKEngine, gpu_status,
};
use datafusion_gpu_topk::internal::exec::TopKSpec;
use datafusion_gpu_topk::internal::fusion::{ENTRY, FusedProgram, Part};
use datafusion_gpu_topk::internal::select::ResidentColumns;
use datafusion_gpu_topk::{Backend, GpuTopKExec, SessionStateBuilderExt};

fn sessions() -> (SessionContext, SessionContext) {
    let make = |enabled: bool| {
        let state = datafusion::execution::SessionStateBuilder::new()
            .with_default_features()
            .with_gpu_topk(
                crate::sessions::base_config()
                    .with_enabled(enabled)
                    .with_backend(Backend::Cpu),
            )
            .build();
        SessionContext::new_with_state(state)
    };
    (make(true), make(false))
}

fn find(plan: &Arc<dyn ExecutionPlan>) -> Option<&GpuTopKExec> {
    plan.downcast_ref::<GpuTopKExec>()
        .or_else(|| plan.children().into_iter().find_map(|c| find(c)))
}

/// One query, planned: its operator's spec, program and input columns (by table position).
struct Planned {
    sql: String,
    spec: TopKSpec,
    program: Arc<FusedProgram>,
    projection: Vec<usize>,
    /// DataFusion's answer with the ties in row order (`, id` appended).
    want: Vec<i64>,
}

async fn plan(
    ours: &SessionContext,
    plain: &SessionContext,
    table: &Schema,
    sql: &str,
    oracle: &str,
) -> Planned {
    let plan = ours
        .sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap();
    let exec = find(&plan).unwrap_or_else(|| panic!("{sql}: no operator"));
    let spec = exec.spec().clone();
    assert_eq!(spec.fusion.keys, Part::Gpu, "{sql}");
    assert!(
        spec.fusion.filter.as_ref().is_none_or(|f| *f == Part::Gpu),
        "{sql}: {}",
        spec.fusion.describe(true)
    );
    let program = spec.fusion.program.clone().expect("keys on the GPU");
    let projection = exec
        .input()
        .schema()
        .fields()
        .iter()
        .map(|f| table.index_of(f.name()).unwrap())
        .collect();
    let batches = plain.sql(oracle).await.unwrap().collect().await.unwrap();
    let want = batches
        .iter()
        .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
        .collect();
    Planned {
        sql: sql.to_string(),
        spec,
        program,
        projection,
        want,
    }
}

/// Runs every planned query fused and unfused on the device; returns the fused reports, in
/// query order (None without a GPU).
fn run_on_device(
    whole: &RecordBatch,
    ids: &Int64Array,
    planned: &[Planned],
) -> Option<Vec<FusedReport>> {
    let device = match gpu_status() {
        datafusion_gpu_topk::internal::device::GpuStatus::Available(d) => Arc::clone(d),
        datafusion_gpu_topk::internal::device::GpuStatus::Unavailable(why) => {
            eprintln!("SKIP: resident top-k on the device: no GPU ({why})");
            return None;
        }
    };
    let mut reports = Vec::new();
    for q in planned {
        let input = whole.project(&q.projection).unwrap();
        let mut engine = TopKEngine::new(&device, q.program.key_kind).unwrap();
        // The denser sample wherever k and the rows allow it (by default only where the
        // candidates might not fit the packed sort's one wave: not at these sizes).
        engine.set_refine_above(Some(0));
        let (kernel, _) = device.generated_kernel(&q.program.source, ENTRY).unwrap();
        let arrays = ResidentColumns::program_inputs(&q.program, &input).unwrap();
        let resident = ResidentColumns::upload(&mut engine, &q.program, &arrays).unwrap();
        assert_eq!(resident.rows(), whole.num_rows());
        for fused in [true, false] {
            let sample_rows = if fused { FUSED_SAMPLE_ROWS } else { 0 };
            let (positions, report) = resident
                .top_k(
                    &mut engine,
                    &kernel,
                    q.spec.k,
                    DeviceAlgorithm::Sample,
                    sample_rows,
                )
                .unwrap_or_else(|e| panic!("{}: {e}", q.sql));
            let got: Vec<i64> = positions
                .iter()
                .skip(q.spec.skip)
                .map(|&p| ids.value(p as usize))
                .collect();
            assert_eq!(got, q.want, "{} (fused: {fused}): {report:?}", q.sql);
            if fused {
                // The sample sets a threshold unless k nears half the rows (then every row
                // is a candidate).
                let sampled = q.spec.k < whole.num_rows() / 4;
                assert_eq!(report.sampled > 0, sampled, "{}: the sample ran", q.sql);
                // A large k's threshold is refined by a denser sample (at ≥ 128 rows a
                // sampled row); a small k's is not.
                if !sampled {
                    assert_eq!(report.refined, 0, "{}", q.sql);
                } else if q.spec.k > RANK_SORT_MAX && whole.num_rows() >= 128 * FUSED_SAMPLE_ROWS {
                    assert!(report.refined > report.sampled, "{}: {report:?}", q.sql);
                } else if q.spec.k <= RANK_SORT_MAX {
                    assert_eq!(report.refined, 0, "{}", q.sql);
                }
                reports.push(report);
            } else {
                assert_eq!(report.candidates as u64, report.passed, "{}", q.sql);
            }
        }
    }
    Some(reports)
}

/// Registers `whole` as table `t` of each session, in batches of 2^16 rows.
fn register_in_batches(sessions: &[&SessionContext], whole: &RecordBatch) {
    let rows = whole.num_rows();
    for ctx in sessions {
        let batches: Vec<RecordBatch> = (0..rows)
            .step_by(1 << 16)
            .map(|s| whole.slice(s, (1 << 16).min(rows - s)))
            .collect();
        let table =
            datafusion::datasource::MemTable::try_new(whole.schema(), vec![batches]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
    }
}

/// Table `t` of `columns` (column 0: the row ids) in both sessions, and the plan of `SELECT id
/// FROM t ORDER BY c DESC LIMIT k` for each column c of `by` (its oracle with `, id` appended).
async fn plan_descending(
    schema: &Arc<Schema>,
    columns: Vec<ArrayRef>,
    by: &[&str],
    k: usize,
) -> (RecordBatch, Int64Array, Vec<Planned>) {
    let whole = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let ids = whole.column(0).as_primitive::<Int64Type>().clone();
    let (ours, plain) = sessions();
    register_in_batches(&[&ours, &plain], &whole);
    let mut planned = Vec::new();
    for column in by {
        let sql = format!("SELECT id FROM t ORDER BY {column} DESC LIMIT {k}");
        let oracle = format!("SELECT id FROM t ORDER BY {column} DESC, id LIMIT {k}");
        planned.push(plan(&ours, &plain, schema, &sql, &oracle).await);
    }
    (whole, ids, planned)
}

#[tokio::test]
async fn resident_top_k_matches_datafusion_on_the_tweet_queries() {
    // Enough rows for the sampled threshold at k = 10^5, and for its denser sample (a step of
    // at least 8 rows in both).
    let rows = 128 * FUSED_SAMPLE_ROWS as u64;
    let parts = tweets::tweets_partitions(&TweetsSpec::new(rows), 4, 1 << 16).unwrap();
    let (ours, plain) = sessions();
    let table = Arc::new(
        datafusion::datasource::MemTable::try_new(tweets::tweets_schema(), parts.clone()).unwrap(),
    );
    ours.register_table("tweets", table.clone()).unwrap();
    plain.register_table("tweets", table).unwrap();
    let schema = tweets::tweets_schema();
    let whole = concat_batches(&schema, parts.iter().flatten()).unwrap();
    let ids = whole.column(0).as_primitive::<Int64Type>().clone();
    let q1 = |sel: f64, tie: &str| {
        format!(
            "SELECT id FROM tweets WHERE tweet_time < '{}' ORDER BY retweet_count DESC{tie} LIMIT 50",
            tweets::time_bound_for_selectivity(sel)
        )
    };
    let q2 = |k: usize, tie: &str| {
        format!(
            "SELECT id FROM tweets ORDER BY retweet_count + 0.5 * likes_count DESC{tie} LIMIT {k}"
        )
    };
    let q3 = |tie: &str| {
        format!(
            "SELECT id FROM tweets WHERE lang = 'en' OR lang = 'es' ORDER BY retweet_count DESC{tie} LIMIT 40 OFFSET 10"
        )
    };
    // A large k over few passing rows: fewer candidates than one merge tile, which the packed
    // sort's plan leaves to the pairs' merge sort.
    let q1_large_k = |tie: &str| {
        format!(
            "SELECT id FROM tweets WHERE tweet_time < '{}' ORDER BY retweet_count DESC{tie} LIMIT 100000",
            tweets::time_bound_for_selectivity(0.001)
        )
    };
    let mut planned = Vec::new();
    for (sql, oracle) in [
        (q1(0.3, ""), q1(0.3, ", id")),
        (q1(0.0, ""), q1(0.0, ", id")),
        (q1(1.0, ""), q1(1.0, ", id")),
        (q2(1, ""), q2(1, ", id")),
        (q2(1000, ""), q2(1000, ", id")),
        (q2(100_000, ""), q2(100_000, ", id")),
        (q3(""), q3(", id")),
        (q1_large_k(""), q1_large_k(", id")),
    ] {
        planned.push(plan(&ours, &plain, &schema, &sql, &oracle).await);
    }
    assert!(planned[1].want.is_empty() && planned[5].want.len() == 100_000);
    assert!(
        (1..=2048).contains(&planned[7].want.len()),
        "{}",
        planned[7].want.len()
    );
    run_on_device(&whole, &ids, &planned);
}

#[tokio::test]
async fn a_large_k_without_a_sampled_threshold_sorts_every_row_exactly() {
    // k beyond half the rows: no sampled threshold, every row a candidate, sorted whole. Few
    // distinct values: long runs of ties, whose order is the rows'. The key bits that vary
    // and the row id's 21 bits fit one word for the first three orders (packed, merge-sorted
    // keys only; the third's field crosses its 128-bit key's words: bits 33 to 66), not for
    // the fourth (doubles that vary in every mantissa bit: merge-sorted as pairs).
    let rows = 2_000_000usize;
    let k = 1_600_000;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v64", DataType::Int64, false),
        Field::new("v32", DataType::Int32, false),
        Field::new("wide", DataType::Float64, false),
        Field::new("s", DataType::Int32, false),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..rows).map(|r| r as i64))),
        Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|r| ((r as i64 * 7919) % 1009) << 33),
        )),
        Arc::new(Int32Array::from_iter_values(
            (0..rows).map(|r| ((r as i32).wrapping_mul(48271) >> 8) % 997),
        )),
        Arc::new(Float64Array::from_iter_values((0..rows).map(|r| {
            let h = (r as u64 % 40_000).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        }))),
        Arc::new(Int32Array::from_iter_values(
            (0..rows).map(|r| (r % 5) as i32),
        )),
    ];
    let orders = ["v64", "v32", "s DESC, v64", "wide"];
    let (whole, ids, planned) = plan_descending(&schema, columns, &orders, k).await;
    let kinds: Vec<KeyWidth> = planned.iter().map(|p| p.program.key_kind).collect();
    assert_eq!(
        kinds,
        [KeyWidth::W64, KeyWidth::W32, KeyWidth::W128, KeyWidth::W64]
    );
    if let Some(reports) = run_on_device(&whole, &ids, &planned) {
        for report in &reports {
            assert_eq!((report.candidates, report.reruns), (rows, 0), "{reports:?}");
        }
        let packed: Vec<bool> = reports.iter().map(|r| r.packed_bits > 0).collect();
        assert_eq!(packed, [true, true, true, false], "{reports:?}");
    }
}

/// Whether a fused selection's sample of one row in `step` takes row r (fused.cuh
/// `sample_row`: the first FUSED_SAMPLE_CLUSTER rows of every `step` · FUSED_SAMPLE_CLUSTER).
fn sampled_at(r: usize, step: usize) -> bool {
    r % (step * FUSED_SAMPLE_CLUSTER) < FUSED_SAMPLE_CLUSTER
}

#[tokio::test]
async fn a_missed_sampled_threshold_reruns_the_pass_and_stays_exact() {
    // 16 rows per sampled row: the sample sees only the first FUSED_SAMPLE_CLUSTER rows of
    // every 16 · FUSED_SAMPLE_CLUSTER; the other rows outnumber the smallest candidate buffer
    // (2^16 pairs).
    const STEP: usize = 16;
    let rows = STEP * FUSED_SAMPLE_ROWS;
    let sampled = |r: usize| sampled_at(r, STEP);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("best_sampled", DataType::Int64, false),
        Field::new("worst_sampled", DataType::Int64, false),
    ]));
    let i = |r: usize| r as i64;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..rows).map(i))),
        // The sampled rows beat every other row: the sample's threshold admits too few.
        Arc::new(Int64Array::from_iter_values((0..rows).map(|r| {
            if sampled(r) {
                1_000_000 + i(r)
            } else {
                i(r) % 1000
            }
        }))),
        // The sampled rows lose to every other row: it admits more than the buffer holds.
        Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|r| if sampled(r) { -i(r) } else { i(r) % 5000 }),
        )),
    ];
    let (whole, ids, planned) =
        plan_descending(&schema, columns, &["best_sampled", "worst_sampled"], 1000).await;
    if let Some(reports) = run_on_device(&whole, &ids, &planned) {
        let reruns: Vec<usize> = reports.iter().map(|r| r.reruns).collect();
        assert_eq!(reruns, vec![1, 1], "each miss reruns the full pass once");
    }
}

#[tokio::test]
async fn a_missed_refined_threshold_reruns_the_pass_and_stays_exact() {
    // 128 rows per row of the first sample, 8 per row of the denser one. ~3500 rows that only
    // the denser sample sees beat every other row: its rank (~2700 for k = 20000) falls among
    // them, so the refined threshold admits too few; the ~3300 other rows it keeps below the
    // first threshold leave it within the one-block threshold's 8192.
    const STEP: usize = 128;
    const DENSE: usize = 8;
    let rows = STEP * FUSED_SAMPLE_ROWS;
    let k = 20_000;
    assert!(k > RANK_SORT_MAX);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
    ]));
    let i = |r: usize| r as i64;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..rows).map(i))),
        Arc::new(Int64Array::from_iter_values((0..rows).map(|r| {
            if sampled_at(r, DENSE) && !sampled_at(r, STEP) && r < 30_000 {
                1_000_000 + i(r)
            } else {
                i(r) % 100_000
            }
        }))),
    ];
    let (whole, ids, planned) = plan_descending(&schema, columns, &["v"], k).await;
    if let Some(reports) = run_on_device(&whole, &ids, &planned) {
        assert_eq!(reports[0].reruns, 1, "the miss reruns the full pass once");
    }
}

#[tokio::test]
async fn a_sampled_large_k_whose_key_bits_do_not_fit_a_word_sorts_its_pairs() {
    // k between the rank sort and a quarter of the rows: the sampled threshold and its denser
    // sample run, and the candidates are sorted whole. Doubles that vary in every mantissa
    // bit and 21 bits of row id do not fit one word (`packed_field`): they are merge-sorted as
    // pairs, exactly.
    let rows = 1usize << 21;
    let k = 50_000;
    assert!(k > RANK_SORT_MAX && k < rows / 4 && rows >= 128 * FUSED_SAMPLE_ROWS);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("wide", DataType::Float64, false),
    ]));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..rows).map(|r| r as i64))),
        Arc::new(Float64Array::from_iter_values((0..rows).map(|r| {
            let h = (r as u64 % 40_000).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        }))),
    ];
    let (whole, ids, planned) = plan_descending(&schema, columns, &["wide"], k).await;
    if let Some(reports) = run_on_device(&whole, &ids, &planned) {
        let report = &reports[0];
        assert!(report.refined > report.sampled, "{report:?}");
        assert!(report.candidates >= k, "{report:?}");
        assert_eq!((report.reruns, report.packed_bits), (0, 0), "{report:?}");
    }
}
