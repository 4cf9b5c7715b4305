// bitonic.cu: bitonic top-k for small k, and the bitonic sort of the final winners.
//
// Top-k (Shanbhag et al., SIGMOD'18, §4): each block loads a chunk of C pairs into shared
// memory (padding past the input with the largest pair, all-ones key and row id, which sorts
// last), then
//   local sort  sorts runs of K2 pairs (K2 = k rounded up to a power of two), alternately
//               ascending and descending: the bitonic sorting network stopped at size K2;
//   merge       for each pair of neighbouring runs (A ascending, B descending), keeps
//               min(A[j], B[j]): a bitonic run holding the K2 smallest of A ∪ B, half the data;
//   rebuild     sorts that bitonic run in log2(K2) half-cleaner steps, directions alternating
//               again, so merge can repeat,
// until one ascending run of the chunk's K2 smallest is left; the block writes it out. The host
// repeats rounds over the blocks' outputs until one block remains: its run, sorted, starts
// with the k smallest pairs. Merged runs stay in place (run r of level L at r·K2·2^L), so no
// step needs more than one barrier. Padding is harmless: a padding pair equal to a real pair
// (all-ones key and row id) is indistinguishable from it in the output.
//
// Sort (the ≤ k winners of a radix select, the survivors of a sampled one): the classic
// bitonic sorting network on a power-of-two padded array, with the steps of stride < T (a
// tile of 4096 pairs) fused into kernels that keep the tile in registers (`sort_local` for all
// sizes ≤ T, `merge_local` for the tail of each larger size) and the steps of stride ≥ T one
// global kernel each (`sort_step`). `rank_sort` sorts the few survivors of a sampled selection,
// `chunk_sort`, `chunk_rank` and `chunk_scatter` up to ~2·10^5 of them.

#include "common.cuh"

#define BITONIC_THREADS 512

template <class K> struct Smem {
    K *keys;
    u64 *ids;
    __device__ __forceinline__ void cmp_swap(u32 i, u32 j, bool ascending) {
        const K a = keys[i], b = keys[j];
        const u64 ia = ids[i], ib = ids[j];
        if (ascending ? pair_less(b, ib, a, ia) : pair_less(a, ia, b, ib)) {
            keys[i] = b;
            keys[j] = a;
            ids[i] = ib;
            ids[j] = ia;
        }
    }
};

// Dynamic shared memory: C keys, then C row ids.
template <class K> __device__ __forceinline__ Smem<K> smem_of(u32 c) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    Smem<K> s;
    s.keys = (K *)smem_raw;
    s.ids = (u64 *)(smem_raw + (size_t)c * sizeof(K));
    return s;
}

// Loads pairs [base, base + c) into shared memory, padding past n with the largest pair.
template <class K> __device__ __forceinline__ void load_chunk(Smem<K> s, const K *keys, const u64 *ids, u64 n, u64 base, u32 c) {
    for (u32 t = threadIdx.x; t < c; t += blockDim.x) {
        const u64 g = base + t;
        if (g < n) {
            s.keys[t] = keys[g];
            s.ids[t] = ids[g];
        } else {
            s.keys[t] = key_max<K>();
            s.ids[t] = ~0ull;
        }
    }
    __syncthreads();
}

// Index of the t-th compare-exchange pair's lower element for distance `stride` (a power of
// two): t with a zero bit inserted at `stride`.
__device__ __forceinline__ u32 pair_index(u32 t, u32 stride) { return 2 * t - (t & (stride - 1)); }

// Bitonic sorting network steps for sizes [2, max_size] over c shared pairs; element i (at
// global position base + i) is sorted ascending iff (base + i) & size is zero.
template <class K> __device__ __forceinline__ void network(Smem<K> s, u32 c, u64 base, u32 max_size) {
    for (u32 size = 2; size <= max_size; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 t = threadIdx.x; t < c / 2; t += blockDim.x) {
                const u32 i = pair_index(t, stride);
                s.cmp_swap(i, i + stride, ((base + i) & size) == 0);
            }
            __syncthreads();
        }
    }
}

// One round of top-k: block b reduces pairs [b·c, (b+1)·c) to its k2 smallest, sorted
// ascending, at out[b·k2, (b+1)·k2). c and k2 are powers of two, k2 < c.
template <class K>
__device__ void topk(const K *keys, const u64 *ids, u64 n, K *out_keys, u64 *out_ids, u32 k2, u32 c) {
    Smem<K> s = smem_of<K>(c);
    load_chunk(s, keys, ids, n, (u64)blockIdx.x * c, c);
    // Local sort: runs of k2, run r ascending iff r is even.
    network(s, c, 0, k2);
    // Merge and rebuild until one run is left. Live runs sit at multiples of `gap`.
    const u32 log_k2 = __ffs(k2) - 1; // k2 is a power of two
    for (u32 gap = k2; gap < c; gap <<= 1) {
        const u32 pairs = c / (2 * gap); // pairs of live runs
        for (u32 t = threadIdx.x; t < pairs * k2; t += blockDim.x) {
            const u32 r = t >> log_k2, j = t & (k2 - 1);
            const u32 a = 2 * r * gap + j, b = a + gap;
            if (pair_less(s.keys[b], s.ids[b], s.keys[a], s.ids[a])) {
                s.keys[a] = s.keys[b];
                s.ids[a] = s.ids[b];
            }
        }
        __syncthreads();
        // Rebuild: the new run r (at 2·r·gap) is bitonic; sort it ascending iff r is even.
        for (u32 stride = k2 / 2; stride > 0; stride >>= 1) {
            for (u32 t = threadIdx.x; t < pairs * (k2 / 2); t += blockDim.x) {
                const u32 r = t >> (log_k2 - 1), u = t & (k2 / 2 - 1);
                const u32 a = 2 * r * gap + pair_index(u, stride);
                s.cmp_swap(a, a + stride, (r & 1) == 0);
            }
            __syncthreads();
        }
    }
    for (u32 t = threadIdx.x; t < k2; t += blockDim.x) {
        out_keys[(u64)blockIdx.x * k2 + t] = s.keys[t];
        out_ids[(u64)blockIdx.x * k2 + t] = s.ids[t];
    }
}

