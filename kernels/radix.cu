// radix.cu: exact radix select of the k smallest (key, row id) pairs, any k < n.
//
// The pairs are read as one (64 + key bits)-bit unsigned integer, key above row id (see
// common.cuh); all of them are distinct, so the k smallest are exactly defined and ties between
// keys are broken by row id. MSD radix selection with 8-bit digits (after RadiK):
//
//   masks   one pass over the input: OR and AND of every virtual word. Bits where they agree
//           are equal in all pairs and are skipped: the first digit starts just below the
//           highest bit that differs (so all-equal keys go straight to the row ids, and narrow
//           ranges like Uniform[128.6, 128.7] skip their common prefix).
//   hist    per pass: a shared-memory histogram of the current digit of every candidate,
//           flushed to the global histogram with one atomic per non-empty bin and block; the
//           last block to finish ("last block" pattern) picks the digit b that holds the
//           k_rem-th smallest candidate.
//   filter  per pass: candidates with digit < b are winners (appended to the output); those
//           with digit b survive into the next pass's candidate buffer, and their OR/AND give
//           the next pass's starting bit; the rest are dropped. When bucket b holds exactly the
//           winners still missing, it is written out too and the selection is done.
//
// All state lives in a device control block, so the host launches every possible pass without
// reading anything back; passes after the last one see `done` and return at once. Each pass
// consumes at least 8 bits, so ceil((64 + key bits) / 8) passes always suffice. The output
// holds exactly k pairs, unordered. Two kernels per pass; warp-aggregated appends.

#include "common.cuh"

#define RADIX_BITS 8
#define RADIX (1 << RADIX_BITS)
#define RADIX_THREADS 256

struct RadixCtl {
    u64 n;      // candidates in this pass's input
    u64 k_rem;  // winners still to find among them
    u64 n_out;  // winners written so far
    u64 n_next; // survivors written by this pass
    u64 or_mask[MAX_VWORDS];
    u64 and_mask[MAX_VWORDS];
    u32 hist[RADIX];
    i32 top;    // bits [0, top) of the virtual integer are undecided; all candidates agree above
    i32 done;   // 1 once the output holds all k winners
    u32 bucket; // the digit chosen by this pass
    i32 last;   // bucket `bucket` holds exactly the missing winners
    u32 blocks_done;
    u32 error;  // nonzero: an invariant failed (reported to the host, never expected)
};

// Resets the control block for a selection of k among n (k < n).
extern "C" __global__ void radix_init(RadixCtl *ctl, u64 n, u64 k) { grid_dependency_wait();
    for (u32 b = threadIdx.x; b < RADIX; b += blockDim.x) ctl->hist[b] = 0;
    if (threadIdx.x == 0) {
        ctl->n = n;
        ctl->k_rem = k;
        ctl->n_out = 0;
        ctl->n_next = 0;
        for (int q = 0; q < MAX_VWORDS; ++q) {
            ctl->or_mask[q] = 0;
            ctl->and_mask[q] = ~0ull;
        }
        ctl->top = 0;
        ctl->done = (k == 0 || k >= n) ? 1 : 0; // the host handles these; never select
        ctl->bucket = 0;
        ctl->last = 0;
        ctl->blocks_done = 0;
        ctl->error = (k == 0 || k >= n) ? 1 : 0;
    }
}

// Accumulates this thread's OR/AND of the pair into registers.
template <class K> __device__ __forceinline__ void accumulate(const K &k, u64 id, u64 *o, u64 *a) {
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q) {
        const u64 v = vword(k, id, q);
        o[q] |= v;
        a[q] &= v;
    }
}

// Warp-reduces the masks and merges them into the control block.
template <class K> __device__ __forceinline__ void flush_masks(RadixCtl *ctl, u64 *o, u64 *a) {
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q) {
        const u64 wo = warp_or(o[q]);
        const u64 wa = warp_and(a[q]);
        if (lane_id() == 0) {
            atomicOr(&ctl->or_mask[q], wo);
            atomicAnd(&ctl->and_mask[q], wa);
        }
    }
}

// The highest differing bit of the masks (read by the last block) becomes `top`.
template <class K> __device__ __forceinline__ int top_from_masks(RadixCtl *ctl) {
    u64 diff[VWords<K>::N];
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q) diff[q] = __ldcg(&ctl->or_mask[q]) ^ __ldcg(&ctl->and_mask[q]);
    int top = 0;
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q)
        if (diff[q]) top = 64 * q + 64 - __clzll(diff[q]);
    return top;
}

template <class K> __device__ void masks(RadixCtl *ctl, const K *keys, const u64 *ids) {
    const u64 n = ctl->n;
    u64 o[VWords<K>::N], a[VWords<K>::N];
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q) {
        o[q] = 0;
        a[q] = ~0ull;
    }
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        accumulate(keys[i], ids[i], o, a);
    flush_masks<K>(ctl, o, a);
    if (!last_block_done(&ctl->blocks_done)) return;
    if (threadIdx.x == 0) {
        const int top = top_from_masks<K>(ctl);
        ctl->top = top;
        // n > k >= 1 distinct pairs always differ somewhere.
        if (top == 0) {
            ctl->error = 2;
            ctl->done = 1;
        }
    }
}

