//! Order-preserving key encoding.
//!
//! Every sort key of an `ORDER BY` maps to an unsigned integer *field* whose unsigned order is
//! exactly DataFusion's order for that key (direction and `NULLS FIRST/LAST` included). The
//! fields of all keys are concatenated, key 0 most significant, into one composite integer of
//! 64, 128 or 256 bits, so that a top-k becomes "the k smallest composite integers". The row id
//! that breaks ties is *not* part of the composite: the selectors pair it with the key.
//!
//! Value bits of one key, ascending (the bit patterns are the type's native representation):
//!
//! | type                                                  | bits  | ascending value bits   |
//! |-------------------------------------------------------|-------|------------------------|
//! | `Boolean`                                             | 1     | `false` = 0, `true` = 1|
//! | `UInt8/16/32/64`                                      | 8…64  | as is                  |
//! | `Int8/16/32/64`, `Date32/64`, `Time32/64`, `Timestamp`, `Duration`, `Decimal32/64/128` | 8…128 | sign bit flipped |
//! | `Float16/32/64`                                       | 16…64 | sign set: all flipped; else sign bit flipped |
//!
//! The float mapping is IEEE 754 totalOrder, i.e. Rust's `total_cmp`, which is what arrow's sort
//! kernels and DataFusion's row format use: `−NaN < −inf < … < −0.0 < +0.0 < … < +inf < +NaN`.
//! NaNs are not canonicalised (x86 produces the sign-set `−NaN` for `0.0 / 0.0`, and DataFusion
//! sorts it first).
//!
//! `DESC` flips all value bits. A nullable key gets one more bit above its value bits, chosen so
//! that NULLs land on the requested side; NULL rows have all value bits zero, whatever the array
//! holds under the null slot, so all NULLs of a key tie:
//!
//! | field (`v` = value bits)  | valid row          | NULL row |
//! |---------------------------|--------------------|----------|
//! | not nullable              | `value`            | (error)  |
//! | nullable, `NULLS FIRST`   | `1 << v \| value`  | `0`      |
//! | nullable, `NULLS LAST`    | `0 << v \| value`  | `1 << v` |
//!
//! The composite is right-aligned: with `total_bits` = Σ field bits, key 0 occupies the highest
//! field bits just below `total_bits` ([`KeyLayout::field_shift`] gives each field's offset) and
//! the bits at and above `total_bits` are zero:
//!
//! ```text
//!   width-1     total_bits-1                                   0
//!   ┌─ 0 … 0 ─┬──────────────┬──────────────┬─────┬──────────────┐
//!   │  unused │ [n₀] value₀  │ [n₁] value₁  │  …  │ [nₘ] valueₘ  │
//!   └─────────┴──────────────┴──────────────┴─────┴──────────────┘
//! ```
//!
//! Encoding runs column by column into the composite vector: one type dispatch per column, then a
//! tight generic loop over the column's `values()` slice (NULL slots included, they are patched
//! afterwards from the validity bitmap, so the main loop stays branch-free and vectorisable).
//!
//! ## Prefix layouts
//!
//! Keys compared byte by byte (strings, binary, dictionaries of them, `Decimal256`) and keys
//! that together need more than 256 bits have no exact composite. [`KeyLayout::with_prefixes`]
//! then builds a *prefix* layout: the leading keys in full while they fit, then one truncated
//! field, and nothing of the keys after it (what follows a truncated field would break its
//! order). A byte key's field is its first bytes, zero-padded and big-endian (up to 16, sized
//! so the composite stays within 128 bits where the keys before it leave room for 8); a wide
//! fixed key keeps its high value bits. The prefix composite is *monotone*: a row that sorts
//! before another never has a larger composite, so a row whose composite exceeds the k-th
//! candidate's can never win, and only rows that tie it need the full comparison
//! ([`crate::select::prefix`]; over a whole table on the GPU, [`crate::select::table`], whose
//! program reads a string's bytes as its [`prefix_words`]). [`KeyLayout::exact`] tells the two
//! kinds apart.
//!
//! A byte key whose values are all short is exact after all: where every value of a column is
//! at most 16 bytes and none ends in a zero byte ([`short_bytes`], known for an in-memory
//! table at planning), its zero-padded prefix is the whole value, and
//! [`KeyLayout::with_short_bytes`] lays it out as a field of all its bytes.