// Sort, one step of size `size` and stride `stride` >= c, in global memory: one thread per
// compare-exchange.
template <class K> __device__ void sort_step(K *keys, u64 *ids, u64 m, u64 size, u64 stride) {
    for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < m / 2; t += (u64)gridDim.x * blockDim.x) {
        const u64 i = 2 * t - (t & (stride - 1)), j = i + stride;
        const bool ascending = (i & size) == 0;
        const K a = keys[i], b = keys[j];
        const u64 ia = ids[i], ib = ids[j];
        if (ascending ? pair_less(b, ib, a, ia) : pair_less(a, ia, b, ib)) {
            keys[i] = b;
            keys[j] = a;
            ids[i] = ib;
            ids[j] = ia;
        }
    }
}

// ---- the sort, with the SIGMOD'18 register layout --------------------------------------------
//
// A block of SORT_THREADS threads holds a tile of SORT_TILE = SORT_PER · SORT_THREADS pairs
// (4096; 2048 for 256-bit keys):
// thread t holds pairs [SORT_PER·t, SORT_PER·(t+1)) of the tile in registers. A step of stride
// < SORT_PER stays in the thread, strides below 32·SORT_PER go through warp shuffles, and only
// the larger ones through shared memory (two barriers each). Pair i of the whole array is
// sorted ascending in a step of size `size` iff i & size is zero, as in the plain network.
#define SORT_THREADS 1024
// Pairs per thread: 4, or 2 for 256-bit keys (four would spill at 64 registers).
template <class K> struct SortPer {
    enum { V = K::BITS == 256 ? 2 : 4 };
};
#define SORT_PER SortPer<K>::V
#define SORT_TILE (SORT_PER * SORT_THREADS)

// A step of stride STRIDE < SORT_PER, inside each thread (compile-time indices keep the pairs
// in registers).
template <class K, int STRIDE>
__device__ __forceinline__ void reg_step(K (&key)[SORT_PER], u64 (&id)[SORT_PER], u64 first, u64 size) {
#pragma unroll
    for (int e = 0; e < SORT_PER; ++e) {
        if ((e & STRIDE) == 0) {
            const int f = e | STRIDE;
            const bool ascending = ((first + e) & size) == 0;
            if (ascending == pair_less(key[f], id[f], key[e], id[e])) {
                const K tk = key[e];
                const u64 ti = id[e];
                key[e] = key[f];
                id[e] = id[f];
                key[f] = tk;
                id[f] = ti;
            }
        }
    }
}

// Steps of sizes [size_lo, size_hi] over the block's tile (global index of its pair 0:
// `tile_base`), each from stride min(size / 2, tile / 2) down to 1; blocks of THREADS threads
// (a tile of SORT_PER · THREADS pairs).
template <class K, int THREADS = SORT_THREADS>
__device__ void tile_network(K (&key)[SORT_PER], u64 (&id)[SORT_PER], u64 tile_base, u64 size_lo, u64 size_hi,
                             Smem<K> s) {
    constexpr u32 TILE = SORT_PER * THREADS;
    const u32 base = threadIdx.x * SORT_PER;
    const u64 first = tile_base + base; // global index of this thread's pair 0
    for (u64 size = size_lo; size <= size_hi; size <<= 1) {
        for (u32 stride = (u32)min(size / 2, (u64)TILE / 2); stride > 0; stride >>= 1) {
            if (stride == 1) {
                reg_step<K, 1>(key, id, first, size);
            } else if (SORT_PER > 2 && stride == 2) {
                reg_step<K, (SORT_PER > 2 ? 2 : 1)>(key, id, first, size);
            } else if (stride < 32 * SORT_PER) {
                const int lanes = stride / SORT_PER;
                const bool lower = (threadIdx.x & lanes) == 0; // this thread holds the lower index
#pragma unroll
                for (int e = 0; e < SORT_PER; ++e) {
                    const K ok = shfl_key(key[e], lanes);
                    const u64 oi = __shfl_xor_sync(FULL_MASK, id[e], lanes);
                    const bool ascending = ((first + e) & size) == 0;
                    // The lower index keeps the smaller pair when ascending.
                    if (pair_less(ok, oi, key[e], id[e]) == (lower == ascending)) {
                        key[e] = ok;
                        id[e] = oi;
                    }
                }
            } else {
                // Pair e of thread t sits at e · THREADS + t, so that a warp's stores and
                // loads hit consecutive words (the tile's own order, t · SORT_PER + e, made
                // them 4- to 8-way bank conflicts). Strides here are multiples of SORT_PER: the
                // partner is pair e of thread t ^ (stride / SORT_PER).
#pragma unroll
                for (int e = 0; e < SORT_PER; ++e) {
                    s.keys[e * THREADS + threadIdx.x] = key[e];
                    s.ids[e * THREADS + threadIdx.x] = id[e];
                }
                __syncthreads();
                const u32 partner = threadIdx.x ^ (stride / SORT_PER);
#pragma unroll
                for (int e = 0; e < SORT_PER; ++e) {
                    const u32 i = base + e, j = i ^ stride;
                    const K ok = s.keys[e * THREADS + partner];
                    const u64 oi = s.ids[e * THREADS + partner];
                    const bool ascending = ((tile_base + i) & size) == 0;
                    if (pair_less(ok, oi, key[e], id[e]) == ((i < j) == ascending)) {
                        key[e] = ok;
                        id[e] = oi;
                    }
                }
                __syncthreads();
            }
        }
    }
}

