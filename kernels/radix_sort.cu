// radix_sort.cu: LSD radix sort of (key, row id) pairs: a whole input of 32-bit keys whose row
// ids ascend in input order (4 passes), and sorts of more pairs than the merge sort takes
// (merge_sort.cu sorts the others: its rounds do not grow with the key width or the row ids).
//
// A pair is read as its virtual integer (common.cuh: row id below, key above) and sorted by
// 8-bit digits from the least significant up, each pass stable, so the result is ordered by
// (key, row id). Only the row id's low `id_digits` bytes are digits (the host knows an upper
// bound of the ids: the input's size for positional inputs). One pass per digit, in the manner
// of Onesweep (Adinets & Merrill, 2022):
//   hist   one read of the input builds the histograms of every digit position at once; the
//          last block turns each into exclusive bucket offsets and plans the passes: a digit
//          position with one bucket holding every pair moves nothing and is skipped (for the
//          survivors of a selection, which share the high key bits, and ids below 2^29, about
//          half of them), and each run pass gets its source and destination buffer;
//   pass   one kernel per digit position: a block takes the next tile (an atomic ticket, so
//          that every earlier tile's block is already running), ranks its pairs by digit
//          stably (warp by warp with match-any, then across warps in shared memory), publishes
//          its bucket counts and looks back over the earlier tiles' (decoupled look-back: a
//          tile's word says "my count" or "my inclusive prefix"), reorders the tile by digit
//          in shared memory and writes each bucket's run to bucket offset + earlier tiles'
//          count (coalesced writes, which with the windowed look-back about halve a pass).
//          Tiles of 2048 pairs (keys up to 64 bits) up to 64 tiles; `rsort_pass_wide`, tiles
//          of twice that, up to 384 of them, whose look-back reads the sums of groups of 16
//          tiles (`GroupLookback`: one round trip per digit); beyond, reduce-then-scan
//          (`rsort_count`, `rsort_scan`, then the pass without look-back).
// The file also holds the top-bits selection's kernels (`rsort_top_*`, below), which keep only
// the pairs that can be among the k smallest before a sort.
// The input is never written: passes alternate between a scratch buffer and the output, with
// the last pass landing in the output. A positional input sorted by its key digits alone
// comes without row ids (null): the first pass writes each pair's position, a third of the
// bytes it would read. Counts must stay below 2^30 (the look-back words keep
// two flag bits).

#include "common.cuh"

#define RSORT_THREADS 256
#define RSORT_WARPS (RSORT_THREADS / 32)
#define RSORT_RADIX 256
#define LOOKBACK_AGGREGATE (1u << 30)
#define LOOKBACK_INCLUSIVE (1u << 31)
#define LOOKBACK_VALUE ((1u << 30) - 1u)
#define LOOKBACK_WINDOW 32
#define HIST_UNROLL 4

// Pairs per thread in a pass: the tile is RSORT_THREADS × this.
template <class K> struct SortItems {
    enum { V = K::BITS <= 64 ? 8 : K::BITS == 128 ? 4 : 2 };
};

// Digit positions of the virtual integer: 8 row id bytes, then the key's.
template <class K> struct SortDigits {
    enum { MAX = 8 + K::BITS / 8 };
};

// Plan word of a digit position: bit 0 run; bits 1-2 source (0 input, 1 scratch, 2 output);
// bits 3-4 destination.
#define PLAN_RUN 1u

// Lowest virtual-integer bit of digit position p.
__device__ __forceinline__ int digit_lo(int p, int id_digits) { return p < id_digits ? 8 * p : 64 + 8 * (p - id_digits); }

