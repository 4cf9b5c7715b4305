//! Top-k over an aggregate: the host reference against DataFusion's GROUP BY (no GPU needed),
//! and the device (aggregate.cu) against the host reference on random and adversarial groups;
//! a generated filtered pass against the reference over the rows its filter passes, and a
//! generated HAVING against the reference's groups that pass it.

use std::collections::HashMap;

use datafusion::arrow::array::{Float64Array, Int64Array};
use datafusion::arrow::datatypes::{Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::prelude::SessionContext;
use datafusion_gpu_topk::internal::device::{
    AGG_FILTERED_ENTRY, AGG_HAVING_ENTRY, AggValue, AggregateCall, AggregateColumn,
    AggregateDecline, AggregateFilter, AggregateGroup, AggregateHaving, AggregateOp,
    AggregateOrder, HavingColumn, HostColumn, KeyWidth, RankBy, TopKEngine, aggregate_top_k_host,
};

use super::*;

/// A host column: 8-byte values' bits and validity.
#[derive(Debug, Clone)]
struct Data {
    values: Vec<u64>,
    valid: Option<Vec<bool>>,
}

impl Data {
    fn host(&self) -> HostColumn<'_> {
        HostColumn {
            values: &self.values,
            valid: self.valid.as_deref(),
        }
    }

    fn get(&self, row: usize) -> Option<u64> {
        (self.valid.as_ref().is_none_or(|v| v[row])).then_some(self.values[row])
    }

    /// The little-endian bytes and the Arrow validity bitmap.
    fn bytes(&self) -> (Vec<u8>, Option<Vec<u8>>) {
        let values = self.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bitmap = self.valid.as_ref().map(|valid| {
            let mut bits = vec![0u8; valid.len().div_ceil(8)];
            for (i, _) in valid.iter().enumerate().filter(|(_, v)| **v) {
                bits[i / 8] |= 1 << (i % 8);
            }
            bits
        });
        (values, bitmap)
    }
}

/// `rows` values from `draw`, NULL with probability `nulls` (no bitmap at 0).
fn data(rng: &mut Rng, rows: usize, nulls: f64, mut draw: impl FnMut(&mut Rng) -> u64) -> Data {
    let values = (0..rows).map(|_| draw(rng)).collect();
    let valid = (nulls > 0.0).then(|| (0..rows).map(|_| !rng.chance(nulls)).collect());
    Data { values, valid }
}

/// f64 extremes for MIN/MAX: both zeros, both infinities, the finite extremes, quarters.
fn extreme(rng: &mut Rng) -> u64 {
    let special = [
        -0.0,
        0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::MAX,
        f64::MIN,
    ];
    match rng.below(3) {
        0 => special[rng.below(special.len() as u64) as usize].to_bits(),
        _ => ((rng.below(41) as f64 - 20.0) * 0.25).to_bits(),
    }
}

/// Quarters, whose sums are exact in any order.
fn quarter(rng: &mut Rng) -> u64 {
    ((rng.below(2001) as f64 - 1000.0) * 0.25).to_bits()
}

/// The value columns every case reads: i64 (0), f64 extremes (1), f64 quarters (2).
fn values(rng: &mut Rng, rows: usize, nulls: f64, big: bool) -> Vec<Data> {
    let int = |rng: &mut Rng| match big {
        // Near the ends of i64, so that sums wrap.
        true => {
            (i64::MAX - rng.below(1000) as i64).wrapping_mul(1 - 2 * (rng.below(2) as i64)) as u64
        }
        false => (rng.below(2001) as i64 - 1000) as u64,
    };
    vec![
        data(rng, rows, nulls, int),
        data(rng, rows, nulls, extreme),
        data(rng, rows, nulls, quarter),
    ]
}

const INT_OPS: [AggregateOp; 6] = [
    AggregateOp::CountStar,
    AggregateOp::Count(0),
    AggregateOp::SumI64(0),
    AggregateOp::MinI64(0),
    AggregateOp::MaxI64(0),
    AggregateOp::SumI64AsF64(0),
];
const FLOAT_OPS: [AggregateOp; 5] = [
    AggregateOp::CountStar,
    AggregateOp::MinF64(1),
    AggregateOp::MaxF64(1),
    AggregateOp::SumF64(2),
    AggregateOp::Count(2),
];

