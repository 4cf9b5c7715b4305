// radix_sort.cu: LSD radix sort of (key, row id) pairs, the sort of the k winners when k is
// large (the survivors of a sampled selection, the winners of a radix select).
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
//          tile's word says "my count" or "my inclusive prefix"), and scatters its pairs to
//          bucket offset + earlier tiles + earlier warps + rank.
// The input is never written: passes alternate between a scratch buffer and the output, with
// the last pass landing in the output. Counts must stay below 2^30 (the look-back words keep
// two flag bits).

#include "common.cuh"

#define RSORT_THREADS 256
#define RSORT_WARPS (RSORT_THREADS / 32)
#define RSORT_RADIX 256
#define LOOKBACK_AGGREGATE (1u << 30)
#define LOOKBACK_INCLUSIVE (1u << 31)
#define LOOKBACK_VALUE ((1u << 30) - 1u)

// Pairs per thread in a pass: the tile is RSORT_THREADS × this.
template <class K> struct SortItems {
    enum { V = K::BITS <= 64 ? 8 : 4 };
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

// Exclusive prefix sum over a block of RSORT_THREADS threads, one value each.
__device__ __forceinline__ u32 block_exclusive_sum(u32 v) {
    __shared__ u32 warp_sums[RSORT_WARPS];
    const u32 lane = lane_id(), warp = threadIdx.x / 32;
    u32 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= (u32)o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    u32 before = 0;
    for (u32 w = 0; w < warp; ++w) before += warp_sums[w];
    __syncthreads();
    return before + x - v;
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
    FOR_BLOCK_ROUNDS(i0, m) {
        const u64 i = i0 + threadIdx.x;
        const bool valid = i < m;
        K k = key_zero<K>();
        u64 id = 0;
        if (valid) {
            k = keys[i];
            id = ids[i];
        }
        const u32 n_valid = __popc(__ballot_sync(FULL_MASK, valid));
#pragma unroll
        for (int p = 0; p < D; ++p) {
            if (p >= nd) break;
            // One atomic per warp when its digits agree (ties, shared high bits: one bucket
            // would otherwise serialise 32 atomics), else one per pair. Lane 0 is valid
            // whenever any lane is.
            const u32 dg = vbits(k, id, digit_lo(p, id_digits), 8);
            const u32 d0 = __shfl_sync(FULL_MASK, dg, 0);
            if (__all_sync(FULL_MASK, !valid || dg == d0)) {
                if (lane_id() == 0 && n_valid != 0) atomicAdd(&sh[p * RSORT_RADIX + d0], n_valid);
            } else if (valid) {
                atomicAdd(&sh[p * RSORT_RADIX + dg], 1u);
            }
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

// One pass: digit position p, pairs of the buffer the plan names moved to the other, stably
// by the digit. Grid: one block per tile of RSORT_THREADS × SortItems pairs.
template <class K>
__device__ void rsort_pass(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys, u64 *tmp_ids,
                           K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan, u32 *lookback,
                           u32 *tickets) {
    constexpr int ITEMS = SortItems<K>::V;
    constexpr u32 TILE = RSORT_THREADS * ITEMS;
    // Per warp: the running count of each digit, then its exclusive prefix over earlier warps.
    __shared__ u32 warp_hist[RSORT_WARPS][RSORT_RADIX + 1];
    __shared__ u32 base[RSORT_RADIX];
    __shared__ u32 s_tile;
    const u32 pw = plan[p];
    if (!(pw & PLAN_RUN)) return;
    const u32 src = (pw >> 1) & 3u, dst = (pw >> 3) & 3u;
    const K *sk = src == 0 ? in_keys : src == 1 ? tmp_keys : out_keys;
    const u64 *si = src == 0 ? in_ids : src == 1 ? tmp_ids : out_ids;
    K *dk = dst == 1 ? tmp_keys : out_keys;
    u64 *di = dst == 1 ? tmp_ids : out_ids;

    if (threadIdx.x == 0) s_tile = atomicAdd(&tickets[p], 1u);
    for (u32 i = threadIdx.x; i < RSORT_WARPS * (RSORT_RADIX + 1); i += RSORT_THREADS) (&warp_hist[0][0])[i] = 0;
    __syncthreads();
    const u32 tile = s_tile;
    const int lo = digit_lo((int)p, (int)id_digits);
    const u32 warp = threadIdx.x / 32, lane = lane_id();
    const u32 lanes_below = (1u << lane) - 1u;
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
            k[i] = sk[g];
            id[i] = si[g];
            digit[i] = vbits(k[i], id[i], lo, 8);
        } else {
            digit[i] = RSORT_RADIX; // past the end: a bucket of its own, never written
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const u32 peers = __match_any_sync(FULL_MASK, digit[i]);
        const u32 before = warp_hist[warp][digit[i]];
        rank[i] = before + __popc(peers & lanes_below);
        __syncwarp();
        if ((peers & lanes_below) == 0) warp_hist[warp][digit[i]] = before + __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    const u32 d = threadIdx.x; // one digit per thread
    u32 count = 0;
#pragma unroll
    for (int w = 0; w < RSORT_WARPS; ++w) {
        const u32 c = warp_hist[w][d];
        warp_hist[w][d] = count;
        count += c;
    }
    u32 *mine = lookback + (u64)tile * RSORT_RADIX + d;
    u32 before = 0;
    if (tile == 0) {
        st_relaxed(mine, LOOKBACK_INCLUSIVE | count);
    } else {
        st_relaxed(mine, LOOKBACK_AGGREGATE | count);
        const u32 *w = mine - RSORT_RADIX;
        while (true) {
            const u32 v = ld_relaxed(w);
            if ((v & (LOOKBACK_AGGREGATE | LOOKBACK_INCLUSIVE)) == 0) continue; // not yet published
            before += v & LOOKBACK_VALUE;
            if (v & LOOKBACK_INCLUSIVE) break;
            w -= RSORT_RADIX;
        }
        st_relaxed(mine, LOOKBACK_INCLUSIVE | (before + count));
    }
    base[d] = offsets[p * RSORT_RADIX + d] + before;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (digit[i] < RSORT_RADIX) {
            const u32 pos = base[digit[i]] + warp_hist[warp][digit[i]] + rank[i];
            dk[pos] = k[i];
            di[pos] = id[i];
        }
    }
}

#define RADIX_SORT_ENTRIES(K, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_hist_##S(const K *keys, const u64 *ids, u64 m, u32 id_digits, u32 *hist, u32 *plan, u32 *lookback,  \
                       u64 lookback_words, u32 *done) {                                                           \
        rsort_hist<K>(keys, ids, m, id_digits, hist, plan, lookback, lookback_words, done);                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RSORT_THREADS)                                                   \
        rsort_pass_##S(u32 p, u32 id_digits, const K *in_keys, const u64 *in_ids, K *tmp_keys, u64 *tmp_ids,      \
                       K *out_keys, u64 *out_ids, u64 m, const u32 *offsets, const u32 *plan, u32 *lookback,      \
                       u32 *tickets) {                                                                            \
        rsort_pass<K>(p, id_digits, in_keys, in_ids, tmp_keys, tmp_ids, out_keys, out_ids, m, offsets, plan,      \
                      lookback + (u64)p * (((m + SortItems<K>::V * RSORT_THREADS - 1) /                           \
                                            (SortItems<K>::V * RSORT_THREADS)) * RSORT_RADIX),                    \
                      tickets);                                                                                   \
    }
INSTANTIATE_KEYS(RADIX_SORT_ENTRIES)