__device__ __forceinline__ u32 ld_relaxed(const u32 *p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_relaxed(u32 *p, u32 v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The lanes of the warp whose digit (0..256) equals this lane's: one ballot per bit. Per bit:
// test, ballot, complement where the bit is clear, and (CUB's MatchAny, written in PTX; the
// compiler's form of the same loop took ~7 instructions a bit). Faster than the compiler's form
// and than __match_any_sync, which wins only on heavy ties.
__device__ __forceinline__ u32 match_digit(u32 d) {
    u32 peers = FULL_MASK;
#pragma unroll
    for (int b = 0; b < 9; ++b) {
        u32 mask;
        asm("{\n\t.reg .pred p;\n\t"
            "and.b32 %0, %1, %2;\n\t"
            "setp.eq.u32 p, %0, %2;\n\t"
            "vote.sync.ballot.b32 %0, p, 0xffffffff;\n\t"
            "@!p not.b32 %0, %0;\n\t}"
            : "=r"(mask)
            : "r"(d), "r"(1u << b));
        peers &= mask;
    }
    return peers;
}

// Adds a pair's digit of every position to the positions' histograms in shared memory
// (`sh`, positions × 256), one shared atomic each: warp_hist_add's check for a digit shared by
// the whole warp costs more than the conflicts it saves here, even on all-equal keys.
template <class K>
__device__ __forceinline__ void hist_add_all(u32 *sh, const K &k, u64 id, u32 id_digits, bool valid) {
    constexpr int D = SortDigits<K>::MAX;
    // Constant bit offsets (the row id's bytes, then the key's), so each digit is a shift.
#pragma unroll
    for (int q = 0; q < D; ++q) {
        const int p = q < 8 ? q : (int)id_digits + (q - 8);
        if (q < 8 && q >= (int)id_digits) continue;
        if (valid) atomicAdd(&sh[p * RSORT_RADIX + vbits(k, id, q < 8 ? 8 * q : 64 + 8 * (q - 8), 8)], 1u);
    }
}

// Histograms of all digit positions (`hist`, positions × 256, zero at launch) in one read;
// also zeroes the passes' look-back words. The last block converts the histograms to
// exclusive offsets and writes the plan (`plan`, one word per position).
template <class K>
__device__ void rsort_hist(const K *keys, const u64 *ids, u64 m, u32 id_digits, u32 *hist, u32 *plan,
                           u32 *lookback, u64 lookback_words, u32 *done) {
    constexpr int D = SortDigits<K>::MAX;
    __shared__ u32 sh[D * RSORT_RADIX];
    const int nd = (int)id_digits + K::BITS / 8;
    for (int i = threadIdx.x; i < nd * RSORT_RADIX; i += RSORT_THREADS) sh[i] = 0;
    const u64 stride = (u64)gridDim.x * RSORT_THREADS;
    for (u64 i = (u64)blockIdx.x * RSORT_THREADS + threadIdx.x; i < lookback_words; i += stride) lookback[i] = 0;
    __syncthreads();
    // HIST_UNROLL pairs per thread and round, their loads issued together (a grid of a few
    // blocks per SM is otherwise bound by one load's latency per round).
    for (u64 i0 = (u64)blockIdx.x * RSORT_THREADS * HIST_UNROLL; i0 < m; i0 += stride * HIST_UNROLL) {
        K ks[HIST_UNROLL];
        u64 is[HIST_UNROLL];
#pragma unroll
        for (int u = 0; u < HIST_UNROLL; ++u) {
            const u64 i = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
            ks[u] = i < m ? keys[i] : key_zero<K>();
            is[u] = i < m && id_digits != 0 ? ids[i] : 0; // no row id digit: 2/3 of the bytes unread
        }
#pragma unroll
        for (int u = 0; u < HIST_UNROLL; ++u) {
            hist_add_all(sh, ks[u], is[u], id_digits, i0 + (u64)u * RSORT_THREADS + threadIdx.x < m);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nd * RSORT_RADIX; i += RSORT_THREADS) {
        if (sh[i] != 0) atomicAdd(&hist[i], sh[i]);
    }
    if (!last_block_done(done)) return;
    __shared__ u32 runs[D];
    for (int p = 0; p < nd; ++p) {
        const u32 c = __ldcg(&hist[p * RSORT_RADIX + threadIdx.x]);
        // A position moves pairs unless one bucket holds them all.
        const int single = __syncthreads_or(c == (u32)m);
        const u32 offset = block_exclusive_sum(c);
        hist[p * RSORT_RADIX + threadIdx.x] = offset;
        if (threadIdx.x == 0) runs[p] = !single;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int total = 0;
    for (int p = 0; p < nd; ++p) total += runs[p];
    if (total == 0) { // all pairs equal in every digit (m ≤ 1): one pass still copies them out
        runs[0] = 1;
        total = 1;
    }
    // The last run lands in the output (2); going backwards, runs alternate scratch/output,
    // and the first reads the input (0).
    u32 src = 0;
    int seen = 0;
    for (int p = 0; p < nd; ++p) {
        if (!runs[p]) {
            plan[p] = 0;
            continue;
        }
        const u32 dst = ((total - 1 - seen) % 2 == 0) ? 2u : 1u;
        plan[p] = PLAN_RUN | (src << 1) | (dst << 3);
        src = dst;
        ++seen;
    }
}

// ---- the top-bits selection: the k smallest of a positional input, sorted ----
//
// A selection of k among n positional pairs (row ids = positions) that sorts only the pairs
// that can be among the k: those whose bin (below) is at most the k-th smallest's.
//   rsort_top_hist     one read of the keys: every block sets the bins (below) from a sample of
//                      the keys, then counts its keys' bins;
//   rsort_top_scatter  a second read: every block finds from the counts the bin of the k-th
//                      smallest (the bound), the count of pairs in it and below, each bin's
//                      start among them, and the status (whether they exceed the buffers,
//                      `cap`, or a bin holds more than TOP_BIG_BIN pairs); each pair at or below
//                      the bound goes to its bin's part of the buffer (a global atomic slot per
//                      pair), so the buffer is ordered by bin, in no order inside a bin; its
//                      block 0 writes each segment-sort block's bins (or big bin's slice);
//   bitonic_sort_segments (bitonic.cu)  one block per quarter tile of bin starts sorts its bins
//                      by (key, row id), into the output: by parts of the bins, then by rank
//                      in each part; a big bin (over 3/4 of a tile: a cluster of keys the bins
//                      did not split) by the blocks whose spans lie inside it, a slice each,
//                      split by its own sample.
// A bin too large for those (TOP_BIG_BIN) makes the host sort the kept pairs instead, after the
// read-back (top_bits.rs `top_bits_complete`).
// Bins are over a coordinate of (the key's top word, position) (TopBins): equal keys spread by
// position. top_window reads a strided sample of 256 keys and takes its smallest and a sample rank
// safely beyond the k-th smallest's expected one; the linear bins divide that range, from a
// sixteenth of it below the smallest, in equal parts (a 64-bit multiply-high by a scale:
// power-of-two widths left most of the bins above the k-th smallest and crowded the others), with
// coordinates further below in octave bins and those above in the last bin; bins stay monotone in
// the pair, so that the pairs near the k-th smallest spread over the bins whatever the keys' high
// bits share (sorted runs, narrow ranges, floats' exponents, ties). Where the sample shows clusters
// that equal parts would crowd (a gap between them, heavy ties below a long tail), the bins are
// quantile bins instead: as many for each interval between sampled keys. If the k-th smallest lies
// beyond the sampled rank, in the last bin (which holds the rest and is not counted): the status
// says the buffers overflow, and the host sorts the whole input instead.
#define TOP_SAMPLE RSORT_THREADS
#define TOP_CROWD_SAMPLES 8u
#define TOP_APART_WORDS 4096u
#define TOP_APART_GROUPS 4

// TOP_BINS, the control words, top_word, top_bin and TopBins: common.cuh (the segment sort
// computes bins too).

// The bins from the block's strided sample of the keys (n ≥ TOP_SAMPLE): the bins end at the
// sampled pair of rank e + 3√e + 16, e the k-th smallest's expected rank, and start a sixteenth of
// that range below the smallest. (A window up to rank 2e + 16 reached past zero for sorted floats
// at k = n/4, spreading the bins over dozens of octaves of encodings where one holds the k-th
// smallest, and foresaw crowding where there was none.) The sample is sorted by a network
// (ranking each key against all 256, twice, took most of a one-block kernel's time). The bins are
// linear, unless four consecutive sample intervals near the k-th smallest span under 1/64 of their
// share of the range (each interval stands for ~n/256 keys, which linear bins would crowd into a
// few); then they are quantile bins (TopBins, common.cuh). In a CPU simulation of the bins
// (n = 2^20), quantile bins cut NaN mixes' largest kept bin from thousands of keys or more to a few
// hundred, within the segment sort's 768 up to k = 2^18, while uniform, sorted, narrow and
// all-equal keys stay linear. Tie groups without a sampled key crowd a bin whatever its edges:
// the big bins' blocks sort those (bitonic.cu `sort_big_bin`). Quantile bins reach sample rank
// TOP_QWANT, k = 3n/8 (~25 bins an interval there): up to it, 64-bit keys with clusters or ties
// keep their bins instead of falling back to the much slower whole sort after foreseen crowding.
#define TOP_QWANT 144u
static_assert(3 * (TOP_QWANT + 1) <= TOP_QMAX, "every interval up to the rank cut in three pieces");
#define TOP_QSIDE 12u
// The most keys a linear bin may be expected to hold at k > n/4 (64-bit keys, coordinates that
// are words) before the bins are quantile bins instead: two thirds of the segment sort's bin
// (TOP_SEGMENT_BIN), above what sampling noise gives evenly spread keys (see top_window).
#define TOP_LOAD_MAX 512.0f
// An edge piece's share of the bins (256 an interval): its width over the mean width of its
// side's intervals, at most one interval's (the gap interval holds ~n/256 keys, as any).
__device__ __forceinline__ u32 top_edge_share(u64 width, u64 mean) {
    return max(1u, (u32)fminf(256.0f, 256.0f * __fdividef(__ull2float_rz(width), __ull2float_rz(max(mean, 1ull)))));
}

// The quantile pieces (TopBins) from the sorted sample's coordinates `s_coord` up to rank
// `want`, into `s_q` (shared); returns their count. Every thread of the block calls it, once.
// Inlined (the histogram's only caller): as a call it needed an 8-byte stack frame (a callee's
// register save beside the histogram's first 16 keys, loaded before it) once quantile bins
// reached every sample up to rank TOP_QWANT. The quantile loops below stay calls: inlined with
// this, their code slowed even the linear bins' histogram and scatter by half (instructions
// fetched cold after each L2 flush), where as calls they cost about a tenth.
// Where coordinates are words (`words`: equal keys share one), a run of r + 1 equal sampled
// words w (r empty intervals) is one tie piece [w, w + 1) with the r intervals' shares, spread
// by position (TopBins), and the interval after the run starts at w + 1; the range ends past
// the word of rank `want`, so that a run there is whole.
__device__ __forceinline__ u32 top_quantile_table(u32 want, u64 base, const u64 *s_coord, u64 *s_q, bool words,
                                                  u64 n) {
    __shared__ u32 s_total[2];
    const u32 t = threadIdx.x;
    // Interval 0 is [base, the smallest sampled pair), interval i + 1 from the i-th on;
    // thread t cuts interval t in 1–3 pieces: (start, share of the bins), share 0 for none.
    const u32 m = want + 1;
    u64 lo[3] = {0, 0, 0};
    u32 share[3] = {0, 0, 0};
    // The range's end (read where used: kept in registers, it made the histogram of 64-bit
    // keys spill).
    const auto end = [&]() { return s_coord[want] + (words && s_coord[want] != ~0ull); };
    // Whether the interval before t's is empty (a run's, when coordinates are words).
    const bool after_empty = words && t >= 2 && t < m && s_coord[t - 2] == s_coord[t - 1];
    // A run's empty intervals: the first starts the tie piece, the others add their shares to
    // it (shares without a piece of their own).
    const bool empty = t < m && words && t >= 1 && s_coord[t - 1] == s_coord[t];
    if (empty) {
        lo[0] = s_coord[t];
        share[0] = 256u;
    } else if (t < m) {
        const u64 a = (t == 0 ? base : s_coord[t - 1]) + after_empty, b = t == want ? end() : s_coord[t];
        const u64 width = b - a;
        // The mean widths of up to TOP_QSIDE intervals on each side (4 missed the end of a −NaN
        // cluster 9 mean widths beyond its last sampled key, crowding thousands of keys into a
        // bin; 12 see it).
        const u32 l0 = t >= TOP_QSIDE ? t - TOP_QSIDE : 0, r1 = min(m, t + TOP_QSIDE + 1);
        const u64 left = t > 0 ? (a - (l0 == 0 ? base : s_coord[l0 - 1])) / (t - l0) : 0;
        const u64 right = t + 1 < m ? (s_coord[r1 - 1] - b) / (r1 - 1 - t) : 0;
        lo[0] = a;
        if ((t == 0 || left < width / 8) && (t + 1 == m || right < width / 8)) {
            // A gap between clusters (a density that only rises across an interval, as
            // from a zipf tail to its ties, stays one piece): its ends as wide as 4 mean
            // intervals on their side, and the rest.
            const u64 dl = t == 0 || left >= width / 8 ? width / 2 : min(width / 2, 4 * left);
            const u64 rest = width - dl, dr = t + 1 == m || right >= rest / 4 ? rest : 4 * right;
            share[0] = dl == 0 ? 0u : t == 0 ? 128u : top_edge_share(dl, left);
            lo[1] = a + dl;
            share[1] = rest != dr ? 128u : 0u;
            lo[2] = b - dr;
            share[2] = dr == 0 ? 0u : t + 1 == m ? 128u : top_edge_share(dr, right);
        } else {
            share[0] = 256u;
        }
    }
    const bool pieceless = empty && after_empty;
    u32 cnt = 0, mine = 0;
#pragma unroll
    for (u32 j = 0; j < 3; ++j) {
        cnt += share[j] != 0 && !pieceless;
        mine += share[j];
    }
    u32 piece = block_exclusive_sum(cnt);
    u32 before = block_exclusive_sum(mine);
    if (t == m - 1) {
        s_total[0] = piece + cnt;
        s_total[1] = before + mine;
    }
    __syncthreads();
    // Piece p's first bin: p plus its shares' prefix of the other bins (at least one each).
    const u32 pieces = s_total[0], shares = s_total[1];
    u32 *first = reinterpret_cast<u32 *>(s_q + TOP_QFIRST);
#pragma unroll
    for (u32 j = 0; j < 3; ++j) {
        if (share[j] != 0 && !pieceless) {
            s_q[piece] = lo[j];
            first[piece] = piece + before * (TOP_LINEAR - pieces) / shares; // < 2^28: u32
            before += share[j];
            ++piece;
        }
    }
    if (t == 0) {
        s_q[pieces] = end();
        first[pieces] = TOP_LINEAR;
    }
    __syncthreads();
    for (u32 p = t; p < pieces; p += RSORT_THREADS) {
        const u64 width = s_q[p + 1] - s_q[p];
        const u32 len = first[p + 1] - first[p];
        // len / width · 2^64, a little less (single precision: no division subroutine), the low
        // bit clear; a piece of one word (or none) when coordinates are words spreads by
        // position: len / n · 2^64, the low bit set (1 alone: fewer positions than bins).
        if (words && width <= 1) {
            const float r = __fdividef((float)len, __ull2float_ru(n)) * (1.0f - 1e-5f);
            s_q[TOP_QSCALE + p] = len >= n ? 1ull : (u64)((double)r * 18446744073709551616.0) | 1ull;
        } else {
            const float r = __fdividef((float)len, __ull2float_ru(width)) * (1.0f - 1e-5f);
            s_q[TOP_QSCALE + p] = width <= len ? 0 : (u64)((double)r * 18446744073709551616.0) & ~1ull;
        }
    }
    __syncthreads();
    return pieces;
}

template <class K> __device__ __forceinline__ void top_window(const K *keys, u64 n, u64 k, TopBins &bins, bool &crowded) {
    __shared__ K s_key[TOP_SAMPLE];
    __shared__ u64 sample[TOP_SAMPLE], s_pos[TOP_SAMPLE], s_coord[TOP_SAMPLE];
    __shared__ u64 s_q[TOP_QWORDS];
    __shared__ u32 s_bin[TOP_SAMPLE];
    __shared__ int s_crowded, s_quant;
    const u32 t = threadIdx.x;
    const u64 step = n / TOP_SAMPLE;
    // Thread t holds the sample's t-th smallest (key, position).
    K key = keys[(u64)t * step];
    u64 pos = (u64)t * step;
    block_sort_pairs<RSORT_THREADS>(key, pos, s_key, s_pos);
    const u64 w = top_word(key);
    // The k-th smallest's expected sample rank e, and the window's end: 3σ and 16 beyond it.
    const u32 e = (u32)(TOP_SAMPLE * k / n), root = (u32)__fsqrt_rd((float)e);
    const u32 want = min((u32)TOP_SAMPLE - 1, e + (u32)(3.0f * __fsqrt_rn((float)e)) + 16);
    if (t == 0) s_crowded = s_quant = 0;
    sample[t] = w; // the network's last shared reads ended at its last barrier
    s_pos[t] = pos;
    __syncthreads();
    const u64 mn = sample[0], hi = sample[want];
    // Coordinates with positions where the sample's words span fewer than 2^63 / n (always for
    // 32-bit keys); keys 2^40 words below its smallest share coordinate 0.
    bins.n = n;
    bins.dlim = 1ull << (63 - (64 - __clzll((long long)(n - 1)))); // ≤ 2^63 / n, no division
    bins.w0 = mn - min(mn, 1ull << 40);
    if (hi - bins.w0 >= bins.dlim) bins.w0 = ~0ull;
    bins.m = 0;
    bins.q = s_q;
    const u64 c0 = bins.coord(mn, s_pos[0]), range = bins.coord(hi, s_pos[want]) - c0;
    bins.base = c0 - min(c0, range / 16);
    // The linear bins' coordinates, [base, base + span]: TOP_LINEAR / (span + 1) · 2^64, a
    // little less, so that the last of them stays below the last bin.
    const u64 span = c0 - bins.base + range;
    bins.scale = span < TOP_LINEAR ? 0 : (u64)((double)TOP_LINEAR / ((double)span + 1.0) * (1.0 - 1e-9) * 18446744073709551616.0);
    s_coord[t] = bins.coord(w, pos);
    __syncthreads();
    // The windows checked: up to the sample rank the k-th smallest reaches (2σ), whose bins
    // are kept (the ties below a zipf tail, which lie beyond it at small k, are not: with 4σ
    // those ties switched the bins to quantile ones, which spread a zipf tail several times
    // worse than linear bins).
    const u32 reach = min(want, e + 2 * root + 2);
    // Where coordinates are words, from k = n/16, any sampled tie up to the rank checked for
    // crowding too: a linear bin holds all of its word's keys (f64 zipf ties at k = n/16: counts
    // 4–7 of ~13K–32K keys, one bin each, crowding foreseen), a tie piece splits them by
    // position. (Below n/16 tie pieces do not pay: linear bins keep few pairs, which are
    // merge-sorted after the read-back when a bin crowds.)
    // (Top bits runs 32- and 64-bit keys only: wider keys' instances skip the quantile bins,
    // whose registers would spill beside their 16 keys a thread.)
    // Beyond k = n/4, 64-bit keys whose coordinates are words: also where the linear bins would
    // hold more than TOP_LOAD_MAX keys a bin at sixteen sample intervals (~n/16 keys) up to the
    // rank checked; their bins are span / TOP_LINEAR coordinates wide. Doubles of uniform values
    // double their density every octave of encodings: at k = 5n/16 and 3n/8 of f64 keys in
    // [0, 1) the kept bins of the top octave hold ~500–700 keys, near the segment sort's big bins,
    // whose kernel is several times slower. Sixteen intervals rather than four, so that sampling
    // noise in evenly spread keys (at most ~480 keys a bin, simulated) stays below the line and
    // only such densities switch the bins.
    if (K::BITS <= 64 && bins.scale != 0 &&
        ((t + 4 <= reach && __ull2float_rz(s_coord[t + 4] - s_coord[t]) * (64.0f * want) <
                                4.0f * __ull2float_rz(s_coord[want] - s_coord[0])) ||
         (bins.w0 == ~0ull && 16 * k >= n && t < want && s_coord[t] == s_coord[t + 1]) ||
         (K::BITS == 64 && bins.w0 == ~0ull && 4 * k > n && want <= TOP_QWANT && t + 16 <= reach &&
          __ull2float_rz(s_coord[t + 16] - s_coord[t]) * (16.0f * TOP_LOAD_MAX * TOP_LINEAR) <
              __ull2float_rz(span) * (float)n)))
        s_quant = 1;
    __syncthreads();
    // Clusters: quantile bins, ≥ 24 of them an interval, up to rank TOP_QWANT; at larger k
    // (64-bit keys above ~3n/8), crowding foreseen.
    if (K::BITS <= 64 && s_quant) {
        if (want <= TOP_QWANT) {
            bins.m = top_quantile_table(want, bins.base, s_coord, s_q, bins.w0 == ~0ull, n);
        } else if (t == 0) {
            s_crowded = 1; // read after the barrier below
        }
    }
    // Crowding foreseen: TOP_CROWD_SAMPLES sampled pairs up to that rank in one bin, each
    // standing for ~n/256 keys (a cluster narrower than a bin; equal keys only where the
    // coordinates are words): ~32K pairs, TOP_BIG_BIN. Bins are monotone in the pair, so those
    // are consecutive in the sorted sample. Uniform keys spread those up to 256 samples over ~3400
    // bins. Only from k = n/16: below, the few kept pairs merge-sorted after the read-back beat
    // sorting all n. (With fewer than 8 samples, crowding was foreseen where the big bins'
    // blocks sort faster than the whole sort.)
    const u32 bin = bins.bin(w, pos);
    s_bin[t] = bin;
    __syncthreads();
    if (16 * k >= n && t + TOP_CROWD_SAMPLES - 1 <= want && s_bin[t + TOP_CROWD_SAMPLES - 1] == bin) s_crowded = 1;
    // From k = n/6, 32-bit keys: sampled tie groups (two sampled pairs or more) whose words lie
    // far apart, at least TOP_APART_GROUPS boundaries between them up to the rank checked
    // (floats of integer counts: f32 zipf ties, consecutive counts 2^20–2^23 encodings apart;
    // 6–8 such boundaries from k = n/16, a CPU simulation of the sample). Each group then sits
    // alone in a gap ~2^20·n coordinates wide, where the groups the sample misses or samples once
    // crowd big bins whatever the bins' edges, and from k ≈ n/6 the whole sort after the
    // read-back is faster than the big bins' blocks (below, they are faster).
    if (K::BITS == 32 && 6 * k >= n) {
        const bool apart = t >= 1 && t + 2 <= want && sample[t - 1] == sample[t] && sample[t + 1] == sample[t + 2] &&
                           sample[t + 1] - sample[t] > TOP_APART_WORDS;
        if (__syncthreads_count(apart) >= TOP_APART_GROUPS && t == 0) s_crowded = 1;
    }
    __syncthreads();
    crowded = s_crowded != 0;
}

// Loads keys i0 + u·RSORT_THREADS + threadIdx.x (u < N) of [0, n), all issued together.
template <class K, int N> __device__ __forceinline__ void load_strided_keys(const K *keys, u64 n, u64 i0, K (&ks)[N]) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
        const u64 i = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
        if (i < n) ks[u] = keys[i];
    }
}

// Keys a thread of rsort_top_hist and rsort_top_scatter takes per round, their loads issued
// together (one round each at n = 2^20: in rounds of 4, each waited on DRAM).
#define SCATTER_ITEMS 16

// The histogram's count of the keys from i0 on (the first round's in `ks`) into `sh`.
template <class K>
__device__ __forceinline__ void top_count(const K *keys, u64 n, u64 i0, u64 stride, K (&ks)[SCATTER_ITEMS],
                                          const TopBins &bins, u32 *sh) {
    for (; i0 < n; i0 += stride) {
#pragma unroll
        for (int u = 0; u < SCATTER_ITEMS; ++u) {
            const u64 i = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
            const u32 bin = bins.bin_of<false>(top_word(ks[u]), i);
            if (i < n && bin < TOP_BINS - 1) atomicAdd(&sh[bin], 1u);
        }
        load_strided_keys(keys, n, i0 + stride, ks);
    }
}

// The bins in the block's shared memory, for a call (as parameters they took a stack frame).
__device__ __forceinline__ const TopBins *top_bins_in_shared(const TopBins &bins) {
    __shared__ TopBins shared_bins;
    if (threadIdx.x == 0) shared_bins = bins;
    __syncthreads();
    return &shared_bins;
}

// The quantile table `q` of m pieces (the control block's, for the scatter) copied into the
// block's shared memory (every thread calls it).
__device__ __forceinline__ const u64 *top_table_in_shared(const u64 *q, u32 m) {
    __shared__ u64 table[TOP_QWORDS];
    top_table_copy(table, q, m);
    __syncthreads();
    return table;
}

// The quantile bins' loops look up only the pairs that can count: a warp gathers those of
// TOP_CHUNK keys a lane (below `limit`: the table's end for the histogram, the end of the
// bound's piece for the scatter) into shared memory, and each lane looks up every 32nd of them
// (a binary search of ~9 steps over the pieces), instead of every key (at k = n/16 the table
// ends near sample rank 44 of 256: ~83% of the keys lie above it), which saves both kernels a
// good part of their time on NaN mixes and ties. (Four keys a lane: with the histogram's other
// arrays, 64-bit keys' buffer fills the 48 KB of static shared memory.)
#define TOP_CHUNK 4
template <class K> struct TopGathered {
    K key[RSORT_THREADS / 32][32 * TOP_CHUNK];
    u32 pos[RSORT_THREADS / 32][32 * TOP_CHUNK];
};

// Gathers the chunk's keys, the first TOP_CHUNK of `ks` (key u at i0 + u·RSORT_THREADS + the
// thread), whose coordinate is below `limit` into the warp's part of `g`; returns their count
// (the same in every lane).
template <class K>
__device__ __forceinline__ u32 top_gather(const K (&ks)[SCATTER_ITEMS], u64 n, u64 i0, const TopBins &bins, u64 limit,
                                          TopGathered<K> &g) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 count = 0;
#pragma unroll
    for (int u = 0; u < TOP_CHUNK; ++u) {
        const u64 i = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
        const bool in = i < n && bins.coord(top_word(ks[u]), i) < limit;
        const u32 mask = __ballot_sync(~0u, in);
        if (in) {
            const u32 at = count + __popc(mask & ((1u << lane) - 1));
            g.key[warp][at] = ks[u];
            g.pos[warp][at] = (u32)i; // < n < 2^21
        }
        count += __popc(mask);
    }
    __syncwarp();
    return count;
}

// Moves the round's keys TOP_CHUNK places down for the next chunk: the chunks' loop stays
// rolled (the key indices constant: registers). Unrolled, its four copies of the gather and the
// lookups made the quantile histogram's loop ~40 KB of instructions, the scatter's more, and
// most issue slots stalled on instruction fetch.
template <class K> __device__ __forceinline__ void top_next_chunk(K (&ks)[SCATTER_ITEMS]) {
#pragma unroll
    for (int u = 0; u + TOP_CHUNK < SCATTER_ITEMS; ++u) ks[u] = ks[u + TOP_CHUNK];
}

// The quantile loops of the histogram and the scatter: f(key, position, bin) by one lane for
// each pair from i0 on (the first round's keys in `ks`) whose coordinate is below `limit`,
// gathered a chunk at a time.
template <class K, class F>
__device__ __forceinline__ void top_each_gathered(const K *keys, u64 n, u64 i0, u64 stride, K (&ks)[SCATTER_ITEMS],
                                                  const TopBins &bins, u64 limit, F f) {
    __shared__ TopGathered<K> g;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (; i0 < n; i0 += stride) {
#pragma unroll 1
        for (int u0 = 0; u0 < SCATTER_ITEMS; u0 += TOP_CHUNK) {
            const u32 count = top_gather(ks, n, i0 + (u64)u0 * RSORT_THREADS, bins, limit, g);
            for (u32 j = lane; j < count; j += 32) {
                const K key = g.key[warp][j];
                const u32 pos = g.pos[warp][j];
                f(key, pos, bins.bin_of<true>(top_word(key), pos));
            }
            __syncwarp();
            top_next_chunk(ks);
        }
        load_strided_keys(keys, n, i0 + stride, ks);
    }
}

// top_count over quantile bins, loading its own keys (not inlined: see top_quantile_table).
template <class K>
__device__ __noinline__ void top_count_quantile(const K *keys, u64 n, u64 i0, u64 stride, const TopBins *shared_bins,
                                                u32 *sh) {
    const TopBins bins = *shared_bins; // its table is top_window's, in shared memory
    K ks[SCATTER_ITEMS];
    load_strided_keys(keys, n, i0, ks);
    // Above the table's end: the last bin, not counted.
    top_each_gathered(keys, n, i0, stride, ks, bins, bins.q[bins.m], [&](const K &, u32, u32 bin) {
        if (bin < TOP_BINS - 1) atomicAdd(&sh[bin], 1u);
    });
}

// The histogram: every block computes the bins from the sample itself (cheaper than a one-block
// kernel's launch), block 0 writes them for the scatter, and each block adds its keys' bins to the
// counts in `top`. The keys above the bins' span (the last bin, where the linear bins clamp: most
// keys, ~55–85% of uniform ones) are not counted: one shared counter took ~3/4 of each warp's
// atomics. The counts are turned into the bound and the bins' starts by each block of the scatter
// and of the segment sort, not by a last block here (its fence and serial scan took a large part of
// this kernel's time).
template <class K> __device__ void rsort_top_hist(const K *keys, u64 n, u64 k, u32 *top) {
    __shared__ u32 sh[TOP_BINS];
    for (u32 i = threadIdx.x; i < TOP_BINS; i += RSORT_THREADS) sh[i] = 0;
    // The first round's keys are loaded while the block computes the bins from the sample.
    const u64 stride = (u64)gridDim.x * RSORT_THREADS * SCATTER_ITEMS;
    u64 i0 = (u64)blockIdx.x * RSORT_THREADS * SCATTER_ITEMS;
    K ks[SCATTER_ITEMS];
    load_strided_keys(keys, n, i0, ks);
    TopBins bins;
    bool crowded;
    top_window(keys, n, k, bins, crowded);
    // Block 0 writes the bins (and the quantile pieces) for the scatter and the segment sort.
    if (blockIdx.x == 0) {
        bins.store(top);
        // Foreseen crowding skips the rest: the host sorts the whole input after the read-back.
        if (crowded && threadIdx.x == 0) top[TOP_STATUS] = TOP_STATUS_FORESEEN;
    }
    if (crowded) return; // every block
    // (Quantile bins for 32- and 64-bit keys only: see top_window.)
    bool linear = bins.m == 0;
    if constexpr (K::BITS > 64) linear = true;
    if (linear) {
        top_count(keys, n, i0, stride, ks, bins, sh);
    } else {
        top_count_quantile(keys, n, i0, stride, top_bins_in_shared(bins), sh);
    }
    __syncthreads();
    // Each block starts its flush at a bin of its own: in the same order, all blocks' atomics
    // would queue on the same few counters.
    for (u32 j = threadIdx.x; j < TOP_BINS - 1; j += RSORT_THREADS) {
        const u32 i = (j + blockIdx.x * 97u) % (TOP_BINS - 1);
        if (sh[i] != 0) atomicAdd(&top[i], sh[i]);
    }
}

// From the bins' counts (`top`, final): the bin of the k-th smallest (the bound), the count of
// pairs in it and below, each bin's start among them (into `start`), and the status: more of
// them than the buffers (`cap`) or fewer counted keys than k (the k-th smallest lies above the
// bins) overflow; a kept bin larger than the big-bin blocks take (TOP_BIG_BIN) is crowded. Every
// thread of the block calls it.
struct TopBound {
    u32 bound, status;
    u64 kept;
};
__device__ __forceinline__ TopBound top_bound(const u32 *top, u64 k, u64 cap, u32 *start) {
    __shared__ u32 s_bound, s_crowded;
    __shared__ u64 s_kept;
    // Thread t holds bins [PER·t, PER·t + PER); the one whose bins reach k finds the bound.
    constexpr u32 PER = TOP_BINS / RSORT_THREADS;
    u32 c[PER], sum = 0;
#pragma unroll
    for (u32 j = 0; j < PER; ++j) {
        c[j] = top[threadIdx.x * PER + j];
        sum += c[j];
    }
    if (threadIdx.x == 0) {
        s_bound = TOP_BINS;
        s_crowded = 0;
        s_kept = 0;
    }
    const u32 before = block_exclusive_sum(sum);
    if (before < k && k <= (u64)before + sum) {
        u32 run = before, bound = 0;
#pragma unroll
        for (u32 j = 0; j < PER; ++j) {
            if (run < k) bound = threadIdx.x * PER + j;
            run += run < k ? c[j] : 0u;
        }
        s_bound = bound;
        s_kept = run;
    }
    u32 at = before;
#pragma unroll
    for (u32 j = 0; j < PER; ++j) {
        start[threadIdx.x * PER + j] = at;
        at += c[j];
    }
    __syncthreads();
    bool crowded = false;
#pragma unroll
    for (u32 j = 0; j < PER; ++j) crowded |= threadIdx.x * PER + j <= s_bound && c[j] > TOP_BIG_BIN;
    if (crowded) s_crowded = 1;
    __syncthreads();
    const u32 status = s_bound == TOP_BINS || s_kept > cap ? TOP_STATUS_OVERFLOW : s_crowded ? TOP_STATUS_CROWDED : 0u;
    return {s_bound, status, s_kept};
}

// For the segment sort (bitonic.cu `sort_segments`), from the bins' starts (`start`, shared,
// from top_bound): for each of its blocks j, whose pairs are the bins starting in
// [j·span, (j+1)·span), its bins and their pairs (`seg[4j..4j+4)`: first bin, its start, one past
// the last bin, one past the last pair), so that a block reads its range at once: a prefix over
// all bins in each block was most of its instructions, and reading a bin's start after its index
// one more round trip. A big bin (over TOP_SEGMENT_BIN pairs; the last bin starting in its
// block's span, as it spans more than two) is left out of that block's range, and the blocks
// whose spans lie inside it, which have no bin of their own, take its slices of 2·span pairs in
// turn: their entry is (bin, its start, TOP_BIG_SLICE | slice, its end; common.cuh); there are at least as
// many of them as slices (⌊c/span⌋ − 1 ≥ ⌈c/(2·span)⌉ for c > 3·span), so that no block is
// launched for big bins (one for each possible slice, in front of the launch, slowed the segment
// sort even of uniform keys). Every thread of block 0.
__device__ __forceinline__ void top_segments(const u32 *start, TopBound b, u64 span, u32 *seg) {
    if (threadIdx.x == 0) seg[0] = seg[1] = 0;
    for (u32 i = threadIdx.x; i <= b.bound; i += RSORT_THREADS) {
        const u64 s0 = start[i], s1 = i < b.bound ? start[i + 1] : b.kept;
        const bool large = s1 - s0 > TOP_SEGMENT_BIN;
        // Blocks whose span starts in (s0, s1] start at bin i + 1 (or take a slice of bin i if
        // their span lies inside it); the block before each ends there, or before bin i for the
        // block of bin i's start if bin i is big. The last bin also ends the last block.
        const u64 home = s0 / span, last = i < b.bound ? s1 / span : (b.kept + span - 1) / span;
        for (u64 j = home + 1; j <= last; ++j) {
            const bool inside = large && (j + 1) * span <= s1;
            seg[4 * j] = inside ? i : i + 1;
            seg[4 * j + 1] = (u32)(inside ? s0 : s1);
            if (j - 1 == home) {
                seg[4 * j - 2] = large ? i : i + 1;
                seg[4 * j - 1] = (u32)(large ? s0 : s1);
            } else {
                seg[4 * j - 2] = large && j * span <= s1 ? TOP_BIG_SLICE | (u32)(j - 2 - home) : i + 1;
                seg[4 * j - 1] = (u32)s1;
            }
        }
    }
}

// The scatter's per-bin fill counters: one per 32-byte sector (see top_place).
#define TOP_FILL_STRIDE 8
// Each pair at or below the bound to its bin's part of `out` (starts from top_bound, slots
// counted in `fill`, zero at launch, one counter per 32-byte sector: counters sharing a sector
// serialise each other's atomics), with its position as row id. A thread loads all its keys,
// then takes all its slots, then writes: in a loop of loads, slot atomics and writes, each round
// waited on the last one's atomics.
template <class K>
__device__ __forceinline__ void top_place(const K *keys, u64 n, u64 i0, u64 stride, K (&ks)[SCATTER_ITEMS],
                                          const TopBins &bins, u32 bound, const u32 *start, u32 *fill, K *out_keys,
                                          u64 *out_ids) {
    for (; i0 < n; i0 += stride) {
        u32 slot[SCATTER_ITEMS];
#pragma unroll
        for (int u = 0; u < SCATTER_ITEMS; ++u) {
            const u64 i = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
            const u32 bin = i < n ? bins.bin_of<false>(top_word(ks[u]), i) : TOP_BINS;
            slot[u] = bin <= bound ? start[bin] + atomicAdd(&fill[bin * TOP_FILL_STRIDE], 1u) : ~0u;
        }
#pragma unroll
        for (int u = 0; u < SCATTER_ITEMS; ++u) {
            if (slot[u] != ~0u) {
                out_keys[slot[u]] = ks[u];
                out_ids[slot[u]] = i0 + (u64)u * RSORT_THREADS + threadIdx.x;
            }
        }
        load_strided_keys(keys, n, i0 + stride, ks);
    }
}

// top_place over quantile bins, loading its own keys (not inlined: see top_quantile_table):
// the pairs below the end of the bound's piece gathered (top_gather), each looked up, given its
// slot and written by one lane.
template <class K>
__device__ __noinline__ void top_place_quantile(const K *keys, u64 n, u64 i0, u64 stride, const TopBins *shared_bins,
                                                u32 bound, const u32 *start, u32 *fill, K *out_keys, u64 *out_ids) {
    __shared__ u64 s_limit;
    TopBins bins = *shared_bins;
    K ks[SCATTER_ITEMS];
    load_strided_keys(keys, n, i0, ks);
    bins.q = top_table_in_shared(bins.q, bins.m);
    if (threadIdx.x == 0) {
        // Coordinates from the start of the piece after the bound's have bins above it (the
        // octave bins' bound: from the first piece's start).
        const u32 *first = reinterpret_cast<const u32 *>(bins.q + TOP_QFIRST);
        u32 p = 0;
#pragma unroll
        for (u32 s = 256; s > 0; s >>= 1) {
            if (p + s < bins.m && TOP_LOW + first[p + s] <= bound) p += s;
        }
        s_limit = bound < TOP_LOW ? bins.q[0] : bins.q[p + 1];
    }
    __syncthreads();
    top_each_gathered(keys, n, i0, stride, ks, bins, s_limit, [&](const K &key, u32 pos, u32 bin) {
        if (bin <= bound) {
            const u32 slot = start[bin] + atomicAdd(&fill[bin * TOP_FILL_STRIDE], 1u);
            out_keys[slot] = key;
            out_ids[slot] = pos;
        }
    });
}

template <class K>
__device__ void rsort_top_scatter(const K *keys, u64 n, u64 k, u64 cap, u32 *top, u32 *fill, u64 span, u32 *seg,
                                  K *out_keys, u64 *out_ids) {
    __shared__ u32 start[TOP_BINS];
    const u32 foreseen = top[TOP_STATUS];
    const TopBins bins = TopBins::of(top);
    const u64 stride = (u64)gridDim.x * RSORT_THREADS * SCATTER_ITEMS;
    u64 i0 = (u64)blockIdx.x * RSORT_THREADS * SCATTER_ITEMS;
    K ks[SCATTER_ITEMS];
    load_strided_keys(keys, n, i0, ks); // issued with the counts' loads
    if (foreseen == TOP_STATUS_FORESEEN) return; // every block
    const TopBound b = top_bound(top, k, cap, start);
    // Block 0 writes the bound, the kept count and the status for the segment sort and the
    // host, and plans the segment sort.
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) {
            top[TOP_BOUND] = b.bound;
            *reinterpret_cast<u64 *>(top + TOP_COUNT) = b.kept;
            top[TOP_STATUS] = b.status;
        }
        if (b.status == 0) top_segments(start, b, span, seg);
    }
    // Crowded bins still scatter: the host sorts the kept pairs after the read-back.
    if (b.status != 0 && b.status != TOP_STATUS_CROWDED) return;
    bool linear = bins.m == 0;
    if constexpr (K::BITS > 64) linear = true;
    if (linear) {
        top_place(keys, n, i0, stride, ks, bins, b.bound, start, fill, out_keys, out_ids);
    } else {
        top_place_quantile(keys, n, i0, stride, top_bins_in_shared(bins), b.bound, start, fill, out_keys, out_ids);
    }
}

