//! The top-bits selection (radix_sort.cu `rsort_top_*`, bitonic.cu `sort_segments`): the k
//! smallest of positional pairs, sorted. A sample of the keys sets bins over (the key's top
//! word, position), so that equal keys spread by position; a histogram finds the bin of the
//! k-th smallest; the pairs at or below it are scattered by bin, and each block sorts a few
//! bins (by rank in shared memory, or larger ones in registers). Three launches on the
//! device's counts, read back once; a cluster of keys that crowds a bin takes the merge sort
//! after the read-back, and one the sample foresees the whole sort.

use super::*;

/// The bins' counts and control words (radix_sort.cu `TOP_BINS` and the words after them: a
/// spare word, bound, status, a spare word, kept count (u64), the bins' base, scale and w0 (u64
/// each)).
const TOP_BINS: usize = 4096;
const TOP_BOUND_WORD: usize = TOP_BINS + 1;
const TOP_STATUS_WORD: usize = TOP_BINS + 2;
/// Status: a kept bin holds more than half a segment-sort tile (radix_sort.cu).
const TOP_STATUS_CROWDED: u32 = 2;
const TOP_COUNT_WORD: usize = TOP_BINS + 4;
const TOP_WORDS: usize = TOP_BINS + 12;
const _: () = assert!(TOP_COUNT_WORD == TOP_STATUS_WORD + 2);
/// Threads of bitonic.cu's `sort_segments` blocks (`SEGMENT_THREADS`), each sorting a tile of
/// a quarter of the sort tile's pairs.
const SEGMENT_THREADS: u32 = 256;
/// Keys a thread of `rsort_top_hist` and `rsort_top_scatter` takes per round (radix_sort.cu
/// `SCATTER_ITEMS`).
const SCATTER_ITEMS: usize = 16;
/// Words between the scatter's per-bin fill counters (radix_sort.cu `TOP_FILL_STRIDE`).
const TOP_FILL_STRIDE: usize = 8;

/// The buffer of kept pairs for a top-bits selection of k among n: uniform keys keep k plus
/// one bin (a few hundred pairs at n = 2^20); this leaves half of k and n / 256 more for
/// keys that crowd their bins.
pub fn top_bits_capacity(n: usize, k: usize) -> usize {
    (k + k / 2 + n / 256).min(n)
}

/// Whether a sampled selection of k among n pairs takes the top-bits selection: positional
/// 32- and 64-bit keys (the scatter writes positions as row ids) of the sizes whose whole sort
/// runs one kernel a pass (up to ~1.5M rows), for k from n / 256 to below n / 4. H100,
/// n = 2^20 (session 18): i32 uniform k = 2^12 / 2^13 / 2^15 / 2^16 / 2^17 in 32 / 33 / 36 /
/// 39 / 47 µs against 47 / 64 / 71 / 86 / 86 µs by the sampled levels or the whole sort; i64
/// 33 / 34 / 37 / 40 / 51 against 58 / 68 / 76 / 97 / 193; all-equal keys 34–44. Zipf ties
/// from k = n / 32 and NaN mixes lose (116–203 µs against 47–165: a crowded bin, then the
/// merge sort after the read-back); from n / 4 its bins crowd. The cost model asks the same. `GPU_TOPK_TOP_BITS=0` turns it off, `=1` takes it wherever it applies (A/B runs).
pub fn top_bits_sorts(kind: KeyKind, n: usize, k: usize, positional: bool) -> bool {
    static FORCED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let forced = FORCED.get_or_init(|| std::env::var("GPU_TOPK_TOP_BITS").ok());
    // Its buffers (at most n pairs) then fit the merge sort of its crowded route.
    // Positions below 2^21: the bins' coordinates hold them (radix_sort.cu `TopBins`).
    let applies = positional
        && k > 0
        && n < 1 << 21
        && matches!(kind, KeyKind::K32 | KeyKind::K64)
        && radix_sort_is_wide(kind, n);
    match forced.as_deref() {
        Some("0") => false,
        Some("1") => applies,
        _ => applies && k.saturating_mul(256) >= n && k.saturating_mul(4) < n,
    }
}

