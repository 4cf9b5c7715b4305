//! String, binary and wide sort keys: every type the row format compares, the refinement of
//! prefix ties, and inputs that cannot be replayed (a join and an aggregate below).
//!
//! The differential suite (`differential`, `fuzz`) covers the same keys over memory, Parquet
//! and CSV tables; these tests add the types it has no column of, and what only a dedicated
//! table shows (long shared prefixes, the `rows_refined` metric).

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BinaryViewArray, Decimal128Array, Decimal256Array, DictionaryArray,
    FixedSizeBinaryArray, Int32Array, Int64Array, RecordBatch, StringArray, StringViewArray,
};
use datafusion::arrow::datatypes::i256;
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::physical_plan::collect;
use datafusion::prelude::SessionContext;

use crate::common::{
    Rng, Storage, count_gpu_topk, exact_rows, physical_plan, plain_session, plan_text, register,
    register_as, run, same_rows_with_metrics, session, test_dir,
};

/// `n` rows over `partitions` partitions: `id`, a string `s` from `value(id)`, its views `sv`,
/// its bytes `bv` and a 4-byte fixed-size binary `fb` of the id.
fn table(
    n: usize,
    partitions: usize,
    value: impl Fn(&mut Rng, usize) -> Option<String>,
) -> Vec<Vec<RecordBatch>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("s", DataType::Utf8, true),
        Field::new("sv", DataType::Utf8View, true),
        Field::new("bv", DataType::BinaryView, true),
        Field::new("fb", DataType::FixedSizeBinary(4), false),
        Field::new("price", DataType::Decimal128(15, 2), true),
        Field::new(
            "ds",
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
            true,
        ),
        Field::new("wide", DataType::Decimal256(60, 0), true),
        Field::new("d2", DataType::Decimal128(38, 0), true),
    ]));
    let mut rng = Rng::new(17);
    let per = n.div_ceil(partitions);
    (0..partitions)
        .map(|p| {
            let ids: Vec<usize> = (p * per..((p + 1) * per).min(n)).collect();
            ids.chunks(333)
                .map(|chunk| {
                    let values: Vec<Option<String>> =
                        chunk.iter().map(|&i| value(&mut rng, i)).collect();
                    let strs: Vec<Option<&str>> = values.iter().map(|v| v.as_deref()).collect();
                    let bytes: Vec<Option<&[u8]>> =
                        strs.iter().map(|v| v.map(str::as_bytes)).collect();
                    let fixed: Vec<[u8; 4]> = chunk
                        .iter()
                        .map(|&i| ((i as u32).wrapping_mul(2_654_435_761)).to_be_bytes())
                        .collect();
                    let columns: Vec<ArrayRef> = vec![
                        Arc::new(Int64Array::from_iter_values(
                            chunk.iter().map(|&i| i as i64),
                        )),
                        Arc::new(StringArray::from(strs.clone())),
                        Arc::new(StringViewArray::from(strs)),
                        Arc::new(BinaryViewArray::from(bytes)),
                        Arc::new(FixedSizeBinaryArray::try_from_iter(fixed.into_iter()).unwrap()),
                        Arc::new(
                            Decimal128Array::from_iter(chunk.iter().map(|&i| {
                                (i % 97 != 5).then_some((i as i128 * 7919) % 100_000 - 20_000)
                            }))
                            .with_precision_and_scale(15, 2)
                            .unwrap(),
                        ),
                        dictionary(&values),
                        Arc::new(
                            Decimal256Array::from_iter(chunk.iter().map(|&i| {
                                // Past 128 bits, the low ones tying within a prefix word.
                                let high = i256::from_i128((i as i128 * 7919) % 1000 - 300);
                                (i % 89 != 3).then(|| {
                                    high.wrapping_mul(i256::from_i128(10i128.pow(38)))
                                        .wrapping_mul(i256::from_i128(1000))
                                        .wrapping_add(i256::from_i128((i % 13) as i128))
                                })
                            }))
                            .with_precision_and_scale(60, 0)
                            .unwrap(),
                        ),
                        Arc::new(
                            Decimal128Array::from_iter(chunk.iter().map(|&i| {
                                (i % 71 != 9).then_some((i % 50) as i128 * 4 + (i % 4) as i128)
                            }))
                            .with_precision_and_scale(38, 0)
                            .unwrap(),
                        ),
                    ];
                    RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()
                })
                .collect()
        })
        .collect()
}