// The rank of a lane's item among the warp's items of its digit so far (lower lanes first),
// counted in `warp_hist` (the warp's row); RSORT_RADIX (past the end) ranks in a bucket of its own.
__device__ __forceinline__ u32 rank_in_warp(u32 digit, u32 *warp_hist) {
    const u32 lanes_below = (1u << lane_id()) - 1u;
    const u32 peers = match_digit(digit);
    const u32 before = warp_hist[digit];
    __syncwarp();
    if ((peers & lanes_below) == 0) warp_hist[digit] = before + __popc(peers);
    __syncwarp();
    return before + __popc(peers & lanes_below);
}

// The tile's count of digit d (one per thread) over its warps' rows; each warp's entry becomes
// the count of the warps before it. After a barrier over the ranking.
__device__ __forceinline__ u32 tile_digit_count(u32 (*warp_hist)[RSORT_RADIX + 1], u32 d) {
    u32 count = 0;
#pragma unroll
    for (int w = 0; w < RSORT_WARPS; ++w) {
        const u32 c = warp_hist[w][d];
        warp_hist[w][d] = count;
        count += c;
    }
    return count;
}

// Word g of `src`; row ids of a positional input (`src` null) are their positions.
template <class W> __device__ __forceinline__ W word_or_position(const W *src, u64 g) { return src[g]; }
__device__ __forceinline__ u64 word_or_position(const u64 *src, u64 g) { return src ? src[g] : g; }

