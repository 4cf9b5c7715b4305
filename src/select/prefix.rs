//! The CPU selector of a prefix layout: string and binary keys, and keys wider than 256 bits.
//!
//! A prefix layout's composite ([`KeyLayout::exact`] is false) is monotone but not exact: a row
//! that sorts before another never has a larger composite, but different keys may share one.
//! So the composite only *rejects*. Once k candidates exist, each `push` first compares the
//! first key's column with the k-th candidate's first key (arrow's vectorised comparison,
//! which reads a string view's inline prefix) and keeps only the rows not worse; it encodes
//! their composites and drops every row whose composite exceeds the k-th candidate's (one
//! comparison per row, no lock). The rows left are encoded in arrow's row format, DataFusion's own
//! comparison of whole keys, and ranked by (row, row id) exactly: rows whose composite is below
//! the k-th candidate's beat it outright, and those that tie it are the ones the full key
//! decides (the `rows_refined` metric counts them once the selection has k candidates). The
//! candidate buffer holds at most `1.5k` (at least `k + 16`) rows and is cut back to the best
//! `k` with `select_nth_unstable`, whose k-th becomes the new threshold: few rows pass the
//! first-key comparison, so a smaller buffer than the exact selector's moves the threshold,
//! and the one published to the scans, sooner.

use std::cmp::Ordering;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, Scalar, UInt32Array};
use datafusion::arrow::compute::kernels::cmp::{gt_eq, lt_eq};
use datafusion::arrow::compute::{SortOptions, is_null, take};
use datafusion::arrow::row::{OwnedRow, Row, RowConverter};
use datafusion::error::Result;
use datafusion::physical_plan::metrics::Count;

use super::cpu::CompositeKey;
use super::{Admitted, SelectInput, SelectionSpec, TopKSelector};
use crate::keys::{KeyLayout, KeyWidth, U256};

/// Builds the selector for the layout's composite width.
pub fn new_selector(spec: &SelectionSpec) -> Result<Arc<dyn TopKSelector>> {
    Ok(match spec.layout.width() {
        KeyWidth::W32 | KeyWidth::W64 => Arc::new(PrefixSelector::<u64>::new(spec)?),
        KeyWidth::W128 => Arc::new(PrefixSelector::<u128>::new(spec)?),
        KeyWidth::W256 => Arc::new(PrefixSelector::<U256>::new(spec)?),
    })
}

/// A candidate: its whole key in row format, its row id and its composite.
#[derive(Clone)]
struct Candidate<K> {
    row: OwnedRow,
    id: u64,
    composite: K,
}

/// The k-th candidate, and its first key as a one-row array where the first key's column
/// may be compared with it by arrow's kernels.
struct Threshold<K> {
    kth: Candidate<K>,
    first: Option<ArrayRef>,
}

/// Which rows of `column` (the first key) are not worse than `threshold` (one row of it):
/// the only ones that can still win. NULLs are better than any value under NULLS FIRST.
fn not_worse(
    column: &ArrayRef,
    threshold: &ArrayRef,
    options: SortOptions,
) -> Result<BooleanArray> {
    if threshold.is_null(0) {
        return Ok(match options.nulls_first {
            true => is_null(column.as_ref())?,
            false => BooleanArray::from(vec![true; column.len()]),
        });
    }
    let scalar = Scalar::new(Arc::clone(threshold));
    let compared = match options.descending {
        true => gt_eq(column, &scalar)?,
        false => lt_eq(column, &scalar)?,
    };
    let Some(nulls) = compared.nulls() else {
        return Ok(compared);
    };
    let values = match options.nulls_first {
        true => compared.values() | &!nulls.inner(),
        false => compared.values() & nulls.inner(),
    };
    Ok(BooleanArray::new(values, None))
}

/// The selection's order: whole key, then row id.
fn by_key_then_id<K>(a: &Candidate<K>, b: &Candidate<K>) -> Ordering {
    a.row.row().cmp(&b.row.row()).then(a.id.cmp(&b.id))
}

/// See the module documentation.
pub(crate) struct PrefixSelector<K> {
    layout: KeyLayout,
    converter: RowConverter,
    k: usize,
    capacity: usize,
    /// The first key's order, for the comparison with the threshold's.
    first_options: SortOptions,
    /// Whether arrow's kernels may compare the first key's column
    /// ([`KeySpec::compares_with_threshold`](crate::keys::KeySpec::compares_with_threshold)).
    compare_first: bool,
    /// Snapshot of the k-th best candidate, read once per push without the buffer lock.
    threshold: RwLock<Option<Arc<Threshold<K>>>>,
    candidates: Mutex<Vec<Candidate<K>>>,
    refined: Count,
}