use std::ops::{BitAnd, BitOr, Not};

use datafusion::arrow::array::{Array, ArrayRef, ArrowPrimitiveType, AsArray};
use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal32Type, Decimal64Type, Decimal128Type, Decimal256Type,
    DurationMicrosecondType, DurationMillisecondType, DurationNanosecondType, DurationSecondType,
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
    Time32MillisecondType, Time32SecondType, Time64MicrosecondType, Time64NanosecondType, TimeUnit,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use datafusion::arrow::row::SortField;
use datafusion::error::{DataFusionError, Result};

#[cfg(test)]
mod tests;

/// The most bits a composite key may have.
pub(crate) const MAX_KEY_BITS: u32 = 256;

/// One sort key: its type and its SQL ordering options.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeySpec {
    /// Type of the key column (after any expression evaluation).
    pub data_type: DataType,
    /// `DESC` when true.
    pub descending: bool,
    /// `NULLS FIRST` when true, `NULLS LAST` otherwise.
    pub nulls_first: bool,
    /// Whether the column may hold NULLs; only then does the key spend a null bit.
    pub nullable: bool,
}

impl KeySpec {
    /// A key of `data_type` ordered by arrow's `SortOptions`.
    pub fn new(data_type: DataType, options: SortOptions, nullable: bool) -> Self {
        Self {
            data_type,
            descending: options.descending,
            nulls_first: options.nulls_first,
            nullable,
        }
    }

    /// Number of value bits (null bit excluded); `None` when the type is not supported.
    pub fn value_bits(&self) -> Option<u32> {
        Native::for_data_type(&self.data_type).map(Native::bits)
    }

    /// Number of bits of this key's field in the composite: value bits plus one null bit when
    /// nullable; `None` when the type is not supported.
    pub fn bits(&self) -> Option<u32> {
        self.value_bits().map(|b| b + u32::from(self.nullable))
    }

    /// Whether the key is compared byte by byte (strings, binary, dictionaries of them,
    /// `Decimal256`): only a prefix layout takes it.
    pub fn by_bytes(&self) -> bool {
        bytes_type(&self.data_type)
    }

    /// arrow's `SortOptions` of the key.
    pub fn options(&self) -> SortOptions {
        SortOptions {
            descending: self.descending,
            nulls_first: self.nulls_first,
        }
    }

    /// Whether a column of this key may be compared with a threshold value by arrow's
    /// comparison kernels (and so by a predicate) in the key's own order: not floats, whose
    /// NaNs and zeros those order otherwise than the sort does, nor dictionaries, whose
    /// comparison with a literal DataFusion may not plan.
    pub fn compares_with_threshold(&self) -> bool {
        !self.data_type.is_floating() && !matches!(self.data_type, DataType::Dictionary(..))
    }
}

/// Types compared byte by byte, whose composite field is a prefix of their bytes.
fn bytes_type(data_type: &DataType) -> bool {
    use DataType::*;
    match data_type {
        Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView | FixedSizeBinary(_)
        | Decimal256(..) => true,
        Dictionary(_, values) => matches!(
            values.as_ref(),
            Utf8 | LargeUtf8 | Utf8View | Binary | LargeBinary | BinaryView
        ),
        _ => false,
    }
}

/// How one key is written into the composite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// All of its value bits.
    Whole,
    /// Its high value bits: `dropped` low bits are left out.
    High { dropped: u32 },
    /// Its first `bytes` bytes, zero-padded, big-endian.
    Bytes { bytes: u32 },
    /// All of its bytes, as [`Part::Bytes`]: every value is at most `bytes` long and none
    /// ends in a zero byte ([`short_bytes`]), so equal fields mean equal values.
    AllBytes { bytes: u32 },
}

/// The most prefix bytes a byte key's field takes (one `u128`).
pub(crate) const MAX_PREFIX_BYTES: u32 = 16;

pub use crate::device::plan::{KeyWidth, Native};
pub use crate::device::u256::U256;

/// How the sort keys of one query pack into a composite integer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLayout {
    specs: Vec<KeySpec>,
    total_bits: u32,
    /// Per key in the composite (the leading keys; all of them in an exact layout).
    parts: Vec<Part>,
    /// Per key in the composite: value bits kept (null bit excluded).
    value_bits: Vec<u32>,
    /// Per key in the composite: offset of the field's lowest bit.
    shifts: Vec<u32>,
}