// The buffers a pass reads and writes, from its plan word.
template <class K> struct PassBuffers {
    const K *keys_in;
    const u64 *ids_in;
    K *keys_out;
    u64 *ids_out;
};

template <class K>
__device__ __forceinline__ PassBuffers<K> pass_buffers(u32 pw, const K *in_keys, const u64 *in_ids, K *tmp_keys,
                                                       u64 *tmp_ids, K *out_keys, u64 *out_ids) {
    const u32 src = (pw >> 1) & 3u, dst = (pw >> 3) & 3u;
    return {src == 0 ? in_keys : src == 1 ? tmp_keys : out_keys, src == 0 ? in_ids : src == 1 ? tmp_ids : out_ids,
            dst == 1 ? tmp_keys : out_keys, dst == 1 ? tmp_ids : out_ids};
}

// Decoupled look-back for one digit of `tile`, whose count the caller has published at `mine`
// (inclusive for tile 0, else an aggregate): the count of the earlier tiles' pairs of that
// digit; publishes this tile's inclusive prefix. LOOKBACK_WINDOW earlier tiles' words per round
// trip: the tiles of a pass run in about one wave and publish their counts together, so a
// one-tile walk would cost a round trip per tile between this one and the nearest inclusive
// prefix. A word not yet published is waited on alone, not by reloading the window.
__device__ __forceinline__ u32 look_back(u32 *mine, u32 tile, u32 count) {
    if (tile == 0) return 0;
    u32 before = 0;
    i64 j = (i64)tile - 1; // tile 0 is inclusive, so the walk stops at j ≥ 0
    while (true) {
        u32 v[LOOKBACK_WINDOW];
#pragma unroll
        for (int w = 0; w < LOOKBACK_WINDOW; ++w) v[w] = j - w >= 0 ? ld_relaxed(mine - (tile - (j - w)) * RSORT_RADIX) : 0u;
        bool found = false, waiting = false;
        i64 used = 0;
#pragma unroll
        for (int w = 0; w < LOOKBACK_WINDOW; ++w) {
            if (found || waiting) continue;
            if ((v[w] & (LOOKBACK_AGGREGATE | LOOKBACK_INCLUSIVE)) == 0) { // not yet published
                waiting = true;
                continue;
            }
            before += v[w] & LOOKBACK_VALUE;
            ++used;
            found = (v[w] & LOOKBACK_INCLUSIVE) != 0;
        }
        if (found) break;
        j -= used;
        if (waiting) {
            // Spin politely on the one word: the L2 is busy with the other tiles' scatters.
            const u32 *word = mine - (tile - j) * RSORT_RADIX;
            while ((ld_relaxed(word) & (LOOKBACK_AGGREGATE | LOOKBACK_INCLUSIVE)) == 0) __nanosleep(32);
        }
    }
    st_relaxed(mine, LOOKBACK_INCLUSIVE | (before + count));
    return before;
}