// Loads the block's tile [tile_base, tile_base + SORT_TILE) of pairs [0, n) into registers,
// padding past n with the largest pair (which sorts last).
template <class K>
__device__ __forceinline__ void load_tile(const K *keys, const u64 *ids, u64 n, u64 tile_base, K (&key)[SORT_PER],
                                          u64 (&id)[SORT_PER]) {
#pragma unroll
    for (int e = 0; e < SORT_PER; ++e) {
        const u64 i = tile_base + threadIdx.x * SORT_PER + e;
        key[e] = i < n ? keys[i] : key_max<K>();
        id[e] = i < n ? ids[i] : ~0ull;
    }
}

template <class K>
__device__ __forceinline__ void store_tile(K *keys, u64 *ids, u64 n, u64 tile_base, const K (&key)[SORT_PER],
                                           const u64 (&id)[SORT_PER]) {
#pragma unroll
    for (int e = 0; e < SORT_PER; ++e) {
        const u64 i = tile_base + threadIdx.x * SORT_PER + e;
        if (i < n) {
            keys[i] = key[e];
            ids[i] = id[e];
        }
    }
}

// Sort, sizes 2 .. min(SORT_TILE, m) of the network over m (a power of two) pairs: each
// block sorts its tile of pairs [0, n) (padded past n) in the direction the full network gives
// it, into out[0, m).
template <class K>
__device__ void sort_local(const K *keys, const u64 *ids, u64 n, K *out_keys, u64 *out_ids, u64 m) {
    K key[SORT_PER];
    u64 id[SORT_PER];
    const u64 tile_base = (u64)blockIdx.x * SORT_TILE;
    load_tile(keys, ids, n, tile_base, key, id);
    tile_network(key, id, tile_base, 2, min(m, (u64)SORT_TILE), smem_of<K>(SORT_TILE));
    store_tile(out_keys, out_ids, m, tile_base, key, id);
}

// Sort of a bin-ordered buffer (radix_sort.cu's top-bits selection): pairs [0, m), m the kept
// count in `top` (the selection's control block, common.cuh), grouped by bin up to the bound,
// each bin at most three quarters of a tile of SEGMENT_TILE pairs. Block j sorts the bins that
// start in [j·T/4, (j+1)·T/4) (at most a tile; its first bin and that bin's start from `seg`,
// radix_sort.cu `top_segments`) by (key, row id), into the same positions of `out`. (Quarter
// spans let a block take bins of up to three quarters of a tile, where half spans allowed half:
// the crowded bins of ties and NaN mixes then stay here.) Nothing when the status is set. Each
// bin is split in 2^bits parts by its pairs' coordinates (TopBins::part; ~4 pairs a part), the
// block's pairs are counted into their parts (shared atomics) and placed by part, and each
// pair's rank in its part (pairs below it) completes its place: ranking each pair against its
// whole bin (~170 pairs at k = n/4) costs many times the instructions. Parts larger than
// SEGMENT_RANK_PART (ties of 64-bit keys, whose coordinates are the keys; octave bins, which
// have no parts) take the register network over the whole tile instead. Blocks of 256 threads.
#define SEGMENT_THREADS 256
#define SEGMENT_TILE (SORT_PER * SEGMENT_THREADS)
// The pairs whose bins' starts a block takes (top_bits.rs `SEGMENT_SPANS_PER_TILE`).
#define SEGMENT_SPAN (SEGMENT_TILE / 4)
#define SEGMENT_RANK_PART 128u
#define SEGMENT_PART_BITS 8u

// Pair `at` of a segment's tile in shared memory: a 32-bit key and its position (< 2^32) packed
// in one word of `s.ids`, ordered as the pair is (one shared load a comparison); other keys
// and row ids as they are.
template <class K> __device__ __forceinline__ void segment_put(Smem<K> s, u32 at, const K &k, u64 id) {
    if constexpr (K::BITS == 32) {
        s.ids[at] = (u64)k.w[0] << 32 | id;
    } else {
        s.keys[at] = k;
        s.ids[at] = id;
    }
}

