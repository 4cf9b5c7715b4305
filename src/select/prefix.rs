//! The CPU selector of a prefix layout: string and binary keys, and keys wider than 256 bits.
//!
//! A prefix layout's composite ([`KeyLayout::exact`] is false) is monotone but not exact: a row
//! that sorts before another never has a larger composite, but different keys may share one.
//! So the composite only *rejects*: each `push` encodes the batch's composites and drops every
//! row whose composite exceeds the k-th candidate's (one comparison per row, no lock, as the
//! exact selector does). The rows left are encoded in arrow's row format, DataFusion's own
//! comparison of whole keys, and ranked by (row, row id) exactly: rows whose composite is below
//! the k-th candidate's beat it outright, and those that tie it are the ones the full key
//! decides (the `rows_refined` metric counts them once the selection has k candidates). The
//! candidate buffer works as the exact selector's: at most `2k` (at least `k + 256`) rows, cut
//! back to the best `k` with `select_nth_unstable`, whose k-th becomes the new threshold.

use std::cmp::Ordering;
use std::fmt;
use std::sync::{Arc, Mutex, RwLock};

use datafusion::arrow::array::{ArrayRef, UInt32Array};
use datafusion::arrow::compute::take;
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
    /// Snapshot of the k-th best candidate, read once per push without the buffer lock.
    threshold: RwLock<Option<Arc<Candidate<K>>>>,
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
            k: spec.k,
            capacity: (2 * spec.k).max(spec.k + 256),
            threshold: RwLock::new(None),
            candidates: Mutex::new(Vec::new()),
            refined: spec.refined_rows.clone(),
        })
    }

    fn snapshot(&self) -> Option<Arc<Candidate<K>>> {
        self.threshold
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Keeps the best `k` of the buffer and makes the k-th the threshold.
    fn cut(&self, candidates: &mut Vec<Candidate<K>>) {
        let kth = if candidates.len() > self.k {
            candidates.select_nth_unstable_by(self.k - 1, by_key_then_id);
            candidates.truncate(self.k);
            candidates[self.k - 1].clone()
        } else {
            let worst = candidates.iter().max_by(|a, b| by_key_then_id(a, b));
            worst.expect("k > 0 candidates").clone()
        };
        // Candidates only ever improve, so the new k-th is never worse than the old.
        *self.threshold.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(kth));
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
        let composites = K::unwrap_encoded(self.layout.encode(input.keys)?)?;
        let ids = input.row_ids;
        let threshold = self.snapshot();

        // Rows the composite cannot reject: below or tied with the k-th candidate's.
        let survivors: Vec<u32> = match &threshold {
            None => (0..n as u32).collect(),
            Some(t) => {
                let survivors: Vec<u32> = (composites.iter().enumerate())
                    .filter(|(_, c)| **c <= t.composite)
                    .map(|(i, _)| i as u32)
                    .collect();
                let ties = survivors
                    .iter()
                    .filter(|&&i| composites[i as usize] == t.composite)
                    .count();
                self.refined.add(ties);
                survivors
            }
        };
        if survivors.is_empty() {
            return Ok(Admitted::Indices(vec![]));
        }
        let columns: Vec<ArrayRef> = if survivors.len() == n {
            input.keys.to_vec()
        } else {
            let indices = UInt32Array::from(survivors.clone());
            (input.keys.iter())
                .map(|c| take(c.as_ref(), &indices, None))
                .collect::<std::result::Result<_, _>>()?
        };
        let rows = self.converter.convert_columns(&columns)?;
        let beats = |row: Row<'_>, id: u64, t: &Candidate<K>| (row, id) < (t.row.row(), t.id);

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
                composite: composites[survivors[j] as usize],
            }));
            // Cut back when full, and as soon as k candidates exist: from then on the threshold
            // filters every push (and the scans below).
            let first_threshold = candidates.len() >= self.k && self.snapshot().is_none();
            if candidates.len() > self.capacity || first_threshold {
                self.cut(&mut candidates);
            }
            self.snapshot()
        };

        let mut indices: Vec<u32> = (local.iter())
            .filter(|&&(j, id)| {
                (threshold.as_ref()).is_none_or(|t| (rows.row(j), id) <= (t.row.row(), t.id))
            })
            .map(|&(j, _)| survivors[j])
            .collect();
        indices.sort_unstable();
        Ok(Admitted::Indices(indices))
    }

    fn threshold_row_id(&self) -> Option<u64> {
        self.snapshot().map(|t| t.id)
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
