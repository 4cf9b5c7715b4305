//! A string column's order-preserving codes: the device image a group key of strings is
//! aggregated by ([`super::ColumnImage::Codes`]).
//!
//! Each row's code is the rank of its value among the column's distinct values in byte order
//! (DataFusion's order of strings), as an i64: equal strings get equal codes and codes sort
//! as their strings, so grouping and ordering by the codes is grouping and ordering by the
//! strings, exactly. The host keeps the distinct values (the *dictionary*) and maps the few
//! chosen groups' codes back to their strings.
//!
//! Interning reads every row once on the host's cores (each piece of rows' distinct values
//! sorted, the pieces' lists merged pairwise, then each row's code), when the image is
//! uploaded. The dictionary is kept
//! beside the device image, under its cache key, for the next query's output; the kept entry
//! holds the host buffers the key's addresses name, so that a key is never reused for other
//! strings while its dictionary is kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Int64Array, LargeStringArray, StringArray, StringViewArray,
};
use datafusion::arrow::buffer::Buffer;
use datafusion::arrow::compute::take;
use datafusion::arrow::datatypes::DataType;
use datafusion::error::{DataFusionError, Result};

use super::strings::on_cores;
use crate::device::GpuError;
use crate::device::column_cache::CacheKey;
use crate::fusion::is_device_string;

/// Dictionaries kept at once: one per string key column of the tables queried last.
const KEPT: usize = 8;

/// A column's codes and its dictionary.
#[derive(Debug)]
pub(crate) struct Interned {
    /// The distinct non-NULL values in byte order, of the column's type.
    pub dictionary: ArrayRef,
    /// Each row's code (0 where the row is NULL), chunk after chunk.
    pub codes: Vec<i64>,
}

/// The byte values of one chunk (`None`: NULL).
fn values(chunk: &dyn Array) -> Result<Vec<Option<&[u8]>>> {
    fn bytes(v: Option<&str>) -> Option<&[u8]> {
        v.map(str::as_bytes)
    }
    Ok(match chunk.data_type() {
        DataType::Utf8 => chunk.as_string::<i32>().iter().map(bytes).collect(),
        DataType::LargeUtf8 => chunk.as_string::<i64>().iter().map(bytes).collect(),
        DataType::Utf8View => chunk.as_string_view().iter().map(bytes).collect(),
        t => {
            return Err(DataFusionError::Execution(format!(
                "no codes of {t} columns"
            )));
        }
    })
}

/// Rows of a piece interned on one core (slices share the chunk's buffers, so that a few
/// large chunks still spread over the cores).
const PIECE_ROWS: usize = 1 << 19;

/// One piece's rows as local ids (`u32::MAX`: NULL) into its distinct values, sorted.
struct Piece<'a> {
    ids: Vec<u32>,
    distinct: Vec<&'a [u8]>,
}

/// `rows`' local ids into their distinct values, and those values sorted (the ids renamed
/// to their rank among them).
fn piece<'a>(rows: &[Option<&'a [u8]>]) -> Piece<'a> {
    let mut seen: HashMap<&[u8], u32> = HashMap::new();
    let mut distinct = Vec::new();
    let mut ids: Vec<u32> = (rows.iter())
        .map(|v| match v {
            None => u32::MAX,
            Some(v) => *seen.entry(*v).or_insert_with(|| {
                distinct.push(*v);
                distinct.len() as u32 - 1
            }),
        })
        .collect();
    let mut order: Vec<u32> = (0..distinct.len() as u32).collect();
    order.sort_unstable_by_key(|&i| distinct[i as usize]);
    let mut rank = vec![0u32; distinct.len()];
    for (r, &i) in order.iter().enumerate() {
        rank[i as usize] = r as u32;
    }
    for id in ids.iter_mut().filter(|id| **id != u32::MAX) {
        *id = rank[*id as usize];
    }
    let distinct = order.iter().map(|&i| distinct[i as usize]).collect();
    Piece { ids, distinct }
}