// Pair `at` of a segment's tile (segment_put's layout).
template <class K> __device__ __forceinline__ void segment_get(Smem<K> s, u32 at, K &k, u64 &id) {
    if constexpr (K::BITS == 32) {
        const u64 c = s.ids[at];
        k.w[0] = (u32)(c >> 32);
        id = c & 0xffffffffu;
    } else {
        k = s.keys[at];
        id = s.ids[at];
    }
}

// The count of pairs [a, e) of the tile below pair i (segment_put's layout), eight loads in
// flight a step (one at a time, each comparison waited on its load).
template <class K> __device__ __forceinline__ u32 rank_in_part(Smem<K> s, u32 a, u32 e, u32 i) {
    const u64 mine = s.ids[i];
    auto below = [&](u32 j) -> u32 {
        if constexpr (K::BITS == 32) {
            return s.ids[j] < mine;
        } else {
            return pair_less(s.keys[j], s.ids[j], s.keys[i], mine);
        }
    };
    u32 rank = 0, j = a;
    for (; j + 8 <= e; j += 8) {
#pragma unroll
        for (u32 u = 0; u < 8; ++u) rank += below(j + u);
    }
    for (; j < e; ++j) rank += below(j);
    return rank;
}

// A big bin's slice (radix_sort.cu `top_segments`: a kept bin of more than TOP_SEGMENT_BIN pairs,
// a cluster near the k-th smallest that the bins did not split, such as a tie group their sample
// missed), sorted by one block of the segment sort's launch. The bin's own sample of
// SEGMENT_TILE pairs (strided over its pairs, which the scatter left in no order), sorted by the
// register network, cuts it in G = ⌈c / SEGMENT_BIG_SLICE⌉ ranges of equally many sampled pairs,
// whatever its keys (ties by position); block g of the bin reads the bin once, counts the pairs
// below its range and gathers those in it (about a slice: half a tile) into shared memory,
// sorts them by the register network, and writes them after the pairs below. No block waits on
// another. More pairs in a range than a tile (a sample that missed most of a cluster; ~1e-4 a
// range for 32K pairs, 16 sampled pairs a range) set the crowded status instead, and the host
// sorts the kept pairs after the read-back. Keys up to 64 bits (the top-bits selection's).
#define SEGMENT_BIG_SLICE (SEGMENT_TILE / 2) // radix_sort.cu top_segments: 2·SEGMENT_SPAN

// Whether pair (w, id) lies below sampled pair j.
__device__ __forceinline__ bool below_sampled(const u64 *sw, const u32 *sid, u32 j, u64 w, u32 id) {
    return w < sw[j] || (w == sw[j] && id < sid[j]);
}

