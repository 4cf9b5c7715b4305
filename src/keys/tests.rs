//! Tests compare the order induced by the encoded keys (ties broken by row index) with arrow's
//! own sort kernels, which are what DataFusion sorts with. Sorted *values* are compared, bit for
//! bit (arrow's array equality is bytewise for primitives), since rows with equal values may be
//! permuted by arrow's unstable sort.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, PrimitiveArray, UInt32Array};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer};
use datafusion::arrow::compute::{
    SortColumn, SortOptions, lexsort_to_indices, sort_to_indices, take,
};
use datafusion::arrow::datatypes::*;
use half::f16;

use super::layout::MAX_KEY_BITS;
use super::*;

/// xorshift64* — deterministic, no `rand` dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bits128(&mut self) -> u128 {
        (u128::from(self.next()) << 64) | u128::from(self.next())
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

fn all_supported_types() -> Vec<DataType> {
    use DataType::*;
    let mut types = vec![
        Boolean,
        Int8,
        Int16,
        Int32,
        Int64,
        UInt8,
        UInt16,
        UInt32,
        UInt64,
        Float16,
        Float32,
        Float64,
        Date32,
        Date64,
        Time32(TimeUnit::Second),
        Time32(TimeUnit::Millisecond),
        Time64(TimeUnit::Microsecond),
        Time64(TimeUnit::Nanosecond),
        Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
        Timestamp(TimeUnit::Millisecond, Some("+05:30".into())),
        Decimal32(9, 2),
        Decimal64(18, 3),
        Decimal128(38, 10),
    ];
    for unit in [
        TimeUnit::Second,
        TimeUnit::Millisecond,
        TimeUnit::Microsecond,
        TimeUnit::Nanosecond,
    ] {
        types.push(Timestamp(unit, None));
        types.push(Duration(unit));
    }
    types
}

/// Builds an array of `dt` from raw bit patterns (truncated to the native width); `valid`
/// marks non-NULL rows. NULL slots keep their bit patterns, i.e. garbage under the null.
fn make_array(dt: &DataType, bits: &[u128], valid: Option<&[bool]>) -> ArrayRef {
    fn prim<T: ArrowPrimitiveType>(
        dt: &DataType,
        values: Vec<T::Native>,
        nulls: Option<NullBuffer>,
    ) -> ArrayRef {
        Arc::new(PrimitiveArray::<T>::new(values.into(), nulls).with_data_type(dt.clone()))
    }
    let nulls = valid.map(|v| NullBuffer::from(v.to_vec()));
    macro_rules! p {
        ($t:ty, |$b:ident| $e:expr) => {
            prim::<$t>(dt, bits.iter().map(|&$b| $e).collect(), nulls)
        };
    }
    use DataType::*;
    match dt {
        Boolean => Arc::new(BooleanArray::new(
            bits.iter().map(|&b| b & 1 == 1).collect::<BooleanBuffer>(),
            nulls,
        )),
        UInt8 => p!(UInt8Type, |b| b as u8),
        UInt16 => p!(UInt16Type, |b| b as u16),
        UInt32 => p!(UInt32Type, |b| b as u32),
        UInt64 => p!(UInt64Type, |b| b as u64),
        Int8 => p!(Int8Type, |b| b as i8),
        Int16 => p!(Int16Type, |b| b as i16),
        Int32 => p!(Int32Type, |b| b as i32),
        Int64 => p!(Int64Type, |b| b as i64),
        Float16 => p!(Float16Type, |b| f16::from_bits(b as u16)),
        Float32 => p!(Float32Type, |b| f32::from_bits(b as u32)),
        Float64 => p!(Float64Type, |b| f64::from_bits(b as u64)),
        Date32 => p!(Date32Type, |b| b as i32),
        Date64 => p!(Date64Type, |b| b as i64),
        Time32(TimeUnit::Second) => p!(Time32SecondType, |b| b as i32),
        Time32(TimeUnit::Millisecond) => p!(Time32MillisecondType, |b| b as i32),
        Time64(TimeUnit::Microsecond) => p!(Time64MicrosecondType, |b| b as i64),
        Time64(TimeUnit::Nanosecond) => p!(Time64NanosecondType, |b| b as i64),
        Timestamp(TimeUnit::Second, _) => p!(TimestampSecondType, |b| b as i64),
        Timestamp(TimeUnit::Millisecond, _) => p!(TimestampMillisecondType, |b| b as i64),
        Timestamp(TimeUnit::Microsecond, _) => p!(TimestampMicrosecondType, |b| b as i64),
        Timestamp(TimeUnit::Nanosecond, _) => p!(TimestampNanosecondType, |b| b as i64),
        Duration(TimeUnit::Second) => p!(DurationSecondType, |b| b as i64),
        Duration(TimeUnit::Millisecond) => p!(DurationMillisecondType, |b| b as i64),
        Duration(TimeUnit::Microsecond) => p!(DurationMicrosecondType, |b| b as i64),
        Duration(TimeUnit::Nanosecond) => p!(DurationNanosecondType, |b| b as i64),
        Decimal32(..) => p!(Decimal32Type, |b| b as i32),
        Decimal64(..) => p!(Decimal64Type, |b| b as i64),
        Decimal128(..) => p!(Decimal128Type, |b| b as i128),
        other => panic!("no test arrays for {other}"),
    }
}

/// Positive IEEE edge patterns for a float with `e` exponent and `m` mantissa bits; the caller
/// adds the negated ones.
fn float_edges(e: u32, m: u32) -> Vec<u128> {
    let inf = ((1u128 << e) - 1) << m;
    let one = ((1u128 << (e - 1)) - 1) << m;
    vec![
        0,                    // +0.0
        1,                    // smallest subnormal
        (1 << m) - 1,         // largest subnormal
        1 << m,               // smallest normal
        one,                  // 1.0
        one | 1,              // 1.0 + ulp
        one + (1 << m),       // 2.0
        inf - 1,              // MAX
        inf,                  // +inf
        inf | 1,              // signalling NaN, smallest payload
        inf | 1 << (m - 1),   // quiet NaN (the canonical one)
        inf | ((1 << m) - 1), // NaN, largest payload
    ]
}

