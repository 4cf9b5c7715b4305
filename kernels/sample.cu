// sample.cu: the sampled threshold of SampleSelect, run as a chain of levels on the device.
//
// One level shrinks a set of m pairs that holds the k smallest to a smaller set that still
// holds them:
//   threshold  one block gathers a stratified sample of s = min(s_max, m) pairs into registers
//              (pair j from stratum [j·m/s, (j+1)·m/s), at a hashed offset, so sorted or clustered
//              inputs are sampled evenly; every pair when s = m) and radix-selects the sample's
//              pair of rank r in shared memory: 8-bit digits of the (key, row id) integer from
//              its highest differing bit down (skipping bits every sampled pair shares), one
//              shared histogram per digit, stopping as soon as the chosen bucket holds one
//              pair. r sits five standard deviations above the expected sample rank of the
//              k-th smallest pair, e = k·s/m: r = ⌈e + 5√e + 3⌉, so that fewer than k
//              pairs fall below the threshold with probability < 1e-6; when s = m, r = k and the
//              threshold is exact.
//   filter     one pass keeps the pairs below the threshold: ≈ (r + 1)·m/s of them
//              (filter_below of candidates.cu on the positional first level, filter_pairs here
//              on later ones).
// The host enqueues every level without waiting: a level reads its input count from the
// device, and a shared `status` word turns the rest of the chain into no-ops once a buffer
// overflowed (the host reads it once at the end and falls back to radix select; so does a
// final count below k, the rare miss).

#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_DIGIT 8

// status bits
#define STATUS_OVERFLOW 1u    // a level's survivors exceeded its buffer
#define STATUS_DUPLICATE 2u   // two sampled pairs were equal (an invariant; never expected)
#define STATUS_FINAL_LARGE 4u // the final rank sort got more pairs than it takes (bitonic.cu)

// Sample pairs per thread, as many as fit the 64 registers of a 1024-thread block without
// spilling: 10 for 32-bit keys (s ≤ 10240), 8 for 64-bit, 4 for 128-bit, 2 for 256-bit.
template <class K> struct SamplePer {
    enum { V = K::BITS == 32 ? 10 : 512 / K::BITS };
};

