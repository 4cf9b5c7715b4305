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

// ---- the candidates of a fused pass in row order ----
//
// A fused pass appends its candidates in no order (each warp flushes its buffer when it
// fills), but with a kept-rows bitmap (one bit per row) it also says which rows they are: a candidate's rank in row order is the number of kept rows before it. Moved
// to that rank, the candidates ascend by row id, and the LSD radix sort needs the key's digits
// only (its stable passes keep that order among equal keys), where it would take the row id's
// digits too (four more passes for 2^28 rows; src/device/algorithms/fused.rs says when):
//   kept_groups   per group of 32 words (1024 rows, one 128-byte line) the kept rows before
//                 it in its chunk of KEPT_CHUNK groups, and each chunk's total;
//   kept_chunks   one block: each chunk's kept rows before it (in place);
//   order_by_row  each candidate moved to its rank: its chunk's and group's counts, and the
//                 bits before it in its group's line.
#define KEPT_CHUNK 256

// A block of KEPT_CHUNK threads per chunk; warp w takes groups w, w + 8, … (coalesced lines).
extern "C" __global__ void __launch_bounds__(KEPT_CHUNK)
    kept_groups(const u32 *bits, u64 words, u32 *group_before, u32 *chunk_total) {
    __shared__ u32 s_sum[KEPT_CHUNK];
    constexpr u32 PER_WARP = KEPT_CHUNK / (KEPT_CHUNK / 32);
    const u32 warp = threadIdx.x / 32, lane = lane_id();
    const u64 g0 = (u64)blockIdx.x * KEPT_CHUNK;
    u32 c[PER_WARP];
#pragma unroll
    for (u32 j = 0; j < PER_WARP; ++j) {
        const u64 w = (g0 + warp + j * (KEPT_CHUNK / 32)) * 32 + lane;
        c[j] = w < words ? __popc(bits[w]) : 0u;
    }
#pragma unroll
    for (u32 j = 0; j < PER_WARP; ++j) {
        const u32 sum = __reduce_add_sync(FULL_MASK, c[j]);
        if (lane == 0) s_sum[warp + j * (KEPT_CHUNK / 32)] = sum;
    }
    __syncthreads();
    const u32 v = s_sum[threadIdx.x];
    const u32 before = block_exclusive_sum(v);
    group_before[g0 + threadIdx.x] = before; // the buffer holds whole chunks
    if (threadIdx.x == KEPT_CHUNK - 1) chunk_total[blockIdx.x] = before + v;
}

// One block of 1024 threads: chunk c's total becomes the kept rows before chunk c. Thread t
// takes a run of consecutive chunks.
extern "C" __global__ void __launch_bounds__(1024) kept_chunks(u32 *chunk, u32 chunks) {
    const u32 per = (chunks + 1023) / 1024, c0 = threadIdx.x * per, c1 = min(chunks, c0 + per);
    u32 sum = 0;
    for (u32 c = c0; c < c1; ++c) sum += chunk[c];
    u32 before = block_exclusive_sum(sum);
    for (u32 c = c0; c < c1; ++c) {
        const u32 v = chunk[c];
        chunk[c] = before;
        before += v;
    }
}

// Candidates [0, min(*count, cap)) of (keys, ids), ids the rows of `bits`, to their ranks in
// (out_keys, out_ids).
template <class K>
__device__ void order_by_row(const K *keys, const u64 *ids, const u64 *count, u64 cap, const u32 *bits,
                             const u32 *group_before, const u32 *chunk_before, K *out_keys, u64 *out_ids) {
    const u64 m = min(*count, cap);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (u64)gridDim.x * blockDim.x) {
        const u64 id = ids[i];
        const u64 w = id >> 5, g = w >> 5;
        u32 rank = chunk_before[g / KEPT_CHUNK] + group_before[g] + __popc(bits[w] & ((1u << (id & 31)) - 1u));
        // The group's words before w, four a load.
        const uint4 *line = reinterpret_cast<const uint4 *>(bits + g * 32);
        const u32 before = (u32)(w & 31);
        for (u32 q = 0; 4 * q < before; ++q) {
            const uint4 v = line[q];
            const u32 x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (u32 e = 0; e < 4; ++e) rank += 4 * q + e < before ? __popc(x[e]) : 0u;
        }
        out_keys[rank] = keys[i];
        out_ids[rank] = id;
    }
}

#define CANDIDATE_ENTRIES(K, S)                                                                                   \
    extern "C" __global__ void                                                                                    \
        append_##S(const K *keys, const u64 *ids, u64 id_start, u64 n, const Threshold<K> *thr, K *cand_keys,     \
                   u64 *cand_ids, u64 *count, u64 cap) {                                                          \
        append<K>(keys, ids, id_start, n, thr, cand_keys, cand_ids, count, cap);                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        filter_below_##S(const K *keys, u64 n, const Threshold<K> *thr, K *cand_keys, u64 *cand_ids, u64 *count, \
                         u64 cap) {                                                                               \
        filter_keys<K>(keys, n, BelowThreshold<K>{thr->valid != 0, thr->key, thr->id}, cand_keys, cand_ids, count, \
                       cap);                                                                                      \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        filter_fraction_##S(const K *keys, u64 n, u32 cut, K *cand_keys, u64 *cand_ids, u64 *count, u64 cap) {   \
        filter_keys<K>(keys, n, HashedFraction{cut}, cand_keys, cand_ids, count, cap);                            \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        pair_max_##S(const K *keys, const u64 *ids, u64 n, K *partial_keys, u64 *partial_ids, u32 *counter,      \
                     Threshold<K> *thr) {                                                                         \
        pair_max<K>(keys, ids, n, partial_keys, partial_ids, counter, thr);                                       \
    }                                                                                                             \
    extern "C" __global__ void threshold_from_##S(const K *keys, const u64 *ids, u64 index, Threshold<K> *thr) {  \
        threshold_from<K>(keys, ids, index, thr);                                                                 \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        order_by_row_##S(const K *keys, const u64 *ids, const u64 *count, u64 cap, const u32 *bits,              \
                         const u32 *group_before, const u32 *chunk_before, K *out_keys, u64 *out_ids) {           \
        order_by_row<K>(keys, ids, count, cap, bits, group_before, chunk_before, out_keys, out_ids);               \
    }
INSTANTIATE_KEYS(CANDIDATE_ENTRIES)