// Slice g of the big bin of pairs [bin, bin + c); the sampled pairs go in `s_words` (the
// segment blocks' part counts, 8-byte aligned: 3·SEGMENT_TILE words).
template <class K>
__device__ __forceinline__ void sort_big_bin(const K *keys, const u64 *ids, u32 *top, u32 bin, u32 c, u32 g,
                                             u32 *s_words, K *out_keys, u64 *out_ids) {
    if constexpr (K::BITS <= 64) {
        const u32 slices = (c + SEGMENT_BIG_SLICE - 1) / SEGMENT_BIG_SLICE;
        if (g >= slices) return;
        u64 *s_sw = reinterpret_cast<u64 *>(s_words);
        u32 *s_sid = s_words + 2 * SEGMENT_TILE;
        __shared__ u32 s_own;
        const K *bk = keys + bin;
        const u64 *bid = ids + bin;
        Smem<K> s = smem_of<K>(SEGMENT_TILE);
        K key[SORT_PER];
        u64 id[SORT_PER];
#pragma unroll
        for (int e = 0; e < SORT_PER; ++e) {
            const u64 i = (u64)(threadIdx.x * SORT_PER + e) * c / SEGMENT_TILE;
            key[e] = bk[i];
            id[e] = bid[i];
        }
        tile_network<K, SEGMENT_THREADS>(key, id, 0, 2, SEGMENT_TILE, s);
#pragma unroll
        for (int e = 0; e < SORT_PER; ++e) {
            s_sw[threadIdx.x * SORT_PER + e] = top_word(key[e]);
            s_sid[threadIdx.x * SORT_PER + e] = (u32)id[e];
        }
        if (threadIdx.x == 0) s_own = 0;
        __syncthreads();
        // The range [sampled pair lo, sampled pair hi) (unbounded for the first and last).
        const u32 lo = g * SEGMENT_TILE / slices, hi = (g + 1) * SEGMENT_TILE / slices;
        const bool first = g == 0, last = g + 1 == slices;
        constexpr int U = 4; // loads in flight a thread
        u32 below = 0;
        for (u32 i0 = 0; i0 < c; i0 += U * SEGMENT_THREADS) {
            K k[U];
            u64 d[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 i = i0 + u * SEGMENT_THREADS + threadIdx.x;
                if (i < c) {
                    k[u] = bk[i];
                    d[u] = bid[i];
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (i0 + u * SEGMENT_THREADS + threadIdx.x >= c) continue;
                const u64 w = top_word(k[u]);
                if (!first && below_sampled(s_sw, s_sid, lo, w, (u32)d[u])) {
                    ++below;
                } else if (last || below_sampled(s_sw, s_sid, hi, w, (u32)d[u])) {
                    const u32 at = atomicAdd(&s_own, 1u);
                    if (at < SEGMENT_TILE) segment_put(s, at, k[u], d[u]);
                }
            }
        }
        below = block_exclusive_sum(below) + below; // inclusive: the last thread holds the total
        __shared__ u32 s_below;
        if (threadIdx.x == SEGMENT_THREADS - 1) s_below = below;
        __syncthreads();
        const u32 own = s_own, before = s_below;
        if (own > SEGMENT_TILE) {
            if (threadIdx.x == 0) *(volatile u32 *)(top + TOP_STATUS) = TOP_STATUS_CROWDED;
            return;
        }
        if (own == 0) return;
#pragma unroll
        for (int e = 0; e < SORT_PER; ++e) {
            const u32 i = threadIdx.x * SORT_PER + e;
            if (i < own) {
                segment_get(s, i, key[e], id[e]);
            } else {
                key[e] = key_max<K>();
                id[e] = ~0ull;
            }
        }
        __syncthreads(); // the network reuses the tile
        tile_network<K, SEGMENT_THREADS>(key, id, 0, 2, SEGMENT_TILE, s);
        store_tile(out_keys + bin + before, out_ids + bin + before, own, 0, key, id);
    }
}

template <class K>
__device__ void sort_segments(const K *keys, const u64 *ids, const u32 *top, const u32 *seg, K *out_keys,
                              u64 *out_ids) {
    __shared__ u32 s_largest;
    // The parts' counts, then their starts in the segment (≤ TOP_BINS of them, and a last).
    __shared__ __align__(8) u32 s_part[TOP_BINS + 1];
    static_assert(3 * SEGMENT_TILE <= TOP_BINS + 1, "s_part holds a big bin's sampled pairs");
    const u32 st = top[TOP_STATUS];
    const u64 m = *reinterpret_cast<const u64 *>(top + TOP_COUNT), p = (u64)blockIdx.x * SEGMENT_SPAN;
    // The block's bins [lo, hi) and their pairs [first, end) (radix_sort.cu `top_segments`),
    // loaded with the words above; or a big bin's slice.
    const uint4 mine = reinterpret_cast<const uint4 *>(seg)[blockIdx.x];
    if (st != 0 || p >= m) return;
    if (mine.z & TOP_BIG_SLICE) {
        sort_big_bin<K>(keys, ids, const_cast<u32 *>(top), mine.y, mine.w - mine.y, mine.z & ~TOP_BIG_SLICE, s_part,
                        out_keys, out_ids);
        return;
    }
    const u32 lo = mine.x, hi = mine.z;
    const u64 first = mine.y;
    const u32 len = mine.w - mine.y, nb = hi - lo;
    if (len == 0) return;
    if (threadIdx.x == 0) s_largest = 0;
    // Parts of ~4 pairs on average (block-uniform), at most TOP_BINS in all.
    u32 bits = 0;
    while (bits < SEGMENT_PART_BITS && (nb << (bits + 1)) <= TOP_BINS && (len >> (bits + 1)) >= 4 * nb) ++bits;
    const u32 parts = nb << bits;
    for (u32 j = threadIdx.x; j < parts; j += SEGMENT_THREADS) s_part[j] = 0;
    const TopBins tb = TopBins::of(top);
    __syncthreads();
    // Pairs i = t + r·SEGMENT_THREADS of the segment: their part, and their slot in it.
    constexpr u32 R = SEGMENT_TILE / SEGMENT_THREADS;
    K key[R];
    u64 id[R];
    u32 part[R], slot[R];
#pragma unroll
    for (u32 r = 0; r < R; ++r) {
        const u32 i = threadIdx.x + r * SEGMENT_THREADS;
        if (i < len) {
            key[r] = keys[first + i];
            id[r] = ids[first + i];
        }
    }
#pragma unroll
    for (u32 r = 0; r < R; ++r) {
        const u32 i = threadIdx.x + r * SEGMENT_THREADS;
        if (i < len) {
            u32 b;
            const u32 f = tb.part(top_word(key[r]), id[r], bits, b);
            part[r] = min(((b - lo) << bits) | f, parts - 1);
            slot[r] = atomicAdd(&s_part[part[r]], 1u);
        }
    }
    __syncthreads();
    // The parts' starts (in place), and the largest part: thread t sums parts
    // [t·per, t·per + per).
    const u32 per = (parts + SEGMENT_THREADS - 1) / SEGMENT_THREADS, j0 = threadIdx.x * per;
    u32 sum = 0, largest = 0;
    for (u32 j = j0; j < min(j0 + per, parts); ++j) {
        sum += s_part[j];
        largest = max(largest, s_part[j]);
    }
    u32 at = block_exclusive_sum(sum); // its barriers order the reads above before the writes below
    for (u32 j = j0; j < min(j0 + per, parts); ++j) {
        const u32 c = s_part[j];
        s_part[j] = at;
        at += c;
    }
    if (largest > SEGMENT_RANK_PART) atomicMax(&s_largest, largest);
    if (threadIdx.x == 0) s_part[parts] = len;
    __syncthreads();
    Smem<K> s = smem_of<K>(SEGMENT_TILE);
    if (s_largest == 0) {
#pragma unroll
        for (u32 r = 0; r < R; ++r) {
            if (threadIdx.x + r * SEGMENT_THREADS < len) {
                slot[r] += s_part[part[r]];
                segment_put(s, slot[r], key[r], id[r]);
            }
        }
        __syncthreads();
        // Each pair's place in the segment: its part's start and its rank in the part. The
        // pairs go there in shared memory, then out in order (from registers to their places,
        // each warp's stores would spread over 32 sectors).
#pragma unroll
        for (u32 r = 0; r < R; ++r) {
            if (threadIdx.x + r * SEGMENT_THREADS < len) {
                const u32 a = s_part[part[r]], e = s_part[part[r] + 1];
                slot[r] = a + rank_in_part<K>(s, a, e, slot[r]);
            }
        }
        __syncthreads();
#pragma unroll
        for (u32 r = 0; r < R; ++r) {
            if (threadIdx.x + r * SEGMENT_THREADS < len) segment_put(s, slot[r], key[r], id[r]);
        }
        __syncthreads();
        for (u32 i = threadIdx.x; i < len; i += SEGMENT_THREADS) segment_get(s, i, out_keys[first + i], out_ids[first + i]);
        return;
    }
    K nkey[SORT_PER];
    u64 nid[SORT_PER];
    load_tile(keys + first, ids + first, len, 0, nkey, nid);
    tile_network<K, SEGMENT_THREADS>(nkey, nid, 0, 2, SEGMENT_TILE, s);
    store_tile(out_keys + first, out_ids + first, len, 0, nkey, nid);
}

// Sort, the steps of stride SORT_TILE/2 .. 1 of size `size` (> SORT_TILE), per tile.
template <class K> __device__ void merge_local(K *keys, u64 *ids, u64 m, u64 size) {
    K key[SORT_PER];
    u64 id[SORT_PER];
    const u64 tile_base = (u64)blockIdx.x * SORT_TILE;
    load_tile(keys, ids, m, tile_base, key, id);
    tile_network(key, id, tile_base, size, size, smem_of<K>(SORT_TILE));
    store_tile(keys, ids, m, tile_base, key, id);
}

// Sort of a small set, the last step of a sampled selection (sample.cu): the m = *n_ptr pairs
// (m ≤ cap), by rank, in one launch. Block (b, c) of a (cap/256)² grid sorts the 256 pairs of
// chunk c (`block_sort_pairs`, one pair per thread), and finds for each pair of chunk b how
// many pairs of chunk c are below it (a binary search in shared memory) and adds that to the
// pair's rank; the last of the ⌈m/256⌉ blocks of row b to finish writes the row's pairs to
// out[rank]. Pairs are distinct, so the ranks are a permutation. Only the blocks that hold
// pairs take part (the grid is sized for cap, since m lives on the device): the others return
// at once. For a few thousand pairs this one launch of searches beats comparing every pair with
// every other (one block then scatters all m pairs), sorting the chunks in a launch of their own,
// and a one-block bitonic sort. `ranks` (cap words) and `row_done` (cap/256 words) must be zero.
// Does nothing once `status` is set; sets bit 4 when m > cap (the host then sorts with the
// kernels above). Blocks of RANK_THREADS.
#define RANK_THREADS 256

template <class K>
__device__ void rank_sort(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, K *out_keys, u64 *out_ids,
                          u32 *status, u32 *ranks, u32 *row_done) {
    __shared__ K s_keys[RANK_THREADS];
    __shared__ u64 s_ids[RANK_THREADS];
    if (__ldcg(status) != 0) return;
    const u64 m = __ldcg(n_ptr);
    if (m > cap) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, 4u);
        return;
    }
    const u64 blocks = cap / RANK_THREADS;
    const u64 rb = (u64)blockIdx.x % blocks, cb = (u64)blockIdx.x / blocks;
    const u64 row = rb * RANK_THREADS, col = cb * RANK_THREADS;
    if (row >= m || col >= m) return; // uniform per block
    const u64 i = row + threadIdx.x, j = col + threadIdx.x;
    const bool mine = i < m;
    const K k = mine ? keys[i] : key_zero<K>();
    const u64 id = mine ? ids[i] : 0;
    // Chunk c, sorted; padded with the largest pair, above every real one (row ids are below
    // 2^64 - 1), so the search below never counts the padding.
    K ck = j < m ? keys[j] : key_max<K>();
    u64 cid = j < m ? ids[j] : ~0ull;
    block_sort_pairs<RANK_THREADS>(ck, cid, s_keys, s_ids);
    s_keys[threadIdx.x] = ck;
    s_ids[threadIdx.x] = cid;
    __syncthreads();
    // Pairs of chunk c below (k, id): binary lifting over positions [0, 255], then the last.
    u32 below = 0;