/// Edge bit patterns for every supported type: MIN, MAX, 0, ±1, ±0.0, ±inf, ±NaN, subnormals.
fn edge_bits(dt: &DataType) -> Vec<u128> {
    let kind = Native::for_data_type(dt).expect("supported type");
    let w = kind.bits();
    let float = |e: u32, m: u32| {
        let sign = 1u128 << (w - 1);
        let pos = float_edges(e, m);
        pos.iter()
            .copied()
            .chain(pos.iter().map(|b| b | sign))
            .collect()
    };
    match kind {
        Native::Bool => vec![0, 1],
        Native::F16 => float(5, 10),
        Native::F32 => {
            let mut v: Vec<u128> = float(8, 23);
            // What the hardware actually produces for 0/0 (sign-set NaN on x86).
            let (zero, other_zero) = (std::hint::black_box(0.0f32), std::hint::black_box(0.0));
            v.push(u128::from((zero / other_zero).to_bits()));
            v
        }
        Native::F64 => {
            let mut v: Vec<u128> = float(11, 52);
            let (zero, other_zero) = (std::hint::black_box(0.0f64), std::hint::black_box(0.0));
            v.push(u128::from((zero / other_zero).to_bits()));
            v
        }
        _ => {
            let all = if w == 128 { u128::MAX } else { (1 << w) - 1 };
            let top = 1u128 << (w - 1);
            vec![
                0,
                1,
                2,
                100,
                all,      // −1 / unsigned MAX
                all - 1,  // −2
                all - 99, // −100
                top,      // signed MIN / unsigned mid
                top + 1,  // MIN + 1
                top - 1,  // signed MAX
                top - 2,  // MAX − 1
                0x5a5a_5a5a_5a5a_5a5a_5a5a_5a5a_5a5a_5a5a & all,
            ]
        }
    }
}

/// Row order by (key, row index): what a selector over (key, row id) pairs produces.
fn key_order(keys: &EncodedKeys) -> Vec<u32> {
    fn order<K: Ord + Copy>(keys: &[K]) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..keys.len() as u32).collect();
        idx.sort_by_key(|&i| keys[i as usize]); // stable: ties stay in row order
        idx
    }
    match keys {
        EncodedKeys::W64(k) => order(k),
        EncodedKeys::W128(k) => order(k),
        EncodedKeys::W256(k) => order(k),
    }
}

fn keys_as_u256(keys: &EncodedKeys) -> Vec<U256> {
    match keys {
        EncodedKeys::W64(k) => k.iter().map(|&v| U256::from_u128(v.into())).collect(),
        EncodedKeys::W128(k) => k.iter().map(|&v| U256::from_u128(v)).collect(),
        EncodedKeys::W256(k) => k.clone(),
    }
}

fn options(spec: &KeySpec) -> SortOptions {
    SortOptions {
        descending: spec.descending,
        nulls_first: spec.nulls_first,
    }
}

/// Encodes `columns` under `specs` and checks that ordering rows by key gives the same sequence
/// of values, column by column, as arrow's (lex)sort with the same options.
fn check_order(columns: &[ArrayRef], specs: Vec<KeySpec>, context: &str) {
    let layout = KeyLayout::try_new(specs.clone()).expect("layout");
    let keys = layout.encode(columns).expect("encode");
    let n = columns[0].len();
    assert_eq!(keys.len(), n, "{context}");
    assert_eq!(keys.width(), layout.width().host(), "{context}");

    // Bits at and above total_bits stay zero (selectors may rely on the range).
    let limit = U256::shl_u128(1, layout.total_bits() % 256);
    if layout.total_bits() < 256 {
        for k in keys_as_u256(&keys) {
            assert!(
                k < limit,
                "{context}: key {k:?} ≥ 2^{}",
                layout.total_bits()
            );
        }
    }

    // The single-column reference agrees with the layout where it applies.
    if specs.len() == 1 && specs[0].bits().unwrap() <= 128 {
        let single = encode_column_u128(&specs[0], columns[0].as_ref()).expect("single");
        let composite: Vec<u128> = keys_as_u256(&keys).iter().map(|k| k.lo).collect();
        assert_eq!(single, composite, "{context}: encode_column_u128 disagrees");
    }

    let ours = UInt32Array::from(key_order(&keys));
    let theirs = if specs.len() == 1 {
        sort_to_indices(columns[0].as_ref(), Some(options(&specs[0])), None).unwrap()
    } else {
        let sort_columns: Vec<SortColumn> = columns
            .iter()
            .zip(&specs)
            .map(|(c, s)| SortColumn {
                values: c.clone(),
                options: Some(options(s)),
            })
            .collect();
        lexsort_to_indices(&sort_columns, None).unwrap()
    };
    for (c, column) in columns.iter().enumerate() {
        let a = take(column.as_ref(), &ours, None).unwrap();
        let b = take(column.as_ref(), &theirs, None).unwrap();
        if a.to_data() != b.to_data() {
            let row = (0..n)
                .find(|&i| a.slice(i, 1).to_data() != b.slice(i, 1).to_data())
                .unwrap();
            panic!(
                "{context}: column {c} differs at sorted position {row}: keys give {:?}, \
                 arrow gives {:?}",
                a.slice(row.saturating_sub(1), 3),
                b.slice(row.saturating_sub(1), 3)
            );
        }
    }
}

fn spec(dt: DataType, descending: bool, nulls_first: bool, nullable: bool) -> KeySpec {
    KeySpec {
        data_type: dt,
        descending,
        nulls_first,
        nullable,
    }
}

const DIRECTIONS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

