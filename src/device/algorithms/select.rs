//! Exact selections of the k smallest pairs: radix select (RadiK), bitonic top-k (SIGMOD'18)
//! and Dr. Top-k's delegates, and the thresholds taken from a selection's result.

use super::*;

impl TopKEngine {
    /// Threshold := the largest of pairs `[0, n)` (n ≥ 1).
    pub fn threshold_from_max(&self, pairs: &DevicePairs, n: usize) -> GpuResult<()> {
        let grid = self.grid_for(n, 8);
        let partial = self.alloc_pairs(grid as usize)?;
        let base = self.scalars.ptr();
        self.launch(
            &self.kernel("pair_max"),
            grid,
            THREADS,
            0,
            args![
                pairs.key_at(0),
                pairs.id_at(0),
                n,
                partial.key_at(0),
                partial.id_at(0),
                base + COUNTER_OFFSET,
                base + THRESHOLD_OFFSET,
            ],
        )
    }

    /// Threshold := pair `index`.
    pub fn threshold_from_index(&self, pairs: &DevicePairs, index: usize) -> GpuResult<()> {
        self.launch(
            &self.kernel("threshold_from"),
            1,
            32,
            0,
            args![
                pairs.key_at(0),
                pairs.id_at(0),
                index,
                self.scalars.ptr() + THRESHOLD_OFFSET
            ],
        )
    }

    // ---- selection (radix.cu, bitonic.cu) --------------------------------------------------

    /// Pairs per block of the bitonic kernels: the largest power of two whose pairs fit the
    /// block's shared memory (8192 for 64- and 128-bit keys on Hopper's 227 KiB).
    pub fn bitonic_chunk(&self) -> usize {
        bitonic_chunk(self.device.max_shared_per_block, self.kind)
    }

    /// The largest k of [`bitonic_select`](Self::bitonic_select): a quarter of the chunk, so
    /// that each round cuts the data at least fourfold.
    pub fn bitonic_max_k(&self) -> usize {
        self.bitonic_chunk() / 4
    }

    /// Exactly the k smallest of pairs `[0, n)` (0 < k < n), unordered, in a new buffer of
    /// `out_capacity` (≥ k) pairs. Reads the control block back once, to check it.
    pub fn radix_select(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
        out_capacity: usize,
    ) -> GpuResult<DevicePairs> {
        if k == 0 || k >= n {
            return Err(GpuError(format!(
                "radix select needs 0 < k < n, got k = {k}, n = {n}"
            )));
        }
        let out = self.alloc_pairs(out_capacity.max(k))?;
        let scratch = [self.alloc_pairs(n)?, self.alloc_pairs(n)?];
        let ctl = self.scalars.ptr() + CTL_OFFSET;
        self.launch("radix_init", 1, THREADS, 0, args![ctl, n, k])?;
        let grid = self.grid_for(n, 16);
        self.launch(
            &self.kernel("radix_masks"),
            grid,
            THREADS,
            0,
            args![ctl, input.key_at(0), input.id_at(0)],
        )?;
        let hist = self.kernel("radix_hist");
        let filter = self.kernel("radix_filter");
        // Every pass consumes at least 8 of the 64 + key bits; passes after the last return.
        let passes = (64 + self.kind.bits()).div_ceil(8) as usize;
        for pass in 0..passes {
            let src = if pass == 0 {
                input
            } else {
                &scratch[(pass - 1) % 2]
            };
            let next = &scratch[pass % 2];
            self.launch(
                &hist,
                grid,
                THREADS,
                0,
                args![ctl, src.key_at(0), src.id_at(0)],
            )?;
            self.launch(
                &filter,
                grid,
                THREADS,
                0,
                args![
                    ctl,
                    src.key_at(0),
                    src.id_at(0),
                    out.key_at(0),
                    out.id_at(0),
                    next.key_at(0),
                    next.id_at(0),
                ],
            )?;
        }
        let block = self.read_bytes(ctl, CTL_BYTES)?;
        let u64_at = |o: usize| u64::from_le_bytes(block[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(block[o..o + 4].try_into().expect("4 bytes"));
        let (n_out, done, error) = (u64_at(CTL_N_OUT), u32_at(CTL_DONE), u32_at(CTL_ERROR));
        if error != 0 || done != 1 || n_out != k as u64 {
            return Err(GpuError(format!(
                "radix select failed its consistency check (error {error}, done {done}, \
                 {n_out} winners for k = {k} of n = {n})"
            )));
        }
        Ok(out)
    }

    /// The k smallest of pairs `[0, n)`, sorted, at the start of a new buffer (its first
    /// min(n, k) pairs; the rest is padding). Needs k ≤ [`bitonic_max_k`](Self::bitonic_max_k).
    pub fn bitonic_select(
        &self,
        input: &DevicePairs,
        n: usize,
        k: usize,
    ) -> GpuResult<DevicePairs> {
        let k2 = k.max(1).next_power_of_two();
        let chunk = self.bitonic_chunk();
        if k2 * 4 > chunk {
            return Err(GpuError(format!(
                "bitonic top-k supports k up to {} for {:?} keys on this device, not {k}",
                self.bitonic_max_k(),
                self.kind
            )));
        }
        let shared = chunk * self.kind.pair_bytes();
        let name = self.kernel("bitonic_topk");
        let mut len = n;
        let mut current: Option<DevicePairs> = None;
        loop {
            let blocks = len.div_ceil(chunk).max(1);
            let out = self.alloc_pairs(blocks * k2)?;
            let src = current.as_ref().unwrap_or(input);
            self.launch(
                &name,
                blocks as u32,
                BITONIC_THREADS,
                shared,
                args![
                    src.key_at(0),
                    src.id_at(0),
                    len,
                    out.key_at(0),
                    out.id_at(0),
                    k2 as u32,
                    chunk as u32
                ],
            )?;
            current = Some(out);
            len = blocks * k2;
            if blocks == 1 {
                break;
            }
        }
        Ok(current.expect("at least one round"))
    }

    /// Dr. Top-k (delegate.cu): the delegates (each subrange's smallest pair) in one read, the
    /// k smallest of them by a sampled selection, and the pairs ≤ the k-th gathered from the
    /// subranges whose delegates are ≤ it; one read-back of the candidate count, then a sort
    /// (or, when ties left more than a few times k candidates, a sampled selection) of the
    /// candidates. `None` when there are fewer than k subranges of the smallest size (the
    /// caller then runs the sampled selection).
    pub fn delegate_select(
        &mut self,
        input: &DevicePairs,
        n: usize,
        k: usize,
    ) -> GpuResult<Option<DevicePairs>> {
        let Some(s) = delegate_subrange(n, k) else {
            return Ok(None);
        };
        let subranges = n.div_ceil(s);
        let ids = if input.positional { 0 } else { input.id_at(0) };
        let delegates = self.alloc_pairs(subranges)?;
        let name = self.kernel("delegate_min");
        self.launch(
            &name,
            self.resident_grid(&name, THREADS)?,
            THREADS,
            0,
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
        let name = self.kernel("delegate_gather");
        self.launch(
            &name,
            self.resident_grid(&name, THREADS)?,
            THREADS,
            0,
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
        Ok(Some(sorted))
    }
}
