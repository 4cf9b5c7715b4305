//! Dr. Top-k's delegates (delegate.cu): each subrange's smallest pair, the k-th smallest
//! of those as a threshold, and the pairs below it gathered from the subranges that pass.

use super::*;

impl TopKEngine {
    /// Dr. Top-k (delegate.cu): the delegates (each subrange's smallest pair) in one read, the
    /// k smallest of them by a sampled selection, and the pairs ≤ the k-th gathered from the
    /// subranges whose delegates are ≤ it; one read-back of the candidate count, then a sort
    /// (or, when ties left more than a few times k candidates, a sampled selection) of the
    /// candidates; `s` pairs a subrange ([`delegate_subrange`]).
    pub(crate) fn delegate_select(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
        s: usize,
    ) -> GpuResult<DevicePairs> {
        let subranges = n.div_ceil(s);
        let ids = if input.positional { 0 } else { input.id_at(0) };
        let delegates = self.alloc_pairs(subranges)?;
        self.launch_resident(
            "delegate_min",
            args![
                input.key_at(0),
                ids,
                n,
                s as u32,
                delegates.key_at(0),
                delegates.id_at(0)
            ],
        )?;
        let (best, _) = self.select_sorted(&delegates, subranges, k, DeviceAlgorithm::Sample)?;
        self.threshold_from_index(&best, k - 1)?;
        let cap = (k * s).min(n);
        let candidates = self.alloc_pairs(cap)?;
        let base = self.scalars.ptr();
        self.write_u64(base + COUNT_OFFSET, 0)?;
        self.launch_resident(
            "delegate_gather",
            args![
                input.key_at(0),
                ids,
                n,
                s as u32,
                delegates.key_at(0),
                delegates.id_at(0),
                base + THRESHOLD_OFFSET,
                candidates.key_at(0),
                candidates.id_at(0),
                base + COUNT_OFFSET,
                cap
            ],
        )?;
        let count = self.read_u64(base + COUNT_OFFSET)? as usize;
        if count < k || count > cap {
            // Impossible by construction (k delegates pass, each subrange holds ≤ s pairs).
            return Err(GpuError(format!(
                "delegate top-k gathered {count} candidates for k = {k} (capacity {cap})"
            )));
        }
        let id_bound = input.id_bound(n);
        let sorted = if count <= DIRECT_SORT_FACTOR * k.max(DIRECT_SORT_MIN) {
            self.sort_pairs(&candidates, count, id_bound)?
        } else {
            self.select_sorted(&candidates, count, k, DeviceAlgorithm::Sample)?
                .0
        };
        Ok(sorted)
    }
}
