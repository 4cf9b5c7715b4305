//! Radix select (RadiK, radix.cu): exactly the k smallest pairs, unordered, any k; and the
//! threshold taken from the largest of a selection's pairs.

use super::*;

impl TopKEngine {
    /// Exactly the k smallest of pairs `[0, n)` (0 < k < n), unordered, in a new buffer of
    /// `out_capacity` (≥ k) pairs. Reads the control block back once, to check it.
    pub(crate) fn radix_select(
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

    /// Threshold := the largest of pairs `[0, n)` (n ≥ 1).
    pub(crate) fn threshold_from_max(&self, pairs: &DevicePairs, n: usize) -> GpuResult<()> {
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
}