impl KeyLayout {
    /// Lays out `specs` (key 0 most significant). `Err` carries a reason fit for `EXPLAIN` when
    /// a key's type is not supported, there are no keys, or the keys need more than
    /// [`MAX_KEY_BITS`] bits. Keys are numbered from 1 in the reason, in `ORDER BY` order.
    pub fn try_new(specs: Vec<KeySpec>) -> std::result::Result<Self, String> {
        if specs.is_empty() {
            return Err("the GPU top-k needs at least one sort key".to_string());
        }
        let mut value_bits = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            match spec.value_bits() {
                Some(b) => value_bits.push(b),
                None => return Err(unsupported_reason(i, &spec.data_type)),
            }
        }
        let field_bits: Vec<u32> = specs
            .iter()
            .zip(&value_bits)
            .map(|(s, b)| b + u32::from(s.nullable))
            .collect();
        let total_bits: u32 = field_bits.iter().sum();
        if total_bits > MAX_KEY_BITS {
            let parts: Vec<String> = field_bits
                .iter()
                .enumerate()
                .map(|(i, b)| format!("key {}: {b}", i + 1))
                .collect();
            return Err(format!(
                "sort keys need {total_bits} bits ({}), more than the GPU top-k's \
                 {MAX_KEY_BITS}-bit limit",
                parts.join(", ")
            ));
        }
        let parts = vec![Part::Whole; specs.len()];
        Ok(Self::placed(specs, parts, value_bits))
    }

    /// Lays out `specs` exactly where [`try_new`](Self::try_new) can, else as a prefix layout
    /// (see the module documentation). `Err` carries a reason fit for `EXPLAIN` when a key's
    /// type is neither fixed-width nor compared by bytes, or there are no keys.
    pub fn with_prefixes(specs: Vec<KeySpec>) -> std::result::Result<Self, String> {
        if specs.is_empty() {
            return Err("the GPU top-k needs at least one sort key".to_string());
        }
        if let Some((i, spec)) =
            (specs.iter().enumerate()).find(|(_, s)| s.value_bits().is_none() && !s.by_bytes())
        {
            return Err(unsupported_reason(i, &spec.data_type));
        }
        if !specs.iter().any(KeySpec::by_bytes)
            && let Ok(exact) = Self::try_new(specs.clone())
        {
            return Ok(exact);
        }
        let (mut parts, mut value_bits, mut used) = (Vec::new(), Vec::new(), 0u32);
        for spec in &specs {
            let null = u32::from(spec.nullable);
            match spec.value_bits() {
                Some(v) if used + null + v <= MAX_KEY_BITS => {
                    parts.push(Part::Whole);
                    value_bits.push(v);
                    used += null + v;
                }
                Some(v) => {
                    let kept = MAX_KEY_BITS.saturating_sub(used + null);
                    if kept > 0 {
                        parts.push(Part::High { dropped: v - kept });
                        value_bits.push(kept);
                    }
                    break;
                }
                None => {
                    let cap = if used + null + 64 <= 128 {
                        128
                    } else {
                        MAX_KEY_BITS
                    };
                    let bytes = (cap.saturating_sub(used + null) / 8).min(MAX_PREFIX_BYTES);
                    if bytes > 0 {
                        parts.push(Part::Bytes { bytes });
                        value_bits.push(8 * bytes);
                    }
                    break;
                }
            }
        }
        Ok(Self::placed(specs, parts, value_bits))
    }

    /// An exact layout where every byte key has a known short length: `short[i]` is
    /// [`short_bytes`] of key `i`'s values, and a byte key's field holds all of its bytes.
    /// `None` where a byte key's length is not known or the fields need more than
    /// [`MAX_KEY_BITS`] bits.
    pub fn with_short_bytes(specs: Vec<KeySpec>, short: &[Option<u32>]) -> Option<Self> {
        let (mut parts, mut value_bits, mut used) = (Vec::new(), Vec::new(), 0u32);
        for (i, spec) in specs.iter().enumerate() {
            let (part, bits) = match (spec.value_bits(), short.get(i).copied().flatten()) {
                (Some(bits), _) => (Part::Whole, bits),
                (None, Some(bytes)) if spec.by_bytes() && bytes <= MAX_PREFIX_BYTES => {
                    // An empty field would have no bits: one byte holds the empty value.
                    let bytes = bytes.max(1);
                    (Part::AllBytes { bytes }, 8 * bytes)
                }
                _ => return None,
            };
            used += bits + u32::from(spec.nullable);
            parts.push(part);
            value_bits.push(bits);
        }
        (used <= MAX_KEY_BITS).then(|| Self::placed(specs, parts, value_bits))
    }

    /// The layout of the leading `parts.len()` keys, `value_bits` kept of each.
    fn placed(specs: Vec<KeySpec>, parts: Vec<Part>, value_bits: Vec<u32>) -> Self {
        let field_bits: Vec<u32> = (specs.iter().zip(&value_bits))
            .map(|(s, b)| b + u32::from(s.nullable))
            .collect();
        let total_bits: u32 = field_bits.iter().sum();
        let mut shifts = vec![0; field_bits.len()];
        let mut shift = total_bits;
        for (s, b) in shifts.iter_mut().zip(&field_bits) {
            shift -= b;
            *s = shift;
        }
        Self {
            specs,
            total_bits,
            parts,
            value_bits,
            shifts,
        }
    }

    /// Whether the composite holds every key in full: equal composites then mean equal keys.
    /// A prefix layout's composite is only monotone (see the module documentation).
    pub fn exact(&self) -> bool {
        self.parts.len() == self.specs.len()
            && (self.parts.iter()).all(|p| matches!(p, Part::Whole | Part::AllBytes { .. }))
    }

    /// For EXPLAIN, in a prefix layout: which keys the composite holds in part, and how.
    pub fn prefix_note(&self) -> Option<String> {
        if self.exact() {
            return None;
        }
        let last = self.parts.len() - 1;
        let cut = match self.parts[last] {
            Part::Bytes { bytes } => format!("sort key {} by its first {bytes} bytes", last + 1),
            Part::High { dropped } => {
                let kept = self.value_bits[last];
                let of = kept + dropped;
                format!("sort key {} by its high {kept} of {of} bits", last + 1)
            }
            Part::Whole | Part::AllBytes { .. } if self.parts.len() < self.specs.len() => {
                format!("sort keys 1..={} in full", self.parts.len())
            }
            Part::Whole | Part::AllBytes { .. } => unreachable!("an inexact layout cuts a key"),
        };
        Some(format!(
            "the composite holds {cut}; ties there are compared in full on the host"
        ))
    }

    /// Keys with a field in the composite: all of them in an exact layout, the leading ones
    /// up to the truncated field in a prefix layout.
    pub fn composite_keys(&self) -> usize {
        self.parts.len()
    }

    /// Bits of key `key`'s field value (null bit excluded): its type's value bits, or what a
    /// prefix layout keeps of it. Panics if the key has no field.
    pub fn field_value_bits(&self, key: usize) -> u32 {
        self.value_bits[key]
    }

    /// The bytes of key `key` its field holds, where that field is a prefix of a byte key's
    /// bytes; `None` for a fixed-width field and for a key without one.
    pub fn prefix_bytes(&self, key: usize) -> Option<u32> {
        match self.parts.get(key) {
            Some(Part::Bytes { bytes } | Part::AllBytes { bytes }) => Some(*bytes),
            _ => None,
        }
    }

    /// The low value bits of key `key` its field leaves out: non-zero where the field holds
    /// only the high bits of a fixed-width key.
    pub fn dropped_bits(&self, key: usize) -> u32 {
        match self.parts.get(key) {
            Some(Part::High { dropped }) => *dropped,
            _ => 0,
        }
    }

    /// arrow's row-format fields of the keys: DataFusion's own comparison of whole keys.
    pub fn sort_fields(&self) -> Vec<SortField> {
        (self.specs.iter())
            .map(|s| SortField::new_with_options(s.data_type.clone(), s.options()))
            .collect()
    }

    /// The keys, most significant first.
    pub fn specs(&self) -> &[KeySpec] {
        &self.specs
    }

    /// Sum of the keys' field bits; composites are `< 2^total_bits`.
    pub fn total_bits(&self) -> u32 {
        self.total_bits
    }

    /// The narrowest key width that holds `total_bits`.
    pub fn width(&self) -> KeyWidth {
        KeyWidth::for_total_bits(self.total_bits)
    }

    /// Offset of the lowest bit of key `key`'s field in the composite (the last key is at 0).
    /// Panics if `key` is out of range.
    pub fn field_shift(&self, key: usize) -> u32 {
        self.shifts[key]
    }

    /// Encodes one batch: `columns[i]` holds key `i`, all columns of the same length. Errors
    /// (never panics) on a column count, length or type that does not match the layout, and on
    /// NULLs in a key declared not nullable.
    pub fn encode(&self, columns: &[ArrayRef]) -> Result<EncodedKeys> {
        let mut out = EncodedKeys::new(self.width());
        self.encode_into(columns, &mut out)?;
        Ok(out)
    }

    /// [`encode`](Self::encode) into `out`, reusing its allocation when its width matches the
    /// layout's (a fresh vector per batch costs page faults comparable to the encoding itself).
    /// On error `out`'s contents are unspecified.
    pub fn encode_into(&self, columns: &[ArrayRef], out: &mut EncodedKeys) -> Result<()> {
        if columns.len() != self.specs.len() {
            return Err(exec_error(format!(
                "key encoding expects {} columns, got {}",
                self.specs.len(),
                columns.len()
            )));
        }
        let n = columns[0].len();
        if let Some((i, c)) = columns.iter().enumerate().find(|(_, c)| c.len() != n) {
            return Err(exec_error(format!(
                "key column {} has {} rows, key column 1 has {n}",
                i + 1,
                c.len()
            )));
        }
        if out.width() != self.width().host() {
            *out = EncodedKeys::new(self.width());
        }
        match out {
            EncodedKeys::W64(v) => self.encode_as(columns, n, v),
            EncodedKeys::W128(v) => self.encode_as(columns, n, v),
            EncodedKeys::W256(v) => self.encode_as(columns, n, v),
        }
    }

    fn encode_as<C: Container>(
        &self,
        columns: &[ArrayRef],
        n: usize,
        out: &mut Vec<C>,
    ) -> Result<()> {
        out.clear();
        out.resize(n, C::default());
        for (i, part) in self.parts.iter().enumerate() {
            let field = Field::new(&self.specs[i], self.value_bits[i], self.shifts[i]);
            encode_column_into(i, &self.specs[i], *part, &field, columns[i].as_ref(), out)?;
        }
        Ok(())
    }
}