#[test]
fn every_type_edges_all_directions() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for dt in all_supported_types() {
        let edges = edge_bits(&dt);
        // Each edge three times, plus NULLs with garbage (edge patterns) under them.
        let mut rows: Vec<(u128, bool)> = edges
            .iter()
            .flat_map(|&b| [(b, true), (b, true), (b, true)])
            .chain(edges.iter().take(5).map(|&b| (b, false)))
            .collect();
        rng.shuffle(&mut rows);
        let bits: Vec<u128> = rows.iter().map(|r| r.0).collect();
        let valid: Vec<bool> = rows.iter().map(|r| r.1).collect();
        let with_nulls = make_array(&dt, &bits, Some(&valid));
        let dense_bits: Vec<u128> = rows.iter().filter(|r| r.1).map(|r| r.0).collect();
        let dense = make_array(&dt, &dense_bits, None);

        let cases: [(&str, ArrayRef, bool); 5] = [
            ("nulls", with_nulls.clone(), true),
            (
                "nulls, sliced",
                with_nulls.slice(3, with_nulls.len() - 7),
                true,
            ),
            ("no nulls, non-nullable", dense.clone(), false),
            ("no nulls, nullable", dense.clone(), true),
            ("no nulls, sliced", dense.slice(5, dense.len() - 6), false),
        ];
        for (name, array, nullable) in cases {
            for (descending, nulls_first) in DIRECTIONS {
                let s = spec(dt.clone(), descending, nulls_first, nullable);
                let context = format!("{dt} {name} desc={descending} nulls_first={nulls_first}");
                check_order(std::slice::from_ref(&array), vec![s], &context);
            }
        }
    }
}

#[test]
fn known_encodings() {
    let i8s: ArrayRef = Arc::new(PrimitiveArray::<Int8Type>::from(vec![
        Some(-128),
        Some(-1),
        Some(0),
        Some(127),
        None,
    ]));
    let enc = |descending, nulls_first, nullable| {
        encode_column_u128(
            &spec(DataType::Int8, descending, nulls_first, nullable),
            &i8s,
        )
    };
    // Not nullable: NULLs are refused.
    assert!(enc(false, false, false).is_err());
    assert_eq!(
        enc(false, false, true).unwrap(),
        [0x000, 0x07F, 0x080, 0x0FF, 0x100]
    );
    assert_eq!(
        enc(false, true, true).unwrap(),
        [0x100, 0x17F, 0x180, 0x1FF, 0x000]
    );
    assert_eq!(
        enc(true, false, true).unwrap(),
        [0x0FF, 0x080, 0x07F, 0x000, 0x100]
    );
    assert_eq!(
        enc(true, true, true).unwrap(),
        [0x1FF, 0x180, 0x17F, 0x100, 0x000]
    );

    let f64s: ArrayRef = Arc::new(PrimitiveArray::<Float64Type>::from(vec![
        -0.0,
        0.0,
        f64::NEG_INFINITY,
        f64::NAN,
        f64::from_bits(0xFFF8_0000_0000_0000), // −NaN
    ]));
    let keys = encode_column_u128(&spec(DataType::Float64, false, false, false), &f64s).unwrap();
    assert_eq!(
        keys,
        [
            0x7FFF_FFFF_FFFF_FFFF,
            0x8000_0000_0000_0000,
            0x000F_FFFF_FFFF_FFFF,
            0xFFF8_0000_0000_0000,
            0x0007_FFFF_FFFF_FFFF,
        ]
    );

    let bools: ArrayRef = Arc::new(BooleanArray::from(vec![Some(false), Some(true), None]));
    let keys = encode_column_u128(&spec(DataType::Boolean, true, false, true), &bools).unwrap();
    assert_eq!(keys, [0b01, 0b00, 0b10]);
}

#[test]
fn null_rows_tie_whatever_lies_under_them() {
    let garbage = [0u128, 1, 77, u128::MAX, 0x8000_0000];
    for dt in [DataType::Int32, DataType::Float64, DataType::Boolean] {
        for (descending, nulls_first) in DIRECTIONS {
            let array = make_array(&dt, &garbage, Some(&[false; 5]));
            let s = spec(dt.clone(), descending, nulls_first, true);
            let keys = encode_column_u128(&s, array.as_ref()).unwrap();
            let null_key = if nulls_first {
                0
            } else {
                1 << s.value_bits().unwrap()
            };
            assert!(keys.iter().all(|&k| k == null_key), "{dt}: {keys:x?}");
        }
    }
}

#[test]
fn layout_widths_and_fields() {
    let l = |specs: Vec<KeySpec>| KeyLayout::try_new(specs).unwrap();
    let i64k = |nullable| spec(DataType::Int64, false, false, nullable);
    let d128 = |nullable| spec(DataType::Decimal128(38, 0), false, false, nullable);

    let one = l(vec![i64k(false)]);
    assert_eq!((one.total_bits(), one.width()), (64, KeyWidth::W64));
    let one_nullable = l(vec![i64k(true)]);
    assert_eq!(
        (one_nullable.total_bits(), one_nullable.width()),
        (65, KeyWidth::W128)
    );
    let two = l(vec![i64k(false), i64k(false)]);
    assert_eq!((two.total_bits(), two.width()), (128, KeyWidth::W128));
    let three = l(vec![i64k(true), i64k(false)]);
    assert_eq!((three.total_bits(), three.width()), (129, KeyWidth::W256));
    let full = l(vec![d128(false), d128(false)]);
    assert_eq!((full.total_bits(), full.width()), (256, KeyWidth::W256));
    let bool_key = l(vec![spec(DataType::Boolean, false, false, false)]);
    assert_eq!(
        (
            bool_key.total_bits(),
            bool_key.width(),
            bool_key.width().host()
        ),
        (1, KeyWidth::W32, KeyWidth::W64)
    );

    // Key 0 is most significant; the last key sits at bit 0.
    let mixed = l(vec![
        spec(DataType::Int32, false, false, true),
        spec(DataType::UInt8, false, false, false),
        spec(DataType::Boolean, false, false, true),
    ]);
    assert_eq!(mixed.total_bits(), 33 + 8 + 2);
    assert_eq!(
        (0..3).map(|i| mixed.field_shift(i)).collect::<Vec<_>>(),
        [10, 2, 0]
    );
    let cols: Vec<ArrayRef> = vec![
        Arc::new(PrimitiveArray::<Int32Type>::from(vec![Some(0), None])),
        Arc::new(PrimitiveArray::<UInt8Type>::from(vec![0xAB, 0xCD])),
        Arc::new(BooleanArray::from(vec![Some(true), None])),
    ];
    let keys = mixed.encode(&cols).unwrap();
    assert_eq!(
        keys,
        EncodedKeys::W64(vec![
            (0x8000_0000 << 10) | (0xAB << 2) | 0b01,
            (0x1_0000_0000 << 10) | (0xCD << 2) | 0b10,
        ])
    );
}

