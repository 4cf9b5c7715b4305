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
// Sort (the ≤ k winners of a radix select): the classic bitonic sorting network on a
// power-of-two padded array, with the steps of stride < C fused into shared-memory kernels
// (`sort_local` for all sizes ≤ C, `merge_local` for the tail of each larger size) and the
// steps of stride ≥ C one global kernel each (`sort_step`).

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

// Sort, sizes 2..min(c, m): each block sorts its chunk of c = min(c, m) pairs in place, in the
// direction the full network gives it. m is a power of two.
template <class K> __device__ void sort_local(K *keys, u64 *ids, u64 m, u32 c) {
    Smem<K> s = smem_of<K>(c);
    const u64 base = (u64)blockIdx.x * c;
    load_chunk(s, keys, ids, m, base, c);
    network(s, c, base, c);
    for (u32 t = threadIdx.x; t < c; t += blockDim.x) {
        keys[base + t] = s.keys[t];
        ids[base + t] = s.ids[t];
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

// Sort, the steps of stride c/2 .. 1 of size `size` (> c), in shared memory.
template <class K> __device__ void merge_local(K *keys, u64 *ids, u64 m, u64 size, u32 c) {
    Smem<K> s = smem_of<K>(c);
    const u64 base = (u64)blockIdx.x * c;
    load_chunk(s, keys, ids, m, base, c);
    for (u32 stride = c / 2; stride > 0; stride >>= 1) {
        for (u32 t = threadIdx.x; t < c / 2; t += blockDim.x) {
            const u32 i = pair_index(t, stride);
            s.cmp_swap(i, i + stride, ((base + i) & size) == 0);
        }
        __syncthreads();
    }
    for (u32 t = threadIdx.x; t < c; t += blockDim.x) {
        keys[base + t] = s.keys[t];
        ids[base + t] = s.ids[t];
    }
}

#define BITONIC_ENTRIES(K, S)                                                                                     \
    extern "C" __global__ void __launch_bounds__(BITONIC_THREADS)                                                 \
        bitonic_topk_##S(const K *keys, const u64 *ids, u64 n, K *out_keys, u64 *out_ids, u32 k2, u32 c) {        \
        topk<K>(keys, ids, n, out_keys, out_ids, k2, c);                                                          \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(BITONIC_THREADS)                                                 \
        bitonic_sort_local_##S(K *keys, u64 *ids, u64 m, u32 c) {                                                 \
        sort_local<K>(keys, ids, m, c);                                                                           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        bitonic_sort_step_##S(K *keys, u64 *ids, u64 m, u64 size, u64 stride) {                                   \
        sort_step<K>(keys, ids, m, size, stride);                                                                 \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(BITONIC_THREADS)                                                 \
        bitonic_merge_local_##S(K *keys, u64 *ids, u64 m, u64 size, u32 c) {                                      \
        merge_local<K>(keys, ids, m, size, c);                                                                    \
    }
INSTANTIATE_KEYS(BITONIC_ENTRIES)