// Writes a tile reordered by digit in shared memory (slot t: the tile's pair of rank t by
// digit) to its bucket's global start plus its offset in the bucket; consecutive threads write
// consecutive positions of a bucket.
template <class K>
__device__ __forceinline__ void scatter_tile(const K *s_keys, const u64 *s_ids, u32 valid, int lo,
                                             const u32 *tile_start, const u32 *global_start, K *keys_out,
                                             u64 *ids_out) {
    for (u32 t = threadIdx.x; t < valid; t += RSORT_THREADS) {
        const K kk = s_keys[t];
        const u64 ii = s_ids[t];
        const u32 dd = vbits(kk, ii, lo, 8);
        const u32 pos = global_start[dd] + (t - tile_start[dd]);
        keys_out[pos] = kk;
        ids_out[pos] = ii;
    }
}

// One pass: digit position p, pairs of the buffer the plan names moved to the other, stably
// by the digit. Grid: one block per tile of RSORT_THREADS × SortItems pairs.
template <class K>
__device__ void rsort_pass(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys, u64 *tmp_ids,
                           K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan, u32 *lookback,
                           u32 *tickets, const u32 *tile_offsets) {
    constexpr int ITEMS = SortItems<K>::V;
    constexpr u32 TILE = RSORT_THREADS * ITEMS;
    // Per warp: the running count of each digit, then its exclusive prefix over earlier warps.
    __shared__ u32 warp_hist[RSORT_WARPS][RSORT_RADIX + 1];
    // Per digit: its first slot in the tile, and the global position of that slot's pair.
    __shared__ u32 tile_start[RSORT_RADIX];
    __shared__ u32 global_start[RSORT_RADIX];
    // The tile reordered by digit, so that the write-out is coalesced within each bucket.
    __shared__ K s_keys[TILE];
    __shared__ u64 s_ids[TILE];
    __shared__ u32 s_tile;
    const u32 pw = plan[p];
    if (!(pw & PLAN_RUN)) return;
    const PassBuffers<K> b = pass_buffers(pw, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids);

    if (threadIdx.x == 0) s_tile = tile_offsets ? blockIdx.x : atomicAdd(&tickets[p], 1u);
    for (u32 i = threadIdx.x; i < RSORT_WARPS * (RSORT_RADIX + 1); i += RSORT_THREADS) (&warp_hist[0][0])[i] = 0;
    __syncthreads();
    const u32 tile = s_tile;
    const int lo = digit_lo((int)p, (int)id_digits);
    const u32 warp = threadIdx.x / 32, lane = lane_id();
    // Warp-striped: the warp's pairs are contiguous, item i of lane l at first + 32·i + l, so
    // processing items in order ranks them in input order.
    const u64 first = (u64)tile * TILE + (u64)warp * 32 * ITEMS + lane;
    K k[ITEMS];
    u64 id[ITEMS];
    u32 digit[ITEMS], rank[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const u64 g = first + 32ull * i;
        if (g < m) {
            k[i] = b.keys_in[g];
            id[i] = word_or_position(b.ids_in, g);
            digit[i] = vbits(k[i], id[i], lo, 8);
        } else {
            digit[i] = RSORT_RADIX; // past the end: a bucket of its own, never written
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) rank[i] = rank_in_warp(digit[i], warp_hist[warp]);
    __syncthreads();
    const u32 d = threadIdx.x; // one digit per thread
    const u32 count = tile_digit_count(warp_hist, d);
    // Reorder the tile by digit in shared memory first: the pairs leave the registers before
    // the look-back, which then runs with few registers live (more resident blocks).
    tile_start[d] = block_exclusive_sum(count);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (digit[i] < RSORT_RADIX) {
            const u32 slot = tile_start[digit[i]] + warp_hist[warp][digit[i]] + rank[i];
            s_keys[slot] = k[i];
            s_ids[slot] = id[i];
        }
    }
    if (tile_offsets) { // reduce-then-scan: rsort_scan gave this tile's bucket starts
        global_start[d] = tile_offsets[(u64)d * gridDim.x + tile];
    } else {
        u32 *mine = lookback + (u64)tile * RSORT_RADIX + d;
        st_relaxed(mine, (tile == 0 ? LOOKBACK_INCLUSIVE : LOOKBACK_AGGREGATE) | count);
        global_start[d] = offsets[p * RSORT_RADIX + d] + look_back(mine, tile, count);
    }
    __syncthreads();
    scatter_tile(s_keys, s_ids, (u32)min((u64)TILE, m - (u64)tile * TILE), lo, tile_start, global_start, b.keys_out,
                 b.ids_out);
}

