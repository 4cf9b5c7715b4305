// candidates.cu: the device-resident candidate buffer of a selection in progress.
//
// Each batch's encoded keys are appended to the candidate buffer with their row ids, except
// rows that cannot win any more: a row is kept only if its (key, row id) is smaller than the
// *threshold*, the k-th best pair of an earlier reduction of the buffer to k (nothing at or
// above it can be among the final k, since the k pairs below it already exist). Appends are
// warp-aggregated (one atomic per warp; the filters go through common.cuh's per-warp write
// buffer); their order does not matter, as pairs are unique.
//
// `pair_max` computes the threshold after a reduction (the largest of the k survivors): a
// grid-stride maximum per block, then the last block to finish reduces the per-block maxima.

#include "common.cuh"

// Keeps the pairs below the threshold (all of them when it is not valid yet).
template <class K> struct BelowThreshold {
    bool filter;
    K key;
    u64 id;
    __device__ __forceinline__ bool operator()(const K &k, u64 i) const { return !filter || pair_less(k, i, key, id); }
};

// Keeps a fixed pseudo-random fraction of the rows, cut / 2^32, by a hash of the row id: the
// filter of the benchmarks' selectivity sweep and of the cost model's calibration (a `WHERE`
// uncorrelated with the keys).
struct HashedFraction {
    u32 cut;
    __device__ __forceinline__ u32 hash(u64 i) const {
        u64 x = i * 0x9E3779B97F4A7C15ull;
        x ^= x >> 32;
        x *= 0xD6E8FEB86659FD93ull;
        return (u32)(x >> 32);
    }
    template <class K> __device__ __forceinline__ bool operator()(const K &, u64 i) const { return hash(i) < cut; }
};

// `filter_keys`: the pass over positional inputs (row id i is i) that keeps what `Keep`
// accepts (`filter_below`: the pairs below a threshold; `filter_fraction`: a hashed fraction).
// Reads the keys only, with 16-byte vector loads, four in flight per thread (the loop of
// read_floor.cu); kept pairs go through the warp's write buffer. 256-bit keys take the scalar
// loop. Blocks of 256 threads.
template <class K, class Keep>
__device__ void filter_keys(const K *keys, u64 n, Keep keep_pair, K *cand_keys, u64 *cand_ids, u64 *count,
                            u64 cap) {
    __shared__ K s_keys[8][WARP_BUFFER];
    __shared__ u64 s_ids[8][WARP_BUFFER];
    const u32 warp = threadIdx.x / 32;
    WarpBuffer<K> buf{s_keys[warp], s_ids[warp], 0};
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 done = 0; // keys [0, done) are handled by the vector loop
    if constexpr (sizeof(K) <= 16) {
        constexpr int PER = 16 / sizeof(K);
        constexpr int UNROLL = 4;
        const u64 nvec = n / PER;
        const uint4 *vec = reinterpret_cast<const uint4 *>(keys);
        // Rounds are uniform per block, so every lane reaches the warp votes.
        for (u64 base = (u64)blockIdx.x * blockDim.x; base < nvec; base += UNROLL * stride) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const u64 i = base + u * stride + threadIdx.x;
                if (i < nvec) v[u] = __ldg(vec + i);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const u64 i = base + u * stride + threadIdx.x;
                const K *kv = reinterpret_cast<const K *>(&v[u]);
                bool keep[PER];
                bool any = false;
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    keep[j] = i < nvec && keep_pair(kv[j], i * PER + j);
                    any |= keep[j];
                }
                if (__any_sync(FULL_MASK, any)) {
#pragma unroll
                    for (int j = 0; j < PER; ++j) buf.push(keep[j], kv[j], i * PER + j, cand_keys, cand_ids, count, cap);
                }
            }
        }
        done = nvec * PER;
    }
    // The keys after the last whole vector (all of them for 256-bit keys), in rounds uniform
    // per block.
    for (u64 i0 = done + (u64)blockIdx.x * blockDim.x; i0 < n; i0 += stride) {
        const u64 i = i0 + threadIdx.x;
        const bool keep = i < n && keep_pair(keys[i], i);
        const K k = i < n ? keys[i] : key_zero<K>();
        buf.push(keep, k, i, cand_keys, cand_ids, count, cap);
    }
    buf.flush(cand_keys, cand_ids, count, cap);
}

// Largest pair of [0, n) into *thr (valid = 1). `partial_keys/ids` hold one pair per block;
// `counter` is zero at launch (and reset by the last block).
template <class K>
__device__ void pair_max(const K *keys, const u64 *ids, u64 n, K *partial_keys, u64 *partial_ids, u32 *counter,
                         Threshold<K> *thr) {
    __shared__ K s_keys[256];
    __shared__ u64 s_ids[256];
    K best = key_zero<K>();
    u64 best_id = 0;
    bool any = false;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const K k = keys[i];
        const u64 id = ids[i];
        if (!any || pair_less(best, best_id, k, id)) {
            best = k;
            best_id = id;
            any = true;
        }
    }
    // Threads without rows contribute the smallest pair, (0, 0), which never wins over a row.
    s_keys[threadIdx.x] = best;
    s_ids[threadIdx.x] = best_id;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const u32 o = threadIdx.x + s;
            if (pair_less(s_keys[threadIdx.x], s_ids[threadIdx.x], s_keys[o], s_ids[o])) {
                s_keys[threadIdx.x] = s_keys[o];
                s_ids[threadIdx.x] = s_ids[o];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial_keys[blockIdx.x] = s_keys[0];
        partial_ids[blockIdx.x] = s_ids[0];
    }
    if (!last_block_done(counter)) return;
    // The last block reduces the per-block maxima (L2 loads: other blocks wrote them).
    best = key_zero<K>();
    best_id = 0;
    for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        const K k = load_cg(&partial_keys[b]);
        const u64 id = __ldcg(&partial_ids[b]);
        if (pair_less(best, best_id, k, id)) {
            best = k;
            best_id = id;
        }
    }
    s_keys[threadIdx.x] = best;
    s_ids[threadIdx.x] = best_id;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const u32 o = threadIdx.x + s;
            if (pair_less(s_keys[threadIdx.x], s_ids[threadIdx.x], s_keys[o], s_ids[o])) {
                s_keys[threadIdx.x] = s_keys[o];
                s_ids[threadIdx.x] = s_ids[o];
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        thr->key = s_keys[0];
        thr->id = s_ids[0];
        thr->valid = 1;
    }
}