/// `values` as a dictionary of the batch's own: unused entries and a NULL entry besides the
/// values, a NULL row by turns a NULL key and a key of the NULL entry.
fn dictionary(values: &[Option<String>]) -> ArrayRef {
    let mut entries: Vec<Option<&str>> = vec![Some("zz-unused"), None, Some("")];
    let mut keys = Vec::with_capacity(values.len());
    for (i, value) in values.iter().enumerate() {
        keys.push(match value {
            None if i % 2 == 0 => None,
            None => Some(1),
            Some(v) => Some(match entries.iter().position(|e| *e == Some(v.as_str())) {
                Some(at) => at as i32,
                None => {
                    entries.push(Some(v));
                    entries.len() as i32 - 1
                }
            }),
        });
    }
    let entries = StringArray::from(entries);
    Arc::new(DictionaryArray::new(
        Int32Array::from(keys),
        Arc::new(entries),
    ))
}

/// Strings sharing a 30-byte prefix, some prefixes of others, NULLs, non-ASCII tails.
fn shared_prefix(rng: &mut Rng, _: usize) -> Option<String> {
    if rng.below(15) == 0 {
        return None;
    }
    let tail: String = (0..rng.below(4))
        .map(|_| ['a', 'b', 'é', 'z'][rng.below(4) as usize])
        .collect();
    Some(format!("https://example.com/shared/path/{tail}"))
}

/// Distinct leading bytes: the prefix alone decides every comparison.
fn distinct(_: &mut Rng, i: usize) -> Option<String> {
    Some(format!(
        "{:08x}-{i}",
        (i as u32).wrapping_mul(2_654_435_761)
    ))
}

/// Runs `sql` with the operator and plain DataFusion (stable order: `id` as the last key)
/// and compares rows one for one; returns the operator's plan text after the run.
async fn same_rows(
    ours: &SessionContext,
    plain: &SessionContext,
    order: &str,
    tail: &str,
) -> String {
    same_rows_where(ours, plain, "", order, tail).await
}

/// [`same_rows`] of the rows that pass `filter` (a `WHERE` clause, or empty).
async fn same_rows_where(
    ours: &SessionContext,
    plain: &SessionContext,
    filter: &str,
    order: &str,
    tail: &str,
) -> String {
    let sql = format!("SELECT id, s FROM t {filter} ORDER BY {order} {tail}");
    let oracle = format!("SELECT id, s FROM t {filter} ORDER BY {order}, id {tail}");
    same_rows_with_metrics(ours, plain, (&sql, &oracle), "").await
}

/// The `rows_refined` metric of an executed plan's text.
fn rows_refined(plan: &str) -> usize {
    metric(plan, "rows_refined")
}