fn order(by: RankBy, descending: bool, nulls_first: bool) -> AggregateOrder {
    AggregateOrder {
        by,
        descending,
        nulls_first,
    }
}

/// Both results equal, f64 by value (zeros of either sign, NaNs of any bits).
fn same_groups(device: &[AggregateGroup], host: &[AggregateGroup]) -> bool {
    let same = |a: &AggValue, b: &AggValue| match (a, b) {
        (AggValue::F64(Some(x)), AggValue::F64(Some(y))) => x == y || (x.is_nan() && y.is_nan()),
        _ => a == b,
    };
    device.len() == host.len()
        && device
            .iter()
            .zip(host)
            .all(|(d, h)| d.key == h.key && d.values.iter().zip(&h.values).all(|(a, b)| same(a, b)))
}

struct Case<'a> {
    name: &'a str,
    keys: Vec<Data>,
    values: Vec<Data>,
    ops: &'a [AggregateOp],
    order: AggregateOrder,
    k: usize,
    estimate: usize,
    algorithm: DeviceAlgorithm,
}

/// Runs a case on the device and the host; returns the device's passes over the rows.
fn check(device: &Arc<GpuDevice>, case: Case<'_>) -> usize {
    let name = case.name;
    let host_keys: Vec<HostColumn> = case.keys.iter().map(Data::host).collect();
    let host_values: Vec<HostColumn> = case.values.iter().map(Data::host).collect();
    let expected = aggregate_top_k_host(&host_keys, &host_values, case.ops, case.order, case.k);
    let bytes: Vec<_> = case
        .keys
        .iter()
        .chain(&case.values)
        .map(Data::bytes)
        .collect();
    let columns: Vec<(&[u8], Option<&[u8]>)> = (bytes.iter())
        .map(|(v, b)| (v.as_slice(), b.as_deref()))
        .collect();
    // The width depends on which columns have NULLs, known before the upload.
    let shape = |d: &Data| AggregateColumn {
        values: 8,
        validity: u64::from(d.valid.is_some()),
        validity_offset: 0,
    };
    let (shape_keys, shape_values): (Vec<_>, Vec<_>) = (
        case.keys.iter().map(shape).collect(),
        case.values.iter().map(shape).collect(),
    );
    let shaped = AggregateCall {
        keys: &shape_keys,
        values: &shape_values,
        ops: case.ops,
        rows: case.keys[0].values.len(),
        order: case.order,
        k: case.k,
        groups_estimate: case.estimate,
        algorithm: case.algorithm,
        filter: None,
        having: None,
    };
    let mut engine = TopKEngine::new(device, shaped.key_width()).unwrap();
    let uploaded = engine.upload_columns(&columns).unwrap();
    let (keys, values) = uploaded.columns.split_at(case.keys.len());
    let call = AggregateCall {
        keys,
        values,
        ..shaped
    };
    let got = engine.aggregate_top_k(&call).unwrap();
    drop(uploaded);
    match expected {
        Err(decline) => {
            assert_eq!(got.report.declined, Some(decline), "{name}");
            assert!(got.top.is_empty(), "{name}");
        }
        Ok((top, groups)) => {
            assert_eq!(got.report.declined, None, "{name}");
            assert_eq!(got.groups, groups, "{name}: groups");
            assert!(
                same_groups(&got.top, &top),
                "{name}: device {:?}\nhost {:?}",
                &got.top[..got.top.len().min(8)],
                &top[..top.len().min(8)]
            );
        }
    }
    got.report.passes
}