// Sets the threshold to pair `index` of (keys, ids), e.g. the k-th of a sorted selection.
template <class K> __device__ void threshold_from(const K *keys, const u64 *ids, u64 index, Threshold<K> *thr) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        thr->key = keys[index];
        thr->id = ids[index];
        thr->valid = 1;
    }
}

// ---- a large k's candidates as one 64-bit word each ------------------------------------------
//
// A fused selection's candidates for a large k all beat one threshold, so their keys share most
// bits. `key_span` finds the bits that vary (per key word, the OR of the complemented keys and
// the OR of the keys; a fused pass ORs the same words as it flushes its candidates, common.cuh
// `WarpBuffer`); the host reads them back with the count, and where the varying field
// [lo, lo + width) and the row id's bits fit one 64-bit word, each pair becomes the word
// (field << id_bits) | row id (common.cuh `packed_word`; the bits outside the field are the same
// in every key). merge_sort.cu packs them as its tile sort loads them and merges the words keys
// only (half the bytes of 64-bit keys' pairs a round moves); its last round unpacks the first m
// back into (key, row id) pairs (`UnpackWords`).

// span[j] |= OR of ~word j, span[N + j] |= OR of word j, over keys [0, min(*count, cap)).
template <class K> __device__ void key_span(const K *keys, const u64 *count, u64 cap, u64 *span) {
    const u64 m = min(*count, cap);
    u64 nand[K::N], any[K::N];
#pragma unroll
    for (int j = 0; j < K::N; ++j) nand[j] = any[j] = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (u64)gridDim.x * blockDim.x) {
        const K k = keys[i];
#pragma unroll
        for (int j = 0; j < K::N; ++j) {
            nand[j] |= (u64)(typename K::Word)~k.w[j];
            any[j] |= (u64)k.w[j];
        }
    }
    // One global atomic per block and word: per warp they serialised on the two words' L2
    // slice.
    __shared__ u64 s_span[2 * K::N];
    if (threadIdx.x < 2 * K::N) s_span[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        nand[j] = warp_or(nand[j]);
        any[j] = warp_or(any[j]);
        if (lane_id() == 0 && (nand[j] | any[j]) != 0) {
            atomicOr(&s_span[j], nand[j]);
            atomicOr(&s_span[K::N + j], any[j]);
        }
    }
    __syncthreads();
    if (threadIdx.x < 2 * K::N && s_span[threadIdx.x] != 0) atomicOr(&span[threadIdx.x], s_span[threadIdx.x]);
}

#define CANDIDATE_ENTRIES(K, S)                                                                                   \
    extern "C" __global__ void                                                                                    \
        append_##S(const K *keys, const u64 *ids, u64 id_start, u64 n, const Threshold<K> *thr, K *cand_keys,     \
                   u64 *cand_ids, u64 *count, u64 cap) { grid_dependency_wait();                                  \
        append<K>(keys, ids, id_start, n, thr, cand_keys, cand_ids, count, cap);                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        filter_below_##S(const K *keys, u64 n, const Threshold<K> *thr, K *cand_keys, u64 *cand_ids, u64 *count, \
                         u64 cap) { grid_dependency_wait();                                                       \
        filter_keys<K>(keys, n, BelowThreshold<K>{thr->valid != 0, thr->key, thr->id}, cand_keys, cand_ids, count, \
                       cap);                                                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        filter_fraction_##S(const K *keys, u64 n, u32 cut, K *cand_keys, u64 *cand_ids, u64 *count, u64 cap) { grid_dependency_wait(); \
        filter_keys<K>(keys, n, HashedFraction{cut}, cand_keys, cand_ids, count, cap);                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        pair_max_##S(const K *keys, const u64 *ids, u64 n, K *partial_keys, u64 *partial_ids, u32 *counter,      \
                     Threshold<K> *thr) { grid_dependency_wait();                                                 \
        pair_max<K>(keys, ids, n, partial_keys, partial_ids, counter, thr);                                       \
    }                                                                                                             \
    extern "C" __global__ void threshold_from_##S(const K *keys, const u64 *ids, u64 index, Threshold<K> *thr) { grid_dependency_wait(); \
        threshold_from<K>(keys, ids, index, thr);                                                                 \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) key_span_##S(const K *keys, const u64 *count, u64 cap,    \
                                                                   u64 *span) { grid_dependency_wait();           \
        key_span<K>(keys, count, cap, span);                                                                      \
    }
INSTANTIATE_KEYS(CANDIDATE_ENTRIES)
