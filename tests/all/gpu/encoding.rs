//! The device encoding of Arrow columns against the keys module, for every key type, option
//! and composite width.

use super::*;

pub(super) fn spec(
    data_type: DataType,
    descending: bool,
    nulls_first: bool,
    nullable: bool,
) -> KeySpec {
    KeySpec {
        data_type,
        descending,
        nulls_first,
        nullable,
    }
}

/// A column of `data_type` with n rows: random values (with the type's edge values mixed in)
/// and, when `nulls`, about a fifth NULL.
pub(super) fn column(data_type: &DataType, n: usize, nulls: bool, rng: &mut Rng) -> ArrayRef {
    let valid: Vec<bool> = (0..n).map(|_| !nulls || rng.below(5) != 0).collect();
    let pick = |rng: &mut Rng, edges: &[i128], random: i128| -> i128 {
        if rng.below(4) == 0 {
            edges[rng.below(edges.len() as u64) as usize]
        } else {
            random
        }
    };
    macro_rules! ints {
        ($array:ty, $t:ty) => {{
            let edges = [<$t>::MIN as i128, <$t>::MAX as i128, 0, 1, -1];
            let values: Vec<Option<$t>> = (0..n)
                .map(|i| {
                    let r = rng.next_u64() as $t as i128;
                    let v = pick(rng, &edges, r) as $t;
                    valid[i].then_some(v)
                })
                .collect();
            Arc::new(<$array>::from(values)) as ArrayRef
        }};
    }
    macro_rules! floats {
        ($array:ty, $t:ty, $from:expr) => {{
            let edges: [$t; 10] = [
                $from(0.0),
                $from(-0.0),
                $from(f64::INFINITY),
                $from(f64::NEG_INFINITY),
                $from(f64::NAN),
                -$from(f64::NAN),
                $from(1.5),
                $from(-1.5),
                $from(f64::MIN_POSITIVE),
                $from(65504.0),
            ];
            let values: Vec<Option<$t>> = (0..n)
                .map(|i| {
                    let v = if rng.below(3) == 0 {
                        edges[rng.below(edges.len() as u64) as usize]
                    } else {
                        $from((rng.unit() - 0.5) * 1000.0)
                    };
                    valid[i].then_some(v)
                })
                .collect();
            Arc::new(<$array>::from(values)) as ArrayRef
        }};
    }
    macro_rules! with_tz {
        ($a:expr, $array:ty, $tz:expr) => {{
            let a = $a;
            let a = a.as_any().downcast_ref::<$array>().unwrap().clone();
            Arc::new(a.with_timezone_opt($tz.clone())) as ArrayRef
        }};
    }
    match data_type {
        DataType::Boolean => {
            let values: Vec<Option<bool>> = (0..n)
                .map(|i| valid[i].then_some(rng.below(2) == 1))
                .collect();
            Arc::new(BooleanArray::from(values))
        }
        DataType::UInt8 => ints!(UInt8Array, u8),
        DataType::UInt16 => ints!(UInt16Array, u16),
        DataType::UInt32 => ints!(UInt32Array, u32),
        DataType::UInt64 => ints!(UInt64Array, u64),
        DataType::Int8 => ints!(Int8Array, i8),
        DataType::Int16 => ints!(Int16Array, i16),
        DataType::Int32 => ints!(Int32Array, i32),
        DataType::Int64 => ints!(Int64Array, i64),
        DataType::Date32 => ints!(Date32Array, i32),
        DataType::Date64 => ints!(Date64Array, i64),
        DataType::Time32(u) => match u {
            datafusion::arrow::datatypes::TimeUnit::Second => ints!(Time32SecondArray, i32),
            _ => ints!(Time32MillisecondArray, i32),
        },
        DataType::Time64(u) => match u {
            datafusion::arrow::datatypes::TimeUnit::Microsecond => {
                ints!(Time64MicrosecondArray, i64)
            }
            _ => ints!(Time64NanosecondArray, i64),
        },
        DataType::Timestamp(u, tz) => {
            use datafusion::arrow::datatypes::TimeUnit::*;
            // with_timezone_opt keeps the values (a cast would convert, and null overflows).
            match u {
                Second => with_tz!(ints!(TimestampSecondArray, i64), TimestampSecondArray, tz),
                Millisecond => {
                    with_tz!(
                        ints!(TimestampMillisecondArray, i64),
                        TimestampMillisecondArray,
                        tz
                    )
                }
                Microsecond => {
                    with_tz!(
                        ints!(TimestampMicrosecondArray, i64),
                        TimestampMicrosecondArray,
                        tz
                    )
                }
                Nanosecond => {
                    with_tz!(
                        ints!(TimestampNanosecondArray, i64),
                        TimestampNanosecondArray,
                        tz
                    )
                }
            }
        }
        DataType::Duration(u) => {
            use datafusion::arrow::datatypes::TimeUnit::*;
            match u {
                Second => ints!(DurationSecondArray, i64),
                Millisecond => ints!(DurationMillisecondArray, i64),
                Microsecond => ints!(DurationMicrosecondArray, i64),
                Nanosecond => ints!(DurationNanosecondArray, i64),
            }
        }
        DataType::Decimal32(p, s) => {
            let a = ints!(Decimal32Array, i32);
            let a = a.as_any().downcast_ref::<Decimal32Array>().unwrap().clone();
            Arc::new(a.with_precision_and_scale(*p, *s).unwrap())
        }
        DataType::Decimal64(p, s) => {
            let a = ints!(Decimal64Array, i64);
            let a = a.as_any().downcast_ref::<Decimal64Array>().unwrap().clone();
            Arc::new(a.with_precision_and_scale(*p, *s).unwrap())
        }
        DataType::Decimal128(p, s) => {
            let edges = [i128::MIN, i128::MAX, 0, 1, -1, i128::from(i64::MIN) - 1];
            let values: Vec<Option<i128>> = (0..n)
                .map(|i| {
                    let r = (i128::from(rng.next_u64()) << 64 | i128::from(rng.next_u64()))
                        >> rng.below(100);
                    valid[i].then_some(pick(rng, &edges, r))
                })
                .collect();
            Arc::new(
                Decimal128Array::from(values)
                    .with_precision_and_scale(*p, *s)
                    .unwrap(),
            )
        }
        DataType::Float16 => floats!(Float16Array, half::f16, half::f16::from_f64),
        DataType::Float32 => floats!(Float32Array, f32, |x: f64| x as f32),
        DataType::Float64 => floats!(Float64Array, f64, |x: f64| x),
        other => panic!("no generator for {other}"),
    }
}