/// Whether the device reads a column of `data_type` as its prefix words
/// ([`prefix_words`]): every type compared by bytes (strings, binary, dictionaries of them,
/// `Decimal256`).
pub(crate) fn has_prefix_words(data_type: &DataType) -> bool {
    bytes_type(data_type)
}

/// The longest value of a string or binary column (or a dictionary of them), where every
/// value is at most [`MAX_PREFIX_BYTES`] long and none ends in a zero byte: then a value's
/// zero-padded prefix word is the value itself, equal words meaning equal values. `None`
/// otherwise, and for other types. NULL slots are not looked at; a dictionary's entries all
/// are, used or not.
pub(crate) fn short_bytes(array: &dyn Array) -> Option<u32> {
    fn longest<'a, V: AsRef<[u8]> + ?Sized + 'a>(
        values: impl Iterator<Item = Option<&'a V>>,
    ) -> Option<u32> {
        let mut longest = 0;
        for value in values.flatten() {
            let value = value.as_ref();
            if value.len() > PREFIX_WORD_BYTES || value.last() == Some(&0) {
                return None;
            }
            longest = longest.max(value.len());
        }
        Some(longest as u32)
    }
    use DataType::*;
    match array.data_type() {
        Utf8 => longest(array.as_string::<i32>().iter()),
        LargeUtf8 => longest(array.as_string::<i64>().iter()),
        Utf8View => longest(array.as_string_view().iter()),
        Binary => longest(array.as_binary::<i32>().iter()),
        LargeBinary => longest(array.as_binary::<i64>().iter()),
        BinaryView => longest(array.as_binary_view().iter()),
        Dictionary(..) => short_bytes(array.as_any_dictionary().values().as_ref()),
        _ => None,
    }
}

