// groups.cu: top-k per group over pairs sorted by (composite key, row id), the composite's
// bits from `lo` up holding the group keys (the window's PARTITION BY) and the bits below the
// order keys (its ORDER BY). A group is a run of pairs whose bits from `lo` up are equal; the
// thread at a group's first pair walks the group in order and keeps
//   ROW_NUMBER (fn 0): its first k pairs, numbered from 1;
//   RANK       (fn 1): the pairs whose rank (1 + the group's pairs with a smaller key) is <= k;
//   DENSE_RANK (fn 2): the pairs whose dense rank (1 + distinct smaller keys) is <= k;
// pairs with equal composites are peers (one rank), ties between them ordered by row id.
// Three launches and no read-back between them:
//   group_count  the kept count of each group (at its first pair; 0 elsewhere), summed per
//                block;
//   group_scan   one block: the block sums' exclusive offsets, and the total;
//   group_write  each group's first pair: its block-local offset plus its block's, then its
//                kept pairs' row ids and ranks, in order: the output is sorted like the pairs.
// The walk is serial within a group (its kept pairs plus one): a group with many peers at its
// k-th key is walked by one thread, which is still linear in what it keeps.
//
// Few large groups (the `group-threshold` algorithm) first drop the pairs that cannot be kept,
// so that only a few per group are sorted:
//   group_sample  every step-th pair's key (the host sorts them and picks, in each group the
//                 sample covers well, a sampled key with enough pairs at or below it: the
//                 group's limit);
//   group_filter  the pairs at or below their group's limit (binary search in the limits,
//                 sorted), and every pair of a group without one, appended to a new buffer.
// A limit is a real pair's key with at least k (distinct, under DENSE_RANK) sampled keys of its
// group at or below it, so every pair the walk keeps passes the filter: the sample decides
// only how many others are sorted with them.
//
// K = 1 (the `group-min` algorithm) keeps, before the sort, only the pairs that may be their
// group's first:
//   group_min_word    one launch a word, from the most significant: each pair's group hashes
//                     to one of mask + 1 slots (initialised to all ones), and a pair whose
//                     higher words equal its slot's takes the atomic minimum of word j; after
//                     the last word a slot holds the smallest composite hashed to it;
//   group_min_filter  drops each pair whose slot holds a smaller composite of its own group.
// A slot's composite is a real pair's, so a dropped pair has a better pair in its group: the
// result is exact whatever the hash, which decides only how many pairs are kept (a group that
// shares its slot with a smaller group keeps all of its pairs).
//
// The kept rows' output columns, where the column cache holds them:
//   group_gather  one launch a column: the kept row ids' values (1, 2, 4, 8 or 16 bytes each)
//                 and validity bits, in the kept rows' order, so the host reads back the
//                 columns instead of row ids to look up at random in host memory.

#include "common.cuh"

#define GROUP_THREADS 256
#define GROUP_SCAN_THREADS 1024

// Whether a and b have the same bits from `lo` up (the same group).
template <class K> __device__ __forceinline__ bool same_group(const K &a, const K &b, u32 lo) {
    constexpr int W = 8 * sizeof(typename K::Word);
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        if ((j + 1) * W <= (int)lo) continue;
        typename K::Word mask = (typename K::Word)~0ull;
        if (j * W < (int)lo) mask = (typename K::Word)(mask << ((int)lo - j * W));
        if ((a.w[j] & mask) != (b.w[j] & mask)) return false;
    }
    return true;
}

template <class K> __device__ __forceinline__ bool same_key(const K &a, const K &b) {
#pragma unroll
    for (int j = 0; j < K::N; ++j)
        if (a.w[j] != b.w[j]) return false;
    return true;
}

template <class K> __device__ __forceinline__ bool group_starts(const K *keys, u64 i, u32 lo) {
    return i == 0 || !same_group(keys[i - 1], keys[i], lo);
}

