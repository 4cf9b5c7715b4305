//! Bitonic top-k (SIGMOD'18, bitonic.cu): the k smallest pairs, sorted, in shared memory,
//! for k up to a quarter of the block's chunk; and the threshold taken from a sorted pair.

use super::*;

impl TopKEngine {
    /// Pairs per block of the bitonic kernels: the largest power of two whose pairs fit the
    /// block's shared memory (8192 for 64- and 128-bit keys on Hopper's 227 KiB).
    pub fn bitonic_chunk(&self) -> usize {
        bitonic_chunk(self.device.max_shared_per_block, self.kind)
    }

    /// The largest k of [`bitonic_select`](Self::bitonic_select): a quarter of the chunk, so
    /// that each round cuts the data at least fourfold.
    pub fn bitonic_max_k(&self) -> usize {
        crate::device::plan::bitonic_max_k(self.device.max_shared_per_block, self.kind)
    }

    /// The k smallest of pairs `[0, n)`, sorted, at the start of a new buffer (its first
    /// min(n, k) pairs; the rest is padding). Needs k ≤ [`bitonic_max_k`](Self::bitonic_max_k).
    pub(crate) fn bitonic_select(
        &self,
        input: &DevicePairs,
        n: usize,
        k: usize,
    ) -> GpuResult<DevicePairs> {
        crate::device::plan::bitonic_takes(k, self.device.max_shared_per_block, self.kind)?;
        let k2 = k.max(1).next_power_of_two();
        let chunk = self.bitonic_chunk();
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

    /// Threshold := pair `index`.
    pub(crate) fn threshold_from_index(&self, pairs: &DevicePairs, index: usize) -> GpuResult<()> {
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
}
