//! Fixed-width keys: each type's ascending value bits, one loop per column.

use datafusion::arrow::array::{Array, ArrowPrimitiveType, AsArray};
use datafusion::arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal32Type, Decimal64Type, Decimal128Type,
    DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType, DurationSecondType,
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
    Time32MillisecondType, Time32SecondType, Time64MicrosecondType, Time64NanosecondType, TimeUnit,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use datafusion::error::Result;

use super::composite::Container;
use super::encode::{Field, run_column};
use super::{KeySpec, downcast_error, exec_error, unsupported_reason};

/// A native value's ascending value bits (zero-extended), see the table in the
/// [module documentation](super).
pub(super) trait OrderedBits: Copy {
    fn ordered_bits(self) -> u128;
}

macro_rules! ordered_unsigned {
    ($($t:ty),*) => {$(
        impl OrderedBits for $t {
            #[inline(always)]
            fn ordered_bits(self) -> u128 {
                self as u128
            }
        }
    )*};
}
ordered_unsigned!(u8, u16, u32, u64, u128, bool);

macro_rules! ordered_signed {
    ($($t:ty => $u:ty),*) => {$(
        impl OrderedBits for $t {
            #[inline(always)]
            fn ordered_bits(self) -> u128 {
                // Flipping the sign bit maps two's complement MIN..=MAX onto 0..=MAX unsigned.
                ((self as $u) ^ (1 << (<$u>::BITS - 1))) as u128
            }
        }
    )*};
}
ordered_signed!(i8 => u8, i16 => u16, i32 => u32, i64 => u64, i128 => u128);

macro_rules! ordered_float {
    ($($t:ty => $u:ty, $i:ty),*) => {$(
        impl OrderedBits for $t {
            #[inline(always)]
            fn ordered_bits(self) -> u128 {
                // totalOrder: negative (sign set) → flip all bits, else flip the sign bit. The
                // arithmetic shift smears the sign into a mask, keeping the loop branch-free.
                let bits = self.to_bits();
                let mask = (((bits as $i) >> (<$u>::BITS - 1)) as $u) | (1 << (<$u>::BITS - 1));
                (bits ^ mask) as u128
            }
        }
    )*};
}
ordered_float!(half::f16 => u16, i16, f32 => u32, i32, f64 => u64, i64);

/// One type dispatch per column, then a monomorphised loop.
pub(super) fn encode_values<C: Container>(
    key: usize,
    spec: &KeySpec,
    field: &Field<C>,
    array: &dyn Array,
    out: &mut [C],
) -> Result<()> {
    use DataType::*;
    match &spec.data_type {
        Boolean => {
            let array = array
                .as_boolean_opt()
                .ok_or_else(|| downcast_error(key, spec))?;
            run_column(field, array.values().iter(), out);
            Ok(())
        }
        UInt8 => encode_primitive::<UInt8Type, C>(key, spec, field, array, out),
        UInt16 => encode_primitive::<UInt16Type, C>(key, spec, field, array, out),
        UInt32 => encode_primitive::<UInt32Type, C>(key, spec, field, array, out),
        UInt64 => encode_primitive::<UInt64Type, C>(key, spec, field, array, out),
        Int8 => encode_primitive::<Int8Type, C>(key, spec, field, array, out),
        Int16 => encode_primitive::<Int16Type, C>(key, spec, field, array, out),
        Int32 => encode_primitive::<Int32Type, C>(key, spec, field, array, out),
        Int64 => encode_primitive::<Int64Type, C>(key, spec, field, array, out),
        Float16 => encode_primitive::<Float16Type, C>(key, spec, field, array, out),
        Float32 => encode_primitive::<Float32Type, C>(key, spec, field, array, out),
        Float64 => encode_primitive::<Float64Type, C>(key, spec, field, array, out),
        Date32 => encode_primitive::<Date32Type, C>(key, spec, field, array, out),
        Date64 => encode_primitive::<Date64Type, C>(key, spec, field, array, out),
        Time32(TimeUnit::Second) => {
            encode_primitive::<Time32SecondType, C>(key, spec, field, array, out)
        }
        Time32(TimeUnit::Millisecond) => {
            encode_primitive::<Time32MillisecondType, C>(key, spec, field, array, out)
        }
        Time64(TimeUnit::Microsecond) => {
            encode_primitive::<Time64MicrosecondType, C>(key, spec, field, array, out)
        }
        Time64(TimeUnit::Nanosecond) => {
            encode_primitive::<Time64NanosecondType, C>(key, spec, field, array, out)
        }
        Timestamp(TimeUnit::Second, _) => {
            encode_primitive::<TimestampSecondType, C>(key, spec, field, array, out)
        }
        Timestamp(TimeUnit::Millisecond, _) => {
            encode_primitive::<TimestampMillisecondType, C>(key, spec, field, array, out)
        }
        Timestamp(TimeUnit::Microsecond, _) => {
            encode_primitive::<TimestampMicrosecondType, C>(key, spec, field, array, out)
        }
        Timestamp(TimeUnit::Nanosecond, _) => {
            encode_primitive::<TimestampNanosecondType, C>(key, spec, field, array, out)
        }
        Duration(TimeUnit::Second) => {
            encode_primitive::<DurationSecondType, C>(key, spec, field, array, out)
        }
        Duration(TimeUnit::Millisecond) => {
            encode_primitive::<DurationMillisecondType, C>(key, spec, field, array, out)
        }
        Duration(TimeUnit::Microsecond) => {
            encode_primitive::<DurationMicrosecondType, C>(key, spec, field, array, out)
        }
        Duration(TimeUnit::Nanosecond) => {
            encode_primitive::<DurationNanosecondType, C>(key, spec, field, array, out)
        }
        Decimal32(..) => encode_primitive::<Decimal32Type, C>(key, spec, field, array, out),
        Decimal64(..) => encode_primitive::<Decimal64Type, C>(key, spec, field, array, out),
        Decimal128(..) => encode_primitive::<Decimal128Type, C>(key, spec, field, array, out),
        other => Err(exec_error(unsupported_reason(key, other))),
    }
}

#[inline]
fn encode_primitive<T, C>(
    key: usize,
    spec: &KeySpec,
    field: &Field<C>,
    array: &dyn Array,
    out: &mut [C],
) -> Result<()>
where
    T: ArrowPrimitiveType,
    T::Native: OrderedBits,
    C: Container,
{
    let array = array
        .as_primitive_opt::<T>()
        .ok_or_else(|| downcast_error(key, spec))?;
    run_column(field, array.values().iter().copied(), out);
    Ok(())
}