#pragma unroll
    for (u32 step = RANK_THREADS / 2; step > 0; step >>= 1) {
        const u32 q = below + step - 1;
        if (pair_less(s_keys[q], s_ids[q], k, id)) below += step;
    }
    if (below == RANK_THREADS - 1 && pair_less(s_keys[below], s_ids[below], k, id)) below = RANK_THREADS;
    if (mine && below != 0) atomicAdd(&ranks[i], below);
    const u32 taking_part = (u32)((m + RANK_THREADS - 1) / RANK_THREADS);
    if (!last_block_of(&row_done[rb], taking_part)) return;
    if (mine) {
        const u32 r = __ldcg(&ranks[i]);
        out_keys[r] = k;
        out_ids[r] = id;
    }
}

// Sort of up to ~2·10^5 pairs whose count lives on the device (the survivors of a sampled
// selection at large k), in three launches, by ranks; tiles of CHUNK_TILE = SORT_PER ·
// CHUNK_THREADS pairs (2048; 1024 for 256-bit keys), T of them for cap pairs:
//   chunk_sort     block b sorts tile b of [0, m) (m = *n_ptr, padded past m with the
//                  largest pair) ascending in registers (`tile_network` with local indices, so
//                  every tile ascends) into `tiles`;
//   chunk_rank     block (b, c) of a T × T grid loads sorted tile c into shared memory and
//                  writes, for each pair of tile b, how many of tile c's pairs are below it (a
//                  search; its own position when c = b) to below[c · T·CHUNK_TILE + i] (padding
//                  pairs get counts too, never read);
//   chunk_scatter  pair i goes to out[Σ_c below[c][i]].
// Pairs are distinct, so the ranks are a permutation of [0, m). Tiles of 4096 pairs sorted by
// 1024-thread blocks left most SMs idle (20 blocks at m = 80K), and adding each rank with an
// atomic was slow: smaller tiles spread the sort, the count matrix replaces the atomics. The
// rank work and its L2 traffic grow with T²: the host uses it up to CHUNK_RANK_MAX pairs. The
// kernels do nothing once `status` (when not null) is set, and chunk_sort sets bit 4 when
// m > cap.
#define CHUNK_THREADS 512
#define CHUNK_TILE (SORT_PER * CHUNK_THREADS)

