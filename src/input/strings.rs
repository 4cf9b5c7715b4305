//! The host side of string images: their bytes and row ends, prefix words derived on every
//! core.

use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray};
use datafusion::arrow::buffer::Buffer;
use datafusion::error::{DataFusionError, Result};

use crate::device::{GpuError, GpuResult};

/// Bytes a row of a string column's prefix words take on the device.
pub(crate) const PREFIX_BYTES: usize = crate::keys::PREFIX_WORD_BYTES;

/// Bytes of a row's end offset in a string column's bytes image.
pub(crate) const STRING_END_BYTES: usize = 8;

/// The bytes of a string chunk's rows, back to back (borrowed where the array holds them so).
pub(super) fn string_bytes(chunk: &dyn Array) -> Result<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
    ) -> Cow<'_, [u8]> {
        let offsets = strings.value_offsets();
        let (start, end) = (offsets[0].as_usize(), offsets[offsets.len() - 1].as_usize());
        Cow::Borrowed(&strings.value_data()[start..end])
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        return Ok(of_offsets(strings));
    }
    if let Some(strings) = chunk.as_string_opt::<i64>() {
        return Ok(of_offsets(strings));
    }
    if let Some(views) = chunk.as_string_view_opt() {
        // A NULL row's view need not be an empty string's: it takes no bytes.
        let mut bytes = Vec::with_capacity(string_data_len(chunk));
        for i in (0..views.len()).filter(|&i| views.is_valid(i)) {
            bytes.extend_from_slice(views.value(i).as_bytes());
        }
        return Ok(Cow::Owned(bytes));
    }
    Err(DataFusionError::Execution(format!(
        "no string image of {} columns",
        chunk.data_type()
    )))
}

/// Bytes of a string chunk's rows (what [`string_bytes`] gives), without copying them.
pub(super) fn string_data_len(chunk: &dyn Array) -> usize {
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
    ) -> usize {
        let offsets = strings.value_offsets();
        offsets[offsets.len() - 1].as_usize() - offsets[0].as_usize()
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        of_offsets(strings)
    } else if let Some(strings) = chunk.as_string_opt::<i64>() {
        of_offsets(strings)
    } else if let Some(views) = chunk.as_string_view_opt() {
        (0..views.len())
            .filter(|&i| views.is_valid(i))
            .map(|i| views.views()[i] as u32 as usize)
            .sum()
    } else {
        0
    }
}

/// A string chunk's row ends, each from `base` (the bytes of the rows before the chunk).
pub(super) fn string_ends(chunk: &dyn Array, base: i64) -> GpuResult<Vec<i64>> {
    fn of_offsets<O: datafusion::arrow::array::OffsetSizeTrait>(
        strings: &datafusion::arrow::array::GenericStringArray<O>,
        base: i64,
    ) -> Vec<i64> {
        let offsets = strings.value_offsets();
        let start = offsets[0].as_usize() as i64;
        (offsets[1..].iter())
            .map(|o| base + o.as_usize() as i64 - start)
            .collect()
    }
    if let Some(strings) = chunk.as_string_opt::<i32>() {
        return Ok(of_offsets(strings, base));
    }
    if let Some(strings) = chunk.as_string_opt::<i64>() {
        return Ok(of_offsets(strings, base));
    }
    if let Some(views) = chunk.as_string_view_opt() {
        let mut end = base;
        return Ok((views.views().iter().enumerate())
            .map(|(i, view)| {
                if views.is_valid(i) {
                    end += (*view as u32) as i64;
                }
                end
            })
            .collect());
    }
    Err(GpuError(format!(
        "no string image of {} columns",
        chunk.data_type()
    )))
}

/// Rows of string chunks whose prefix words (or row ends) are derived at once (at least one
/// chunk).
const PREFIX_WINDOW_ROWS: usize = 1 << 23;

/// `chunks` in consecutive windows of about [`PREFIX_WINDOW_ROWS`] rows.
pub(super) fn prefix_windows(chunks: &[ArrayRef]) -> Vec<&[ArrayRef]> {
    let mut windows = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, chunk) in chunks.iter().enumerate() {
        if rows > 0 && rows + chunk.len() > PREFIX_WINDOW_ROWS {
            windows.push(&chunks[start..i]);
            (start, rows) = (i, 0);
        }
        rows += chunk.len();
    }
    if start < chunks.len() {
        windows.push(&chunks[start..]);
    }
    windows
}

/// Every buffer of `data` and of its children, validity bitmaps of the children included (a
/// dictionary's values and their NULLs are part of what its rows read).
pub(super) fn buffers(data: &datafusion::arrow::array::ArrayData) -> Vec<Buffer> {
    let mut all = data.buffers().to_vec();
    for child in data.child_data() {
        all.extend(child.nulls().map(|n| n.inner().inner().clone()));
        all.extend(buffers(child));
    }
    all
}