pub(super) fn all_key_types() -> Vec<DataType> {
    use datafusion::arrow::datatypes::TimeUnit::*;
    vec![
        DataType::Boolean,
        DataType::UInt8,
        DataType::UInt16,
        DataType::UInt32,
        DataType::UInt64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Date32,
        DataType::Date64,
        DataType::Time32(Second),
        DataType::Time32(Millisecond),
        DataType::Time64(Microsecond),
        DataType::Time64(Nanosecond),
        DataType::Timestamp(Second, None),
        DataType::Timestamp(Millisecond, None),
        DataType::Timestamp(Microsecond, Some("+02:00".into())),
        DataType::Timestamp(Nanosecond, None),
        DataType::Duration(Second),
        DataType::Duration(Millisecond),
        DataType::Duration(Microsecond),
        DataType::Duration(Nanosecond),
        DataType::Decimal32(9, 2),
        DataType::Decimal64(18, 3),
        DataType::Decimal128(38, 10),
    ]
}

pub(super) fn assert_same_encoding(
    device: &Arc<GpuDevice>,
    layout: &KeyLayout,
    columns: &[ArrayRef],
    what: &str,
) {
    let expected = layout.encode(columns).unwrap();
    let got = encode_keys_device(device, layout, columns).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.width(), expected.width(), "{what}");
    if got != expected {
        panic!("{what}: the device encoding differs from KeyLayout::encode");
    }
}

#[test]
fn gpu_encoding_matches_the_keys_module_for_every_type_and_option() {
    let Some(device) = gpu_or_skip("gpu_encoding_matches_the_keys_module") else {
        return;
    };
    let mut rng = Rng::new(5);
    for data_type in all_key_types() {
        for nullable in [false, true] {
            for descending in [false, true] {
                for nulls_first in [false, true] {
                    let n = 1000 + rng.below(100) as usize;
                    let full = column(&data_type, n + 13, nullable, &mut rng);
                    // Sliced at an odd offset: bit offsets of booleans and validity bitmaps.
                    for array in [full.slice(0, n), full.slice(5, n), full.slice(13, n)] {
                        let s = spec(data_type.clone(), descending, nulls_first, nullable);
                        let layout = KeyLayout::try_new(vec![s]).unwrap();
                        let what = format!(
                            "{data_type} nullable={nullable} desc={descending} \
                             nulls_first={nulls_first} offset={}",
                            array.offset()
                        );
                        assert_same_encoding(&device, &layout, &[array], &what);
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_encoding_matches_for_composite_layouts_of_every_width() {
    let Some(device) = gpu_or_skip("gpu_encoding_matches_for_composite_layouts") else {
        return;
    };
    let types = all_key_types();
    let mut rng = Rng::new(11);
    let mut kinds_seen = std::collections::HashSet::new();
    for round in 0..400 {
        let keys = 1 + rng.below(4) as usize;
        let specs: Vec<KeySpec> = (0..keys)
            .map(|_| {
                let t = types[rng.below(types.len() as u64) as usize].clone();
                spec(t, rng.below(2) == 1, rng.below(2) == 1, rng.below(2) == 1)
            })
            .collect();
        let Ok(layout) = KeyLayout::try_new(specs.clone()) else {
            continue; // over 256 bits
        };
        kinds_seen.insert(layout.width());
        let n = 1 + rng.below(3000) as usize;
        let columns: Vec<ArrayRef> = specs
            .iter()
            .map(|s| column(&s.data_type, n + 3, s.nullable, &mut rng).slice(3, n))
            .collect();
        assert_same_encoding(
            &device,
            &layout,
            &columns,
            &format!("round {round}: {specs:?}"),
        );
    }
    assert_eq!(
        kinds_seen.len(),
        4,
        "layouts of every width were drawn: {kinds_seen:?}"
    );
}