/// Metric `name` of an executed plan's text.
pub(crate) fn metric(plan: &str, name: &str) -> usize {
    let key = format!("{name}=");
    let at = plan
        .find(&key)
        .unwrap_or_else(|| panic!("{name} in the metrics: {plan}"));
    let digits: String = plan[at + key.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().unwrap()
}

/// With the CUDA backend forced on a GPU, a string key over a whole table (in memory over
/// several partitions; Parquet files of several row groups) is selected on the device from its
/// prefix words, the ties refined on the host, and string predicates are evaluated on the
/// device over each row's bytes: DataFusion's rows, no fallback, and the repeated query finds
/// the prefix words and bytes in the column cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn string_keys_select_on_the_device_over_whole_tables() {
    use datafusion_gpu_topk::internal::device::{GpuStatus, gpu_status};
    if let GpuStatus::Unavailable(why) = gpu_status() {
        eprintln!("SKIP: string keys on the device: no GPU ({why})");
        return;
    }
    let dir = test_dir("strings-device");
    type Values = fn(&mut Rng, usize) -> Option<String>;
    let values: [(&str, Values); 2] = [("distinct", distinct), ("shared", shared_prefix)];
    for (name, value) in values {
        let data = table(30_000, 3, value);
        for storage in [Storage::Memory, Storage::GpuTable, Storage::Parquet] {
            let config =
                crate::sessions::test_config(true).with_backend(datafusion_gpu_topk::Backend::Cuda);
            let ours = crate::common::session_with(3, 1000, config);
            let plain = plain_session(3, storage);
            register_as(&ours, "t", &data, storage, &dir).await;
            register_as(&plain, "t", &data, storage, &dir).await;
            // A decimal key or filter is read as an i64 (the prices fit).
            let cases = [
                ("", "s", "LIMIT 10"),
                ("", "sv DESC", "LIMIT 100"),
                ("", "s NULLS FIRST", "LIMIT 5 OFFSET 3"),
                ("", "bv DESC NULLS LAST", "LIMIT 1000"),
                ("", "id % 7, sv", "LIMIT 50"),
                ("", "price DESC, sv", "LIMIT 20"),
                // A dictionary by its values' prefix words; a Decimal256 and a fixed-size
                // binary by their leading bytes.
                ("", "ds", "LIMIT 10"),
                ("WHERE price > 0", "ds DESC NULLS FIRST", "LIMIT 100"),
                ("", "wide DESC", "LIMIT 30"),
                ("", "wide NULLS FIRST, id", "LIMIT 12"),
                ("", "fb DESC", "LIMIT 10"),
                // Keys past 256 bits: the last field keeps its high bits.
                ("", "price, d2 DESC, id", "LIMIT 40"),
                ("", "price DESC, id % 3, id % 5", "LIMIT 25"),
                (
                    "WHERE price < CAST(-150 AS DECIMAL(15, 2))",
                    "sv DESC",
                    "LIMIT 30",
                ),
                // String predicates on each row's bytes, with numeric and string keys.
                ("WHERE s LIKE '%b%'", "price DESC", "LIMIT 10"),
                (
                    "WHERE sv NOT LIKE '%a_é%' AND length(s) > 34",
                    "id DESC",
                    "LIMIT 25",
                ),
                (
                    "WHERE s >= 'c' AND sv < 'e' OR starts_with(s, '0') \
                     OR sv IN ('https://example.com/shared/path/', 'x')",
                    "s DESC",
                    "LIMIT 40",
                ),
                (
                    "WHERE ends_with(sv, 'z') OR s IS NULL OR octet_length(s) = 10",
                    "price, sv",
                    "LIMIT 15",
                ),
            ];
            for (filter, order, tail) in cases {
                for round in 0..2 {
                    let plan = same_rows_where(&ours, &plain, filter, order, tail).await;
                    let what = format!("{name}, {storage:?}, {filter} ORDER BY {order} {tail}");
                    assert!(plan.contains("backend=cuda"), "{what}: {plan}");
                    assert_eq!(metric(&plan, "gpu_fallbacks"), 0, "{what}: {plan}");
                    assert!(plan.contains("keys=gpu"), "{what}: {plan}");
                    if !filter.is_empty() {
                        assert!(plan.contains("filter=gpu"), "{what}: {plan}");
                    }
                    if round == 1 {
                        assert!(metric(&plan, "cache_hits") > 0, "{what}: {plan}");
                        assert_eq!(metric(&plan, "cache_misses"), 0, "{what}: {plan}");
                    }
                    if name == "distinct" && order.starts_with('s') {
                        assert_eq!(rows_refined(&plan), 0, "{what}: {plan}");
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every byte-compared type, in every direction, over memory, Parquet and CSV.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_byte_key_type_matches_datafusion() {
    let data = table(4000, 3, shared_prefix);
    let dir = test_dir("strings-types");
    for storage in [Storage::Memory, Storage::Parquet, Storage::Csv] {
        let ours = session(true, 3, 256);
        let plain = plain_session(3, storage);
        if storage == Storage::Csv {
            // CSV holds strings only.
            let strings: Vec<Vec<RecordBatch>> = (data.iter())
                .map(|p| p.iter().map(|b| b.project(&[0, 1]).unwrap()).collect())
                .collect();
            register_as(&ours, "t", &strings, storage, &dir).await;
            register_as(&plain, "t", &strings, storage, &dir).await;
        } else {
            register_as(&ours, "t", &data, storage, &dir).await;
            register_as(&plain, "t", &data, storage, &dir).await;
        }
        let mut keys = vec![
            "s",
            "arrow_cast(s, 'LargeUtf8')",
            "arrow_cast(s, 'Utf8View')",
            "arrow_cast(s, 'Binary')",
            "arrow_cast(s, 'LargeBinary')",
            "arrow_cast(s, 'Dictionary(Int16, Utf8)')",
        ];
        if storage != Storage::Csv {
            keys.extend(["sv", "bv", "fb", "arrow_cast(id, 'Decimal256(50, 0)') * 3"]);
        }
        for key in keys {
            for dir in ["ASC", "DESC", "ASC NULLS FIRST", "DESC NULLS LAST"] {
                for tail in ["LIMIT 7", "LIMIT 100 OFFSET 20"] {
                    same_rows(&ours, &plain, &format!("{key} {dir}"), tail).await;
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows whose prefix ties the k-th candidate's are the only ones compared in full: none where
/// the prefixes differ, and the shared-prefix rows where they do not (with the right answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_prefix_ties_are_compared_in_full() {
    let ours = session(true, 4, 1000);
    let plain = session(false, 4, 1000);
    register(&ours, "t", table(20_000, 4, distinct));
    register(&plain, "t", table(20_000, 4, distinct));
    let plan = same_rows(&ours, &plain, "s DESC", "LIMIT 10").await;
    assert!(plan.contains("ties=refined"), "{plan}");
    assert_eq!(rows_refined(&plan), 0, "{plan}");

    let ours = session(true, 4, 1000);
    let plain = session(false, 4, 1000);
    register(&ours, "t", table(20_000, 4, shared_prefix));
    register(&plain, "t", table(20_000, 4, shared_prefix));
    let plan = same_rows(&ours, &plain, "s", "LIMIT 10").await;
    assert!(rows_refined(&plan) > 0, "{plan}");
}

/// A join and an aggregate below: inputs the operator reads once, as they stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn string_keys_over_a_join_and_an_aggregate() {
    let data = table(3000, 3, shared_prefix);
    let ours = session(true, 3, 200);
    let plain = session(false, 3, 200);
    for ctx in [&ours, &plain] {
        register(ctx, "t", data.clone());
        register(ctx, "u", data.clone());
    }
    let queries = [
        "SELECT t.id, u.s FROM t JOIN u ON t.id = u.id % 500 ORDER BY u.s DESC, t.id, u.id LIMIT 25",
        "SELECT s, count(*) AS c, max(id) AS m FROM t GROUP BY s ORDER BY s NULLS FIRST LIMIT 6",
        "SELECT s, max(sv) AS m FROM t GROUP BY s ORDER BY m DESC, s LIMIT 6",
    ];
    for sql in queries {
        let plan = physical_plan(&ours, sql).await.unwrap();
        assert_eq!(count_gpu_topk(&plan), 1, "{sql}:\n{}", plan_text(&plan));
        let got = exact_rows(&collect(plan, ours.task_ctx()).await.unwrap());
        let want = exact_rows(&run(&plain, sql).await.unwrap());
        assert_eq!(got, want, "{sql}");
    }
}

/// A string key DataFusion fails to evaluate fails ours with its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_string_key_fails_with_datafusions_error() {
    let data = table(1000, 2, distinct);
    let ours = session(true, 2, 100);
    let plain = session(false, 2, 100);
    register(&ours, "t", data.clone());
    register(&plain, "t", data);
    let sql = "SELECT id FROM t ORDER BY concat(s, CAST(10 / (id - id) AS VARCHAR)) LIMIT 5";
    let plan = physical_plan(&ours, sql).await.unwrap();
    assert_eq!(count_gpu_topk(&plan), 1, "{}", plan_text(&plan));
    let ours = run(&ours, sql).await.unwrap_err().to_string();
    let theirs = run(&plain, sql).await.unwrap_err().to_string();
    assert_eq!(ours, theirs);
}
