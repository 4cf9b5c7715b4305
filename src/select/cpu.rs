//! The CPU selector: the host twin of the GPU algorithms, and what runs without a GPU.
//!
//! Each `push` encodes the batch's keys ([`KeyLayout::encode`]), drops every row that is not
//! better than a snapshot of the shared threshold (one comparison per row, no lock), reduces
//! the survivors to at most `k` locally, and appends them to the shared candidate buffer. When
//! the buffer exceeds its capacity (`2k`, at least `k + 256`) it is cut back to the best `k` with
//! a linear-time `select_nth_unstable`, and the k-th candidate becomes the new threshold. The
//! cost is O(n) comparisons plus O(k) per `k` admitted rows; `finish` sorts the last `k`.

use std::fmt;
use std::sync::{Arc, Mutex, RwLock};

use datafusion::error::{DataFusionError, Result};

use super::{Admitted, SelectInput, SelectionSpec, TopKSelector};
use crate::keys::{EncodedKeys, KeyLayout, KeyWidth, U256};

/// A composite key container (`u64`, `u128` or [`U256`]).
pub(crate) trait CompositeKey: Ord + Copy + Send + Sync + fmt::Debug + 'static {
    fn unwrap_encoded(keys: EncodedKeys) -> Result<Vec<Self>>;
}

macro_rules! composite_key {
    ($t:ty, $variant:ident) => {
        impl CompositeKey for $t {
            fn unwrap_encoded(keys: EncodedKeys) -> Result<Vec<Self>> {
                match keys {
                    EncodedKeys::$variant(v) => Ok(v),
                    _ => Err(DataFusionError::Internal(
                        "key layout produced an unexpected composite width".into(),
                    )),
                }
            }
        }
    };
}
composite_key!(u64, W64);
composite_key!(u128, W128);
composite_key!(U256, W256);

/// Builds the CPU selector for the layout's composite width.
pub fn new_selector(spec: &SelectionSpec) -> Arc<dyn TopKSelector> {
    match spec.layout.width() {
        KeyWidth::W32 | KeyWidth::W64 => Arc::new(CpuSelector::<u64>::new(spec)),
        KeyWidth::W128 => Arc::new(CpuSelector::<u128>::new(spec)),
        KeyWidth::W256 => Arc::new(CpuSelector::<U256>::new(spec)),
    }
}

/// See the module documentation.
pub(crate) struct CpuSelector<K> {
    layout: KeyLayout,
    k: usize,
    capacity: usize,
    /// Snapshot of the k-th best `(key, row id)`, read once per push without the buffer lock.
    threshold: RwLock<Option<(K, u64)>>,
    candidates: Mutex<Vec<(K, u64)>>,
}

impl<K: CompositeKey> fmt::Debug for CpuSelector<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuSelector").field("k", &self.k).finish()
    }
}

impl<K: CompositeKey> CpuSelector<K> {
    pub fn new(spec: &SelectionSpec) -> Self {
        Self {
            layout: spec.layout.clone(),
            k: spec.k,
            capacity: (2 * spec.k).max(spec.k + 256),
            threshold: RwLock::new(None),
            candidates: Mutex::new(Vec::new()),
        }
    }

    fn snapshot(&self) -> Option<(K, u64)> {
        *self.threshold.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// Keeps the best `k` of `v` (unordered) and returns the k-th best, if `v` had more than `k`.
fn cut_to_k<T: Ord + Copy>(v: &mut Vec<T>, k: usize) -> Option<T> {
    if v.len() <= k || k == 0 {
        if k == 0 {
            v.clear();
        }
        return None;
    }
    let (_, kth, _) = v.select_nth_unstable(k - 1);
    let kth = *kth;
    v.truncate(k);
    Some(kth)
}

impl<K: CompositeKey> TopKSelector for CpuSelector<K> {
    fn describe(&self) -> String {
        "cpu".to_string()
    }

    fn push(&self, input: SelectInput<'_>) -> Result<Admitted> {
        let n = input.num_rows();
        if n == 0 || self.k == 0 {
            return Ok(Admitted::Indices(vec![]));
        }
        let keys = K::unwrap_encoded(self.layout.encode(input.keys)?)?;
        let ids = input.row_ids;

        // Survivors of the threshold snapshot: (key, row id, position in this input).
        let mut local: Vec<(K, u64, u32)> = Vec::new();
        match self.snapshot() {
            None => local.extend(
                keys.iter()
                    .enumerate()
                    .map(|(i, &key)| (key, ids.get(i), i as u32)),
            ),
            Some((tk, tid)) => {
                for (i, &key) in keys.iter().enumerate() {
                    // Keys decide almost always; the row id only among equal keys.
                    if key < tk || (key == tk && ids.get(i) < tid) {
                        local.push((key, ids.get(i), i as u32));
                    }
                }
            }
        }
        if local.is_empty() {
            return Ok(Admitted::Indices(vec![]));
        }
        cut_to_k(&mut local, self.k);

        let threshold = {
            let mut candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
            candidates.extend(local.iter().map(|&(key, id, _)| (key, id)));
            // Cut back when full, and as soon as k candidates exist: from then on the threshold
            // filters every push (and the scans below).
            let first_threshold = candidates.len() >= self.k && self.snapshot().is_none();
            if candidates.len() > self.capacity || first_threshold {
                let kth = match cut_to_k(&mut candidates, self.k) {
                    Some(kth) => kth,
                    None => *candidates.iter().max().expect("k > 0 candidates"),
                };
                // Candidates only ever improve, so the new k-th is never worse than the old.
                *self.threshold.write().unwrap_or_else(|e| e.into_inner()) = Some(kth);
            }
            self.snapshot()
        };

        let mut indices: Vec<u32> = local
            .iter()
            .filter(|&&(key, id, _)| threshold.is_none_or(|t| (key, id) <= t))
            .map(|&(_, _, i)| i)
            .collect();
        indices.sort_unstable();
        Ok(Admitted::Indices(indices))
    }

    fn threshold_row_id(&self) -> Option<u64> {
        self.snapshot().map(|(_, id)| id)
    }

    fn live_row_ids(&self) -> Result<Option<Vec<u64>>> {
        let candidates = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids: Vec<u64> = candidates.iter().map(|&(_, id)| id).collect();
        ids.sort_unstable();
        Ok(Some(ids))
    }

    fn finish(&self) -> Result<Vec<u64>> {
        let mut candidates =
            std::mem::take(&mut *self.candidates.lock().unwrap_or_else(|e| e.into_inner()));
        cut_to_k(&mut candidates, self.k);
        candidates.sort_unstable();
        Ok(candidates.into_iter().map(|(_, id)| id).collect())
    }
}