// The kept pairs of the group whose first pair is s: how many, and (out_ids not null) their row
// ids and ranks written in order.
template <class K>
__device__ u64 group_walk(const K *keys, const u64 *ids, u64 m, u64 s, u32 lo, u32 fn, u64 k,
                          u64 *out_ids, u64 *out_ranks) {
    const K first = keys[s];
    K prev = first;
    u64 kept = 0, rank = 0, dense = 0;
    for (u64 j = s; j < m; ++j) {
        const K key = keys[j];
        if (j > s && !same_group(key, first, lo)) break;
        const u64 position = j - s + 1;
        if (j == s || !same_key(key, prev)) {
            rank = position;
            dense += 1;
        }
        const u64 r = fn == 0 ? position : fn == 1 ? rank : dense;
        if (r > k) break;
        if (out_ids) {
            out_ids[kept] = ids[j];
            out_ranks[kept] = r;
        }
        ++kept;
        prev = key;
    }
    return kept;
}

// Exclusive prefix sums of one value per thread over a block of GROUP_THREADS; `total` gets
// the block's sum.
__device__ __forceinline__ u64 block_exclusive(u64 v, u64 *total) {
    __shared__ u64 warp_sums[GROUP_THREADS / 32];
    const u32 lane = lane_id(), warp = threadIdx.x / 32;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(FULL_MASK, x, o);
        if ((int)lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    u64 before = 0, all = 0;
    for (u32 w = 0; w < GROUP_THREADS / 32; ++w) {
        if (w < warp) before += warp_sums[w];
        all += warp_sums[w];
    }
    *total = all;
    return before + x - v;
}

template <class K>
__device__ void group_count(const K *keys, const u64 *ids, u64 m, u32 lo, u32 fn, u64 k, u64 *block_sums) {
    const u64 i = (u64)blockIdx.x * GROUP_THREADS + threadIdx.x;
    u64 c = 0;
    if (i < m && group_starts(keys, i, lo)) c = group_walk(keys, ids, m, i, lo, fn, k, (u64 *)0, (u64 *)0);
    u64 total;
    block_exclusive(c, &total);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = total;
}

template <class K>
__device__ void group_write(const K *keys, const u64 *ids, u64 m, u32 lo, u32 fn, u64 k, const u64 *block_offsets,
                            u64 *out_ids, u64 *out_ranks) {
    const u64 i = (u64)blockIdx.x * GROUP_THREADS + threadIdx.x;
    const bool starts = i < m && group_starts(keys, i, lo);
    const u64 c = starts ? group_walk(keys, ids, m, i, lo, fn, k, (u64 *)0, (u64 *)0) : 0;
    u64 total;
    const u64 at = block_offsets[blockIdx.x] + block_exclusive(c, &total);
    if (c > 0) group_walk(keys, ids, m, i, lo, fn, k, out_ids + at, out_ranks + at);
}

// In place: the n block sums become exclusive offsets; `total` gets their sum. One block.
extern "C" __global__ void __launch_bounds__(GROUP_SCAN_THREADS) group_scan(u64 *sums, u64 n, u64 *total) {
    grid_dependency_wait();
    __shared__ u64 chunk_sums[GROUP_SCAN_THREADS];
    const u64 per = (n + GROUP_SCAN_THREADS - 1) / GROUP_SCAN_THREADS;
    const u64 lo = threadIdx.x * per, hi = min(lo + per, n);
    u64 s = 0;
    for (u64 j = lo; j < hi; ++j) s += sums[j];
    chunk_sums[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 run = 0;
        for (u32 t = 0; t < GROUP_SCAN_THREADS; ++t) {
            const u64 v = chunk_sums[t];
            chunk_sums[t] = run;
            run += v;
        }
        *total = run;
    }
    __syncthreads();
    u64 run = chunk_sums[threadIdx.x];
    for (u64 j = lo; j < hi; ++j) {
        const u64 v = sums[j];
        sums[j] = run;
        run += v;
    }
}

// dst[i] = src[ids[i]] for i < n, `width` bytes a value; with `src_valid` (a bitmap of the
// table's rows, bit i of byte i / 8) also the bits into `dst_valid`, one 32-bit word a warp of
// 32 consecutive rows (every lane of a warp stays in the loop for the ballot).
extern "C" __global__ void __launch_bounds__(GROUP_THREADS)
    group_gather(const u8 *src, u32 width, const u8 *src_valid, const u64 *ids, u64 n, u8 *dst,
                 u32 *dst_valid) {
    grid_dependency_wait();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 base = (u64)blockIdx.x * blockDim.x + (threadIdx.x & ~31u); base < n; base += stride) {
        const u64 i = base + lane_id();
        bool valid = false;
        if (i < n) {
            const u64 row = ids[i];
            switch (width) {
            case 1: dst[i] = src[row]; break;
            case 2: ((u16 *)dst)[i] = ((const u16 *)src)[row]; break;
            case 4: ((u32 *)dst)[i] = ((const u32 *)src)[row]; break;
            case 8: ((u64 *)dst)[i] = ((const u64 *)src)[row]; break;
            default:
                ((u64 *)dst)[2 * i] = ((const u64 *)src)[2 * row];
                ((u64 *)dst)[2 * i + 1] = ((const u64 *)src)[2 * row + 1];
            }
            if (src_valid) valid = (src_valid[row >> 3] >> (row & 7)) & 1u;
        }
        if (src_valid) {
            const u32 bits = __ballot_sync(FULL_MASK, valid);
            if (lane_id() == 0) dst_valid[base >> 5] = bits;
        }
    }
}