/// `f` of each item, in order, the items spread over up to one thread a core: deriving
/// prefix words, gathering strings' row ends and bytes (`Utf8View` bytes row by row), and
/// the rows a per-group selection kept.
pub(crate) fn on_cores<T: Send, R: Send>(
    items: Vec<T>,
    f: impl Fn(T) -> GpuResult<R> + Sync,
) -> GpuResult<Vec<R>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len().max(1));
    if threads <= 1 {
        return items.into_iter().map(f).collect();
    }
    let mut shares: Vec<Vec<(usize, T)>> = (0..threads).map(|_| Vec::new()).collect();
    let n = items.len();
    for (i, item) in items.into_iter().enumerate() {
        shares[i % threads].push((i, item));
    }
    let f = &f;
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|scope| {
        let running: Vec<_> = (shares.into_iter())
            .map(|share| {
                scope.spawn(move || -> GpuResult<Vec<(usize, R)>> {
                    share
                        .into_iter()
                        .map(|(i, item)| Ok((i, f(item)?)))
                        .collect()
                })
            })
            .collect();
        for thread in running {
            let done = thread.join().unwrap_or_else(|_| {
                Err(GpuError(
                    "a host thread deriving a column image panicked".into(),
                ))
            })?;
            for (i, r) in done {
                results[i] = Some(r);
            }
        }
        Ok::<_, GpuError>(())
    })?;
    Ok(results
        .into_iter()
        .map(|r| r.expect("every item done"))
        .collect())
}

/// The prefix words of `chunks`, back to back, derived on up to one thread a core.
pub(super) fn derive_prefix_words(chunks: &[ArrayRef]) -> GpuResult<Vec<u8>> {
    let rows: usize = chunks.iter().map(|c| c.len()).sum();
    let mut bytes = vec![0u8; rows * PREFIX_BYTES];
    // Pieces of at most 2^20 rows (slices share the chunk's buffers), so that a window of
    // few large chunks still spreads over the threads.
    let pieces: Vec<ArrayRef> = (chunks.iter())
        .flat_map(|c| {
            (0..c.len())
                .step_by(1 << 20)
                .map(|at| c.slice(at, (c.len() - at).min(1 << 20)))
        })
        .collect();
    let mut slots = Vec::with_capacity(pieces.len());
    let mut rest = bytes.as_mut_slice();
    for piece in &pieces {
        let (slot, tail) = rest.split_at_mut(piece.len() * PREFIX_BYTES);
        slots.push((piece, slot));
        rest = tail;
    }
    on_cores(slots, |(piece, slot)| {
        crate::keys::write_prefix_words(piece.as_ref(), slot).map_err(|e| GpuError(e.to_string()))
    })?;
    Ok(bytes)
}

/// The chunks' values in pieces a thread each: each dictionary's entries once however many
/// chunks share them, other chunks in slices of 2^20 rows.
fn value_pieces(chunks: &[ArrayRef]) -> Vec<ArrayRef> {
    let mut seen = std::collections::HashSet::new();
    let mut pieces: Vec<ArrayRef> = Vec::new();
    for chunk in chunks {
        match chunk.as_any_dictionary_opt() {
            Some(d) if seen.insert(Arc::as_ptr(d.values()).cast::<()>()) => {
                pieces.push(Arc::clone(d.values()));
            }
            Some(_) => {}
            None => pieces.extend(
                (0..chunk.len())
                    .step_by(1 << 20)
                    .map(|at| chunk.slice(at, (chunk.len() - at).min(1 << 20))),
            ),
        }
    }
    pieces
}

/// [`crate::keys::short_bytes`] over every chunk (`None` where any is not short, or there are
/// none), on up to one thread a core; each dictionary's entries are read once however many
/// chunks share them.
pub(crate) fn short_chunks(chunks: &[ArrayRef]) -> Option<u32> {
    short_pieces(value_pieces(chunks))
}

fn short_pieces(pieces: Vec<ArrayRef>) -> Option<u32> {
    if pieces.is_empty() {
        return None;
    }
    let longest = on_cores(pieces, |piece| Ok(crate::keys::short_bytes(piece.as_ref()))).ok()?;
    longest.into_iter().try_fold(0, |a, b| Some(a.max(b?)))
}