template <class K>
__device__ void chunk_sort(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, K *tile_keys, u64 *tile_ids,
                           u32 *status) {
    if (status && __ldcg(status) != 0) return;
    const u64 m = __ldcg(n_ptr);
    if (m > cap) {
        if (status && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, 4u);
        return;
    }
    const u64 tile_base = (u64)blockIdx.x * CHUNK_TILE;
    if (tile_base >= m) return;
    K key[SORT_PER];
    u64 id[SORT_PER];
    load_tile(keys, ids, m, tile_base, key, id);
    // Local indices: size CHUNK_TILE sorts every tile ascending.
    tile_network<K, CHUNK_THREADS>(key, id, 0, 2, (u64)CHUNK_TILE, smem_of<K>(CHUNK_TILE));
    store_tile(tile_keys, tile_ids, tile_base + CHUNK_TILE, tile_base, key, id);
}

template <class K>
__device__ void chunk_rank(const K *tile_keys, const u64 *tile_ids, const u64 *n_ptr, u64 cap, u32 *below,
                           const u32 *status) {
    if (status && __ldcg(status) != 0) return;
    const u64 m = __ldcg(n_ptr);
    if (m > cap) return;
    const u64 grid_tiles = (cap + CHUNK_TILE - 1) / CHUNK_TILE;
    const u64 b = (u64)blockIdx.x % grid_tiles, c = (u64)blockIdx.x / grid_tiles;
    const u64 used = (m + CHUNK_TILE - 1) / CHUNK_TILE;
    if (b >= used || c >= used) return; // uniform per block
    Smem<K> s = smem_of<K>(CHUNK_TILE);
    const u64 row = b * CHUNK_TILE, col = c * CHUNK_TILE;
    if (c != b) {
        for (u32 t = threadIdx.x; t < CHUNK_TILE; t += CHUNK_THREADS) {
            s.keys[t] = tile_keys[col + t];
            s.ids[t] = tile_ids[col + t];
        }
    }
    __syncthreads();
    // This thread's pairs: positions first .. first + SORT_PER - 1 of sorted tile b. Each one's
    // count in tile c starts where the previous one's ended (a gallop after one binary
    // search), and the counts go out in one vector store.
    const u32 first = threadIdx.x * SORT_PER;
    u32 count[SORT_PER];
#pragma unroll
    for (int e = 0; e < SORT_PER; ++e) {
        if (c == b) {
            count[e] = first + e;
            continue;
        }
        const K k = tile_keys[row + first + e];
        const u64 id = tile_ids[row + first + e];
        u32 n = 0;
        if (e == 0) {
            // Binary lifting over [0, CHUNK_TILE - 1], then the last (the padding, the largest
            // pair, is never below a real one).
#pragma unroll
            for (u32 step = CHUNK_TILE / 2; step > 0; step >>= 1) {
                const u32 q = n + step - 1;
                if (pair_less(s.keys[q], s.ids[q], k, id)) n += step;
            }
            if (n == CHUNK_TILE - 1 && pair_less(s.keys[n], s.ids[n], k, id)) n = CHUNK_TILE;
        } else {
            // Every pair of tile c below the previous pair is below this one.
            n = count[e - 1];
            u32 g = 1;
            while (n + g <= CHUNK_TILE && pair_less(s.keys[n + g - 1], s.ids[n + g - 1], k, id)) {
                n += g;
                g <<= 1;
            }
            for (g >>= 1; g > 0; g >>= 1) {
                if (n + g <= CHUNK_TILE && pair_less(s.keys[n + g - 1], s.ids[n + g - 1], k, id)) n += g;
            }
        }
        count[e] = n;
    }
    u32 *out = below + c * grid_tiles * CHUNK_TILE + row + first;
    if (SORT_PER == 4) {
        *reinterpret_cast<uint4 *>(out) = make_uint4(count[0], count[1], count[SORT_PER > 2 ? 2 : 0],
                                                      count[SORT_PER > 3 ? 3 : 0]);
    } else {
        *reinterpret_cast<uint2 *>(out) = make_uint2(count[0], count[SORT_PER > 1 ? 1 : 0]);
    }
}