// Position of sample pair j: stratum [j·m/s, (j+1)·m/s) at a hashed offset (strata bounds in
// double precision and the offset by a 64-bit multiply-high: 64-bit divisions would cost more
// than the gather itself).
__device__ __forceinline__ u64 stratified(u64 j, u64 m, u64 s, double step, u64 seed) {
    if (s == m) return j;
    const u64 lo = (u64)((double)j * step);
    const u64 hi = min((u64)((double)(j + 1) * step), m);
    u64 h = (j + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    return hi > lo ? lo + __umul64hi(h, hi - lo) : lo;
}

// The level's input count: `*n_ptr` (a previous level's survivors) or `n`.
__device__ __forceinline__ u64 level_count(u64 n, const u64 *n_ptr) { return n_ptr ? __ldcg(n_ptr) : n; }

// Threshold := the sample's pair of rank r (valid = 0: keep every pair, when r ≥ s).
// `ids` null: row id = position. One block of SAMPLE_THREADS threads.
template <class K>
__device__ void sample_threshold(const K *keys, const u64 *ids, u64 n, const u64 *n_ptr, u64 cap, u64 k, u32 s_max,
                                 u64 seed, Threshold<K> *thr, u32 *status) {
    constexpr int PER = SamplePer<K>::V;
    __shared__ u32 hist[1 << SAMPLE_DIGIT];
    __shared__ u32 s_bucket, s_rank, s_count;
    if (__ldcg(status) != 0) return;
    const u64 m = level_count(n, n_ptr);
    if (m > cap) {
        if (threadIdx.x == 0) atomicOr(status, STATUS_OVERFLOW);
        return;
    }
    const u64 s = min((u64)min(s_max, (u32)(PER * SAMPLE_THREADS)), m);
    // Register slots in use (block-uniform): the host shrinks the sample of a last level
    // (fewer survivors are needed than PER · 1024 samples give), and the loops below skip
    // the empty slots' instructions, the kernel's cost on its one SM.
    const int per = (int)((s + SAMPLE_THREADS - 1) / SAMPLE_THREADS);
    u64 r = k;
    if (s < m) {
        const double e = (double)k * (double)s / (double)m;
        r = (u64)ceil(e + 5.0 * sqrt(e) + 3.0);
    }
    if (r >= s) {
        if (threadIdx.x == 0) thr->valid = 0;
        return;
    }
    K key[PER];
    u64 id[PER];
    u32 active = 0; // bit t: pair t is still a candidate
    const double step = (double)m / (double)s;
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        const u64 j = threadIdx.x + (u64)t * SAMPLE_THREADS;
        if (t < per && j < s) {
            const u64 pos = stratified(j, m, s, step, seed);
            key[t] = keys[pos];
            id[t] = ids ? ids[pos] : pos;
            active |= 1u << t;
        } else {
            key[t] = key_zero<K>();
            id[t] = 0;
        }
    }
    // Bits where every sampled pair agrees decide nothing: the first digit ends at the highest
    // bit that differs (all-equal keys start in the row ids, narrow ranges below their common
    // prefix), as radix.cu's masks pass does.
    constexpr int NV = VWords<K>::N;
    __shared__ u64 s_or[NV], s_and[NV];
    if (threadIdx.x < NV) {
        s_or[threadIdx.x] = 0;
        s_and[threadIdx.x] = ~0ull;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        u64 o = 0, a = ~0ull;
#pragma unroll
        for (int t = 0; t < PER; ++t) {
            if (t < per && ((active >> t) & 1u)) {
                const u64 w = vword(key[t], id[t], q);
                o |= w;
                a &= w;
            }
        }
        o = warp_or(o);
        a = warp_and(a);
        if (lane_id() == 0) {
            atomicOr(&s_or[q], o);
            atomicAnd(&s_and[q], a);
        }
    }
    __syncthreads();
    // One past the highest bit below `hi` in which sampled pairs differ (0: none). A digit
    // starts there, so windows of bits every sampled pair shares are never histogrammed: Q2's
    // half-integer f64 scores share their low mantissa bits, rounds that each took a block-wide
    // histogram to learn nothing before the row id's digits (skipping them nearly halves the
    // denser sample's threshold).
    const auto differing_below = [&](int hi) {
        for (int q = (hi - 1) >> 6; q >= 0; --q) {
            u64 differ = s_or[q] ^ s_and[q];
            if (hi - 64 * q < 64) differ &= (1ull << (hi - 64 * q)) - 1ull;
            if (differ != 0) return 64 * q + 64 - __clzll(differ);
        }
        return 0;
    };
    const int top = differing_below(64 * NV); // bits [0, top) are undecided
    u32 rank = (u32)r; // rank among the candidates still active
    for (int hi = top; hi > 0;) {
        const int lo = max(hi - SAMPLE_DIGIT, 0), bits = hi - lo;
        for (u32 b = threadIdx.x; b < (1u << SAMPLE_DIGIT); b += blockDim.x) hist[b] = 0;
        __syncthreads();
        // A warp whose active pairs share one digit (heavy ties) adds them with one atomic;
        // otherwise each active lane adds its own (the digits are then spread, and a match-any
        // per pair would cost more than the conflicts it saves).
#pragma unroll
        for (int t = 0; t < PER; ++t) {
            if (t >= per) break;
            const bool a = (active >> t) & 1u;
            const u32 d = a ? vbits(key[t], id[t], lo, bits) : 0u;
            warp_hist_add(hist, d, a);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l scans bins [8l, 8l + 8); the lane whose range holds `rank` finds the bin.
            constexpr int PER_LANE = (1 << SAMPLE_DIGIT) / 32;
            u32 c[PER_LANE], total = 0;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                c[i] = hist[threadIdx.x * PER_LANE + i];
                total += c[i];
            }
            u32 inclusive = total;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_up_sync(FULL_MASK, inclusive, o);
                if ((int)threadIdx.x >= o) inclusive += v;
            }
            u32 before = inclusive - total;
            if (before <= rank && rank < inclusive) {
#pragma unroll
                for (int i = 0; i < PER_LANE; ++i) {
                    if (rank >= before && rank < before + c[i]) {
                        s_bucket = threadIdx.x * PER_LANE + i;
                        s_rank = rank - before;
                        s_count = c[i];
                    }
                    before += c[i];
                }
            }
        }
        __syncthreads();
        const u32 bucket = s_bucket, count = s_count;
        rank = s_rank;