// Grouped look-back of the wide pass: the tiles of a pass run in about one wave and publish their
// counts together, so the windowed look-back walked ~8 windows of 32 earlier tiles per digit before
// meeting an inclusive prefix, a large share of a wide pass's instructions and stalls. Here a tile
// also adds its counts into its group's sums (LOOKBACK_GROUP tiles a group) and counts itself done
// in the group; its prefix is the sums of the earlier groups plus the words of the earlier tiles of
// its own group: at most groups + LOOKBACK_GROUP − 1 loads per digit, issued together, one round
// trip. Earlier tiles hold earlier tickets, so they run and publish before they wait: no tile waits
// on a later one.
#define LOOKBACK_GROUP 16

// A pass's look-back region for `tiles` tiles: the tiles' words (tiles × 256), the groups'
// sums (groups × 256), then one row of the groups' done counters; zero at launch.
__device__ __forceinline__ u64 group_lookback_words(u64 tiles) {
    const u64 groups = (tiles + LOOKBACK_GROUP - 1) / LOOKBACK_GROUP;
    return (tiles + groups + 1) * RSORT_RADIX;
}

__device__ __forceinline__ u32 ld_acquire(const u32 *p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

struct GroupLookback {
    u32 *words; // the pass's region
    u32 tiles;
    __device__ __forceinline__ u32 groups() const { return (tiles + LOOKBACK_GROUP - 1) / LOOKBACK_GROUP; }
    __device__ __forceinline__ u32 *sums() const { return words + (u64)tiles * RSORT_RADIX; }
    __device__ __forceinline__ u32 *done() const { return sums() + (u64)groups() * RSORT_RADIX; }

    // Publishes tile `tile`'s count of digit d (one digit per thread; every thread calls it):
    // its word, its group's sum, then (after the block's fences) the group's done count.
    __device__ __forceinline__ void publish(u32 tile, u32 d, u32 count) const {
        st_relaxed(words + (u64)tile * RSORT_RADIX + d, LOOKBACK_AGGREGATE | count);
        if (count != 0) atomicAdd(sums() + (u64)(tile / LOOKBACK_GROUP) * RSORT_RADIX + d, count);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(done() + tile / LOOKBACK_GROUP, 1u);
    }

    // The count of digit d in the tiles before `tile` (every thread calls it, one digit each).
    __device__ __forceinline__ u32 prefix(u32 tile, u32 d) const {
        const u32 g = tile / LOOKBACK_GROUP;
        if (d < g) { // thread j waits until every tile of group j has published
            const u32 expect = min((u32)LOOKBACK_GROUP, tiles - d * LOOKBACK_GROUP);
            while (ld_acquire(done() + d) < expect) __nanosleep(32);
        }
        __syncthreads();
        u32 before = 0;
        const u32 *sum = sums() + d;
#pragma unroll 8
        for (u32 j = 0; j < g; ++j) before += ld_relaxed(sum + (u64)j * RSORT_RADIX);
        // The earlier tiles of this group: their words, loaded together, then any not yet
        // published waited on alone.
        const u32 first = g * LOOKBACK_GROUP;
        u32 w[LOOKBACK_GROUP - 1];
#pragma unroll
        for (int i = 0; i < LOOKBACK_GROUP - 1; ++i) {
            w[i] = first + i < tile ? ld_relaxed(words + (u64)(first + i) * RSORT_RADIX + d) : LOOKBACK_AGGREGATE;
        }
#pragma unroll
        for (int i = 0; i < LOOKBACK_GROUP - 1; ++i) {
            while ((w[i] & LOOKBACK_AGGREGATE) == 0) {
                __nanosleep(32);
                w[i] = ld_relaxed(words + (u64)(first + i) * RSORT_RADIX + d);
            }
            before += w[i] & LOOKBACK_VALUE;
        }
        return before;
    }
};

// Pairs per thread of a wide-tile pass (rsort_pass_wide): twice SortItems, a tile of 4096 pairs
// for keys of up to 64 bits (2048 for 128-bit, 1024 for 256-bit keys). Four times SortItems
// took 206 registers (one block of 8 warps per SM) and code that missed the instruction cache.
template <class K> struct WideItems {
    enum { V = 2 * SortItems<K>::V };
};

// Digit (8 bits at lo) of the word that holds it: a key (lo ≥ 64) or a row id.
template <class K> __device__ __forceinline__ u32 word_digit(const K &k, int lo) { return vbits(k, 0ull, lo, 8); }
__device__ __forceinline__ u32 word_digit(u64 id, int lo) { return (u32)(id >> lo) & 0xffu; }

// A word loaded through the L2 (the input of a pass is the previous pass's output, not in L1).
template <class K> __device__ __forceinline__ K load_word_cg(const K *p) { return load_cg(p); }
__device__ __forceinline__ u64 load_word_cg(const u64 *p) { return __ldcg(p); }

// Items of a lane left in [0, m) from pair `first` on (32-bit, so that the per-item bounds
// checks and addresses need no 64-bit registers: one base pointer, immediate offsets).
__device__ __forceinline__ u32 items_left(u64 first, u64 m) { return first < m ? (u32)min(m - first, 1ull << 20) : 0u; }

// Loads the warp's ITEMS words of `src` (item i of lane l at first + 32·i + l) and ranks them
// by digit, stably: each item's digit (RSORT_RADIX past the end) and its rank among the warp's
// earlier items of that digit; `warp_hist` (this warp's row) counts them.
template <class W, int ITEMS>
__device__ __forceinline__ void rank_words(const W *src, u64 first, u64 m, int lo, u32 *warp_hist, W (&w)[ITEMS],
                                           u32 (&digit)[ITEMS], u32 (&rank)[ITEMS]) {
    const W *p = src + first;
    const u32 left = items_left(first, m);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (32u * i < left) w[i] = load_word_cg(p + 32 * i);
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        digit[i] = 32u * i < left ? word_digit(w[i], lo) : RSORT_RADIX;
        rank[i] = rank_in_warp(digit[i], warp_hist);
    }
}

