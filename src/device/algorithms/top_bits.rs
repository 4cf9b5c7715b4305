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

/// The buffer of kept pairs for a top-bits selection of k among n: uniform keys keep k plus
/// one bin (a few hundred pairs at n = 2^20); this leaves half of k and n / 256 more for
/// keys that crowd their bins.
pub fn top_bits_capacity(n: usize, k: usize) -> usize {
    (k + k / 2 + n / 256).min(n)
}

/// Whether a sampled selection of k among n pairs takes the top-bits selection: positional 32- and
/// 64-bit keys (the scatter writes positions as row ids) of the sizes whose whole sort runs one
/// kernel a pass (up to ~1.5M rows), for k from n / 256 up to n / 4 (32-bit keys) or below 3n / 4
/// (64-bit). H100, n = 2^20 (the uniform keys' time against that of the sampled levels
/// or the whole sort): i32 k = 2^12 / 2^15 / 2^16 / 2^17 / 2^18 in 31 / 34 / 37 / 41 / 52 µs
/// against 47 / 71 / 86 / 86 / 85; i64 32 / 36 / 40 / 47 / 53 against 59 / 76 / 97 / 193 / 194, and
/// 75 / 89 µs at 2^19 / 5·2^17 against 194 / 193. Past those, 32-bit keys lose: their whole sort
/// takes 83–88 µs, and f32 keys in [0, 1) crowd a bin (180 µs at 2^19). Where the sample shows
/// clusters, the bins follow the sample's quantiles (f32 NaN mixes at k = 2^12 / 2^13 /
/// 2^15 / 2^16 in 55 / 55 / 59 / 69 µs against 66 / 77 / 96 / 125, f64 59 / 61 / 69 / 77 against
/// 111–240, i32 zipf ties at 2^15 / 2^16 38 / 60 against 85 / 112), and up to k = n / 4 where the
/// sampled keys are distinct (f32 / f64 NaN mixes at 2^17 in 80 / 78 µs against 127 /
/// 231, at 3·2^16 81 / 81 against 124 / 227, at 2^18 84 / 89 against 119 / 226); with tie groups
/// the sample missed sorted on the device as big bins (i32 zipf ties at 3·2^15 – 2^18
/// in 70–92 µs against 113–116, i64 68–85 against 130–209, f32 / f64 at 2^15 60 / 57 against 93 /
/// 97); f64 keys' ties, whose coordinates are words alone, by tie pieces, and clusters and ties
/// of 64-bit keys up to k = 3n / 8 by quantile bins (same call: f64 zipf ties at
/// k = 2^16 – 2^18 in 92–113 µs against 204–216 for the whole sort after crowding was foreseen,
/// at 3n / 8 128 against 209; f64 NaN mixes at 3n / 8 114 against 230, f64 sorted 77 against 221,
/// i64 zipf ties 84 against 210); f32 zipf counts from k = n / 16 still take 84–118 µs (their
/// tie groups between sampled counts crowd big bins), where the routes before top bits took
/// 74–97 for 32-bit keys, and from n / 6 the whole sort after the sample foresees
/// crowding, 123 µs against 135–136; and
/// all-equal 32-bit keys at n / 4 take 45 µs against 34 for the whole sort, which skips the digits
/// they share. The cost model asks the same. `GPU_TOPK_TOP_BITS=0` turns it off, `=1` takes it
/// wherever it applies (A/B runs).
pub fn top_bits_sorts(kind: KeyKind, n: usize, k: usize, positional: bool) -> bool {
    static FORCED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let forced = FORCED.get_or_init(|| std::env::var("GPU_TOPK_TOP_BITS").ok());
    // Its buffers (at most n pairs) then fit the merge sort of its crowded route.
    // Positions below 2^21: 32-bit keys' coordinates then always hold them (common.cuh
    // `TopBins`: (word − w0) · n + position below 2^63).
    let applies = positional
        && k > 0
        && n < 1 << 21
        && matches!(kind, KeyKind::K32 | KeyKind::K64)
        && radix_sort_is_wide(kind, n);
    match forced.as_deref() {
        Some("0") => false,
        Some("1") => applies,
        _ => {
            let below = match kind {
                KeyKind::K32 => k.saturating_mul(4) <= n,
                _ => k.saturating_mul(4) < n.saturating_mul(3),
            };
            applies && k.saturating_mul(256) >= n && below
        }
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
                // read back: the merge sort's tiles and rounds took 41 µs for 5.6K pairs, the
                // rank sort 11 µs (H100, f32 NaN mix, n = 2^20, k = 2^12).
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