#pragma unroll
        for (int t = 0; t < PER; ++t) {
            if (t < per && (active & (1u << t)) && vbits(key[t], id[t], lo, bits) != bucket) active &= ~(1u << t);
        }
        if (count == 1) break; // uniform: every thread read the same count
        hi = differing_below(lo);
        if (hi == 0) {
            // Every bit is decided and more than one pair is left: equal pairs were sampled.
            if (threadIdx.x == 0) atomicOr(status, STATUS_DUPLICATE);
            return;
        }
    }
    if (top == 0) {
        // All sampled pairs are equal (an invariant violation unless s = 1).
        if (s > 1) {
            if (threadIdx.x == 0) atomicOr(status, STATUS_DUPLICATE);
            return;
        }
    }
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        if (t < per && (active & (1u << t))) {
            thr->key = key[t];
            thr->id = id[t];
            thr->valid = 1;
        }
    }
}

// Appends the pairs of [0, m) below the threshold (every pair when it is not valid) to out,
// m read from `*n_ptr` (or `n` when null). `ids` null: row id = position.
template <class K>
__device__ void filter_pairs(const K *keys, const u64 *ids, u64 n, const u64 *n_ptr, const Threshold<K> *thr,
                             K *out_keys, u64 *out_ids, u64 *count, u64 cap, const u32 *status) {
    if (__ldcg(status) != 0) return;
    append(keys, ids, 0, level_count(n, n_ptr), thr, out_keys, out_ids, count, cap);
}

// Threshold := the pair of rank r among the m = *n_ptr pairs of a denser sample, when r < m ≤ cap;
// else the threshold stays as it was. The fused selection samples, below a first threshold,
// more rows than one block holds (src/device/engine/fused.rs `fused_select`): every sampled row
// below the old threshold is here, so the new one is the old sample's estimate refined, never
// looser.
template <class K>
__device__ void refine_threshold(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, u64 r,
                                 Threshold<K> *thr, u32 *status) {
    const u64 m = __ldcg(n_ptr);
    if (m <= r || m > cap) return;
    sample_threshold<K>(keys, ids, m, nullptr, cap, r, (u32)m, 0, thr, status);
}

#define SAMPLE_ENTRIES(K, S)                                                                                      \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                  \
        sample_threshold_##S(const K *keys, const u64 *ids, u64 n, const u64 *n_ptr, u64 cap, u64 k, u32 s_max,   \
                             u64 seed, Threshold<K> *thr, u32 *status) { grid_dependency_wait();                  \
        sample_threshold<K>(keys, ids, n, n_ptr, cap, k, s_max, seed, thr, status);                               \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        filter_pairs_##S(const K *keys, const u64 *ids, u64 n, const u64 *n_ptr, const Threshold<K> *thr,         \
                         K *out_keys, u64 *out_ids, u64 *count, u64 cap, const u32 *status) { grid_dependency_wait(); \
        filter_pairs<K>(keys, ids, n, n_ptr, thr, out_keys, out_ids, count, cap, status);                         \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                  \
        refine_threshold_##S(const K *keys, const u64 *ids, const u64 *n_ptr, u64 cap, u64 r, Threshold<K> *thr,  \
                             u32 *status) { grid_dependency_wait();                                               \
        refine_threshold<K>(keys, ids, n_ptr, cap, r, thr, status);                                               \
    }
INSTANTIATE_KEYS(SAMPLE_ENTRIES)