/// Each row's first [`MAX_PREFIX_BYTES`] bytes, zero-padded, as a big-endian `u128` (0 for a
/// NULL row): the device's image of a string or binary column, from which a prefix layout's
/// field takes its leading bytes. A string that is a prefix of another, or that ends in zero
/// bytes, may tie it here; the full comparison settles those ties.
pub(crate) fn prefix_words(array: &dyn Array) -> Result<Vec<u128>> {
    let mut bytes = vec![0u8; PREFIX_WORD_BYTES * array.len()];
    write_prefix_words(array, &mut bytes)?;
    Ok((bytes.chunks_exact(PREFIX_WORD_BYTES))
        .map(|w| u128::from_le_bytes(w.try_into().expect("16 bytes")))
        .collect())
}

/// Bytes of one prefix word.
pub(crate) const PREFIX_WORD_BYTES: usize = MAX_PREFIX_BYTES as usize;

/// [`prefix_words`] as the device holds them: each word's little-endian bytes, into `out`
/// (16 bytes a row of `array`).
pub(crate) fn write_prefix_words(array: &dyn Array, out: &mut [u8]) -> Result<()> {
    fn write<'a>(out: &mut [u8], value: impl Fn(usize) -> &'a [u8]) {
        for (i, slot) in out.chunks_exact_mut(PREFIX_WORD_BYTES).enumerate() {
            let bytes = value(i);
            let mut word = [0u8; PREFIX_WORD_BYTES];
            let m = bytes.len().min(PREFIX_WORD_BYTES);
            word[..m].copy_from_slice(&bytes[..m]);
            slot.copy_from_slice(&u128::from_be_bytes(word).to_le_bytes());
        }
    }
    if out.len() != PREFIX_WORD_BYTES * array.len() {
        return Err(exec_error(format!(
            "{} bytes for the prefix words of {} rows",
            out.len(),
            array.len()
        )));
    }
    match array.data_type() {
        DataType::Utf8 => {
            let a = array.as_string::<i32>();
            write(out, |i| a.value(i).as_bytes())
        }
        DataType::LargeUtf8 => {
            let a = array.as_string::<i64>();
            write(out, |i| a.value(i).as_bytes())
        }
        DataType::Utf8View => {
            let a = array.as_string_view();
            write(out, |i| a.value(i).as_bytes())
        }
        DataType::Binary => {
            let a = array.as_binary::<i32>();
            write(out, |i| a.value(i))
        }
        DataType::LargeBinary => {
            let a = array.as_binary::<i64>();
            write(out, |i| a.value(i))
        }
        DataType::BinaryView => {
            let a = array.as_binary_view();
            write(out, |i| a.value(i))
        }
        DataType::FixedSizeBinary(_) => {
            let a = array.as_fixed_size_binary();
            write(out, |i| a.value(i))
        }
        DataType::Decimal256(..) => {
            let a = array.as_primitive::<Decimal256Type>();
            for (v, slot) in (a.values().iter()).zip(out.chunks_exact_mut(PREFIX_WORD_BYTES)) {
                // Big-endian two's complement with the sign bit flipped orders as bytes.
                let mut be = v.to_be_bytes();
                be[0] ^= 0x80;
                let word: [u8; PREFIX_WORD_BYTES] = be[..PREFIX_WORD_BYTES].try_into().unwrap();
                slot.copy_from_slice(&u128::from_be_bytes(word).to_le_bytes());
            }
        }
        DataType::Dictionary(..) => {
            // Each dictionary value's word once, then one copy a row.
            let dictionary = array.as_any_dictionary();
            let values = dictionary.values();
            if values.is_empty() {
                out.fill(0); // every row is NULL
                return Ok(());
            }
            let mut words = vec![0u8; PREFIX_WORD_BYTES * values.len()];
            write_prefix_words(values.as_ref(), &mut words)?;
            for (k, slot) in (dictionary.normalized_keys().into_iter())
                .zip(out.chunks_exact_mut(PREFIX_WORD_BYTES))
            {
                // A NULL key may hold any index; its word is cleared below.
                if let Some(word) = words.get(PREFIX_WORD_BYTES * k..PREFIX_WORD_BYTES * (k + 1)) {
                    slot.copy_from_slice(word);
                }
            }
        }
        other => {
            return Err(exec_error(format!(
                "the device reads no prefix words of {other} columns"
            )));
        }
    };
    // A dictionary's row is NULL where its key or its value is.
    if let Some(nulls) = array.logical_nulls() {
        for i in (0..array.len()).filter(|&i| nulls.is_null(i)) {
            out[PREFIX_WORD_BYTES * i..PREFIX_WORD_BYTES * (i + 1)].fill(0);
        }
    }
    Ok(())
}

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
        return Err(exec_error(unsupported_reason(0, &spec.data_type)));
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