#[test]
fn u256_order_and_shifts() {
    assert!(
        U256 { hi: 1, lo: 0 }
            > U256 {
                hi: 0,
                lo: u128::MAX
            }
    );
    assert!(U256 { hi: 1, lo: 2 } < U256 { hi: 1, lo: 3 });
    assert_eq!(
        U256::shl_u128(u128::MAX, 0),
        U256 {
            hi: 0,
            lo: u128::MAX
        }
    );
    assert_eq!(
        U256::shl_u128(u128::MAX, 1),
        U256 {
            hi: 1,
            lo: u128::MAX - 1
        }
    );
    assert_eq!(U256::shl_u128(3, 128), U256 { hi: 3, lo: 0 });
    assert_eq!(
        U256::shl_u128(1, 255),
        U256 {
            hi: 1 << 127,
            lo: 0
        }
    );
    assert_eq!(!U256::ZERO, U256::MAX);
}

/// Columns for the composite tests: values from a small pool so that earlier keys tie often
/// and later keys decide.
fn pooled(dt: &DataType, n: usize, null_every: usize, rng: &mut Rng) -> ArrayRef {
    let edges = edge_bits(dt);
    let pool = &edges[..edges.len().min(5)];
    let bits: Vec<u128> = (0..n).map(|_| pool[rng.below(pool.len())]).collect();
    let valid: Vec<bool> = (0..n)
        .map(|_| null_every == 0 || rng.below(null_every) != 0)
        .collect();
    make_array(dt, &bits, (null_every != 0).then_some(&valid[..]))
}

#[test]
fn composites_w64_w128_w256() {
    let mut rng = Rng(42);
    let n = 3000;
    type Case = Vec<(DataType, bool, bool, bool)>; // type, nullable, desc, nulls_first
    let cases: Vec<(KeyWidth, Case)> = vec![
        (
            KeyWidth::W64,
            vec![
                (DataType::Int32, true, true, false),
                (DataType::UInt8, false, false, false),
                (DataType::Boolean, true, false, true),
            ],
        ),
        (
            KeyWidth::W128,
            vec![
                (DataType::Int64, true, false, false),
                (DataType::Float32, true, true, true),
            ],
        ),
        (
            KeyWidth::W128,
            vec![
                (DataType::Float64, false, true, false),
                (DataType::Int64, false, false, true),
            ],
        ),
        (
            KeyWidth::W256,
            vec![
                (DataType::Int64, true, true, true),
                (DataType::Float64, false, false, false),
            ],
        ),
        (
            KeyWidth::W256,
            vec![
                (DataType::Decimal128(38, 2), false, false, true),
                (DataType::Decimal128(20, 0), false, true, false),
            ],
        ),
        (
            KeyWidth::W256,
            vec![
                (DataType::Decimal128(38, 2), true, false, true),
                (DataType::Int64, true, true, false),
            ],
        ),
        (
            KeyWidth::W256,
            vec![
                (DataType::Decimal128(38, 2), true, true, false),
                (DataType::Float16, true, false, false),
                (
                    DataType::Timestamp(TimeUnit::Microsecond, None),
                    true,
                    true,
                    true,
                ),
                (DataType::Boolean, true, false, true),
            ],
        ),
    ];
    for (width, keys) in cases {
        let specs: Vec<KeySpec> = keys
            .iter()
            .map(|(dt, nullable, desc, nf)| spec(dt.clone(), *desc, *nf, *nullable))
            .collect();
        assert_eq!(KeyLayout::try_new(specs.clone()).unwrap().width(), width);
        let columns: Vec<ArrayRef> = keys
            .iter()
            .map(|(dt, nullable, ..)| pooled(dt, n, if *nullable { 4 } else { 0 }, &mut rng))
            .collect();
        let context = format!("{width:?} {keys:?}");
        check_order(&columns, specs.clone(), &context);
        let sliced: Vec<ArrayRef> = columns.iter().map(|c| c.slice(7, n - 20)).collect();
        check_order(&sliced, specs, &format!("{context} sliced"));
    }
}

#[test]
fn randomized_against_lexsort() {
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let types = all_supported_types();
    for case in 0..120 {
        let n = 2000 + rng.below(3000);
        let mut specs = Vec::new();
        let mut columns = Vec::new();
        let mut bits_used = 0;
        for _ in 0..1 + rng.below(4) {
            let dt = types[rng.below(types.len())].clone();
            let nullable = rng.below(3) != 0;
            let s = spec(dt.clone(), rng.below(2) == 1, rng.below(2) == 1, nullable);
            if bits_used + s.bits().unwrap() > MAX_KEY_BITS {
                continue;
            }
            bits_used += s.bits().unwrap();
            let edges = edge_bits(&dt);
            let mode = rng.below(3);
            let bits: Vec<u128> = (0..n)
                .map(|_| match mode {
                    0 => edges[rng.below(edges.len())],
                    1 => edges[rng.below(edges.len().min(3))], // few distinct values: ties
                    _ => rng.bits128(),
                })
                .collect();
            // Null rate: none, rare, common, or all.
            let null_every = if nullable {
                [0, 50, 3, 1][rng.below(4)]
            } else {
                0
            };
            let valid: Vec<bool> = (0..n)
                .map(|_| null_every == 0 || (null_every > 1 && rng.below(null_every) != 0))
                .collect();
            columns.push(make_array(
                &dt,
                &bits,
                (null_every != 0).then_some(&valid[..]),
            ));
            specs.push(s);
        }
        let offset = rng.below(10);
        let columns: Vec<ArrayRef> = columns
            .iter()
            .map(|c| c.slice(offset, n - offset))
            .collect();
        let context = format!("case {case}: {specs:?}");
        check_order(&columns, specs, &context);
    }
}

