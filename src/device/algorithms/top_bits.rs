//! The top-bits selection (radix_sort.cu `rsort_top_hist`, `rsort_top_filter`): the k smallest
//! of positional pairs, sorted, from a histogram of the key's top bits, a stable filter of the
//! pairs at or below the k-th smallest's bin, and the key's radix passes over those alone, all
//! enqueued on the device's counts and read back once.

use super::*;

/// The bins and control words (radix_sort.cu `TOP_BINS` and the words after them: done
/// counter, bound, status, tile ticket, kept count (u64), the bins' base (u64) and shift).
const TOP_BINS: usize = 4096;
const TOP_BOUND_WORD: usize = TOP_BINS + 1;
const TOP_STATUS_WORD: usize = TOP_BINS + 2;
/// Status: a kept bin holds more than half a segment-sort tile (radix_sort.cu).
const TOP_STATUS_CROWDED: u32 = 2;
const TOP_COUNT_WORD: usize = TOP_BINS + 4;
const TOP_WORDS: usize = TOP_BINS + 10;
/// Threads of bitonic.cu's `sort_segments` blocks (`SEGMENT_THREADS`), each sorting a tile of
/// a quarter of the sort tile's pairs.
const SEGMENT_THREADS: u32 = 256;
/// Pairs per tile of `rsort_top_filter` (`RSORT_THREADS` × `TOP_ITEMS`).
const TOP_FILTER_TILE: usize = RSORT_THREADS as usize * 16;

/// The buffer of kept pairs for a top-bits selection of k among n: uniform keys keep k plus
/// about n / 2048 (one bin: the bins span twice the sampled range); this leaves 8× that and
/// half of k for keys that crowd their bins.
pub fn top_bits_capacity(n: usize, k: usize) -> usize {
    (k + k / 2 + n / 256).min(n)
}

/// Whether a sampled selection of k among n pairs takes the top-bits selection: positional
/// 32- and 64-bit keys (row ids ascending in input order, as its second route needs) of the
/// sizes whose whole sort runs one kernel a pass (up to ~1.5M rows), for k from n / 128 to
/// below n / 8 (32-bit keys) or n / 4 (64-bit keys). H100, n = 2^20 (session 17): i32 uniform
/// k = 2^13 / 2^15 / 2^16 / 2^17 in 54 / 63 / 64 / 81 µs against 66 / 72 / 86 / 86 µs by the
/// levels or the whole sort; i64 67 / 86 µs against 98 / 196 µs at 2^16 / 2^17; below n / 128
/// its fixed ~45 µs loses to the levels, and from n / 4 its bins crowd. The cost model asks
/// the same. `GPU_TOPK_TOP_BITS=0` turns it off, `=1` takes it wherever it applies (A/B runs).
pub fn top_bits_sorts(kind: KeyKind, n: usize, k: usize, positional: bool) -> bool {
    let forced = std::env::var("GPU_TOPK_TOP_BITS").ok();
    let applies = positional
        && n > RANK_SORT_MAX
        && k > 0
        && top_bits_capacity(n, k).div_ceil(radix_sort_wide_tile(kind)) <= ONESWEEP_WIDE_MAX_TILES
        && radix_sort_is_wide(kind, n);
    let below = match kind {
        KeyKind::K32 => 8,
        KeyKind::K64 => 4,
        _ => return false,
    };
    match forced.as_deref() {
        Some("0") => false,
        Some("1") => applies,
        _ => applies && k.saturating_mul(128) >= n && k.saturating_mul(below) < n,
    }
}

/// A top-bits selection enqueued by [`TopKEngine::top_bits_enqueue`]: what its second route
/// needs, and its sorted output, valid when the status read back is clear.
#[derive(Debug)]
pub(super) struct TopBitsRun {
    keys: u64,
    n: usize,
    cap: usize,
    ctl: PooledBuffer,
    kept: DevicePairs,
    out: DevicePairs,
}

/// Byte offsets in a top-bits selection's control block (u32 words): the bins and their
/// words, the scatter's per-bin fill counters, the radix sort's bucket offsets per key byte,
/// its plan and tickets, the stable filter's done counter, then its tiles' look-back words.
struct TopBitsLayout {
    fill: u64,
    hist: u64,
    plan: u64,
    tickets: u64,
    done: u64,
    words: u64,
    bytes: usize,
}

impl TopBitsLayout {
    fn new(kind: KeyKind, n: usize) -> Self {
        let positions = kind.key_bytes() as u64;
        let fill = (4 * TOP_WORDS) as u64;
        let hist = fill + 4 * TOP_BINS as u64;
        let plan = hist + 4 * 256 * positions;
        let tickets = plan + 4 * positions;
        let done = tickets + 4 * positions;
        let words = done + 4;
        let bytes = words as usize + 4 * n.div_ceil(TOP_FILTER_TILE);
        TopBitsLayout {
            fill,
            hist,
            plan,
            tickets,
            done,
            words,
            bytes,
        }
    }
}