// The sign of (a's group bits) - (b's): the bits from `lo` up, most significant word first.
template <class K> __device__ __forceinline__ int group_cmp(const K &a, const K &b, u32 lo) {
    constexpr int W = 8 * sizeof(typename K::Word);
#pragma unroll
    for (int j = K::N - 1; j >= 0; --j) {
        if ((j + 1) * W <= (int)lo) continue;
        typename K::Word mask = (typename K::Word)~0ull;
        if (j * W < (int)lo) mask = (typename K::Word)(mask << ((int)lo - j * W));
        const typename K::Word x = a.w[j] & mask, y = b.w[j] & mask;
        if (x != y) return x < y ? -1 : 1;
    }
    return 0;
}

template <class K> __device__ __forceinline__ bool key_less(const K &a, const K &b) {
#pragma unroll
    for (int j = K::N - 1; j >= 0; --j) {
        if (a.w[j] != b.w[j]) return a.w[j] < b.w[j];
    }
    return false;
}

template <class K> __device__ void group_sample(const K *keys, u64 step, u64 s, K *out) {
    const u64 i = (u64)blockIdx.x * GROUP_THREADS + threadIdx.x;
    if (i < s) out[i] = keys[i * step];
}

template <class K>
__device__ void group_filter(const K *keys, const u64 *ids, u64 m, u32 lo, const K *limits, u64 n, K *out_keys,
                             u64 *out_ids, u64 *count) {
    FOR_BLOCK_ROUNDS(i0, m) {
        const u64 i = i0 + threadIdx.x;
        bool keep = false;
        K k;
        u64 id = 0;
        if (i < m) {
            k = keys[i];
            id = ids[i];
            // The first limit whose group is not below k's.
            u64 a = 0, b = n;
            while (a < b) {
                const u64 mid = (a + b) / 2;
                if (group_cmp(limits[mid], k, lo) < 0) a = mid + 1;
                else b = mid;
            }
            keep = a == n || group_cmp(limits[a], k, lo) != 0 || !key_less(limits[a], k);
        }
        const u64 pos = warp_append(keep, count);
        if (keep) {
            out_keys[pos] = k;
            out_ids[pos] = id;
        }
    }
}