/// A top-bits selection enqueued by [`TopKEngine::top_bits_enqueue`]: its control words, its
/// kept pairs, and their sort, valid when the status read back is clear.
#[derive(Debug)]
pub(super) struct TopBitsRun {
    k: usize,
    cap: usize,
    ctl: PooledBuffer,
    kept: DevicePairs,
    out: DevicePairs,
}

impl TopKEngine {
    /// Enqueues the top-bits selection of k among the `n` positional pairs of `input`: a
    /// memset and three launches, no read-back (see radix_sort.cu).
    pub(super) fn top_bits_enqueue(
        &self,
        input: &DevicePairs,
        n: usize,
        k: usize,
    ) -> GpuResult<TopBitsRun> {
        debug_assert!(input.positional && k > 0);
        let k = k.min(n);
        let cap = top_bits_capacity(n, k);
        // The bins and their words, then the scatter's per-bin fill counters.
        let fill = (4 * TOP_WORDS) as u64;
        let ctl_bytes = 4 * (TOP_WORDS + TOP_FILL_STRIDE * TOP_BINS);
        let ctl = self.device.pool.alloc(ctl_bytes, &self.stream)?;
        self.memset_zero(ctl.ptr(), ctl_bytes)?;
        let kept = self.alloc_pairs(cap)?;
        let out = self.alloc_pairs(cap)?;
        let c = ctl.ptr();
        let grid =
            (2 * self.device.sm_count).min(n.div_ceil(RSORT_THREADS as usize * SCATTER_ITEMS));
        self.launch(
            &self.kernel("rsort_top_hist"),
            grid as u32,
            RSORT_THREADS,
            0,
            args![input.key_at(0), n, k, c],
        )?;
        let grid = n
            .div_ceil(RSORT_THREADS as usize * SCATTER_ITEMS)
            .min(8 * self.device.sm_count);
        self.launch(
            &self.kernel("rsort_top_scatter"),
            grid as u32,
            RSORT_THREADS,
            0,
            args![
                input.key_at(0),
                n,
                k,
                cap,
                c,
                c + fill,
                kept.key_at(0),
                kept.id_at(0)
            ],
        )?;
        let tile = SEGMENT_THREADS as usize * sort_tile(self.kind) / SORT_THREADS as usize;
        self.launch(
            &self.kernel("bitonic_sort_segments"),
            cap.div_ceil(tile / 2) as u32,
            SEGMENT_THREADS,
            tile * self.kind.pair_bytes(),
            args![
                kept.key_at(0),
                kept.id_at(0),
                c,
                c + 4 * TOP_BOUND_WORD as u64,
                c + 4 * TOP_COUNT_WORD as u64,
                c + 4 * TOP_STATUS_WORD as u64,
                out.key_at(0),
                out.id_at(0)
            ],
        )?;
        Ok(TopBitsRun {
            k,
            cap,
            ctl,
            kept,
            out,
        })
    }

    /// Reads a top-bits selection's status and kept count back (one round trip): its sorted
    /// pairs, and whether device work ran after the read-back (where a kept bin was too large
    /// for the segment sort, the merge sort of the kept pairs, truncated at k); `None` when
    /// more pairs shared the k-th smallest's bins than its buffers hold, or when the sample
    /// foresaw a crowded bin (nothing sorted).
    pub(super) fn top_bits_complete(
        &mut self,
        run: TopBitsRun,
    ) -> GpuResult<Option<(DevicePairs, bool)>> {
        // The status word, a spare word, then the kept count (u64).
        let at = run.ctl.ptr() + 4 * TOP_STATUS_WORD as u64;
        let bytes = self.read_bytes(at, 16)?;
        let status = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
        let kept = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
        match status {
            0 => Ok(Some((run.out, false))),
            TOP_STATUS_CROWDED => {
                let count = run.ctl.ptr() + 4 * TOP_COUNT_WORD as u64;
                let sorted = self.merge_sort(&run.kept, 0, count, run.cap, run.k, 0)?;
                Ok(Some((sorted.into_pairs(kept), true)))
            }
            _ => Ok(None),
        }
    }
}