// Moves the warp's ITEMS words of `src` (as rank_words loaded them) to their slots of the
// tile reordered by digit.
template <class W, int ITEMS>
__device__ __forceinline__ void place_words(const W *src, u64 first, u64 m, W *dst, const u32 (&slot)[ITEMS]) {
    W w[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + 32ull * i < m) w[i] = word_or_position(src, first + 32ull * i);
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (first + 32ull * i < m) dst[slot[i]] = w[i];
    }
}

// Each item's slot in the tile reordered by digit (after tile_digit_count and the tile's digit
// starts): its digit's start, the earlier warps' count of that digit, its rank in the warp.
template <int ITEMS>
__device__ __forceinline__ void tile_slots(const u32 (&digit)[ITEMS], const u32 (&rank)[ITEMS], const u32 *tile_start,
                                           const u32 *warp_row, u32 (&slot)[ITEMS]) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        slot[i] = digit[i] < RSORT_RADIX ? tile_start[digit[i]] + warp_row[digit[i]] + rank[i] : 0u;
    }
}

// Stores words held in registers to their slots (items past the end have none).
template <class W, int ITEMS>
__device__ __forceinline__ void place_registers(const W (&w)[ITEMS], const u32 (&digit)[ITEMS],
                                                const u32 (&slot)[ITEMS], W *dst) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (digit[i] < RSORT_RADIX) dst[slot[i]] = w[i];
    }
}