#[test]
fn empty_input() {
    let layout = KeyLayout::try_new(vec![spec(DataType::Int64, false, false, true)]).unwrap();
    let empty = make_array(&DataType::Int64, &[], None);
    let keys = layout.encode(&[empty]).unwrap();
    assert!(keys.is_empty());
    assert_eq!(keys, EncodedKeys::W128(vec![]));
}

#[test]
fn unsupported_types_are_refused_with_a_reason() {
    let ok = spec(DataType::Int64, false, false, false);
    let err =
        KeyLayout::try_new(vec![ok.clone(), spec(DataType::Utf8, false, false, true)]).unwrap_err();
    assert_eq!(
        err,
        "sort key 2 has type Utf8, which the GPU top-k does not support"
    );
    for dt in [
        DataType::Utf8View,
        DataType::LargeUtf8,
        DataType::Binary,
        DataType::Decimal256(76, 0),
        DataType::Interval(IntervalUnit::MonthDayNano),
        DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
        DataType::List(Arc::new(datafusion::arrow::datatypes::Field::new(
            "item",
            DataType::Int32,
            true,
        ))),
        DataType::Null,
        DataType::Time32(TimeUnit::Nanosecond),
        DataType::Time64(TimeUnit::Second),
    ] {
        let s = spec(dt.clone(), false, false, true);
        assert_eq!(s.value_bits(), None, "{dt}");
        assert_eq!(s.bits(), None, "{dt}");
        let err = KeyLayout::try_new(vec![s.clone()]).unwrap_err();
        assert!(err.starts_with("sort key 1 has type "), "{err}");
        assert!(err.contains(&dt.to_string()), "{err}");
        let array = datafusion::arrow::array::new_empty_array(&DataType::Utf8);
        assert!(encode_column_u128(&s, array.as_ref()).is_err());
    }
    assert_eq!(
        KeyLayout::try_new(vec![]).unwrap_err(),
        "the GPU top-k needs at least one sort key"
    );
}

#[test]
fn too_many_bits_are_refused() {
    let d = spec(DataType::Decimal128(38, 0), false, false, true);
    let err = KeyLayout::try_new(vec![d.clone(), d.clone()]).unwrap_err();
    assert!(err.contains("258 bits"), "{err}");
    assert!(err.contains("key 1: 129, key 2: 129"), "{err}");
    let mut many = vec![spec(DataType::Int64, false, false, false); 4];
    assert!(KeyLayout::try_new(many.clone()).is_ok());
    many.push(spec(DataType::Boolean, false, false, false));
    assert!(KeyLayout::try_new(many).unwrap_err().contains("257 bits"));
    // A 129-bit field does not fit the single-column u128 reference.
    let array = make_array(&DataType::Decimal128(38, 0), &[1], None);
    assert!(encode_column_u128(&d, array.as_ref()).is_err());
}