impl<K: CompositeKey> fmt::Debug for PrefixSelector<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixSelector")
            .field("k", &self.k)
            .finish()
    }
}

impl<K: CompositeKey> PrefixSelector<K> {
    pub fn new(spec: &SelectionSpec) -> Result<Self> {
        Ok(Self {
            layout: spec.layout.clone(),
            converter: RowConverter::new(spec.layout.sort_fields())?,
            first_options: spec.layout.specs()[0].options(),
            compare_first: spec.layout.specs()[0].compares_with_threshold(),
            k: spec.k,
            capacity: spec.k + (spec.k / 2).max(16),
            threshold: RwLock::new(None),
            candidates: Mutex::new(Vec::new()),
            refined: spec.refined_rows.clone(),
        })
    }

    fn snapshot(&self) -> Option<Arc<Threshold<K>>> {
        self.threshold
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Keeps the best `k` of the buffer and makes the k-th the threshold.
    fn cut(&self, candidates: &mut Vec<Candidate<K>>) -> Result<()> {
        let kth = if candidates.len() > self.k {
            candidates.select_nth_unstable_by(self.k - 1, by_key_then_id);
            candidates.truncate(self.k);
            candidates[self.k - 1].clone()
        } else {
            let worst = candidates.iter().max_by(|a, b| by_key_then_id(a, b));
            worst.expect("k > 0 candidates").clone()
        };
        let first = match self.compare_first {
            false => None,
            true => {
                let columns = self
                    .converter
                    .convert_rows(std::iter::once(kth.row.row()))?;
                columns.into_iter().next()
            }
        };
        let threshold = Threshold { kth, first };
        *self.threshold.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(threshold));
        Ok(())
    }
}

impl<K: CompositeKey> TopKSelector for PrefixSelector<K> {
    fn describe(&self) -> String {
        "cpu (key prefixes, ties compared in full)".to_string()
    }

    fn push(&self, input: SelectInput<'_>) -> Result<Admitted> {
        let n = input.num_rows();
        if n == 0 || self.k == 0 {
            return Ok(Admitted::Indices(vec![]));
        }
        let ids = input.row_ids;
        let threshold = self.snapshot();

        // Rows whose first key is not worse than the threshold's (all before there is one).
        let mut positions: Vec<u32> = match threshold.as_ref().and_then(|t| t.first.as_ref()) {
            None => (0..n as u32).collect(),
            Some(first) => {
                let mask = not_worse(&input.keys[0], first, self.first_options)?;
                mask.values().set_indices().map(|i| i as u32).collect()
            }
        };
        if positions.is_empty() {
            return Ok(Admitted::Indices(vec![]));
        }
        let take_rows = |columns: &[ArrayRef], rows: &[u32]| -> Result<Vec<ArrayRef>> {
            let indices = UInt32Array::from(rows.to_vec());
            Ok((columns.iter())
                .map(|c| take(c.as_ref(), &indices, None))
                .collect::<std::result::Result<_, _>>()?)
        };
        let mut columns = match positions.len() == n {
            true => input.keys.to_vec(),
            false => take_rows(input.keys, &positions)?,
        };

        // Of those, the rows the composite cannot reject: below or tied with the k-th's.
        let mut composites = K::unwrap_encoded(self.layout.encode(&columns)?)?;
        if let Some(t) = &threshold {
            let kth = t.kth.composite;
            let kept: Vec<u32> = (0..composites.len() as u32)
                .filter(|&j| composites[j as usize] <= kth)
                .collect();
            let ties = kept
                .iter()
                .filter(|&&j| composites[j as usize] == kth)
                .count();
            self.refined.add(ties);
            if kept.is_empty() {
                return Ok(Admitted::Indices(vec![]));
            }
            if kept.len() < composites.len() {
                columns = take_rows(&columns, &kept)?;
                composites = kept.iter().map(|&j| composites[j as usize]).collect();
                positions = kept.iter().map(|&j| positions[j as usize]).collect();
            }
        }
        let survivors = positions;
        let rows = self.converter.convert_columns(&columns)?;
        let beats =
            |row: Row<'_>, id: u64, t: &Threshold<K>| (row, id) < (t.kth.row.row(), t.kth.id);

        // Survivors that beat the threshold: (position in `survivors`, row id).
        let mut local: Vec<(usize, u64)> = (0..survivors.len())
            .map(|j| (j, ids.get(survivors[j] as usize)))
            .filter(|&(j, id)| threshold.as_ref().is_none_or(|t| beats(rows.row(j), id, t)))
            .collect();
        if local.is_empty() {
            return Ok(Admitted::Indices(vec![]));
        }
        let order =
            |a: &(usize, u64), b: &(usize, u64)| (rows.row(a.0), a.1).cmp(&(rows.row(b.0), b.1));
        if local.len() > self.k {
            local.select_nth_unstable_by(self.k - 1, order);
            local.truncate(self.k);
        }

        let threshold = {
            let mut candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
            candidates.extend(local.iter().map(|&(j, id)| Candidate {
                row: rows.row(j).owned(),
                id,
                composite: composites[j],
            }));
            // Cut back when full, and as soon as k candidates exist: from then on the threshold
            // filters every push (and the scans below).
            let first_threshold = candidates.len() >= self.k && self.snapshot().is_none();
            if candidates.len() > self.capacity || first_threshold {
                self.cut(&mut candidates)?;
            }
            self.snapshot()
        };

        let mut indices: Vec<u32> = (local.iter())
            .filter(|&&(j, id)| {
                (threshold.as_ref())
                    .is_none_or(|t| (rows.row(j), id) <= (t.kth.row.row(), t.kth.id))
            })
            .map(|&(j, _)| survivors[j])
            .collect();
        indices.sort_unstable();
        Ok(Admitted::Indices(indices))
    }