template <class K>
__device__ void chunk_scatter(const K *tile_keys, const u64 *tile_ids, const u64 *n_ptr, u64 cap, const u32 *below,
                              K *out_keys, u64 *out_ids, const u32 *status) {
    if (status && __ldcg(status) != 0) return;
    const u64 m = __ldcg(n_ptr);
    if (m > cap) return;
    const u64 grid_tiles = (cap + CHUNK_TILE - 1) / CHUNK_TILE;
    const u64 used = (m + CHUNK_TILE - 1) / CHUNK_TILE;
    const u64 stride = grid_tiles * CHUNK_TILE;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < used * CHUNK_TILE; i += (u64)gridDim.x * blockDim.x) {
        // Sorted tiles: the real pairs of each tile come first, then its padding.
        if (i % CHUNK_TILE >= m - i / CHUNK_TILE * CHUNK_TILE) continue;
        u32 rank = 0;
#pragma unroll 8
        for (u64 c = 0; c < used; ++c) rank += __ldcg(&below[c * stride + i]);
        out_keys[rank] = tile_keys[i];
        out_ids[rank] = tile_ids[i];
    }
}

#define BITONIC_ENTRIES(K, S)                                                                                     \
    extern "C" __global__ void __launch_bounds__(BITONIC_THREADS)                                                 \
        bitonic_topk_##S(const K *keys, const u64 *ids, u64 n, K *out_keys, u64 *out_ids, u32 k2, u32 c) { grid_dependency_wait(); \
        topk<K>(keys, ids, n, out_keys, out_ids, k2, c);                                                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SORT_THREADS)                                                    \
        bitonic_sort_local_##S(const K *keys, const u64 *ids, u64 n, K *out_keys, u64 *out_ids, u64 m) { grid_dependency_wait(); \
        sort_local<K>(keys, ids, n, out_keys, out_ids, m);                                                        \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        bitonic_sort_step_##S(K *keys, u64 *ids, u64 m, u64 size, u64 stride) { grid_dependency_wait();           \
        sort_step<K>(keys, ids, m, size, stride);                                                                 \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SORT_THREADS)                                                    \
        bitonic_merge_local_##S(K *keys, u64 *ids, u64 m, u64 size) { grid_dependency_wait();                     \
        merge_local<K>(keys, ids, m, size);                                                                       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RANK_THREADS)                                                    \
        bitonic_rank_sort_##S(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, K *out_keys, u64 *out_ids, \
                              u32 *status, u32 *ranks, u32 *row_done) { grid_dependency_wait();                   \
        rank_sort<K>(keys, ids, n_ptr, cap, out_keys, out_ids, status, ranks, row_done);                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)                                                   \
        bitonic_chunk_sort_##S(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, K *tile_keys,            \
                               u64 *tile_ids, u32 *status) { grid_dependency_wait();                              \
        chunk_sort<K>(keys, ids, n_ptr, cap, tile_keys, tile_ids, status);                                        \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)                                                   \
        bitonic_chunk_rank_##S(const K *tile_keys, const u64 *tile_ids, const u64 *n_ptr, u64 cap, u32 *below,    \
                               const u32 *status) { grid_dependency_wait();                                       \
        chunk_rank<K>(tile_keys, tile_ids, n_ptr, cap, below, status);                                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        bitonic_chunk_scatter_##S(const K *tile_keys, const u64 *tile_ids, const u64 *n_ptr, u64 cap,             \
                                  const u32 *below, K *out_keys, u64 *out_ids, const u32 *status) { grid_dependency_wait(); \
        chunk_scatter<K>(tile_keys, tile_ids, n_ptr, cap, below, out_keys, out_ids, status);                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SEGMENT_THREADS, 4)                                               \
        bitonic_sort_segments_##S(const K *keys, const u64 *ids, const u32 *top, const u32 *seg,                  \
                                  K *out_keys, u64 *out_ids) { grid_dependency_wait();                            \
        sort_segments<K>(keys, ids, top, seg, out_keys, out_ids);                                                 \
    }
INSTANTIATE_KEYS(BITONIC_ENTRIES)