/// Two sorted lists of distinct values merged into one, without repeats.
fn merge<'a>(a: Vec<&'a [u8]>, b: Vec<&'a [u8]>) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// The codes and dictionary of the column whose chunks are `chunks` (all of one string type),
/// interned on the host's cores: each piece's distinct values sorted, the pieces' lists
/// merged pairwise into the dictionary, each piece's values found in it, each row's code
/// looked up.
pub(crate) fn intern(chunks: &[ArrayRef]) -> Result<Interned> {
    let data_type = chunks
        .first()
        .map_or(DataType::Utf8, |c| c.data_type().clone());
    if !is_device_string(&data_type) || chunks.iter().any(|c| *c.data_type() != data_type) {
        return Err(DataFusionError::Execution(format!(
            "no codes of a column of {data_type} chunks"
        )));
    }
    let failed = |e: GpuError| DataFusionError::Execution(e.0);
    let slices: Vec<ArrayRef> = (chunks.iter())
        .flat_map(|c| {
            (0..c.len())
                .step_by(PIECE_ROWS)
                .map(|at| c.slice(at, (c.len() - at).min(PIECE_ROWS)))
        })
        .collect();
    let values: Vec<Vec<Option<&[u8]>>> = on_cores(slices.iter().collect(), |c| {
        values(c.as_ref()).map_err(|e| GpuError(e.to_string()))
    })
    .map_err(failed)?;
    let pieces: Vec<Piece> =
        on_cores(values.iter().collect(), |rows| Ok(piece(rows))).map_err(failed)?;
    let mut lists: Vec<Vec<&[u8]>> = pieces.iter().map(|p| p.distinct.clone()).collect();
    while lists.len() > 1 {
        let mut pairs = Vec::with_capacity(lists.len().div_ceil(2));
        let mut rest = lists.into_iter();
        while let Some(a) = rest.next() {
            pairs.push((a, rest.next().unwrap_or_default()));
        }
        lists = on_cores(pairs, |(a, b)| Ok(merge(a, b))).map_err(failed)?;
    }
    let sorted = lists.pop().unwrap_or_default();
    let per_piece: Vec<Vec<i64>> = on_cores(pieces.iter().collect(), |p| {
        // The piece's sorted values are an increasing run of the dictionary's.
        let mut global = Vec::with_capacity(p.distinct.len());
        let mut from = 0;
        for v in &p.distinct {
            from += sorted[from..].partition_point(|d| d < v);
            global.push(from as i64);
        }
        Ok((p.ids.iter())
            .map(|&id| match id {
                u32::MAX => 0,
                id => global[id as usize],
            })
            .collect())
    })
    .map_err(failed)?;
    let dictionary: ArrayRef = match data_type {
        DataType::Utf8 => Arc::new(StringArray::from_iter_values(sorted.iter().map(utf8))),
        DataType::LargeUtf8 => {
            Arc::new(LargeStringArray::from_iter_values(sorted.iter().map(utf8)))
        }
        _ => Arc::new(StringViewArray::from_iter_values(sorted.iter().map(utf8))),
    };
    Ok(Interned {
        dictionary,
        codes: per_piece.concat(),
    })
}

/// The bytes of a string array's value as the `str` they are.
fn utf8<'a>(bytes: &&'a [u8]) -> &'a str {
    // The bytes are a value of a string array, valid UTF-8.
    std::str::from_utf8(bytes).expect("a string array's value")
}

/// The strings of `codes` (`None`: NULL) in `dictionary`.
pub(crate) fn decode(dictionary: &ArrayRef, codes: &[Option<i64>]) -> Result<ArrayRef> {
    let n = dictionary.len() as i64;
    if let Some(bad) = codes.iter().flatten().find(|&&c| c < 0 || c >= n) {
        return Err(DataFusionError::Execution(format!(
            "code {bad} beyond a dictionary of {n} strings"
        )));
    }
    let indices: Int64Array = codes.iter().copied().collect();
    Ok(take(dictionary.as_ref(), &indices, None)?)
}

/// A kept dictionary: the image's key, the host buffers its addresses name, the dictionary.
type Kept = (CacheKey, Vec<Buffer>, ArrayRef);

static DICTIONARIES: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// Keeps `dictionary` of the codes image whose cache key is `key` (its column's buffers:
/// `owners`), the oldest kept one going where [`KEPT`] are.
pub(crate) fn keep(key: &CacheKey, owners: Vec<Buffer>, dictionary: ArrayRef) {
    let mut kept = DICTIONARIES.lock().unwrap_or_else(|p| p.into_inner());
    kept.retain(|(k, _, _)| k != key);
    if kept.len() >= KEPT {
        kept.remove(0);
    }
    kept.push((key.clone(), owners, dictionary));
}