#[test]
fn aggregate_top_k_matches_the_host_reference() {
    let Some(device) = gpu_or_skip("aggregate_top_k_matches_the_host_reference") else {
        return;
    };
    let mut rng = Rng::new(77);
    let rows = 50_000;
    let keys = |rng: &mut Rng, range: u64, nulls: f64| {
        vec![data(rng, rows, nulls, |r| {
            (r.below(range) as i64 - (range / 2) as i64) as u64
        })]
    };
    use DeviceAlgorithm::*;
    let desc = |i| order(RankBy::Op(i), true, true);
    let mut cases = vec![
        (
            "one group",
            keys(&mut rng, 1, 0.0),
            INT_OPS.as_slice(),
            desc(2),
            5,
        ),
        (
            "ties at the k-th count",
            keys(&mut rng, 3000, 0.0),
            &INT_OPS,
            desc(0),
            100,
        ),
        (
            "NULL keys, ascending",
            keys(&mut rng, 500, 0.1),
            &INT_OPS,
            order(RankBy::Op(3), false, false),
            40,
        ),
        (
            "k above the groups",
            keys(&mut rng, 50, 0.2),
            &FLOAT_OPS,
            desc(3),
            1000,
        ),
        (
            "f64 extremes by MIN",
            keys(&mut rng, 700, 0.05),
            &FLOAT_OPS,
            order(RankBy::Op(1), false, true),
            64,
        ),
        (
            "f64 extremes by MAX",
            keys(&mut rng, 700, 0.0),
            &FLOAT_OPS,
            desc(2),
            64,
        ),
        (
            "average",
            keys(&mut rng, 2000, 0.0),
            &INT_OPS,
            order(RankBy::Avg { sum: 5, count: 1 }, true, false),
            25,
        ),
    ];
    // Every key distinct: all-ones and i64::MIN among them.
    let mut distinct: Vec<u64> = (0..rows as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    distinct[0] = u64::MAX;
    distinct[1] = 1 << 63;
    let distinct = vec![Data {
        values: distinct,
        valid: None,
    }];
    cases.push(("all distinct", distinct, &INT_OPS, desc(2), 300));
    for (i, (name, keys, ops, order, k)) in cases.into_iter().enumerate() {
        let nulls = if i % 2 == 0 { 0.1 } else { 0.0 };
        // Each selection route, the bitonic one only where k fits it.
        let algorithm = [
            Bitonic, Delegate, Sample, Radix, Bitonic, Radix, Sample, Radix,
        ][i];
        let big = i % 3 == 1;
        let values = values(&mut rng, rows, nulls, big);
        // Sums of integers near 2^63 as f64 round differently in another order.
        let ops = if big && ops == INT_OPS {
            &INT_OPS[..5]
        } else {
            ops
        };
        let case = Case {
            name,
            keys,
            values,
            ops,
            order,
            k,
            estimate: 4096,
            algorithm,
        };
        check(&device, case);
    }
}

/// Sums near the ends of i64 wrap, two nullable key columns, and a table sized for one group
/// grows until it holds every group.
#[test]
fn aggregate_top_k_wraps_sums_and_grows_its_table() {
    let Some(device) = gpu_or_skip("aggregate_top_k_wraps_sums_and_grows_its_table") else {
        return;
    };
    let mut rng = Rng::new(5);
    let rows = 60_000;
    let two_keys = vec![
        data(&mut rng, rows, 0.05, |r| r.below(300)),
        data(&mut rng, rows, 0.05, |r| (r.below(100) as i64 - 50) as u64),
    ];
    for (descending, nulls_first) in [(true, true), (false, false)] {
        let case = Case {
            name: "two keys, growing",
            keys: two_keys.clone(),
            values: values(&mut rng, rows, 0.3, true),
            ops: &INT_OPS[..5],
            order: order(RankBy::Op(2), descending, nulls_first),
            k: 500,
            estimate: 1,
            algorithm: DeviceAlgorithm::Radix,
        };
        let passes = check(&device, case);
        assert!(
            passes > 1,
            "{passes} passes for a table sized for one group"
        );
    }
    // One group whose sum wraps past i64::MAX.
    let one = vec![data(&mut rng, 4, 0.0, |_| 7)];
    let wrapping = Data {
        values: vec![i64::MAX as u64, 1, 1, i64::MAX as u64],
        valid: None,
    };
    let case = Case {
        name: "wrapping sum",
        keys: one,
        values: vec![wrapping.clone(), wrapping.clone(), wrapping],
        ops: &[AggregateOp::SumI64(0)],
        order: order(RankBy::Op(0), true, true),
        k: 1,
        estimate: 1,
        algorithm: DeviceAlgorithm::Bitonic,
    };
    check(&device, case);
}

/// A NaN into MIN or MAX over f64 declines (DataFusion's result depends on the rows' order);
/// into a SUM it does not (ranked by the count: the device's NaN bits are its own).
#[test]
fn aggregate_top_k_declines_nan_extremes() {
    let Some(device) = gpu_or_skip("aggregate_top_k_declines_nan_extremes") else {
        return;
    };
    let mut rng = Rng::new(9);
    let rows = 10_000;
    let keys = vec![data(&mut rng, rows, 0.0, |r| r.below(100))];
    let mut with_nan = values(&mut rng, rows, 0.0, false);
    with_nan[1].values[rows / 2] = f64::NAN.to_bits();
    with_nan[2].values[rows / 3] = f64::NAN.to_bits();
    for (ops, declines) in [
        (FLOAT_OPS.as_slice(), true),
        (&[AggregateOp::CountStar, AggregateOp::SumF64(2)], false),
    ] {
        let case = Case {
            name: "NaN",
            keys: keys.clone(),
            values: with_nan.clone(),
            ops,
            order: order(RankBy::Op(0), true, true),
            k: 10,
            estimate: 100,
            algorithm: DeviceAlgorithm::Radix,
        };
        check(&device, case);
        let host: Vec<HostColumn> = with_nan.iter().map(Data::host).collect();
        let declined = aggregate_top_k_host(
            &[keys[0].host()],
            &host,
            ops,
            order(RankBy::Op(0), true, true),
            10,
        );
        assert_eq!(
            declined.err() == Some(AggregateDecline::NanInMinMax),
            declines
        );
    }
}

/// The reference's accumulators are DataFusion's: its GROUP BY over a table of several
/// partitions gives every group the same values (wrapping sums, MIN/MAX over infinities and
/// zeros, NULLs), f64 compared by value.
#[tokio::test]
async fn aggregate_reference_matches_datafusion() {
    let mut rng = Rng::new(3);
    let rows = 20_000;
    let mut key = data(&mut rng, rows, 0.05, |r| (r.below(400) as i64 - 200) as u64);
    let mut cols = values(&mut rng, rows, 0.2, true);
    // Groups whose only f64 is an infinity: DataFusion's MIN(+inf) is f64::MAX, its MAX(-inf)
    // f64::MIN (the accumulators' start values).
    for (row, (group, value)) in [(1000, f64::INFINITY), (1001, f64::NEG_INFINITY)]
        .into_iter()
        .enumerate()
    {
        let row = rows - 1 - row;
        key.values[row] = group;
        cols[1].values[row] = value.to_bits();
        for valid in [key.valid.as_mut(), cols[1].valid.as_mut()]
            .into_iter()
            .flatten()
        {
            valid[row] = true;
        }
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("v", DataType::Int64, true),
        Field::new("e", DataType::Float64, true),
        Field::new("q", DataType::Float64, true),
    ]));
    let int = |d: &Data, from: usize, to: usize| -> ArrayRef {
        Arc::new(Int64Array::from_iter(
            (from..to).map(|r| d.get(r).map(|v| v as i64)),
        ))
    };
    let float = |d: &Data, from: usize, to: usize| -> ArrayRef {
        Arc::new(Float64Array::from_iter(
            (from..to).map(|r| d.get(r).map(f64::from_bits)),
        ))
    };
    let partitions = (0..4)
        .map(|p| {
            let (from, to) = (p * rows / 4, (p + 1) * rows / 4);
            let columns = vec![
                int(&key, from, to),
                int(&cols[0], from, to),
                float(&cols[1], from, to),
                float(&cols[2], from, to),
            ];
            vec![RecordBatch::try_new(Arc::clone(&schema), columns).unwrap()]
        })
        .collect();
    let ctx = SessionContext::new();
    crate::common::register(&ctx, "t", partitions);
    let sql = "SELECT k, COUNT(*), COUNT(v), SUM(v), MIN(v), MAX(v), MIN(e), MAX(e), SUM(q), COUNT(q) \
               FROM t GROUP BY k";
    let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
    let ops = [
        AggregateOp::CountStar,
        AggregateOp::Count(0),
        AggregateOp::SumI64(0),
        AggregateOp::MinI64(0),
        AggregateOp::MaxI64(0),
        AggregateOp::MinF64(1),
        AggregateOp::MaxF64(1),
        AggregateOp::SumF64(2),
        AggregateOp::Count(2),
    ];
    let host: Vec<HostColumn> = cols.iter().map(Data::host).collect();
    let (all, groups) = aggregate_top_k_host(
        &[key.host()],
        &host,
        &ops,
        order(RankBy::Op(0), true, true),
        rows,
    )
    .unwrap();
    let reference: HashMap<Option<i64>, &AggregateGroup> =
        all.iter().map(|g| (g.key[0], g)).collect();
    let mut seen = 0;
    for batch in &batches {
        let k = batch
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        for row in 0..batch.num_rows() {
            let key = k.is_valid(row).then(|| k.value(row));
            let group = reference[&key];
            let values: Vec<AggValue> = (0..ops.len())
                .map(|i| {
                    let c = batch.column(i + 1);
                    match ops[i] {
                        AggregateOp::CountStar | AggregateOp::Count(_) => AggValue::Count(
                            c.as_any().downcast_ref::<Int64Array>().unwrap().value(row) as u64,
                        ),
                        AggregateOp::SumI64(_)
                        | AggregateOp::MinI64(_)
                        | AggregateOp::MaxI64(_) => {
                            let a = c.as_any().downcast_ref::<Int64Array>().unwrap();
                            AggValue::I64(a.is_valid(row).then(|| a.value(row)))
                        }
                        _ => {
                            let a = c.as_any().downcast_ref::<Float64Array>().unwrap();
                            AggValue::F64(a.is_valid(row).then(|| a.value(row)))
                        }
                    }
                })
                .collect();
            let datafusion = AggregateGroup {
                key: vec![key],
                values,
            };
            assert!(
                same_groups(
                    std::slice::from_ref(&datafusion),
                    std::slice::from_ref(group)
                ),
                "DataFusion {datafusion:?}\nreference {group:?}"
            );
            seen += 1;
        }
    }
    assert_eq!(seen, groups);
    let extremes = |group: i64| &reference[&Some(group)].values[5..7];
    assert_eq!(
        extremes(1000),
        [
            AggValue::F64(Some(f64::MAX)),
            AggValue::F64(Some(f64::INFINITY))
        ]
    );
    assert_eq!(
        extremes(1001),
        [
            AggValue::F64(Some(f64::NEG_INFINITY)),
            AggValue::F64(Some(f64::MIN))
        ]
    );
}