impl TopKEngine {
    /// Enqueues the top-bits selection of k among the `n` positional pairs of `input`: a
    /// memset and four launches, no read-back (see radix_sort.cu).
    pub(super) fn top_bits_enqueue(
        &self,
        input: &DevicePairs,
        n: usize,
        k: usize,
    ) -> GpuResult<TopBitsRun> {
        debug_assert!(input.positional && k > 0);
        let k = k.min(n);
        let cap = top_bits_capacity(n, k);
        let layout = TopBitsLayout::new(self.kind, n);
        let ctl = self.device.pool.alloc(layout.bytes, &self.stream)?;
        self.memset_zero(ctl.ptr(), layout.bytes)?;
        let kept = self.alloc_pairs(cap)?;
        let out = self.alloc_pairs(cap)?;
        let c = ctl.ptr();
        let grid = (2 * self.device.sm_count).min(n.div_ceil(RSORT_THREADS as usize * 4)) as u32;
        // The scatter's threads take 16 keys each (radix_sort.cu `SCATTER_ITEMS`).
        let scatter_grid = n
            .div_ceil(RSORT_THREADS as usize * 16)
            .min(8 * self.device.sm_count);
        self.launch(
            &self.kernel("rsort_top_window"),
            1,
            RSORT_THREADS,
            0,
            args![input.key_at(0), n, k, c],
        )?;
        self.launch(
            &self.kernel("rsort_top_hist"),
            grid,
            RSORT_THREADS,
            0,
            args![input.key_at(0), n, k, cap, c],
        )?;
        self.launch(
            &self.kernel("rsort_top_scatter"),
            scatter_grid as u32,
            RSORT_THREADS,
            0,
            args![
                input.key_at(0),
                n,
                c,
                c + layout.fill,
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
            keys: input.key_at(0),
            n,
            cap,
            ctl,
            kept,
            out,
        })
    }

    /// Reads a top-bits selection's status back (one round trip): its sorted pairs; where a
    /// kept bin was too large for the segment sort, the second route (the stable filter and
    /// the key's radix passes) run first; `None` when more pairs shared the k-th smallest's
    /// bins than its buffers hold (nothing sorted).
    pub(super) fn top_bits_complete(
        &mut self,
        run: TopBitsRun,
    ) -> GpuResult<Option<(DevicePairs, bool)>> {
        let status_at = run.ctl.ptr() + 4 * TOP_STATUS_WORD as u64;
        let status =
            u32::from_le_bytes(self.read_bytes(status_at, 4)?.try_into().expect("4 bytes"));
        match status {
            0 => Ok(Some((run.out, false))),
            TOP_STATUS_CROWDED => {
                self.memset_zero(status_at, 4)?;
                self.top_bits_stable(&run)?;
                Ok(Some((run.out, true)))
            }
            _ => Ok(None),
        }
    }

    /// The second route of a top-bits selection whose histogram ran: the pairs at or below
    /// the bound kept in input order (radix_sort.cu `rsort_top_filter`), then the key's radix
    /// passes on the device's count, into `run.out`.
    fn top_bits_stable(&self, run: &TopBitsRun) -> GpuResult<()> {
        let (n, cap) = (run.n, run.cap);
        let positions = self.kind.key_bytes();
        let wide = radix_sort_is_wide(self.kind, cap);
        let tiles = cap.div_ceil(if wide {
            radix_sort_wide_tile(self.kind)
        } else {
            radix_sort_tile(self.kind)
        });
        let pass_words = if wide {
            (tiles + tiles.div_ceil(LOOKBACK_GROUP) + 1) * 256
        } else {
            tiles * 256
        };
        let lookback_words = positions * pass_words;
        // Freed to the pool in stream order, after the passes.
        let lookback = self
            .device
            .pool
            .alloc(4 * lookback_words.max(1), &self.stream)?;
        let tmp = self.alloc_pairs(cap)?;
        let layout = TopBitsLayout::new(self.kind, n);
        let c = run.ctl.ptr();
        self.launch(
            &self.kernel("rsort_top_filter"),
            n.div_ceil(TOP_FILTER_TILE) as u32,
            RSORT_THREADS,
            0,
            args![
                run.keys,
                n,
                c,
                run.kept.key_at(0),
                run.kept.id_at(0),
                c + layout.words,
                c + layout.hist,
                c + layout.plan,
                lookback.ptr(),
                lookback_words,
                c + layout.done
            ],
        )?;
        for p in 0..positions {
            let mut args = args![p as u32, 0u32].to_vec();
            args.extend_from_slice(&sort_buffers(&run.kept, &tmp, &run.out));
            args.extend_from_slice(args![
                cap,
                c + layout.hist,
                c + layout.plan,
                lookback.ptr(),
                c + layout.tickets
            ]);
            let count = c + 4 * TOP_COUNT_WORD as u64;
            self.launch_sort_pass(wide, tiles, args, 0, count)?;
        }
        Ok(())
    }
}