// A hash of a's bits from `lo` up (its group).
template <class K> __device__ __forceinline__ u64 group_hash(const K &a, u32 lo) {
    constexpr int W = 8 * sizeof(typename K::Word);
    u64 h = 0x9E3779B97F4A7C15ull;
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        // Words wholly below `lo` hash as zero.
        const int below = (int)lo - j * W;
        const typename K::Word mask = below >= W  ? (typename K::Word)0
                                      : below > 0 ? (typename K::Word)((typename K::Word)~0ull << below)
                                                  : (typename K::Word)~0ull;
        u64 x = h ^ (u64)(a.w[j] & mask);
        // splitmix64's finaliser.
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
        h = x ^ (x >> 31);
    }
    return h;
}

__device__ __forceinline__ void atomic_min_word(u32 *at, u32 v) { atomicMin(at, v); }
__device__ __forceinline__ void atomic_min_word(u64 *at, u64 v) { atomicMin(at, v); }

template <class K> __device__ void group_min_word(const K *keys, u64 m, u32 lo, K *slots, u64 mask, u32 j) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (u64)gridDim.x * blockDim.x) {
        const typename K::Word *key = keys[i].w;
        typename K::Word *slot = slots[group_hash(keys[i], lo) & mask].w;
        bool higher = true;
        for (int w = K::N - 1; w > (int)j; --w) higher = higher && slot[w] == key[w];
        const typename K::Word kj = key[j], sj = slot[j];
        // Words only fall, so a stale read can only cost an atomic, never skip one.
        if (higher && kj < sj) atomic_min_word(slot + j, kj);
    }
}

template <class K>
__device__ void group_min_filter(const K *keys, const u64 *ids, u64 m, u32 lo, const K *slots, u64 mask,
                                 K *out_keys, u64 *out_ids, u64 *count) {
    FOR_BLOCK_ROUNDS(i0, m) {
        const u64 i = i0 + threadIdx.x;
        bool keep = false;
        K k;
        u64 id = 0;
        if (i < m) {
            k = keys[i];
            id = ids[i];
            const K s = slots[group_hash(k, lo) & mask];
            keep = !same_group(s, k, lo) || !key_less(s, k);
        }
        const u64 pos = warp_append(keep, count);
        if (keep) {
            out_keys[pos] = k;
            out_ids[pos] = id;
        }
    }
}

#define GROUP_ENTRIES(K, S)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_count_##S(const K *keys, const u64 *ids, u64 m, u32 lo, u32 fn, u64 k, u64 *block_sums) {           \
        grid_dependency_wait();                                                                                   \
        group_count<K>(keys, ids, m, lo, fn, k, block_sums);                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_write_##S(const K *keys, const u64 *ids, u64 m, u32 lo, u32 fn, u64 k, const u64 *block_offsets,    \
                        u64 *out_ids, u64 *out_ranks) {                                                           \
        grid_dependency_wait();                                                                                   \
        group_write<K>(keys, ids, m, lo, fn, k, block_offsets, out_ids, out_ranks);                               \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_sample_##S(const K *keys, u64 step, u64 s, K *out) {                                                \
        grid_dependency_wait();                                                                                   \
        group_sample<K>(keys, step, s, out);                                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_filter_##S(const K *keys, const u64 *ids, u64 m, u32 lo, const K *limits, u64 n, K *out_keys,       \
                         u64 *out_ids, u64 *count) {                                                              \
        grid_dependency_wait();                                                                                   \
        group_filter<K>(keys, ids, m, lo, limits, n, out_keys, out_ids, count);                                   \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_min_word_##S(const K *keys, u64 m, u32 lo, K *slots, u64 mask, u32 j) {                             \
        grid_dependency_wait();                                                                                   \
        group_min_word<K>(keys, m, lo, slots, mask, j);                                                           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(GROUP_THREADS)                                                   \
        group_min_filter_##S(const K *keys, const u64 *ids, u64 m, u32 lo, const K *slots, u64 mask, K *out_keys, \
                             u64 *out_ids, u64 *count) {                                                          \
        grid_dependency_wait();                                                                                   \
        group_min_filter<K>(keys, ids, m, lo, slots, mask, out_keys, out_ids, count);                             \
    }
INSTANTIATE_KEYS(GROUP_ENTRIES)