    fn threshold_row_id(&self) -> Option<u64> {
        self.snapshot().map(|t| t.kth.id)
    }

    fn live_row_ids(&self) -> Result<Option<Vec<u64>>> {
        let candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<u64> = candidates.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        Ok(Some(ids))
    }

    fn finish(&self) -> Result<Vec<u64>> {
        let mut candidates =
            std::mem::take(&mut *self.candidates.lock().unwrap_or_else(|e| e.into_inner()));
        if candidates.len() > self.k {
            candidates.select_nth_unstable_by(self.k - 1, by_key_then_id);
            candidates.truncate(self.k);
        }
        candidates.sort_unstable_by(by_key_then_id);
        Ok(candidates.into_iter().map(|c| c.id).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KeySpec;
    use crate::select::RowIds;
    use datafusion::arrow::array::{Int32Array, StringViewArray};
    use datafusion::arrow::datatypes::DataType;

    /// Batches pushed out of order, with heavy ties on the prefix and on whole keys: the
    /// selection is the first k rows of a stable sort by the whole keys, whatever the order.
    #[test]
    fn matches_a_stable_sort_of_the_whole_keys() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let stems = ["", "a", "ab", "https://example.com/shared/path/", "é"];
        for round in 0..40u64 {
            let batches: Vec<(u64, Vec<ArrayRef>)> = (0..6u64)
                .map(|b| {
                    let n = 1 + next(300) as usize;
                    let strings: Vec<Option<String>> = (0..n)
                        .map(|_| {
                            (next(9) != 0).then(|| {
                                let stem = stems[next(stems.len() as u64) as usize];
                                format!("{stem}{}", "xyz".repeat(next(3) as usize))
                            })
                        })
                        .collect();
                    let second = Int32Array::from_iter_values((0..n).map(|_| next(3) as i32));
                    let columns: Vec<ArrayRef> =
                        vec![Arc::new(StringViewArray::from(strings)), Arc::new(second)];
                    (b << 20, columns)
                })
                .collect();
            let specs = vec![
                KeySpec {
                    data_type: DataType::Utf8View,
                    descending: round % 2 == 1,
                    nulls_first: round % 4 < 2,
                    nullable: true,
                },
                KeySpec {
                    data_type: DataType::Int32,
                    descending: round % 3 == 0,
                    nulls_first: false,
                    nullable: false,
                },
            ];
            let layout = KeyLayout::with_prefixes(specs).unwrap();
            let k = [1, 5, 40, 2000][round as usize % 4];
            let selector = new_selector(&SelectionSpec::new(layout.clone(), k)).unwrap();
            let mut order: Vec<usize> = (0..batches.len()).collect();
            order.rotate_left(round as usize % batches.len());
            for &b in &order {
                let (first_id, columns) = &batches[b];
                let input = SelectInput {
                    keys: columns,
                    row_ids: RowIds::Range(*first_id),
                };
                selector.push(input).unwrap();
            }
            let got = selector.finish().unwrap();

            let converter = RowConverter::new(layout.sort_fields()).unwrap();
            let mut all: Vec<(OwnedRow, u64)> = Vec::new();
            for (first_id, columns) in &batches {
                let rows = converter.convert_columns(columns).unwrap();
                all.extend(
                    (0..rows.num_rows()).map(|i| (rows.row(i).owned(), first_id + i as u64)),
                );
            }
            all.sort_by(|a, b| (a.0.row(), a.1).cmp(&(b.0.row(), b.1)));
            let want: Vec<u64> = all.iter().take(k).map(|(_, id)| *id).collect();
            assert_eq!(got, want, "round {round}, k = {k}");
        }
    }
}