/// The dictionary kept under `key`, if any.
pub(crate) fn kept(key: &CacheKey) -> Option<ArrayRef> {
    let kept = DICTIONARIES.lock().unwrap_or_else(|p| p.into_inner());
    (kept.iter())
        .find(|(k, _, _)| k == key)
        .map(|(_, _, d)| Arc::clone(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_sort_and_group_as_the_strings() {
        let a: ArrayRef = Arc::new(StringArray::from(vec![
            Some("pear"),
            None,
            Some("apple"),
            Some(""),
        ]));
        let b: ArrayRef = Arc::new(StringArray::from(vec![
            Some("apple"),
            Some("é"),
            Some("pear"),
            None,
            Some("z"),
        ]));
        let interned = intern(&[a, b]).unwrap();
        let dictionary = interned.dictionary.as_string::<i32>();
        let words: Vec<&str> = dictionary.iter().flatten().collect();
        assert_eq!(words, ["", "apple", "pear", "z", "é"]);
        assert_eq!(interned.codes, [2, 0, 1, 0, 1, 4, 2, 0, 3]);
        let back = decode(&interned.dictionary, &[Some(4), None, Some(0)]).unwrap();
        let back: Vec<Option<&str>> = back.as_string::<i32>().iter().collect();
        assert_eq!(back, [Some("é"), None, Some("")]);
        assert!(decode(&interned.dictionary, &[Some(5)]).is_err());
    }

    /// Rows over several pieces and chunks: the codes are the values' ranks.
    #[test]
    fn codes_across_pieces_are_the_values_ranks() {
        let rows = 2 * PIECE_ROWS + 123;
        let value = |i: usize| (!i.is_multiple_of(3)).then(|| format!("v{}", (i * 7919) % 5003));
        let first: Vec<Option<String>> = (0..rows).map(value).collect();
        let second: Vec<Option<String>> = (rows..rows + 1000).map(value).collect();
        let chunks = [
            Arc::new(StringArray::from(first.clone())) as ArrayRef,
            Arc::new(StringArray::from(second.clone())),
        ];
        let interned = intern(&chunks).unwrap();
        let mut distinct: Vec<&String> = first.iter().chain(&second).flatten().collect();
        distinct.sort();
        distinct.dedup();
        let dictionary = interned.dictionary.as_string::<i32>();
        assert_eq!(dictionary.len(), distinct.len());
        assert!((0..distinct.len()).all(|i| dictionary.value(i) == distinct[i]));
        for (row, v) in first.iter().chain(&second).enumerate() {
            let want = v
                .as_ref()
                .map_or(0, |v| distinct.binary_search(&v).unwrap() as i64);
            assert_eq!(interned.codes[row], want, "row {row}");
        }
    }

    #[test]
    fn views_and_large_strings_keep_their_type() {
        for array in [
            Arc::new(StringViewArray::from(vec!["b", "a", "b"])) as ArrayRef,
            Arc::new(LargeStringArray::from(vec!["b", "a", "b"])),
        ] {
            let interned = intern(std::slice::from_ref(&array)).unwrap();
            assert_eq!(interned.dictionary.data_type(), array.data_type());
            assert_eq!(interned.codes, [1, 0, 1]);
        }
        let mixed = [
            Arc::new(StringArray::from(vec!["a"])) as ArrayRef,
            Arc::new(LargeStringArray::from(vec!["a"])),
        ];
        assert!(intern(&mixed).is_err());
    }

    #[test]
    fn a_kept_dictionary_is_found_by_its_key() {
        let key: CacheKey = vec![(usize::MAX - 7, 3)];
        let dictionary: ArrayRef = Arc::new(StringArray::from(vec!["x"]));
        keep(&key, Vec::new(), Arc::clone(&dictionary));
        assert!(Arc::ptr_eq(&kept(&key).unwrap(), &dictionary));
        assert!(kept(&vec![(usize::MAX - 7, 4)]).is_none());
    }
}
