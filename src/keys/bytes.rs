//! Byte keys (strings, binary, dictionaries of them, `Decimal256`): their prefix field in the
//! composite, and their prefix words, the device's image of such a column.

use datafusion::arrow::array::{Array, AsArray};
use datafusion::arrow::datatypes::{DataType, Decimal256Type};
use datafusion::error::Result;

use super::layout::MAX_PREFIX_BYTES;
use super::spec::bytes_type;
use super::{KeySpec, downcast_error, exec_error};

/// Whether the device reads a column of `data_type` as its prefix words
/// ([`prefix_words`]): every type compared by bytes (strings, binary, dictionaries of them,
/// `Decimal256`).
pub(crate) fn has_prefix_words(data_type: &DataType) -> bool {
    bytes_type(data_type)
}

/// The most distinct values [`distinct_prefixes`] keeps: a key with more is not worth the
/// memory, and its prefixes rarely tell all its values apart.
pub(crate) const MAX_DISTINCT_PREFIXES: usize = 1 << 12;

/// Each distinct value of a string or binary column (or a dictionary's entries) under its
/// zero-padded prefix word, where no two distinct values share one (then comparing prefix
/// words orders the values as comparing their bytes does, and equal words mean equal values,
/// however long the values are); `None` where two do, where there are more than
/// [`MAX_DISTINCT_PREFIXES`], and for other types. NULL slots are not looked at.
pub(crate) fn distinct_prefixes(array: &dyn Array) -> Option<DistinctPrefixes> {
    fold_values(array, DistinctPrefixes::default(), |mut seen, value| {
        seen.insert(value)?;
        Some(seen)
    })
}

/// `f` folded over the non-NULL values of a string or binary column (a dictionary's entries,
/// all of them, used or not), from `init`; `None` where `f` gives `None`, and for other types.
fn fold_values<T>(array: &dyn Array, init: T, f: impl FnMut(T, &[u8]) -> Option<T>) -> Option<T> {
    match array.as_any_dictionary_opt() {
        Some(dictionary) => fold_plain(dictionary.values().as_ref(), init, f),
        None => fold_plain(array, init, f),
    }
}

/// [`fold_values`] over a column that is not a dictionary.
fn fold_plain<T>(array: &dyn Array, init: T, f: impl FnMut(T, &[u8]) -> Option<T>) -> Option<T> {
    fn fold<'a, V: AsRef<[u8]> + ?Sized + 'a, T>(
        values: impl Iterator<Item = Option<&'a V>>,
        init: T,
        mut f: impl FnMut(T, &[u8]) -> Option<T>,
    ) -> Option<T> {
        values
            .flatten()
            .try_fold(init, |acc, value| f(acc, value.as_ref()))
    }
    use DataType::*;
    match array.data_type() {
        Utf8 => fold(array.as_string::<i32>().iter(), init, f),
        LargeUtf8 => fold(array.as_string::<i64>().iter(), init, f),
        Utf8View => fold(array.as_string_view().iter(), init, f),
        Binary => fold(array.as_binary::<i32>().iter(), init, f),
        LargeBinary => fold(array.as_binary::<i64>().iter(), init, f),
        BinaryView => fold(array.as_binary_view().iter(), init, f),
        _ => None,
    }
}

/// Distinct values by their prefix words ([`distinct_prefixes`]).
#[derive(Debug, Default)]
pub(crate) struct DistinctPrefixes {
    values: std::collections::HashMap<[u8; PREFIX_WORD_BYTES], Box<[u8]>>,
}

impl DistinctPrefixes {
    /// Adds `value`; `None` where another value has its prefix word, or past
    /// [`MAX_DISTINCT_PREFIXES`] values.
    fn insert(&mut self, value: &[u8]) -> Option<()> {
        let mut word = [0u8; PREFIX_WORD_BYTES];
        let n = value.len().min(PREFIX_WORD_BYTES);
        word[..n].copy_from_slice(&value[..n]);
        match self.values.get(&word) {
            Some(held) => (held.as_ref() == value).then_some(()),
            None if self.values.len() >= MAX_DISTINCT_PREFIXES => None,
            None => {
                self.values.insert(word, value.into());
                Some(())
            }
        }
    }

    /// Both sets' values, where they still tell every value apart.
    pub(crate) fn merge(mut self, other: DistinctPrefixes) -> Option<DistinctPrefixes> {
        for value in other.values.into_values() {
            self.insert(&value)?;
        }
        Some(self)
    }
}

/// The longest value of a string or binary column (or a dictionary of them), where every
/// value is at most [`MAX_PREFIX_BYTES`] long and none ends in a zero byte: then a value's
/// zero-padded prefix word is the value itself, equal words meaning equal values. `None`
/// otherwise, and for other types. NULL slots are not looked at; a dictionary's entries all
/// are, used or not.
pub(crate) fn short_bytes(array: &dyn Array) -> Option<u32> {
    fold_values(array, 0u32, |longest, value| {
        let short = value.len() <= PREFIX_WORD_BYTES && value.last() != Some(&0);
        short.then(|| longest.max(value.len() as u32))
    })
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

/// The first `bytes` bytes of `value`, zero-padded, as a big-endian integer of `bytes` bytes.
#[inline(always)]
fn prefix_of(value: &[u8], bytes: usize) -> u128 {
    let mut buf = [0u8; 16];
    let n = value.len().min(bytes);
    buf[..n].copy_from_slice(&value[..n]);
    u128::from_be_bytes(buf) >> (128 - 8 * bytes)
}

/// Each row's [`prefix_of`] its bytes (0 under NULL slots, which are patched afterwards).
pub(super) fn byte_prefixes(
    key: usize,
    spec: &KeySpec,
    array: &dyn Array,
    bytes: usize,
) -> Result<Vec<u128>> {
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