#[test]
fn mismatched_input_is_an_error_not_a_panic() {
    let layout = KeyLayout::try_new(vec![
        spec(DataType::Int64, false, false, false),
        spec(DataType::Float64, true, true, true),
    ])
    .unwrap();
    let ints = make_array(&DataType::Int64, &[1, 2, 3], None);
    let floats = make_array(&DataType::Float64, &[1, 2, 3], None);

    // Column count.
    let err = layout.encode(std::slice::from_ref(&ints)).unwrap_err();
    assert!(
        err.to_string().contains("expects 2 columns, got 1"),
        "{err}"
    );
    // Length.
    let err = layout
        .encode(&[ints.clone(), floats.slice(0, 2)])
        .unwrap_err();
    assert!(err.to_string().contains("key column 2 has 2 rows"), "{err}");
    // Type (including a different time zone or decimal scale).
    let err = layout
        .encode(&[floats.clone(), floats.clone()])
        .unwrap_err();
    assert!(
        err.to_string().contains("key column 1 has type Float64"),
        "{err}"
    );
    let ts = |tz: &str| DataType::Timestamp(TimeUnit::Second, Some(tz.into()));
    let err = encode_column_u128(
        &spec(ts("UTC"), false, false, false),
        make_array(&ts("+01:00"), &[1], None).as_ref(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("expects"), "{err}");
    let err = encode_column_u128(
        &spec(DataType::Decimal64(10, 2), false, false, false),
        make_array(&DataType::Decimal64(10, 3), &[1], None).as_ref(),
    );
    assert!(err.is_err());
    // NULLs in a key declared not nullable.
    let with_null = make_array(&DataType::Int64, &[1, 2, 3], Some(&[true, false, true]));
    let err = layout.encode(&[with_null, floats.clone()]).unwrap_err();
    assert!(err.to_string().contains("declared not nullable"), "{err}");
    // A null buffer without NULLs is fine.
    let no_null = make_array(&DataType::Int64, &[1, 2, 3], Some(&[true; 3]));
    assert!(layout.encode(&[no_null, floats]).is_ok());
}

/// Strings with long shared prefixes, prefixes of each other, empty and non-ASCII values.
fn awkward_strings(rng: &mut Rng, n: usize) -> Vec<Option<String>> {
    let stems = [
        "",
        "a",
        "ab",
        "abc",
        "é",
        "日本語",
        "https://example.com/a/b/c/d/e/",
    ];
    (0..n)
        .map(|_| {
            if rng.below(10) == 0 {
                return None;
            }
            let mut s = stems[rng.below(stems.len())].to_string();
            for _ in 0..rng.below(3) {
                s.push(['a', 'b', '\u{7f}', 'ÿ', '\u{1}'][rng.below(5)]);
            }
            Some(s)
        })
        .collect()
}

/// Nullable keys over `columns` whose directions and NULL placements vary with `round` and
/// the key's position, so that rounds cover every combination.
fn round_specs(columns: &[ArrayRef], round: usize) -> Vec<KeySpec> {
    (columns.iter().enumerate())
        .map(|(i, c)| KeySpec {
            data_type: c.data_type().clone(),
            descending: (round + i) % 2 == 1,
            nulls_first: (round / 2 + i).is_multiple_of(2),
            nullable: true,
        })
        .collect()
}

/// A prefix layout's composite never orders two rows against their full keys: whenever arrow's
/// row format (DataFusion's comparison) puts a row first, its composite is not larger.
#[test]
fn prefix_composites_are_monotone_in_the_full_order() {
    use datafusion::arrow::array::{
        BinaryArray, Decimal128Array, DictionaryArray, Int32Array, LargeStringArray, StringArray,
        StringViewArray,
    };
    use datafusion::arrow::row::RowConverter;
    let mut rng = Rng(0x5eed_1234_abcd);
    let n = 300;
    for round in 0..24 {
        let strings = awkward_strings(&mut rng, n);
        let as_str: Vec<Option<&str>> = strings.iter().map(|s| s.as_deref()).collect();
        let string_column: ArrayRef = match round % 5 {
            0 => Arc::new(StringArray::from(as_str.clone())),
            1 => Arc::new(LargeStringArray::from(as_str.clone())),
            2 => Arc::new(StringViewArray::from(as_str.clone())),
            3 => {
                let bytes: Vec<Option<&[u8]>> =
                    as_str.iter().map(|s| s.map(str::as_bytes)).collect();
                Arc::new(BinaryArray::from(bytes))
            }
            _ => {
                let values = Arc::new(StringArray::from(vec!["zz", "", "ab", "abc", "日本語"]));
                let codes: Int32Array = (0..n)
                    .map(|_| (rng.below(8) != 0).then(|| rng.below(5) as i32))
                    .collect();
                Arc::new(DictionaryArray::<Int32Type>::try_new(codes, values).unwrap())
            }
        };
        let wide: ArrayRef = Arc::new(
            (0..n)
                .map(|_| (rng.below(9) != 0).then(|| (rng.below(7) as i128 - 3) << 100))
                .collect::<Decimal128Array>()
                .with_precision_and_scale(38, 0)
                .unwrap(),
        );
        let small: ArrayRef = Arc::new(Int32Array::from_iter_values(
            (0..n).map(|_| rng.below(3) as i32),
        ));
        // Shapes: a string first, a string after a fixed key, and keys wider than 256 bits.
        let columns: Vec<ArrayRef> = match round % 3 {
            0 => vec![Arc::clone(&string_column), Arc::clone(&small)],
            1 => vec![Arc::clone(&small), Arc::clone(&string_column)],
            _ => vec![Arc::clone(&wide), Arc::clone(&wide), Arc::clone(&small)],
        };
        let specs = round_specs(&columns, round);
        let layout = KeyLayout::with_prefixes(specs).unwrap();
        assert!(!layout.exact(), "round {round}");
        assert!(layout.prefix_note().is_some());
        let rows = RowConverter::new(layout.sort_fields())
            .unwrap()
            .convert_columns(&columns)
            .unwrap();
        let composites: Vec<U256> = match layout.encode(&columns).unwrap() {
            EncodedKeys::W64(v) => v.into_iter().map(|x| U256::from_u128(x.into())).collect(),
            EncodedKeys::W128(v) => v.into_iter().map(U256::from_u128).collect(),
            EncodedKeys::W256(v) => v,
        };
        for a in 0..n {
            for b in 0..n {
                if rows.row(a) < rows.row(b) {
                    assert!(
                        composites[a] <= composites[b],
                        "round {round}: rows {a} and {b} ({:?}, {:?})",
                        columns[0].slice(a, 1),
                        columns[0].slice(b, 1)
                    );
                }
            }
        }
    }
}

/// Fixed keys within 256 bits stay exact; byte keys and wider keys make a prefix layout of
/// the leading keys, sized as the module documentation says.
#[test]
fn prefix_layouts_take_the_leading_keys() {
    let spec = |data_type: DataType, nullable: bool| KeySpec {
        data_type,
        descending: false,
        nulls_first: false,
        nullable,
    };
    let exact = KeyLayout::with_prefixes(vec![spec(DataType::Int64, true)]).unwrap();
    assert!(exact.exact() && exact.prefix_note().is_none());

    let first = KeyLayout::with_prefixes(vec![spec(DataType::Utf8View, true)]).unwrap();
    assert_eq!(first.total_bits(), 1 + 15 * 8);
    let after = KeyLayout::with_prefixes(vec![
        spec(DataType::Int64, false),
        spec(DataType::Utf8, false),
        spec(DataType::Int32, false),
    ])
    .unwrap();
    assert_eq!(
        after.total_bits(),
        64 + 8 * 8,
        "the string fills the rest of 128 bits"
    );
    let late = KeyLayout::with_prefixes(vec![
        spec(DataType::Decimal128(38, 0), true),
        spec(DataType::Int64, false),
        spec(DataType::Binary, false),
    ])
    .unwrap();
    assert_eq!(late.total_bits(), 129 + 64 + 7 * 8, "then up to 256 bits");
    let wide = KeyLayout::with_prefixes(vec![
        spec(DataType::Decimal128(38, 0), true),
        spec(DataType::Decimal128(38, 0), true),
        spec(DataType::Int8, false),
    ])
    .unwrap();
    assert!(!wide.exact());
    assert_eq!(wide.total_bits(), 256);
    assert!(wide.prefix_note().unwrap().contains("high 126 of 128 bits"));
    assert!(
        KeyLayout::with_prefixes(vec![spec(DataType::Utf8, false)])
            .unwrap()
            .width()
            == KeyWidth::W128
    );
    let nested = DataType::List(Arc::new(datafusion::arrow::datatypes::Field::new(
        "x",
        DataType::Int32,
        true,
    )));
    assert!(KeyLayout::with_prefixes(vec![spec(nested, true)]).is_err());
}

/// A dictionary whose values are empty (every key NULL) encodes as NULLs.
#[test]
fn an_empty_dictionary_encodes_as_nulls() {
    use datafusion::arrow::array::{DictionaryArray, Int32Array, StringArray};
    let values = Arc::new(StringArray::from(Vec::<&str>::new()));
    let keys = Int32Array::from(vec![None, None, None]);
    let column: ArrayRef = Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values).unwrap());
    for nulls_first in [false, true] {
        let spec = KeySpec {
            data_type: column.data_type().clone(),
            descending: false,
            nulls_first,
            nullable: true,
        };
        let layout = KeyLayout::with_prefixes(vec![spec]).unwrap();
        let EncodedKeys::W128(keys) = layout.encode(std::slice::from_ref(&column)).unwrap() else {
            panic!("a 121-bit layout");
        };
        let null = if nulls_first { 0 } else { 1u128 << 120 };
        assert_eq!(keys, vec![null; 3]);
    }
}