/// The bytes of the chunks' prefix words that tell their values apart exactly: where every
/// value is short, [`short_chunks`]; else, where the column's distinct values have distinct
/// prefix words ([`crate::keys::distinct_prefixes`], over all chunks together), a whole
/// prefix word, whose field is exact all the same; else `None`. The second test hashes every
/// row of a column of few values: a column cache's image pays it once, not each plan.
pub(crate) fn exact_prefix_bytes(chunks: &[ArrayRef]) -> Option<u32> {
    let pieces = value_pieces(chunks);
    if let Some(longest) = short_pieces(pieces.clone()) {
        return Some(longest);
    }
    if pieces.is_empty() {
        return None;
    }
    let distinct = on_cores(pieces, |piece| {
        Ok(crate::keys::distinct_prefixes(piece.as_ref()))
    })
    .ok()?;
    let mut distinct = distinct.into_iter();
    let first = distinct.next()??;
    distinct.try_fold(first, |all, piece| all.merge(piece?))?;
    Some(crate::keys::PREFIX_WORD_BYTES as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Results come back in the items' order whatever thread ran them, and an item's error
    /// is the call's.
    #[test]
    fn on_cores_keeps_order_and_errors() {
        let items: Vec<u64> = (0..1000).collect();
        let squares = on_cores(items.clone(), |i| Ok(i * i)).unwrap();
        assert_eq!(squares, items.iter().map(|i| i * i).collect::<Vec<_>>());
        let failed = on_cores(items, |i| match i {
            677 => Err(GpuError("item 677".into())),
            i => Ok(i),
        });
        assert_eq!(failed, Err(GpuError("item 677".into())));
        assert_eq!(on_cores(Vec::<u8>::new(), Ok).unwrap(), Vec::<u8>::new());
    }

    /// [`short_chunks`] is [`crate::keys::short_bytes`] over all chunks: the longest where
    /// every chunk is short, `None` where one is not or there are none. [`exact_prefix_bytes`]
    /// is the same where all are short; else a whole prefix word where the distinct values'
    /// prefix words tell them apart across all chunks, `None` where they do not.
    #[test]
    fn short_chunks_are_short_bytes_of_all() {
        use datafusion::arrow::array::{DictionaryArray, StringArray};
        use datafusion::arrow::datatypes::Int32Type;
        let strings = |v: &[Option<&str>]| -> ArrayRef { Arc::new(StringArray::from(v.to_vec())) };
        let dictionary: ArrayRef = Arc::new(
            vec![Some("abcdefgh"), None]
                .into_iter()
                .collect::<DictionaryArray<Int32Type>>(),
        );
        let short = [strings(&[Some("ab"), None]), strings(&[Some("abcde")])];
        assert_eq!(short_chunks(&short), Some(5));
        assert_eq!(exact_prefix_bytes(&short), Some(5));
        let mixed = [
            short[0].clone(),
            Arc::clone(&dictionary),
            dictionary.slice(1, 1),
        ];
        assert_eq!(short_chunks(&mixed), Some(8));
        assert_eq!(exact_prefix_bytes(&mixed), Some(8));
        // Long values whose prefix words differ: a ship instruction's.
        let long = [short[0].clone(), strings(&[Some("abcdefghijklmnopq")])];
        assert_eq!(short_chunks(&long), None);
        assert_eq!(exact_prefix_bytes(&long), Some(16));
        assert_eq!(short_chunks(&[strings(&[Some("a\0")])]), None);
        assert_eq!(exact_prefix_bytes(&[strings(&[Some("a\0")])]), Some(16));
        // Two values under one prefix word, in one chunk or in two.
        let shared = |a: &str, b: &str| [strings(&[Some(a), Some("ab")]), strings(&[Some(b)])];
        assert_eq!(
            exact_prefix_bytes(&shared("abcdefghijklmnopq", "abcdefghijklmnopr")),
            None
        );
        assert_eq!(exact_prefix_bytes(&shared("a", "a\0")), None);
        assert_eq!(
            exact_prefix_bytes(&[strings(&[Some("a"), Some("a\0")])]),
            None
        );
        // Too many distinct values to keep.
        let many: Vec<String> = (0..=crate::keys::MAX_DISTINCT_PREFIXES)
            .map(|i| format!("{i:05}-{}", "x".repeat(15)))
            .collect();
        let many: ArrayRef = Arc::new(StringArray::from_iter_values(many));
        assert_eq!(exact_prefix_bytes(&[many.slice(0, 10), many.clone()]), None);
        assert_eq!(exact_prefix_bytes(&[many.slice(0, 10)]), Some(16));
        assert_eq!(short_chunks(&[]), None);
        assert_eq!(exact_prefix_bytes(&[]), None);
    }

    /// Prefix words derived in pieces over the cores are those of the whole chunks.
    #[test]
    fn derived_prefix_words_are_each_chunks() {
        use std::sync::Arc;

        use datafusion::arrow::array::StringArray;
        let chunks: Vec<ArrayRef> = (0..5)
            .map(|c| {
                let values: Vec<Option<String>> = (0..(c * 700_001 % 1_500_000))
                    .map(|i| (i % 7 != 3).then(|| format!("{c}-{i:09}-tail")))
                    .collect();
                Arc::new(StringArray::from(values)) as ArrayRef
            })
            .collect();
        let derived = derive_prefix_words(&chunks).unwrap();
        let mut want = Vec::new();
        for chunk in &chunks {
            for w in crate::keys::prefix_words(chunk.as_ref()).unwrap() {
                want.extend_from_slice(&w.to_le_bytes());
            }
        }
        assert_eq!(derived, want);
    }
}