fn unsupported_reason(key: usize, data_type: &DataType) -> String {
    format!(
        "sort key {} has type {data_type}, which the GPU top-k does not support",
        key + 1
    )
}

fn exec_error(message: String) -> DataFusionError {
    DataFusionError::Execution(message)
}

/// A native value's ascending value bits (zero-extended), see the module table.
trait OrderedBits: Copy {
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

/// A composite container (`u64`, `u128`, [`U256`]).
trait Container:
    Copy + Default + BitOr<Output = Self> + BitAnd<Output = Self> + Not<Output = Self>
{
    /// `v << shift`, general and slow-ish: for loop-invariant constants. Callers guarantee the
    /// result fits.
    fn place(v: u128, shift: u32) -> Self;

    /// Runs `body` with the cheapest placer for `value_bits` value bits at `shift`. A variable
    /// shift of a `u128`/`U256` is a branchy multi-instruction sequence per row; most fields
    /// have ≤ 64 value bits inside one 64-bit word, where a plain `u64` shift does (about
    /// twice as fast in the per-row loop).
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output;
}

/// Moves a field's value bits (in the low bits of `v`) to their place in the container.
trait Placer<C>: Copy {
    fn place(self, v: u128) -> C;
}

/// A loop generic over the placer chosen at run time (a generic closure, in effect).
trait PlacerBody<C> {
    type Output;
    fn run<P: Placer<C>>(self, placer: P) -> Self::Output;
}

/// `u64` container: a plain shift.
#[derive(Clone, Copy)]
struct Shl64(u32);

impl Placer<u64> for Shl64 {
    #[inline(always)]
    fn place(self, v: u128) -> u64 {
        (v as u64) << self.0
    }
}

impl Container for u64 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        (v as u64) << shift
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, _value_bits: u32, body: B) -> B::Output {
        body.run(Shl64(shift))
    }
}