/// The device's image of a string column (its prefix words) is the same for every string and
/// binary array type, and its leading bytes are the host composite's field, bit for bit.
#[test]
fn prefix_words_are_the_host_composites_field() {
    use datafusion::arrow::array::{
        BinaryArray, BinaryViewArray, LargeBinaryArray, LargeStringArray, StringArray,
        StringViewArray,
    };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let strings = awkward_strings(&mut rng, 400);
    let texts: Vec<Option<&str>> = strings.iter().map(|s| s.as_deref()).collect();
    let bytes: Vec<Option<&[u8]>> = texts.iter().map(|s| s.map(str::as_bytes)).collect();
    let arrays: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(texts.clone())),
        Arc::new(LargeStringArray::from(texts.clone())),
        Arc::new(StringViewArray::from(texts.clone())),
        Arc::new(BinaryArray::from(bytes.clone())),
        Arc::new(LargeBinaryArray::from(bytes.clone())),
        Arc::new(BinaryViewArray::from(bytes.clone())),
    ];
    let words = prefix_words(arrays[0].as_ref()).unwrap();
    for array in &arrays {
        assert_eq!(
            prefix_words(array.as_ref()).unwrap(),
            words,
            "{}",
            array.data_type()
        );
        // Sliced arrays read their own rows.
        let sliced = prefix_words(array.slice(7, 100).as_ref()).unwrap();
        assert_eq!(sliced, words[7..107], "{}", array.data_type());
    }
    for (i, s) in texts.iter().enumerate() {
        let mut padded = [0u8; 16];
        if let Some(s) = s {
            let n = s.len().min(16);
            padded[..n].copy_from_slice(&s.as_bytes()[..n]);
        }
        assert_eq!(words[i], u128::from_be_bytes(padded), "row {i}: {s:?}");
    }
    // The field of a string key alone: all 16 bytes, or 15 beside a null bit.
    for nullable in [false, true] {
        let array: ArrayRef = if nullable {
            Arc::clone(&arrays[2])
        } else {
            let valid: Vec<&str> = texts.iter().map(|s| s.unwrap_or("")).collect();
            Arc::new(StringViewArray::from(valid))
        };
        let words = prefix_words(array.as_ref()).unwrap();
        let layout =
            KeyLayout::with_prefixes(vec![spec(DataType::Utf8View, false, false, nullable)])
                .unwrap();
        let bytes = layout.prefix_bytes(0).expect("a byte field");
        assert_eq!(bytes, if nullable { 15 } else { 16 });
        let EncodedKeys::W128(keys) = layout.encode(&[Arc::clone(&array)]).unwrap() else {
            panic!("128-bit composites");
        };
        let value_mask = u128::MAX >> (128 - 8 * bytes);
        for (i, (key, word)) in keys.iter().zip(&words).enumerate() {
            if array.is_valid(i) {
                assert_eq!(key & value_mask, word >> (128 - 8 * bytes), "row {i}");
            }
        }
    }
}

/// A dictionary's prefix words are its values' (NULL where the key or its entry is), and a
/// `Decimal256`'s and a fixed-size binary's leading bytes are their host composite's field.
#[test]
fn prefix_words_of_dictionaries_decimals_and_fixed_binary() {
    use datafusion::arrow::array::{
        Decimal256Array, DictionaryArray, FixedSizeBinaryArray, Int8Array, StringArray,
    };
    use datafusion::arrow::datatypes::i256;
    let entries = StringArray::from(vec![Some("unused"), None, Some("b"), Some("a"), Some("")]);
    let keys = Int8Array::from(vec![
        Some(2),
        None,
        Some(1),
        Some(3),
        Some(4),
        Some(2),
        Some(3),
    ]);
    let dictionary: ArrayRef = Arc::new(DictionaryArray::new(keys, Arc::new(entries)));
    let plain: ArrayRef = Arc::new(StringArray::from(vec![
        Some("b"),
        None,
        None,
        Some("a"),
        Some(""),
        Some("b"),
        Some("a"),
    ]));
    assert_eq!(
        prefix_words(dictionary.as_ref()).unwrap(),
        prefix_words(plain.as_ref()).unwrap()
    );
    assert_eq!(
        prefix_words(dictionary.slice(2, 4).as_ref()).unwrap(),
        prefix_words(plain.slice(2, 4).as_ref()).unwrap()
    );
    let empty: ArrayRef = Arc::new(DictionaryArray::new(
        Int8Array::from(vec![None, None]),
        Arc::new(StringArray::from(Vec::<&str>::new())),
    ));
    assert_eq!(prefix_words(empty.as_ref()).unwrap(), vec![0, 0]);

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let decimals: ArrayRef = Arc::new(
        Decimal256Array::from_iter((0..300).map(|i| {
            let v = i256::from_parts(rng.next() as u128, rng.next() as i128 >> (i % 120));
            (i % 17 != 4).then_some(v)
        }))
        .with_precision_and_scale(76, 0)
        .unwrap(),
    );
    let fixed: ArrayRef = Arc::new(
        FixedSizeBinaryArray::try_from_iter((0..300).map(|_| rng.next().to_be_bytes())).unwrap(),
    );
    for (array, descending) in [(decimals, false), (fixed, true)] {
        let words = prefix_words(array.as_ref()).unwrap();
        let layout = KeyLayout::with_prefixes(vec![spec(
            array.data_type().clone(),
            descending,
            false,
            true,
        )])
        .unwrap();
        let bytes = layout.prefix_bytes(0).expect("a byte field");
        let EncodedKeys::W128(keys) = layout.encode(&[Arc::clone(&array)]).unwrap() else {
            panic!("128-bit composites");
        };
        let value_mask = u128::MAX >> (128 - 8 * bytes);
        let flip = if descending { value_mask } else { 0 };
        for (i, (key, word)) in keys.iter().zip(&words).enumerate() {
            if array.is_valid(i) {
                let field = (word >> (128 - 8 * bytes)) ^ flip;
                assert_eq!(key & value_mask, field, "{}: row {i}", array.data_type());
            } else {
                assert_eq!(*word, 0, "row {i}");
            }
        }
    }
}

