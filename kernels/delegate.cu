// delegate.cu: Dr. Top-k's delegates (Gaihre et al., SC'21), for the k smallest pairs.
//
// The n pairs are cut into subranges of S consecutive pairs (S = 2^α, the host's α rule). The
// delegate of a subrange is its smallest pair (Dr. Top-k's "maximum delegate", mirrored). If T
// is the k-th smallest delegate, the k subranges whose delegates are ≤ T hold k pairs ≤ T, so
// the k smallest pairs overall are all ≤ T, and each lies in a subrange whose delegate is
// ≤ T (any other subrange's pairs all exceed T). So
//   delegate_min      one read of the input writes the n/S delegates (a warp per subrange:
//                     keys only, the row id being the position, when the input is positional);
//   (host)            the k smallest delegates are selected (sampled selection of the n/S
//                     delegates), T is the k-th;
//   delegate_gather   "delegate-top-k filtering": a warp per subrange tests its delegate and,
//                     for the ≥ k subranges that pass, appends their pairs ≤ T; ≤ k·S pairs are
//                     read, a sliver of n when S ≈ √(n/k);
//   (host)            the k smallest candidates are sorted (radix sort, or a selection first
//                     when ties left many).

#include "common.cuh"

// Delegate j := the smallest pair of pairs [j·S, min((j+1)·S, n)). `ids` null: row id =
// position. One warp per subrange, grid-stride over subranges.
template <class K>
__device__ void delegate_min(const K *keys, const u64 *ids, u64 n, u32 s, K *dkeys, u64 *dids) {
    const u64 subranges = (n + s - 1) / s;
    const u64 warps = (u64)gridDim.x * blockDim.x / 32;
    const u32 lane = lane_id();
    for (u64 j = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; j < subranges; j += warps) {
        const u64 lo = j * s, hi = min(lo + s, n);
        K best = key_max<K>();
        u64 best_id = ~0ull;
        for (u64 i = lo + lane; i < hi; i += 32) {
            const K k = keys[i];
            const u64 id = ids ? ids[i] : i;
            if (pair_less(k, id, best, best_id)) {
                best = k;
                best_id = id;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            K other;
#pragma unroll
            for (int w = 0; w < K::N; ++w) other.w[w] = __shfl_xor_sync(FULL_MASK, best.w[w], o);
            const u64 other_id = __shfl_xor_sync(FULL_MASK, best_id, o);
            if (pair_less(other, other_id, best, best_id)) {
                best = other;
                best_id = other_id;
            }
        }
        if (lane == 0) {
            dkeys[j] = best;
            dids[j] = best_id;
        }
    }
}

// Appends the pairs ≤ T (the threshold) of every subrange whose delegate is ≤ T to the
// candidates (counted past `cap` but not written). One warp per subrange.
template <class K>
__device__ void delegate_gather(const K *keys, const u64 *ids, u64 n, u32 s, const K *dkeys, const u64 *dids,
                                const Threshold<K> *thr, K *cand_keys, u64 *cand_ids, u64 *count, u64 cap) {
    const u64 subranges = (n + s - 1) / s;
    const u64 warps = (u64)gridDim.x * blockDim.x / 32;
    const u32 lane = lane_id();
    const K tk = thr->key;
    const u64 tid = thr->id;
    for (u64 j = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; j < subranges; j += warps) {
        if (pair_less(tk, tid, dkeys[j], dids[j])) continue; // warp-uniform: delegate > T
        const u64 lo = j * s, hi = min(lo + s, n);
        for (u64 i0 = lo; i0 < hi; i0 += 32) {
            const u64 i = i0 + lane;
            bool keep = false;
            K k;
            u64 id = 0;
            if (i < hi) {
                k = keys[i];
                id = ids ? ids[i] : i;
                keep = !pair_less(tk, tid, k, id);
            }
            const u64 pos = warp_append(keep, count);
            if (keep && pos < cap) {
                cand_keys[pos] = k;
                cand_ids[pos] = id;
            }
        }
    }
}

#define DELEGATE_ENTRIES(K, S)                                                                                    \
    extern "C" __global__ void delegate_min_##S(const K *keys, const u64 *ids, u64 n, u32 s, K *dkeys, u64 *dids) { grid_dependency_wait(); \
        delegate_min<K>(keys, ids, n, s, dkeys, dids);                                                            \
    }                                                                                                             \
    extern "C" __global__ void delegate_gather_##S(const K *keys, const u64 *ids, u64 n, u32 s, const K *dkeys,   \
                                                   const u64 *dids, const Threshold<K> *thr, K *cand_keys,        \
                                                   u64 *cand_ids, u64 *count, u64 cap) { grid_dependency_wait();  \
        delegate_gather<K>(keys, ids, n, s, dkeys, dids, thr, cand_keys, cand_ids, count, cap);                   \
    }
INSTANTIATE_KEYS(DELEGATE_ENTRIES)