/// A generated filtered pass (src/fusion/aggregate.rs) aggregates the rows its predicate
/// passes (NULL as false), as the host reference over those rows; a row DataFusion would fail
/// on (an integer division by zero) declines the call.
#[test]
fn aggregate_top_k_skips_the_rows_its_filter_rejects() {
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::PhysicalExpr;
    use datafusion::physical_expr::expressions::{BinaryExpr, Column, IsNullExpr, Literal};
    use datafusion_gpu_topk::internal::fusion::aggregate_filter;
    let Some(device) = gpu_or_skip("aggregate_top_k_skips_the_rows_its_filter_rejects") else {
        return;
    };
    let mut rng = Rng::new(91);
    let rows = 40_000;
    let key = data(&mut rng, rows, 0.05, |r| r.below(500));
    let value = data(&mut rng, rows, 0.1, |r| (r.below(41) as i64 - 20) as u64);
    let schema = Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("v", DataType::Int64, true),
    ]);
    let lit = |v: i64| -> Arc<dyn PhysicalExpr> { Arc::new(Literal::new(ScalarValue::from(v))) };
    let binary = |l, op, r| -> Arc<dyn PhysicalExpr> { Arc::new(BinaryExpr::new(l, op, r)) };
    let (k, v): (Arc<dyn PhysicalExpr>, Arc<dyn PhysicalExpr>) =
        (Arc::new(Column::new("k", 0)), Arc::new(Column::new("v", 1)));
    // v > 3 OR k IS NULL.
    let passing = binary(
        binary(Arc::clone(&v), Operator::Gt, lit(3)),
        Operator::Or,
        Arc::new(IsNullExpr::new(k)),
    );
    // 100 / v > 1: v is 0 on some rows.
    let failing = binary(binary(lit(100), Operator::Divide, v), Operator::Gt, lit(1));
    let ops = [
        AggregateOp::CountStar,
        AggregateOp::SumI64(0),
        AggregateOp::MinI64(0),
    ];
    let passes: Vec<bool> = (0..rows)
        .map(|i| key.get(i).is_none() || value.get(i).is_some_and(|v| v as i64 > 3))
        .collect();
    let kept = |d: &Data| Data {
        values: (d.values.iter().zip(&passes))
            .filter(|(_, p)| **p)
            .map(|(v, _)| *v)
            .collect(),
        valid: (d.valid.as_ref()).map(|valid| {
            (valid.iter().zip(&passes))
                .filter(|(_, p)| **p)
                .map(|(v, _)| *v)
                .collect()
        }),
    };
    let (host_key, host_value) = (kept(&key), kept(&value));
    let expected = aggregate_top_k_host(
        &[host_key.host()],
        &[host_value.host()],
        &ops,
        order(RankBy::Op(1), true, false),
        40,
    )
    .expect("no NaN");
    let (key_bytes, value_bytes) = (key.bytes(), value.bytes());
    // Nullable keys (65 bits) and a nullable ranking sum (65): a 256-bit composite.
    let mut engine = TopKEngine::new(&device, KeyWidth::W256).unwrap();
    let uploaded = engine
        .upload_columns(&[
            (&key_bytes.0, key_bytes.1.as_deref()),
            (&value_bytes.0, value_bytes.1.as_deref()),
        ])
        .unwrap();
    let [key_column, value_column] = uploaded.columns[..] else {
        panic!("two columns");
    };
    // Each program input's four arguments: values, bit offset, validity, its bit offset.
    let inputs: Vec<u64> = [key_column, value_column]
        .iter()
        .flat_map(|c| [c.values, 0, c.validity, 0])
        .collect();
    for (predicate, want) in [(passing, Some(&expected)), (failing, None)] {
        let program = aggregate_filter(&predicate, &schema, &[0, 1], 1).unwrap();
        assert_eq!(program.inputs.len(), 2, "{}", program.source);
        let (kernel, _) = device
            .generated_kernel(&program.source, AGG_FILTERED_ENTRY)
            .unwrap();
        let call = AggregateCall {
            keys: &[key_column],
            values: &[value_column],
            ops: &ops,
            rows,
            order: order(RankBy::Op(1), true, false),
            k: 40,
            groups_estimate: 1024,
            algorithm: DeviceAlgorithm::Radix,
            filter: Some(AggregateFilter {
                kernel: &kernel,
                inputs: &inputs,
            }),
            having: None,
        };
        assert_eq!(call.key_width(), KeyWidth::W256);
        let got = engine.aggregate_top_k(&call).unwrap();
        match want {
            Some((top, groups)) => {
                assert_eq!(got.report.declined, None);
                assert_eq!(got.groups, *groups);
                assert!(same_groups(&got.top, top), "{:?}\n{:?}", got.top, top);
            }
            None => assert_eq!(got.report.declined, Some(AggregateDecline::HostOnlyRow)),
        }
    }
    drop(uploaded);
}