/// Short byte keys: [`short_bytes`] says when every value fits a prefix word and ends in a
/// non-zero byte, and the layout [`KeyLayout::with_short_bytes`] builds of them is exact:
/// composites compare as arrow's row format does, ties included, in every direction.
#[test]
fn short_byte_keys_are_exact() {
    use datafusion::arrow::array::{BinaryArray, DictionaryArray, Int32Array, StringArray};
    use datafusion::arrow::row::RowConverter;
    let strings = |v: &[Option<&str>]| StringArray::from(v.to_vec());
    assert_eq!(
        short_bytes(&strings(&[
            Some("a"),
            None,
            Some(""),
            Some("abcdefghijklmnop")
        ])),
        Some(16)
    );
    assert_eq!(short_bytes(&strings(&[Some("abcdefghijklmnopq")])), None);
    assert_eq!(short_bytes(&strings(&[Some("a\0")])), None);
    assert_eq!(short_bytes(&strings(&[Some("a\0b"), None])), Some(3));
    assert_eq!(short_bytes(&strings(&[None, None])), Some(0));
    let binary = BinaryArray::from(vec![&b"\x00\x01"[..], b"\xff"]);
    assert_eq!(short_bytes(&binary), Some(2));
    let dictionary: DictionaryArray<Int32Type> =
        vec![Some("xy"), None, Some("xyz")].into_iter().collect();
    assert_eq!(short_bytes(&dictionary), Some(3));
    assert_eq!(short_bytes(&Int32Array::from(vec![1])), None);

    let mut rng = Rng(41);
    let alphabet = [
        "",
        "a",
        "b",
        "a\0b",
        "ab",
        "b\u{ff}",
        "日本",
        "abcdefghijklmnop",
    ];
    let n = 300;
    let string: ArrayRef = Arc::new(StringArray::from(
        (0..n)
            .map(|_| (rng.below(8) != 0).then(|| alphabet[rng.below(8)]))
            .collect::<Vec<_>>(),
    ));
    let dictionary: ArrayRef = Arc::new(
        (0..n)
            .map(|_| (rng.below(6) != 0).then(|| alphabet[rng.below(4)]))
            .collect::<DictionaryArray<Int32Type>>(),
    );
    let small: ArrayRef = Arc::new(Int32Array::from_iter_values(
        (0..n).map(|_| rng.below(3) as i32),
    ));
    for round in 0..8 {
        let columns = vec![
            Arc::clone(&string),
            Arc::clone(&small),
            Arc::clone(&dictionary),
        ];
        let specs = round_specs(&columns, round);
        let short: Vec<Option<u32>> = columns.iter().map(|c| short_bytes(c.as_ref())).collect();
        assert_eq!(short, vec![Some(16), None, Some(3)]);
        let layout = KeyLayout::with_short_bytes(specs, &short).unwrap();
        assert!(layout.exact() && layout.prefix_note().is_none());
        assert_eq!(layout.total_bits(), (1 + 128) + (1 + 32) + (1 + 24));
        assert_eq!(layout.prefix_bytes(2), Some(3));
        let rows = RowConverter::new(layout.sort_fields())
            .unwrap()
            .convert_columns(&columns)
            .unwrap();
        let composites = keys_as_u256(&layout.encode(&columns).unwrap());
        for a in 0..n {
            for b in 0..n {
                assert_eq!(
                    rows.row(a).cmp(&rows.row(b)),
                    composites[a].cmp(&composites[b]),
                    "round {round}: rows {a} and {b}"
                );
            }
        }
    }
    // A key of unknown length, or too many bits, has no short layout.
    let spec = |data_type| KeySpec::new(data_type, SortOptions::default(), false);
    assert!(KeyLayout::with_short_bytes(vec![spec(DataType::Utf8)], &[None]).is_none());
    let wide = vec![
        spec(DataType::Utf8),
        spec(DataType::Decimal128(38, 0)),
        spec(DataType::Decimal128(38, 0)),
    ];
    assert!(KeyLayout::with_short_bytes(wide, &[Some(16), None, None]).is_none());
}

/// [`KeyLayout::with_known_bytes`]: a short byte key is laid out whole and the keys after it
/// follow (exact where all fit); one of unknown length, or too long, is cut as
/// [`KeyLayout::with_prefixes`] cuts it; a short key past the 256 bits is cut too.
#[test]
fn known_short_bytes_lay_out_the_keys_after_them() {
    let spec = |data_type, nullable| KeySpec::new(data_type, SortOptions::default(), nullable);
    let keys = || vec![spec(DataType::Utf8, true), spec(DataType::Int64, false)];
    let whole = KeyLayout::with_known_bytes(keys(), &[Some(7), None]).unwrap();
    assert!(whole.exact() && whole.prefix_note().is_none());
    assert_eq!(whole.total_bits(), (1 + 56) + 64);
    assert_eq!((whole.prefix_bytes(0), whole.field_shift(1)), (Some(7), 0));
    let empty = KeyLayout::with_known_bytes(keys(), &[Some(0), None]).unwrap();
    assert_eq!((empty.exact(), empty.total_bits()), (true, (1 + 8) + 64));
    for short in [&[None, None][..], &[Some(17), None], &[]] {
        let cut = KeyLayout::with_known_bytes(keys(), short).unwrap();
        assert_eq!(cut, KeyLayout::with_prefixes(keys()).unwrap());
        assert!(!cut.exact() && cut.composite_keys() == 1);
    }
    let wide = vec![
        spec(DataType::Decimal128(38, 0), false),
        spec(DataType::Decimal128(38, 0), false),
        spec(DataType::Utf8, false),
    ];
    let cut = KeyLayout::with_known_bytes(wide, &[None, None, Some(4)]).unwrap();
    assert!(!cut.exact());
}