/// `u128` container, field within bits 0..64.
#[derive(Clone, Copy)]
struct LowWord(u32);

impl Placer<u128> for LowWord {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        u128::from((v as u64) << self.0)
    }
}

/// `u128` container, field within bits 64..128 (holds `shift − 64`).
#[derive(Clone, Copy)]
struct HighWord(u32);

impl Placer<u128> for HighWord {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        u128::from((v as u64) << self.0) << 64
    }
}

/// `u128` container, any field.
#[derive(Clone, Copy)]
struct Shl128(u32);

impl Placer<u128> for Shl128 {
    #[inline(always)]
    fn place(self, v: u128) -> u128 {
        v << self.0
    }
}

impl Container for u128 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        v << shift
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output {
        if value_bits <= 64 && shift + value_bits <= 64 {
            body.run(LowWord(shift))
        } else if value_bits <= 64 && shift >= 64 {
            body.run(HighWord(shift - 64))
        } else {
            body.run(Shl128(shift))
        }
    }
}

/// [`U256`] container, field within the low half, placed there by `P`.
#[derive(Clone, Copy)]
struct LowHalf<P>(P);

impl<P: Placer<u128>> Placer<U256> for LowHalf<P> {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256 {
            hi: 0,
            lo: self.0.place(v),
        }
    }
}

/// [`U256`] container, field within the high half, placed there by `P`.
#[derive(Clone, Copy)]
struct HighHalf<P>(P);

impl<P: Placer<u128>> Placer<U256> for HighHalf<P> {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256 {
            hi: self.0.place(v),
            lo: 0,
        }
    }
}

/// [`U256`] container, field straddling the halves.
#[derive(Clone, Copy)]
struct Shl256(u32);

impl Placer<U256> for Shl256 {
    #[inline(always)]
    fn place(self, v: u128) -> U256 {
        U256::shl_u128(v, self.0)
    }
}

/// Adapts a [`U256`] loop to a half's `u128` placer, so the halves reuse the `u128` choice.
struct InHalf<B> {
    body: B,
    high: bool,
}

impl<B: PlacerBody<U256>> PlacerBody<u128> for InHalf<B> {
    type Output = B::Output;

