//! The top-bits selection (radix_sort.cu `rsort_top_*`, bitonic.cu `sort_segments`): the k
//! smallest of positional pairs, sorted. A sample of the keys sets bins over (the key's top
//! word, position), so that equal keys spread by position: equal parts of the sample's range,
//! or as many bins for each interval between sampled keys where the sample shows clusters
//! that equal parts would crowd (a NaN mix's −NaN payloads; where the sample spans too many
//! 64-bit words for positions, the words alone, a sampled tie then one piece split by
//! position); a histogram finds the bin of the
//! k-th smallest; the pairs at or below it are scattered by bin, and each block sorts a few
//! bins: split in parts of a few pairs by their coordinates, placed by part, ranked in their
//! part (ties of 64-bit keys, which no part splits, by the register network); a kept bin too
//! large for a block (a tie group the sample missed: a "big bin") is split by a sample of its
//! own pairs, a block per slice (bitonic.cu `sort_big_bin`). Three launches on the device's
//! counts, read back once; a bin too large for those (over 32K pairs) makes the host sort the
//! kept pairs after the read-back, and one the sample foresees (from k = n/16; from n/6, for
//! 32-bit keys, sampled tie groups far apart such as floats of counts) all.

use super::*;

/// The bins' counts and control words (common.cuh `TOP_BINS` and the words after them: a
/// spare word, bound, status, a spare word, kept count (u64), the bins' base, scale, w0,
/// positions' bound and words' bound (u64 each), the count of quantile pieces, a spare word,
/// and the pieces' table of `TOP_QWORDS` u64 words).
const TOP_BINS: usize = 4096;
/// The most quantile pieces (common.cuh `TOP_QMAX`).
const TOP_QMAX: usize = 435;
const TOP_QWORDS: usize = 2 * TOP_QMAX + 1 + (TOP_QMAX + 2) / 2;
const TOP_STATUS_WORD: usize = TOP_BINS + 2;
/// Status: a kept bin holds more than 3/4 of a segment-sort tile (radix_sort.cu).
const TOP_STATUS_CROWDED: u32 = 2;
const TOP_COUNT_WORD: usize = TOP_BINS + 4;
const TOP_WORDS: usize = TOP_BINS + 18 + 2 * TOP_QWORDS;
const _: () = assert!(TOP_COUNT_WORD == TOP_STATUS_WORD + 2);
/// Threads of bitonic.cu's `sort_segments` blocks (`SEGMENT_THREADS`), each sorting the bins
/// that start in a quarter of its tile (a quarter of the sort tile's pairs).
const SEGMENT_THREADS: u32 = 256;
/// A segment-sort block takes the bins starting in one of this many parts of its tile
/// (bitonic.cu `SEGMENT_SPAN`): kept bins of up to 3/4 of the tile then fit (radix_sort.cu
/// `TOP_SEGMENT_BIN`).
const SEGMENT_SPANS_PER_TILE: usize = 4;
/// Keys a thread of `rsort_top_hist` and `rsort_top_scatter` takes per round (radix_sort.cu
/// `SCATTER_ITEMS`).
const SCATTER_ITEMS: usize = 16;
/// Words between the scatter's per-bin fill counters (radix_sort.cu `TOP_FILL_STRIDE`).
const TOP_FILL_STRIDE: usize = 8;

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
        // The bins and their words, the scatter's per-bin fill counters, then each segment
        // sort block's bins and pairs, or its big bin's slice (four words, read as one; and
        // one block past the last; radix_sort.cu `top_segments`).
        let tile = SEGMENT_THREADS as usize * sort_tile(self.kind) / SORT_THREADS as usize;
        let span = tile / SEGMENT_SPANS_PER_TILE;
        let segment_blocks = cap.div_ceil(span);
        let fill = (4 * TOP_WORDS) as u64;
        let seg = (fill + (4 * TOP_FILL_STRIDE * TOP_BINS) as u64).next_multiple_of(16);
        let ctl_bytes = seg as usize + 16 * (segment_blocks + 1);
        let ctl = self.device.pool.alloc(ctl_bytes, &self.stream)?;
        self.memset_zero(ctl.ptr(), seg as usize)?;
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
                span,
                c + seg,
                kept.key_at(0),
                kept.id_at(0)
            ],
        )?;
        self.launch(
            &self.kernel("bitonic_sort_segments"),
            segment_blocks as u32,
            SEGMENT_THREADS,
            tile * self.kind.pair_bytes(),
            args![
                kept.key_at(0),
                kept.id_at(0),
                c,
                c + seg,
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
    /// for the segment sort, the sort of all kept pairs, by the rank sort, the chunk rank sort
    /// or the merge sort truncated at k, as their count allows); `None` when
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
                // The sampled selection's choice for its survivors (sample.rs), by the count
                // read back: for a few thousand pairs the one-launch rank sort costs a fraction
                // of the merge sort's tiles and rounds.
                let count = run.ctl.ptr() + 4 * TOP_COUNT_WORD as u64;
                let sorted = if kept <= RANK_SORT_MAX {
                    self.rank_sort(&run.kept, kept)?
                } else if kept <= chunk_rank_max(self.kind) {
                    self.chunk_rank_sort(&run.kept, count, kept, 0)?
                } else {
                    self.merge_sort(&run.kept, 0, count, run.cap, run.k, 0)?
                        .into_pairs(kept)
                };
                Ok(Some((sorted, true)))
            }
            _ => Ok(None),
        }
    }
}