/// A generated `HAVING` (src/fusion/aggregate.rs) over a count, an integer sum and extremes of
/// both types ranks only the groups it passes: the first k of the reference's groups in order
/// that pass it; a group DataFusion would fail on (a division by zero) declines the call.
#[test]
fn aggregate_top_k_ranks_the_groups_having_keeps() {
    use datafusion::common::ScalarValue;
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::PhysicalExpr;
    use datafusion::physical_expr::expressions::{BinaryExpr, Column, IsNotNullExpr, Literal};
    use datafusion_gpu_topk::internal::fusion::{KernelInput, aggregate_having};
    let mut rng = Rng::new(93);
    let rows = 40_000;
    let key = data(&mut rng, rows, 0.05, |r| r.below(500));
    let int = data(&mut rng, rows, 0.1, |r| (r.below(41) as i64 - 20) as u64);
    let float = data(&mut rng, rows, 0.1, |r| {
        (r.below(100) as f64 * 0.25).to_bits()
    });
    let ops = [
        AggregateOp::CountStar,
        AggregateOp::SumI64(0),
        AggregateOp::MinI64(0),
        AggregateOp::MaxF64(1),
    ];
    // The aggregation's output: the key, then the ops' values.
    let schema = Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("n", DataType::Int64, true),
        Field::new("s", DataType::Int64, true),
        Field::new("lo", DataType::Int64, true),
        Field::new("hi", DataType::Float64, true),
    ]);
    let column =
        |name: &str, at: usize| -> Arc<dyn PhysicalExpr> { Arc::new(Column::new(name, at)) };
    let lit = |v: ScalarValue| -> Arc<dyn PhysicalExpr> { Arc::new(Literal::new(v)) };
    let binary = |l, op, r| -> Arc<dyn PhysicalExpr> { Arc::new(BinaryExpr::new(l, op, r)) };
    let and = |l, r| binary(l, Operator::And, r);
    // n > 80 AND lo <= -19 AND hi < 24.5 AND s IS NOT NULL.
    let passing = and(
        and(
            binary(column("n", 1), Operator::Gt, lit(ScalarValue::from(80i64))),
            binary(
                column("lo", 3),
                Operator::LtEq,
                lit(ScalarValue::from(-19i64)),
            ),
        ),
        and(
            binary(column("hi", 4), Operator::Lt, lit(ScalarValue::from(24.5))),
            Arc::new(IsNotNullExpr::new(column("s", 2))),
        ),
    );
    // 100 / (n - n) > 1: every group divides by zero.
    let zero = binary(column("n", 1), Operator::Minus, column("n", 1));
    let failing = binary(
        binary(lit(ScalarValue::from(100i64)), Operator::Divide, zero),
        Operator::Gt,
        lit(ScalarValue::from(1i64)),
    );
    let order = order(RankBy::Op(1), true, false);
    let (all, groups) = aggregate_top_k_host(
        &[key.host()],
        &[int.host(), float.host()],
        &ops,
        order,
        rows,
    )
    .expect("no NaN");
    let passes = |g: &AggregateGroup| match g.values[..] {
        [
            AggValue::Count(n),
            AggValue::I64(s),
            AggValue::I64(lo),
            AggValue::F64(hi),
        ] => {
            n > 80 && s.is_some() && lo.is_some_and(|lo| lo <= -19) && hi.is_some_and(|h| h < 24.5)
        }
        _ => panic!("{g:?}"),
    };
    let expected: Vec<AggregateGroup> =
        all.iter().filter(|g| passes(g)).take(30).cloned().collect();
    // HAVING decides which groups are ranked: not the first 30 of them all.
    assert!(!expected.is_empty() && expected[..] != all[..30]);
    let Some(device) = gpu_or_skip("aggregate_top_k_ranks_the_groups_having_keeps") else {
        return;
    };
    let bytes = [key.bytes(), int.bytes(), float.bytes()];
    let columns: Vec<(&[u8], Option<&[u8]>)> = (bytes.iter())
        .map(|(v, b)| (v.as_slice(), b.as_deref()))
        .collect();
    // Nullable keys (65 bits) and a nullable ranking sum (65): a 256-bit composite.
    let mut engine = TopKEngine::new(&device, KeyWidth::W256).unwrap();
    let uploaded = engine.upload_columns(&columns).unwrap();
    let (keys, values) = uploaded.columns.split_at(1);
    for (predicate, want) in [(passing, Some(&expected)), (failing, None)] {
        let program = aggregate_having(&predicate, &schema).unwrap();
        let having_columns: Vec<HavingColumn> = (program.inputs.iter())
            .map(|input| match input {
                KernelInput::Column(0) => HavingColumn::Key(0),
                KernelInput::Column(c) => HavingColumn::Op(c - 1),
                other => panic!("{other:?}"),
            })
            .collect();
        let (kernel, _) = device
            .generated_kernel(&program.source, AGG_HAVING_ENTRY)
            .unwrap();
        let call = AggregateCall {
            keys,
            values,
            ops: &ops,
            rows,
            order,
            k: 30,
            groups_estimate: 1024,
            algorithm: DeviceAlgorithm::Radix,
            filter: None,
            having: Some(AggregateHaving {
                kernel: &kernel,
                columns: &having_columns,
            }),
        };
        assert_eq!(call.key_width(), KeyWidth::W256);
        let got = engine.aggregate_top_k(&call).unwrap();
        match want {
            Some(top) => {
                assert_eq!(got.report.declined, None);
                // Every group was aggregated; HAVING picked among them.
                assert_eq!(got.groups, groups);
                assert!(same_groups(&got.top, top), "{:?}\n{:?}", got.top, top);
            }
            None => assert_eq!(got.report.declined, Some(AggregateDecline::HostOnlyRow)),
        }
    }
    drop(uploaded);
}