    #[inline(always)]
    fn run<P: Placer<u128>>(self, placer: P) -> B::Output {
        if self.high {
            self.body.run(HighHalf(placer))
        } else {
            self.body.run(LowHalf(placer))
        }
    }
}

impl Container for U256 {
    #[inline(always)]
    fn place(v: u128, shift: u32) -> Self {
        U256::shl_u128(v, shift)
    }

    #[inline(always)]
    fn with_placer<B: PlacerBody<Self>>(shift: u32, value_bits: u32, body: B) -> B::Output {
        if shift + value_bits <= 128 {
            u128::with_placer(shift, value_bits, InHalf { body, high: false })
        } else if shift >= 128 {
            u128::with_placer(shift - 128, value_bits, InHalf { body, high: true })
        } else {
            body.run(Shl256(shift))
        }
    }
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
struct Field<C> {
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
    fn new(spec: &KeySpec, value_bits: u32, shift: u32) -> Self {
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
fn encode_column_into<C: Container>(
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

/// One type dispatch per column, then a monomorphised loop.
fn encode_values<C: Container>(
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

#[inline(always)]
fn run_column<I, C>(field: &Field<C>, values: I, out: &mut [C])
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

/// The first `bytes` bytes of `value`, zero-padded, as a big-endian integer of `bytes` bytes.
#[inline(always)]
fn prefix_of(value: &[u8], bytes: usize) -> u128 {
    let mut buf = [0u8; 16];
    let n = value.len().min(bytes);
    buf[..n].copy_from_slice(&value[..n]);
    u128::from_be_bytes(buf) >> (128 - 8 * bytes)
}

/// Each row's [`prefix_of`] its bytes (0 under NULL slots, which are patched afterwards).
fn byte_prefixes(key: usize, spec: &KeySpec, array: &dyn Array, bytes: usize) -> Result<Vec<u128>> {
    fn each<'a, V: AsRef<[u8]> + ?Sized + 'a>(
        values: impl Iterator<Item = Option<&'a V>>,
        bytes: usize,
    ) -> Vec<u128> {
        values
            .map(|v| v.map_or(0, |v| prefix_of(v.as_ref(), bytes)))
            .collect()
    }
    use DataType::*;
    let wrong = || downcast_error(key, spec);
    Ok(match array.data_type() {
        Utf8 => each(
            array.as_string_opt::<i32>().ok_or_else(wrong)?.iter(),
            bytes,
        ),
        LargeUtf8 => each(
            array.as_string_opt::<i64>().ok_or_else(wrong)?.iter(),
            bytes,
        ),
        Utf8View => each(array.as_string_view_opt().ok_or_else(wrong)?.iter(), bytes),
        Binary => each(
            array.as_binary_opt::<i32>().ok_or_else(wrong)?.iter(),
            bytes,
        ),
        LargeBinary => each(
            array.as_binary_opt::<i64>().ok_or_else(wrong)?.iter(),
            bytes,
        ),
        BinaryView => each(array.as_binary_view_opt().ok_or_else(wrong)?.iter(), bytes),
        FixedSizeBinary(_) => each(
            array.as_fixed_size_binary_opt().ok_or_else(wrong)?.iter(),
            bytes,
        ),
        Decimal256(..) => {
            let array = array
                .as_primitive_opt::<Decimal256Type>()
                .ok_or_else(wrong)?;
            (array.values().iter())
                .map(|v| {
                    // Big-endian two's complement with the sign bit flipped orders as bytes.
                    let mut be = v.to_be_bytes();
                    be[0] ^= 0x80;
                    prefix_of(&be, bytes)
                })
                .collect()
        }
        Dictionary(..) => {
            let dictionary = array.as_any_dictionary_opt().ok_or_else(wrong)?;
            if dictionary.values().is_empty() {
                return Ok(vec![0; array.len()]); // every row is NULL
            }
            let values = byte_prefixes(key, spec, dictionary.values().as_ref(), bytes)?;
            (dictionary.normalized_keys().into_iter())
                .map(|k| values.get(k).copied().unwrap_or(0))
                .collect()
        }
        _ => return Err(wrong()),
    })
}

fn downcast_error(key: usize, spec: &KeySpec) -> DataFusionError {
    exec_error(format!(
        "key column {} could not be read as {}",
        key + 1,
        spec.data_type
    ))
}
