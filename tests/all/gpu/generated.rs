//! Generated programs (src/fusion) on the device against DataFusion's evaluation, across
//! reductions.

use super::*;

/// The generated program of a query (planned with the CPU backend, which plans fusion too)
/// run by the CUDA selector with a tiny candidate buffer (many reductions and threshold
/// updates), against the CPU selector fed by DataFusion's own evaluation of the same
/// predicate and keys. Random batches with NULLs, NaNs and edge values (the differential
/// tests' table), explicit consecutive ids.
#[tokio::test]
async fn generated_programs_match_datafusion_evaluation_across_reductions() {
    use datafusion::arrow::array::{AsArray, RecordBatch};
    use datafusion::arrow::compute::{filter_record_batch, prep_null_mask_filter};
    fn null_as_false(
        mask: &datafusion::arrow::array::BooleanArray,
    ) -> datafusion::arrow::array::BooleanArray {
        match mask.null_count() {
            0 => mask.clone(),
            _ => prep_null_mask_filter(mask),
        }
    }
    use datafusion_gpu_topk::{Backend, GpuTopKConfig, GpuTopKExec, SessionStateBuilderExt};

    let data = crate::differential::table(11, &[&[700, 1, 333, 2048, 999, 64, 1500, 5]]);
    let ctx = {
        let state = datafusion::execution::SessionStateBuilder::new()
            .with_default_features()
            // Programs for a streamed input: string predicates stay on the host.
            .with_gpu_topk(
                GpuTopKConfig::default()
                    .with_backend(Backend::Cpu)
                    .with_column_cache(false),
            )
            .build();
        datafusion::prelude::SessionContext::new_with_state(state)
    };
    crate::common::register(&ctx, "t", vec![data[0][..1].to_vec()]);
    let queries = [
        (
            "WHERE i32 > 0 OR b",
            "f64 * 2.0 - CAST(i16 AS DOUBLE) DESC NULLS LAST, i64",
            10,
        ),
        ("", "f32 / f32, CAST(f32 AS DOUBLE) * f64 DESC", 37),
        (
            "WHERE NOT (i16 >= -3) AND i8 IS NOT NULL",
            "i8 + i8 DESC, u64 * u64",
            100,
        ),
        (
            "WHERE nan_only = nan_only AND f64 <> -0.0",
            "-f64, ts_ns",
            5,
        ),
        ("WHERE s LIKE 'a%'", "g DESC, u8 - u8", 64),
        (
            "WHERE ts_ns < TIMESTAMP '2000-01-01 00:00:00'",
            "i64 / 7, i64 % 5 DESC",
            1,
        ),
        ("", "b NULLS FIRST, d32 DESC", 300),
        (
            "WHERE i8 IN (1, NULL, -128) OR f64 NOT IN (0.0, -0.0, 1.5)",
            "CASE g WHEN 1 THEN f64 WHEN 2 THEN -f64 END DESC, round(f32, 1)",
            40,
        ),
        (
            "WHERE CASE WHEN i8 IS NULL THEN b ELSE i8 > 0 END",
            "floor(f64) DESC, ceil(f32), abs(f64), round(f64)",
            70,
        ),
        (
            "WHERE ds IN ('en', 'zz', NULL) OR ds <> 'es'",
            "i16 DESC",
            90,
        ),
        // Guarded operations; the table's edge values make some batches rerun on the host.
        (
            "WHERE i32 / 7 > 1 OR u8 % 3 = 0",
            "sqrt(abs(f64)) DESC, i64 / 3",
            30,
        ),
        ("WHERE i16 > 0", "sqrt(f64), abs(i8) DESC", 30),
        (
            "WHERE ts_ns + INTERVAL '1 day' < TIMESTAMP '2000-01-01 00:00:00'",
            "ts_us - INTERVAL '2 days 3 hours' DESC, ts_s + INTERVAL '1 minute'",
            45,
        ),
    ];
    fn find(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Option<&GpuTopKExec> {
        plan.downcast_ref::<GpuTopKExec>()
            .or_else(|| plan.children().into_iter().find_map(|c| find(c)))
    }
    // Planned first (also without a GPU): every query must get a program.
    let mut planned = Vec::new();
    for (filter, order, k) in queries {
        let sql = format!("SELECT rid FROM t {filter} ORDER BY {order} LIMIT {k}");
        let plan = crate::common::physical_plan(&ctx, &sql).await.unwrap();
        let spec = find(&plan)
            .unwrap_or_else(|| panic!("{sql}: no operator"))
            .spec()
            .clone();
        let program = spec
            .fusion
            .program
            .clone()
            .unwrap_or_else(|| panic!("{sql}: no program: {}", spec.fusion.describe(true)));
        // The operator's input is a projection of the table: its columns, by name.
        let input = find(&plan).unwrap().input().schema();
        let columns: Vec<usize> = input
            .fields()
            .iter()
            .map(|f| data[0][0].schema().index_of(f.name()).unwrap())
            .collect();
        planned.push((sql, spec, program, k, columns));
    }
    let Some(device) =
        gpu_or_skip("generated_programs_match_datafusion_evaluation_across_reductions")
    else {
        return;
    };
    let mut compared = 0;
    'queries: for (sql, spec, program, k, projection) in planned {
        for algorithm in [Algorithm::Radix, Algorithm::Auto] {
            let selection = SelectionSpec {
                program: Some(Arc::clone(&program)),
                ..SelectionSpec::new(spec.layout.clone(), k)
            };
            let gpu = new_cuda_selector_with_capacity(
                &selection,
                Arc::clone(&device),
                resolve(&device, &selection, algorithm).unwrap(),
                256,
            )
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let cpu = cpu::new_selector(&selection);
            let (mut first_id, mut passed_gpu, mut passed_cpu) = (0u64, 0usize, 0usize);
            for batch in &data[0] {
                let batch = &batch.project(&projection).unwrap();
                let n = batch.num_rows();
                // Reference: DataFusion evaluates the predicate, then the keys on the survivors.
                // Its evaluation may fail on a row (sqrt of a negative number, a timestamp out
                // of range): the generated program must then send the query to the host
                // (checked below).
                let reference = || -> datafusion::error::Result<(Vec<ArrayRef>, Vec<u64>)> {
                    let (filtered, ids): (RecordBatch, Vec<u64>) = match &spec.filter {
                        Some(predicate) => {
                            let mask = predicate.evaluate(batch)?.into_array(n)?;
                            let mask = null_as_false(mask.as_boolean());
                            let ids = mask
                                .values()
                                .set_indices()
                                .map(|i| first_id + i as u64)
                                .collect();
                            (filter_record_batch(batch, &mask)?, ids)
                        }
                        None => (batch.clone(), (first_id..first_id + n as u64).collect()),
                    };
                    let keys = spec
                        .sort_exprs
                        .iter()
                        .map(|s| s.expr.evaluate(&filtered)?.into_array(ids.len()))
                        .collect::<datafusion::error::Result<_>>()?;
                    Ok((keys, ids))
                };
                let reference = reference();
                let datafusion_fails = reference.is_err();
                if let Ok((keys, ids)) = &reference {
                    passed_cpu += ids.len();
                    cpu.push(SelectInput {
                        keys,
                        row_ids: RowIds::Explicit(ids),
                    })
                    .unwrap();
                }
                // The program reads the raw columns (and the host predicate, when it has one).
                use datafusion_gpu_topk::internal::fusion::{self, KernelInput};
                // Two chunks per row input (the operator pushes several batches at once); one
                // lookup table per dictionary input.
                let h = n / 3;
                let columns: Vec<Vec<ArrayRef>> = program
                    .inputs
                    .iter()
                    .map(|input| {
                        let whole = match input {
                            KernelInput::Column(c) => Arc::clone(batch.column(*c)),
                            KernelInput::HostPredicate => {
                                let predicate = spec.filter.as_ref().unwrap();
                                let mask =
                                    predicate.evaluate(batch).unwrap().into_array(n).unwrap();
                                Arc::new(null_as_false(mask.as_boolean())) as ArrayRef
                            }
                            KernelInput::DictionaryCodes(c) => {
                                fusion::dictionary_codes(batch.column(*c)).unwrap()
                            }
                            KernelInput::DictionaryMatch { column, values } => {
                                return vec![
                                    fusion::dictionary_match(batch.column(*column), values)
                                        .unwrap(),
                                ];
                            }
                            KernelInput::StringPrefix(_)
                            | KernelInput::StringColumn(_)
                            | KernelInput::StringCodes(_) => {
                                panic!("{sql}: a streamed program over a string image")
                            }
                        };
                        vec![whole.slice(0, h), whole.slice(h, n - h)]
                    })
                    .collect();
                let admitted =
                    match gpu.push_columns(datafusion_gpu_topk::internal::select::ColumnsInput {
                        columns: &columns,
                        first_id,
                    }) {
                        Ok(_) if datafusion_fails => {
                            panic!("{sql}: DataFusion fails on this batch, the program did not")
                        }
                        Ok(admitted) => admitted,
                        // Two different NaNs added or multiplied, or a row DataFusion fails on: the
                        // operator reruns such a query on the host (the differential tests check
                        // that end to end).
                        Err(e) if e.to_string().contains("only the host reproduces") => {
                            eprintln!("{sql}: rerun on the host: {e}");
                            continue 'queries;
                        }
                        Err(e) => panic!("{sql}: {e}"),
                    };
                passed_gpu += admitted.passed;
                assert!(
                    admitted.rows.windows(2).all(|w| w[0] < w[1])
                        && admitted.rows.iter().all(|&r| (r as usize) < n)
                );
                first_id += n as u64;
            }
            assert_eq!(passed_gpu, passed_cpu, "{sql}: rows passing the predicate");
            let expected = cpu.finish().unwrap();
            let got = gpu.finish().unwrap_or_else(|e| panic!("{sql}: {e}"));
            assert_eq!(got, expected, "{sql} ({algorithm}): winners differ");
            assert_eq!(got.len(), k.min(passed_cpu), "{sql}");
            compared += 1;
        }
    }
    assert!(compared >= 10, "only {compared} of 14 selections compared");
}