__device__ __forceinline__ void digit_range(const RadixCtl *ctl, int *lo, int *nbits) {
    const int top = ctl->top;
    *lo = top > RADIX_BITS ? top - RADIX_BITS : 0;
    *nbits = top - *lo;
}

template <class K> __device__ void hist(RadixCtl *ctl, const K *keys, const u64 *ids) {
    if (ctl->done) return;
    __shared__ u32 s_hist[RADIX];
    for (u32 b = threadIdx.x; b < RADIX; b += blockDim.x) s_hist[b] = 0;
    __syncthreads();
    const u64 n = ctl->n;
    int lo, nbits;
    digit_range(ctl, &lo, &nbits);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        atomicAdd(&s_hist[vbits(keys[i], ids[i], lo, nbits)], 1u);
    __syncthreads();
    for (u32 b = threadIdx.x; b < RADIX; b += blockDim.x)
        if (s_hist[b]) atomicAdd(&ctl->hist[b], s_hist[b]);
    if (!last_block_done(&ctl->blocks_done)) return;

    // Last block: choose the bucket holding the k_rem-th smallest candidate.
    if (threadIdx.x == 0) {
        const u64 k_rem = ctl->k_rem;
        u64 below = 0;
        u32 b = 0;
        for (; b < RADIX; ++b) {
            const u64 c = __ldcg(&ctl->hist[b]);
            if (below + c >= k_rem) break;
            below += c;
        }
        if (b == RADIX) { // fewer than k_rem candidates: impossible by construction
            ctl->error = 3;
            ctl->done = 1;
        } else {
            const u64 c = __ldcg(&ctl->hist[b]);
            ctl->bucket = b;
            ctl->k_rem = k_rem - below;
            ctl->last = (c == k_rem - below) ? 1 : 0;
        }
        ctl->n_next = 0;
        for (int q = 0; q < MAX_VWORDS; ++q) {
            ctl->or_mask[q] = 0;
            ctl->and_mask[q] = ~0ull;
        }
    }
    __syncthreads();
    for (u32 b = threadIdx.x; b < RADIX; b += blockDim.x) ctl->hist[b] = 0;
}

template <class K>
__device__ void filter(RadixCtl *ctl, const K *keys, const u64 *ids, K *out_keys, u64 *out_ids, K *next_keys,
                       u64 *next_ids) {
    if (ctl->done) return;
    const u64 n = ctl->n;
    const u32 bucket = ctl->bucket;
    const bool last = ctl->last != 0;
    int lo, nbits;
    digit_range(ctl, &lo, &nbits);
    u64 o[VWords<K>::N], a[VWords<K>::N];
#pragma unroll
    for (int q = 0; q < VWords<K>::N; ++q) {
        o[q] = 0;
        a[q] = ~0ull;
    }
    FOR_BLOCK_ROUNDS(i0, n) {
        const u64 i = i0 + threadIdx.x;
        bool win = false, survive = false;
        K k;
        u64 id = 0;
        if (i < n) {
            k = keys[i];
            id = ids[i];
            const u32 d = vbits(k, id, lo, nbits);
            win = d < bucket || (last && d == bucket);
            survive = !last && d == bucket;
        }
        const u64 w = warp_append(win, &ctl->n_out);
        if (win) {
            out_keys[w] = k;
            out_ids[w] = id;
        }
        const u64 s = warp_append(survive, &ctl->n_next);
        if (survive) {
            next_keys[s] = k;
            next_ids[s] = id;
            accumulate(k, id, o, a);
        }
    }
    if (!last) flush_masks<K>(ctl, o, a);
    if (!last_block_done(&ctl->blocks_done)) return;

    // Last block: advance to the next pass.
    if (threadIdx.x == 0) {
        if (last) {
            ctl->done = 1;
        } else {
            const int top = top_from_masks<K>(ctl);
            ctl->n = __ldcg(&ctl->n_next);
            ctl->top = top;
            // Survivors share every bit from lo up and are >= 2 distinct pairs.
            if (top == 0 || top > lo) {
                ctl->error = 4;
                ctl->done = 1;
            }
        }
    }
}

#define RADIX_ENTRIES(K, S)                                                                                       \
    extern "C" __global__ void __launch_bounds__(RADIX_THREADS)                                                   \
        radix_masks_##S(RadixCtl *ctl, const K *keys, const u64 *ids) { grid_dependency_wait();                   \
        masks<K>(ctl, keys, ids);                                                                                 \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RADIX_THREADS)                                                   \
        radix_hist_##S(RadixCtl *ctl, const K *keys, const u64 *ids) { grid_dependency_wait();                    \
        hist<K>(ctl, keys, ids);                                                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(RADIX_THREADS)                                                   \
        radix_filter_##S(RadixCtl *ctl, const K *keys, const u64 *ids, K *out_keys, u64 *out_ids, K *next_keys,   \
                         u64 *next_ids) { grid_dependency_wait();                                                 \
        filter<K>(ctl, keys, ids, out_keys, out_ids, next_keys, next_ids);                                        \
    }
INSTANTIATE_KEYS(RADIX_ENTRIES)
