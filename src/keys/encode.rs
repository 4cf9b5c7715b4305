//! The column encoder: one key's field of every row ORed into the composites of a batch.

use datafusion::arrow::array::Array;
use datafusion::error::Result;

use super::bytes::byte_prefixes;
use super::composite::{Container, Placer, PlacerBody};
use super::fixed::{OrderedBits, encode_values};
use super::layout::Part;
use super::{KeySpec, KeyWidth, U256, exec_error};

/// Composite keys of one batch, one per row, in the layout's width.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodedKeys {
    /// Layouts of ≤ 64 bits.
    W64(Vec<u64>),
    /// Layouts of 65..=128 bits.
    W128(Vec<u128>),
    /// Layouts of 129..=256 bits.
    W256(Vec<U256>),
}

impl EncodedKeys {
    /// No rows, in the host container of `width` (`u64` up to 64 bits).
    pub fn new(width: KeyWidth) -> Self {
        match width {
            KeyWidth::W32 | KeyWidth::W64 => Self::W64(Vec::new()),
            KeyWidth::W128 => Self::W128(Vec::new()),
            KeyWidth::W256 => Self::W256(Vec::new()),
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        match self {
            Self::W64(v) => v.len(),
            Self::W128(v) => v.len(),
            Self::W256(v) => v.len(),
        }
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The container's width (`W64` for keys of up to 64 bits).
    pub fn width(&self) -> KeyWidth {
        match self {
            Self::W64(_) => KeyWidth::W64,
            Self::W128(_) => KeyWidth::W128,
            Self::W256(_) => KeyWidth::W256,
        }
    }
}

/// Encodes one column on its own: each row's field (value bits, and the null bit placed per the
/// spec when nullable) in the low [`KeySpec::bits`] bits. This is the single-key reference for
/// tests and for the GPU kernels. Errors on an unsupported or mismatched type, on NULLs in a
/// non-nullable spec, and on a field wider than 128 bits (nullable `Decimal128`).
#[cfg(test)]
pub(crate) fn encode_column_u128(spec: &KeySpec, array: &dyn Array) -> Result<Vec<u128>> {
    let Some(value_bits) = spec.value_bits() else {
        return Err(exec_error(super::unsupported_reason(0, &spec.data_type)));
    };
    if value_bits + u32::from(spec.nullable) > 128 {
        return Err(exec_error(format!(
            "a nullable {} key needs 129 bits, which does not fit a u128; use KeyLayout::encode",
            spec.data_type
        )));
    }
    let mut out = vec![0u128; array.len()];
    let field = Field::new(spec, value_bits, 0);
    encode_column_into(0, spec, Part::Whole, &field, array, &mut out)?;
    Ok(out)
}

/// The per-row loop of one column: OR each row's placed field into the composite.
struct ColumnLoop<'a, I, C> {
    values: I,
    out: &'a mut [C],
    xor: u128,
    valid: C,
}

impl<I, C> PlacerBody<C> for ColumnLoop<'_, I, C>
where
    I: Iterator,
    I::Item: OrderedBits,
    C: Container,
{
    type Output = ();

    #[inline(always)]
    fn run<P: Placer<C>>(self, placer: P) {
        let (xor, valid) = (self.xor, self.valid);
        for (o, v) in self.out.iter_mut().zip(self.values) {
            *o = *o | placer.place(v.ordered_bits() ^ xor) | valid;
        }
    }
}

/// Where and how one key's field is written into the composite; loop-invariant constants.
#[derive(Clone, Copy)]
pub(super) struct Field<C> {
    /// XORed into the value bits: all value bits for `DESC`, else 0.
    xor: u128,
    shift: u32,
    value_bits: u32,
    /// ORed into valid rows (the null bit under `NULLS FIRST`).
    valid: C,
    /// The whole field of a NULL row (the null bit under `NULLS LAST`).
    null: C,
    /// Clears this field, keeping the others.
    keep: C,
}

impl<C: Container> Field<C> {
    pub(super) fn new(spec: &KeySpec, value_bits: u32, shift: u32) -> Self {
        let value_mask = if value_bits == 128 {
            u128::MAX
        } else {
            (1u128 << value_bits) - 1
        };
        let null_bit = if spec.nullable {
            C::place(1, shift + value_bits)
        } else {
            C::default()
        };
        let (valid, null) = if spec.nulls_first {
            (null_bit, C::default())
        } else {
            (C::default(), null_bit)
        };
        Self {
            xor: if spec.descending { value_mask } else { 0 },
            shift,
            value_bits,
            valid,
            null,
            keep: !(C::place(value_mask, shift) | null_bit),
        }
    }
}

/// ORs key `key`'s field for every row of `array` into `out` (whose field bits are zero).
pub(super) fn encode_column_into<C: Container>(
    key: usize,
    spec: &KeySpec,
    part: Part,
    field: &Field<C>,
    array: &dyn Array,
    out: &mut [C],
) -> Result<()> {
    if array.data_type() != &spec.data_type {
        return Err(exec_error(format!(
            "key column {} has type {}, the key layout expects {}",
            key + 1,
            array.data_type(),
            spec.data_type
        )));
    }
    if array.len() != out.len() {
        return Err(exec_error(format!(
            "key column {} has {} rows, expected {}",
            key + 1,
            array.len(),
            out.len()
        )));
    }
    let nulls = array.logical_nulls().filter(|n| n.null_count() > 0);
    if let Some(nulls) = &nulls
        && !spec.nullable
    {
        return Err(exec_error(format!(
            "key column {} holds {} NULLs but was declared not nullable",
            key + 1,
            nulls.null_count()
        )));
    }
    match part {
        Part::Whole => encode_values(key, spec, field, array, out)?,
        Part::High { dropped } => {
            // The whole value first (DESC flips all its bits), then its high bits placed.
            let whole = KeySpec {
                nullable: false,
                ..spec.clone()
            };
            let whole_field = Field::<u128>::new(&whole, field.value_bits + dropped, 0);
            let mut values = vec![0u128; out.len()];
            encode_values(key, spec, &whole_field, array, &mut values)?;
            let high = values.into_iter().map(|v| v >> dropped);
            run_column(&Field { xor: 0, ..*field }, high, out);
        }
        Part::Bytes { bytes } | Part::AllBytes { bytes } => {
            let prefixes = byte_prefixes(key, spec, array, bytes as usize)?;
            run_column(field, prefixes.into_iter(), out);
        }
    }
    if let Some(nulls) = nulls {
        // Patch NULL rows afterwards: their value bits are whatever the array holds under the
        // slot, so the main loop wrote garbage there that must be cleared.
        for i in (!nulls.inner()).set_indices() {
            out[i] = (out[i] & field.keep) | field.null;
        }
    }
    Ok(())
}

#[inline(always)]
pub(super) fn run_column<I, C>(field: &Field<C>, values: I, out: &mut [C])
where
    I: Iterator,
    I::Item: OrderedBits,
    C: Container,
{
    let body = ColumnLoop {
        values,
        out,
        xor: field.xor,
        valid: field.valid,
    };
    C::with_placer(field.shift, field.value_bits, body);
}