// rsort_pass over tiles of RSORT_THREADS × WideItems pairs, for inputs of a few hundred thousand
// pairs and more. With 2048-pair tiles, a pass over 1M pairs has 512 tiles in one wave whose
// look-back saturated the L2; half the tiles cut the look-back traffic by about 3× (fewer tiles,
// each finding an inclusive prefix in fewer rounds). The tile lives in dynamic shared memory
// (40–64 KiB), so a block holds only the word that carries the digit in registers: it ranks those,
// places them in shared memory, then loads the other word of each pair straight into its slot. Its
// counts are published as soon as they are known, before the placing, so that later tiles'
// look-backs wait less.
template <class K>
__device__ void rsort_pass_wide(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys,
                                u64 *tmp_ids, K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan,
                                u32 *lookback, u32 *tickets) {
    constexpr int ITEMS = WideItems<K>::V;
    constexpr u32 TILE = RSORT_THREADS * ITEMS;
    __shared__ u32 warp_hist[RSORT_WARPS][RSORT_RADIX + 1];
    __shared__ u32 tile_start[RSORT_RADIX];
    __shared__ u32 global_start[RSORT_RADIX];
    __shared__ u32 s_tile;
    extern __shared__ __align__(16) u8 wide_tile[];
    K *s_keys = reinterpret_cast<K *>(wide_tile);
    u64 *s_ids = reinterpret_cast<u64 *>(wide_tile + (u64)TILE * sizeof(K));
    const u32 pw = plan[p];
    if (!(pw & PLAN_RUN)) return;
    const PassBuffers<K> b = pass_buffers(pw, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids);

    if (threadIdx.x == 0) s_tile = atomicAdd(&tickets[p], 1u);
    for (u32 i = threadIdx.x; i < RSORT_WARPS * (RSORT_RADIX + 1); i += RSORT_THREADS) (&warp_hist[0][0])[i] = 0;
    __syncthreads();
    const u32 tile = s_tile;
    const int lo = digit_lo((int)p, (int)id_digits);
    const bool key_digit = lo >= 64;
    const u32 warp = threadIdx.x / 32;
    const u64 first = (u64)tile * TILE + (u64)warp * 32 * ITEMS + lane_id();
    u32 digit[ITEMS], rank[ITEMS];
    // The digit's word stays in registers until its slot is known.
    K kw[ITEMS];
    u64 iw[ITEMS];
    if (key_digit) {
        rank_words<K, ITEMS>(b.keys_in, first, m, lo, warp_hist[warp], kw, digit, rank);
    } else {
        rank_words<u64, ITEMS>(b.ids_in, first, m, lo, warp_hist[warp], iw, digit, rank);
    }
    __syncthreads();
    const u32 d = threadIdx.x; // one digit per thread
    const u32 count = tile_digit_count(warp_hist, d);
    const GroupLookback look{lookback, (u32)((m + TILE - 1) / TILE)};
    look.publish(tile, d, count);
    tile_start[d] = block_exclusive_sum(count);
    __syncthreads();
    u32 slot[ITEMS];
    tile_slots<ITEMS>(digit, rank, tile_start, warp_hist[warp], slot);
    if (key_digit) {
        place_registers<K, ITEMS>(kw, digit, slot, s_keys);
        place_words<u64, ITEMS>(b.ids_in, first, m, s_ids, slot);
    } else {
        place_registers<u64, ITEMS>(iw, digit, slot, s_ids);
        place_words<K, ITEMS>(b.keys_in, first, m, s_keys, slot);
    }
    global_start[d] = offsets[p * RSORT_RADIX + d] + look.prefix(tile, d);
    __syncthreads();
    scatter_tile(s_keys, s_ids, (u32)min((u64)TILE, m - (u64)tile * TILE), lo, tile_start, global_start, b.keys_out,
                 b.ids_out);
}

// Reduce-then-scan, for passes over many tiles: there every tile of the one wave would spin
// in the look-back at once, and the look-back's loads (256 digits × a window of tiles, per
// tile and round trip) saturated the L2.
// rsort_count writes each tile's bucket counts, digit-major (counts[d · tiles + tile]);
// rsort_scan turns each digit's row into the global position of the tile's first pair of that
// digit; rsort_pass then scatters without looking back.
template <class K>
__device__ void rsort_count(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, const K *tmp_keys,
                            const u64 *tmp_ids, const K *out_keys, const u64 *out_ids, u64 m, const u32 *plan,
                            u32 *counts) {
    constexpr int ITEMS = SortItems<K>::V;
    constexpr u32 TILE = RSORT_THREADS * ITEMS;
    __shared__ u32 hist[RSORT_RADIX];
    const u32 pw = plan[p];
    if (!(pw & PLAN_RUN)) return;
    const u32 src = (pw >> 1) & 3u;
    const K *sk = src == 0 ? in_keys : src == 1 ? tmp_keys : out_keys;
    const u64 *si = src == 0 ? in_ids : src == 1 ? tmp_ids : out_ids;
    const int lo = digit_lo((int)p, (int)id_digits);
    const bool key_digit = lo >= 64;
    hist[threadIdx.x] = 0;
    __syncthreads();
    const u64 base = (u64)blockIdx.x * TILE;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const u64 g = base + (u64)i * RSORT_THREADS + threadIdx.x;
        const bool valid = g < m;
        u32 dg = 0;
        if (valid) {
            // Only the word that holds the digit is read.
            const K k = key_digit ? sk[g] : key_zero<K>();
            const u64 id = key_digit ? 0 : si[g];
            dg = vbits(k, id, lo, 8);
        }
        warp_hist_add(hist, dg, valid);
    }
    __syncthreads();
    counts[(u64)threadIdx.x * gridDim.x + blockIdx.x] = hist[threadIdx.x];
}

// One block per digit: counts[d · tiles + t] := offsets[d] + Σ_{t' < t} counts[d · tiles + t'].
__device__ void scan_tile_counts(u32 p, const u32 *plan, u32 *counts, u32 tiles, const u32 *offsets) {
    __shared__ u32 carry;
    const u32 pw = plan[p];
    if (!(pw & PLAN_RUN)) return;
    u32 *row = counts + (u64)blockIdx.x * tiles;
    if (threadIdx.x == 0) carry = offsets[p * RSORT_RADIX + blockIdx.x];
    __syncthreads();
    for (u32 t0 = 0; t0 < tiles; t0 += RSORT_THREADS) {
        const u32 t = t0 + threadIdx.x;
        const u32 v = t < tiles ? row[t] : 0u;
        const u32 ex = block_exclusive_sum(v);
        const u32 c = carry;
        if (t < tiles) row[t] = c + ex;
        __syncthreads();
        if (threadIdx.x == RSORT_THREADS - 1) carry = c + ex + v;
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(RSORT_THREADS)
    rsort_scan(u32 p, const u32 *plan, u32 *counts, u32 tiles, const u32 *offsets) { grid_dependency_wait();
    scan_tile_counts(p, plan, counts, tiles, offsets);
}

#define RADIX_SORT_ENTRIES(K, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_hist_##S(const K *keys, const u64 *ids, u64 m, u32 id_digits, u32 *hist, u32 *plan, u32 *lookback,  \
                       u64 lookback_words, u32 *done) { grid_dependency_wait();                                   \
        rsort_hist<K>(keys, ids, m, id_digits, hist, plan, lookback, lookback_words, done);                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_pass_##S(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys, u64 *tmp_ids,      \
                       K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan, u32 *lookback,      \
                       u32 *tickets, const u32 *tile_offsets) { grid_dependency_wait();                           \
        rsort_pass<K>(p, id_digits, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids, m, offsets, plan,      \
                      lookback + (u64)p * (((m + SortItems<K>::V * RSORT_THREADS - 1) /                           \
                                            (SortItems<K>::V * RSORT_THREADS)) * RSORT_RADIX),                    \
                      tickets, tile_offsets);                                                                     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS, 2)                                                \
        rsort_pass_wide_##S(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys, u64 *tmp_ids, \
                            K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan, u32 *lookback, \
                            u32 *tickets) { grid_dependency_wait();                                               \
        rsort_pass_wide<K>(p, id_digits, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids, m, offsets, plan, \
                           lookback + (u64)p * group_lookback_words((m + WideItems<K>::V * RSORT_THREADS - 1) /   \
                                                                     (WideItems<K>::V * RSORT_THREADS)),          \
                           tickets);                                                                              \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_count_##S(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, const K *tmp_keys,             \
                        const u64 *tmp_ids, const K *out_keys, const u64 *out_ids, u64 m, const u32 *plan,        \
                        u32 *counts) { grid_dependency_wait();                                                    \
        rsort_count<K>(p, id_digits, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids, m, plan, counts);     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_top_hist_##S(const K *keys, u64 n, u64 k, u32 *top) { grid_dependency_wait();                       \
        rsort_top_hist<K>(keys, n, k, top);                                                                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_top_scatter_##S(const K *keys, u64 n, u64 k, u64 cap, u32 *top, u32 *fill, u64 span, u32 *seg,      \
                              K *out_keys, u64 *out_ids) { grid_dependency_wait();                                \
        rsort_top_scatter<K>(keys, n, k, cap, top, fill, span, seg, out_keys, out_ids);                           \
    }
INSTANTIATE_KEYS(RADIX_SORT_ENTRIES)
