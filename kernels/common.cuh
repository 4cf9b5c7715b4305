// common.cuh: types and helpers shared by every kernel file (NVRTC-compilable: no host headers).
//
// A *pair* is a composite key (the order-preserving encoding of the sort keys, see
// src/keys/mod.rs) and a 64-bit row id. Pairs are ordered by (key, row id); since row ids are
// unique, so are pairs, which is what makes radix selection exact and ties deterministic.
//
// Keys live in memory as arrays of little-endian words, least significant first, exactly like
// Rust's u32 / u64 / u128 (the 256-bit key is four u64 words, converted on the host). The four
// key types share one interface: `K::N` words of type `K::Word`, `K::BITS` bits.
//
// For radix selection a pair is read as one *virtual* integer of 64 + K::BITS bits: the row id
// in bits [0, 64), the key above it. Virtual word 0 is the row id, virtual word j + 1 is key
// word j (zero-extended for the 32-bit key).
#pragma once

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned short u16;
typedef short i16;
typedef unsigned char u8;
typedef signed char i8;

struct K32 {
    typedef u32 Word;
    enum { N = 1, BITS = 32 };
    Word w[N];
};
struct K64 {
    typedef u64 Word;
    enum { N = 1, BITS = 64 };
    Word w[N];
};
struct __align__(16) K128 {
    typedef u64 Word;
    enum { N = 2, BITS = 128 };
    Word w[N];
};
struct __align__(16) K256 {
    typedef u64 Word;
    enum { N = 4, BITS = 256 };
    Word w[N];
};

// Virtual words of a pair (row id + key), and the most any key type has.
#define MAX_VWORDS 5
template <class K> struct VWords {
    enum { N = 1 + (K::BITS + 63) / 64 };
};

template <class K> __device__ __forceinline__ K key_max() {
    K k;
#pragma unroll
    for (int j = 0; j < K::N; ++j) k.w[j] = (typename K::Word)(~0ull);
    return k;
}

template <class K> __device__ __forceinline__ K key_zero() {
    K k;
#pragma unroll
    for (int j = 0; j < K::N; ++j) k.w[j] = 0;
    return k;
}

// (a, ia) < (b, ib): key words from the most significant down, then the row id.
template <class K>
__device__ __forceinline__ bool pair_less(const K &a, u64 ia, const K &b, u64 ib) {
#pragma unroll
    for (int j = K::N - 1; j >= 0; --j) {
        if (a.w[j] != b.w[j]) return a.w[j] < b.w[j];
    }
    return ia < ib;
}

// Virtual word q of the pair. The unrolled selects keep `k` in registers (a run-time index
// into a register array would spill it to local memory).
template <class K> __device__ __forceinline__ u64 vword(const K &k, u64 id, int q) {
    u64 r = (q == 0) ? id : 0ull;
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        if (q == j + 1) r = (u64)k.w[j];
    }
    return r;
}

// Bits [lo, lo + nbits) of the virtual integer, nbits <= 32.
template <class K>
__device__ __forceinline__ u32 vbits(const K &k, u64 id, int lo, int nbits) {
    const int q = lo >> 6, r = lo & 63;
    u64 v = vword(k, id, q) >> r;
    if (r + nbits > 64) v |= vword(k, id, q + 1) << (64 - r);
    return (u32)(v & ((1ull << nbits) - 1));
}

// ---- packed words: a pair as one 64-bit word (candidates.cu, merge_sort.cu) ----

// Bits [lo, lo + width) of the key as one word, width ≤ 64 (word j holds bits [jW, jW + W)).
template <class K> __device__ __forceinline__ u64 key_field(const K &k, u32 lo, u32 width) {
    constexpr int W = 8 * sizeof(typename K::Word);
    u64 v = 0;
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        const int at = j * W - (int)lo; // where word j's bit 0 lands in the field
        if (at >= 64 || at <= -W) continue;
        const u64 w = (u64)k.w[j];
        v |= at >= 0 ? w << at : w >> -at;
    }
    return width >= 64 ? v : v & ((1ull << width) - 1ull);
}

// The key whose bits outside the field are `fixed`'s and whose field is `field`.
template <class K> __device__ __forceinline__ K key_with_field(K k, u64 field, u32 lo) {
    constexpr int W = 8 * sizeof(typename K::Word);
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        const int at = j * W - (int)lo;
        if (at >= 64 || at <= -W) continue;
        k.w[j] |= (typename K::Word)(at >= 0 ? field >> at : field << -at);
    }
    return k;
}

// The word of pair (k, id): its key's field above the row id's `id_bits` bits (id < 2^id_bits).
template <class K> __device__ __forceinline__ u64 packed_word(const K &k, u64 id, u32 lo, u32 width, u32 id_bits) {
    return (key_field(k, lo, width) << id_bits) | id;
}

// Loads bypassing L1, for data other blocks of the same kernel wrote (read in a last block).
template <class K> __device__ __forceinline__ K load_cg(const K *p) {
    K k;
#pragma unroll
    for (int j = 0; j < K::N; ++j) k.w[j] = __ldcg(&p->w[j]);
    return k;
}

// The threshold as stored on the device (the host allocates and zeroes 64 bytes for it).
template <class K> struct Threshold {
    K key;
    u64 id;
    u32 valid;
};

// ---- key fields ----------------------------------------------------------------------------

struct U128 {
    u64 lo, hi;
};

__device__ __forceinline__ bool get_bit(const u8 *bits, u64 i) { return (bits[i >> 3] >> (i & 7)) & 1; }

// Word j (64-bit words) of (v << shift), for shift < 256.
__device__ __forceinline__ u64 shifted_word(U128 v, int shift, int j) {
    const int o = 64 * j - shift; // bit of v that lands on bit 0 of word j
    if (o >= 128 || o <= -64) return 0;
    if (o < 0) return v.lo << (-o);
    if (o == 0) return v.lo;
    if (o < 64) return (v.lo >> o) | (v.hi << (64 - o));
    if (o == 64) return v.hi;
    return v.hi >> (o - 64);
}

// ---- warp helpers --------------------------------------------------------------------------

#define FULL_MASK 0xffffffffu

// Programmatic dependent launch (Hopper on): the engine launches each kernel with programmatic
// stream serialisation (src/device/engine `launch_function`), so the driver stages it while
// the previous kernel drains, and it may start before that kernel's writes are visible. Every
// kernel calls this before its first access to global memory (a unit test checks the sources);
// it returns once the previous kernel has completed and its writes are visible, at once when
// the kernel was launched without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }

__device__ __forceinline__ u64 warp_or(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ u64 warp_and(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v &= __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Key k of the lane `lane_mask` away (xor), word by word.
template <class K> __device__ __forceinline__ K shfl_key(const K &k, int lane_mask) {
    K r;
#pragma unroll
    for (int w = 0; w < K::N; ++w) r.w[w] = __shfl_xor_sync(FULL_MASK, k.w[w], lane_mask);
    return r;
}

// Sorts the block's THREADS (key, row id) pairs (a power of two, at least 32), one per thread,
// ascending by thread index: a bitonic network whose steps of stride < 32 exchange through warp
// shuffles (no barrier) and the others through shared memory (`sk`, `sid`, THREADS each).
template <u32 THREADS, class K> __device__ __forceinline__ void block_sort_pairs(K &k, u64 &id, K *sk, u64 *sid) {
    const u32 t = threadIdx.x;
    for (u32 size = 2; size <= THREADS; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            K pk;
            u64 pid;
            if (stride >= 32) {
                sk[t] = k;
                sid[t] = id;
                __syncthreads();
                pk = sk[t ^ stride];
                pid = sid[t ^ stride];
                __syncthreads();
            } else {
                pk = shfl_key(k, (int)stride);
                pid = __shfl_xor_sync(FULL_MASK, id, (int)stride);
            }
            // The lower position of an ascending pair of positions keeps the smaller pair.
            const bool want_smaller = ((t & stride) == 0) == ((t & size) == 0);
            if (pair_less(pk, pid, k, id) == want_smaller) {
                k = pk;
                id = pid;
            }
        }
    }
}

// Exclusive prefix sum over the block's threads (a multiple of 32, at most 1024), one value
// each; every thread calls it.
__device__ __forceinline__ u32 block_exclusive_sum(u32 v) {
    __shared__ u32 warp_sums[32];
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

// Warp-aggregated append: every lane of the warp calls this (all 32 lanes must be active);
// lanes with `want` get consecutive slots from `*counter`, one atomic per warp.
__device__ __forceinline__ u64 warp_append(bool want, u64 *counter) {
    const u32 mask = __ballot_sync(FULL_MASK, want);
    if (mask == 0) return 0;
    const u32 leader = __ffs(mask) - 1;
    u64 base = 0;
    if (lane_id() == leader) base = atomicAdd(counter, (u64)__popc(mask));
    base = __shfl_sync(FULL_MASK, base, leader);
    return base + __popc(mask & ((1u << lane_id()) - 1u));
}

// A per-warp buffer of survivors in shared memory (RadiK's write buffer): lanes append with a
// ballot, and the warp flushes the buffer with one global atomic and coalesced writes when it
// may not take another full ballot. With millions of survivors (k = 2^20) one atomic per warp
// and ballot serialised on the counter, for several times the pass's read time; buffered, a
// flush moves ≥ WARP_BUFFER − 32 pairs per atomic. Past `cap` the count still grows and nothing
// is written: the host sees the overflow.
#define WARP_BUFFER 128
// With `span`, a flush also ORs each key it stores into its lane's words after the buffer's
// row ids (`span_words`: the caller's ids array then holds WARP_BUFFER + SPAN_WORDS words; the
// caller zeroes them, `clear_span`, and ORs the warp's, `warp_span`, into its span at the
// end): per key word j, `span_word(j)` the OR of the complemented keys, `span_word(K::N + j)`
// the OR of the keys (candidates.cu `key_span`'s words), so that a fused pass's candidates
// need no second read for them. Shared words rather than registers: the generated passes
// have none to spare (registers held within a flush cost Q3's program its occupancy hint and
// slowed its pass); a lane's own words rather than two shared words and an atomic per key word
// and pair, which serialised the warp's lanes at every flush and held registers that cost Q3's
// program its pipelined variant.
template <class K> struct WarpBuffer {
    K *keys;
    u64 *ids;
    u32 fill; // warp-uniform

    // Keys of up to two words keep a lane's own span words; wider ones (whose buffers leave no
    // room under the 48 KB of static shared memory for 32 lanes' words) share two per key word
    // through atomics.
    static constexpr bool LANE_SPAN = K::N <= 2;
    static constexpr u32 SPAN_WORDS = (LANE_SPAN ? 64 : 2) * K::N;
    __device__ __forceinline__ u64 *span_words() const { return ids + WARP_BUFFER; }
    // Span word w (< 2 · K::N) of this lane.
    __device__ __forceinline__ u64 &span_word(u32 w) const { return span_words()[LANE_SPAN ? 32 * w + lane_id() : w]; }

    // Zeroes the span words (every lane calls this).
    __device__ __forceinline__ void clear_span() const {
        if (LANE_SPAN) {
#pragma unroll
            for (u32 w = 0; w < 2 * K::N; ++w) span_word(w) = 0;
        } else if (lane_id() < 2 * K::N) {
            span_words()[lane_id()] = 0;
        }
        __syncwarp();
    }

    // The warp's span word w (< 2 · K::N): the OR of its lanes' (every lane calls this).
    __device__ __forceinline__ u64 warp_span(u32 w) const {
        __syncwarp();
        return LANE_SPAN ? warp_or(span_word(w)) : span_words()[w];
    }

    __device__ __forceinline__ void flush(K *out_keys, u64 *out_ids, u64 *count, u64 cap, bool span = false) {
        __syncwarp();
        u64 base = 0;
        if (lane_id() == 0 && fill > 0) base = atomicAdd(count, (u64)fill);
        base = __shfl_sync(FULL_MASK, base, 0);
        for (u32 i = lane_id(); i < fill; i += 32) {
            if (base + i < cap) {
                const K k = keys[i];
                out_keys[base + i] = k;
                out_ids[base + i] = ids[i];
                if (span) {
                    // The lane's own words: no atomics (the warp's 32 lanes serialised on two
                    // shared words) and no registers held across the pass.
#pragma unroll
                    for (int j = 0; j < K::N; ++j) {
                        const u64 nand = (u64)(typename K::Word)~k.w[j], any = (u64)k.w[j];
                        if (LANE_SPAN) {
                            span_word(j) |= nand;
                            span_word(K::N + j) |= any;
                        } else {
                            atomicOr((unsigned long long *)&span_word(j), nand);
                            atomicOr((unsigned long long *)&span_word(K::N + j), any);
                        }
                    }
                }
            }
        }
        __syncwarp();
        fill = 0;
    }

    // Every lane calls this (all 32 active).
    __device__ __forceinline__ void push(bool keep, const K &k, u64 id, K *out_keys, u64 *out_ids, u64 *count,
                                         u64 cap, bool span = false) {
        const u32 mask = __ballot_sync(FULL_MASK, keep);
        // Most rows of a round that appends something append nothing (Q2 at k = 10^6: 0.5% of
        // rows, ~0.6 a warp's round of 128): one uniform branch skips the buffer's bookkeeping,
        // whose instructions would delay the next round's loads.
        if (mask == 0) return;
        if (keep) {
            const u32 slot = fill + __popc(mask & ((1u << lane_id()) - 1u));
            keys[slot] = k;
            ids[slot] = id;
        }
        fill += __popc(mask);
        if (fill > WARP_BUFFER - 32) flush(out_keys, out_ids, count, cap, span);
    }
};

// Warp-aggregated histogram add: every lane of the warp calls this (all 32 lanes active);
// lanes with `valid` add one to bin `digit`. When the valid lanes' digits agree (ties, shared
// high bits: one bin would otherwise serialise 32 shared atomics) one lane adds them all; else
// each adds its own (the digits are then spread, and a match per pair would cost more than
// the conflicts it saves).
__device__ __forceinline__ void warp_hist_add(u32 *hist, u32 digit, bool valid) {
    const u32 want = __ballot_sync(FULL_MASK, valid);
    if (want == 0) return;
    const u32 first = __shfl_sync(FULL_MASK, digit, __ffs(want) - 1);
    if (__all_sync(FULL_MASK, !valid || digit == first)) {
        if (lane_id() == 0) atomicAdd(&hist[first], (u32)__popc(want));
    } else if (valid) {
        atomicAdd(&hist[digit], 1u);
    }
}

// "Last block" pattern: every thread of the `blocks` blocks taking part calls this after its
// global writes; returns true in the one block that finished last (all other blocks' writes
// are then visible to it). The counter must be zero at launch; the last block resets it.
__device__ __forceinline__ bool last_block_of(u32 *counter, u32 blocks) {
    __shared__ bool am_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 ticket = atomicAdd(counter, 1u);
        am_last = (ticket == blocks - 1);
        if (am_last) *counter = 0;
    }
    __syncthreads();
    if (am_last) __threadfence();
    return am_last;
}

// `last_block_of` with every block of the grid taking part.
__device__ __forceinline__ bool last_block_done(u32 *counter) { return last_block_of(counter, gridDim.x); }

// Grid-stride iteration whose trip count is uniform across each block (so that warp-wide
// ballots see all 32 lanes): `i0` is the block's first index of each round.
#define FOR_BLOCK_ROUNDS(i0, n)                                                                \
    for (u64 i0 = (u64)blockIdx.x * blockDim.x; i0 < (n); i0 += (u64)gridDim.x * blockDim.x)

// Declares the extern "C" entry points of a kernel template for the four key types:
// NAME_k32, NAME_k64, NAME_k128, NAME_k256.
#define INSTANTIATE_KEYS(MACRO)                                                                \
    MACRO(K32, k32)                                                                            \
    MACRO(K64, k64)                                                                            \
    MACRO(K128, k128)                                                                          \
    MACRO(K256, k256)

// ---- appending below a threshold ----------------------------------------------------------

// Appends rows [0, n) of (keys, ids) below the threshold at `*count`. `ids` null means
// consecutive row ids starting at `id_start`. Rows past `cap` are counted but not written (the
// host reads the count and treats count > cap as an overflow).
template <class K>
__device__ void append(const K *keys, const u64 *ids, u64 id_start, u64 n, const Threshold<K> *thr, K *cand_keys,
                       u64 *cand_ids, u64 *count, u64 cap) {
    const bool filter = thr->valid != 0;
    const K tk = thr->key;
    const u64 tid = thr->id;
    FOR_BLOCK_ROUNDS(i0, n) {
        const u64 i = i0 + threadIdx.x;
        bool keep = false;
        K k;
        u64 id = 0;
        if (i < n) {
            k = keys[i];
            id = ids ? ids[i] : id_start + i;
            keep = !filter || pair_less(k, id, tk, tid);
        }
        const u64 pos = warp_append(keep, count);
        if (keep && pos < cap) {
            cand_keys[pos] = k;
            cand_ids[pos] = id;
        }
    }
}

// ---- the top-bits selection's bins (radix_sort.cu `rsort_top_*`, bitonic.cu `sort_segments`) ----

#define TOP_BINS 4096u
// Control words after the bins' counts: a spare word, the bound, the status, a spare word, the
// kept count (u64), the bins' base, scale, w0, positions' bound and words' bound (u64 each,
// TopBins), the count of quantile pieces and a spare word, then the pieces' table (TopBins).
#define TOP_BOUND (TOP_BINS + 1)
#define TOP_STATUS (TOP_BINS + 2)
#define TOP_COUNT (TOP_BINS + 4)
#define TOP_BASE (TOP_BINS + 6)
#define TOP_SCALE (TOP_BINS + 8)
#define TOP_W0 (TOP_BINS + 10)
#define TOP_N (TOP_BINS + 12)
#define TOP_DLIM (TOP_BINS + 14)
#define TOP_PIECES (TOP_BINS + 16)
#define TOP_TABLE (TOP_BINS + 18)
// The status word: the kept pairs exceed the buffers (or the k-th smallest lies above the bins);
// a kept bin is larger than the segment sort takes; crowding foreseen by the sample.
#define TOP_STATUS_OVERFLOW 1u
#define TOP_STATUS_CROWDED 2u
#define TOP_STATUS_FORESEEN 4u
// The most pairs a kept bin may hold for a segment-sort block: three quarters of its tile
// (bitonic.cu SEGMENT_TILE, 1024 pairs for keys up to 128 bits), so that a block's bins, starting
// in a quarter tile (SEGMENT_SPAN), fill at most a tile. Larger kept bins ("big bins", a cluster
// of keys near the k-th smallest) are split by a sample of their own pairs in slices of half a
// tile, one block a slice (bitonic.cu `sort_big_bin`), up to TOP_BIG_BIN pairs: each of those
// blocks reads its whole bin.
#define TOP_SEGMENT_BIN 768u
#define TOP_BIG_BIN 32768u
// A segment-sort block's entry that holds a big bin's slice (radix_sort.cu `top_segments`).
#define TOP_BIG_SLICE (1u << 31)
// The most quantile pieces (up to 3 per interval, ≤ TOP_QWANT + 1 intervals, see
// radix_sort.cu; top_bits.rs `TOP_QMAX`), and the table's layout in u64 words: the pieces'
// starts (and the end), their scales, their first bins (u32).
#define TOP_QMAX 435u
#define TOP_QSCALE (TOP_QMAX + 1)
#define TOP_QFIRST (2 * TOP_QMAX + 1)
#define TOP_QWORDS (TOP_QFIRST + (TOP_QMAX + 2) / 2)
static_assert(TOP_QMAX < 512, "top_quantile_bin's binary lifting");

// Copies the words of a quantile table of m pieces that top_quantile_bin reads: the starts and
// the end, the scales, the first bins (every thread of the block calls it; the whole table is
// 1089 words, m is ~50–150).
__device__ __forceinline__ void top_table_copy(u64 *dst, const u64 *src, u32 m) {
    const u32 total = (m + 1) + m + (m + 2) / 2;
    for (u32 j = threadIdx.x; j < total; j += blockDim.x) {
        const u32 i = j <= m ? j : j <= 2 * m ? TOP_QSCALE + (j - m - 1) : TOP_QFIRST + (j - 2 * m - 1);
        dst[i] = src[i];
    }
}

// The key's most significant word (all of a 32- or 64-bit key).
template <class K> __device__ __forceinline__ u64 top_word(const K &k) { return (u64)k.w[K::N - 1]; }

// The bin of a coordinate (TopBins below): bins [TOP_LOW, TOP_BINS - 1) are linear from the
// base up, ⌊d · scale / 2^64⌋ for a coordinate d above it (d itself when the scale is 0: a
// range of fewer coordinates than bins), and the last bin takes those above them; bins
// [0, TOP_LOW) take the coordinates below the base by the octave of their distance to it (8
// bins an octave), so that a long lower tail spreads too: below the smallest sampled key lie
// ~n/257 keys, which one clamped bin held for f32 keys in [0, 1) (their encodings crowd
// towards zero).
#define TOP_LOW 512u
#define TOP_LINEAR (TOP_BINS - 1 - TOP_LOW)
__device__ __forceinline__ u32 top_bin(u64 c, u64 base, u64 scale) {
    if (c >= base) {
        const u64 d = c - base;
        return TOP_LOW + (u32)min(scale ? __umul64hi(d, scale) : d, (u64)TOP_LINEAR);
    }
    const u64 d = base - c;
    const int e = 63 - __clzll((long long)d);
    const u32 m = (u32)(e >= 3 ? d >> (e - 3) : d << (3 - e)) & 7u; // 3 bits below the leading one
    return TOP_LOW - 1 - min((u32)e * 8 + m, TOP_LOW - 1);
}

// The quantile bin of coordinate c (of a pair at position `pos`) among the `m` pieces of table
// `q` (TopBins below), and its part of 2^bits (into `f`, for bits > 0). A piece whose scale has
// its low bit set is a tie piece: one word's pairs, spread by position.
__device__ __forceinline__ u32 top_quantile_bin(u64 c, u64 pos, u32 m, const u64 *q, u32 bits, u32 &f) {
    f = 0;
    if (c < q[0]) return top_bin(c, q[0], 0);
    if (c >= q[m]) return TOP_BINS - 1;
    // The last piece starting at or below c (binary lifting; m ≤ TOP_QMAX < 512).
    u32 i = 0;
#pragma unroll
    for (u32 s = 256; s > 0; s >>= 1) {
        if (i + s < m && q[i + s] <= c) i += s;
    }
    const u32 *first = reinterpret_cast<const u32 *>(q + TOP_QFIRST);
    const u32 b0 = first[i], len = first[i + 1] - b0;
    const u64 sc = q[TOP_QSCALE + i], d = sc & 1 ? pos : c - q[i];
    if (bits != 0 && sc != 0) f = (u32)((d * sc) >> (64 - bits));
    return TOP_LOW + b0 + (u32)min(sc ? __umul64hi(d, sc) : d, (u64)len - 1);
}
// The same as a call (TopBins::bin).
__device__ __noinline__ u32 top_quantile_bin_call(u64 c, u64 pos, u32 m, const u64 *q) {
    u32 f;
    return top_quantile_bin(c, pos, m, q, 0, f);
}

// The bins of a top-bits selection. A key's bin is monotone in (key's top word, position),
// the order of positional pairs: the bins divide a range of coordinates, and the coordinate
// of a word near the sample's (fewer than 2^63 / n words above `w0`, always for 32-bit keys)
// is (word − w0) · n + position, so that equal keys spread over bins by their positions (all
// equal, heavy ties), with no coordinates between one word's last position and the next
// word's first (ties of consecutive integers, such as zipf counts, stay dense); with `w0` =
// ~0 (a sample spanning more words) it is the word alone. Positions < n < 2^21.
//
// Linear bins (m = 0): bins [TOP_LOW, TOP_BINS − 1) divide the range from `base` up in equal
// parts (top_bin). Quantile bins (m > 0 pieces, where the sample shows a cluster that linear
// bins would crowd, see radix_sort.cu `top_window`): the range is cut at the sorted sample's
// coordinates, so that each interval holds ~n/256 keys whatever its width (a NaN mix's −NaN
// payloads, the ties below a zipf tail); an interval much wider than its neighbours (a gap
// between clusters) is cut again, into an edge piece on each side 4 times as wide as the
// mean of up to 12 intervals on that side (the cluster's end) and the gap between. Piece i starts at q[i]
// (q[m]: the end), has scale q[TOP_QSCALE + i] (as the linear bins'; 0: fewer coordinates
// than bins; the low bit clear) and bins [TOP_LOW + first[i], TOP_LOW + first[i + 1]), first =
// the u32 words from q + TOP_QFIRST, as many as its share of the keys. Where coordinates are
// words (`w0` = ~0), a run of equal sampled words w is a tie piece [w, w + 1): one key, spread
// over the piece's bins by position (its scale, len / n · 2^64, has the low bit set; f64 zipf
// ties, whose words span exponents, crowded a bin a sampled count). Coordinates below the range
// take the octave bins, those above it the last bin. `q` points to shared memory (the histogram
// and the scatter) or to the control block (the segment sort).
struct TopBins {
    u64 base, scale, w0, n, dlim;
    u32 m;
    const u64 *q;
    __device__ __forceinline__ u64 coord(u64 w, u64 pos) const {
        if (w0 == ~0ull) return w;
        if (w < w0) return 0;
        const u64 d = w - w0;
        return d >= dlim ? 1ull << 63 : d * n + pos;
    }
    // The bin of coordinate c and, for bits > 0, the part of it of 2^bits that holds c (into
    // `f`): the top bits of the fraction of d · scale / 2^64 that the bin drops; 0 in the
    // octave bins, the last bin and bins of one coordinate. Monotone in c within a bin, as
    // bins are across them. QUANT: m > 0 (the histogram and the scatter take the test out of
    // their loops).
    template <bool QUANT> __device__ __forceinline__ u32 bin_part_of(u64 c, u64 pos, u32 bits, u32 &f) const {
        f = 0;
        if (!QUANT) {
            const u32 b = top_bin(c, base, scale);
            if (bits != 0 && c >= base && scale != 0 && b != TOP_BINS - 1) f = (u32)(((c - base) * scale) >> (64 - bits));
            return b;
        }
        return top_quantile_bin(c, pos, m, q, bits, f);
    }
    template <bool QUANT> __device__ __forceinline__ u32 bin_of(u64 w, u64 pos) const {
        u32 f;
        return bin_part_of<QUANT>(coord(w, pos), pos, 0, f);
    }
    // The bin of (w, pos); quantile bins by a call (radix_sort.cu's sample bins: their code
    // would be fetched cold in the histogram's path, see top_quantile_table there).
    __device__ __forceinline__ u32 bin(u64 w, u64 pos) const;
    // The bin of (w, pos) (into `b`) and the part of it, of 2^bits, that holds the pair.
    __device__ __forceinline__ u32 part(u64 w, u64 pos, u32 bits, u32 &b) const;
    // Writes the bins into the control block `top` (every thread of one block calls it).
    __device__ __forceinline__ void store(u32 *top) const {
        u64 *w = reinterpret_cast<u64 *>(top);
        if (threadIdx.x == 0) {
            w[TOP_BASE / 2] = base;
            w[TOP_SCALE / 2] = scale;
            w[TOP_W0 / 2] = w0;
            w[TOP_N / 2] = n;
            w[TOP_DLIM / 2] = dlim;
            top[TOP_PIECES] = m;
        }
        if (m != 0) top_table_copy(w + TOP_TABLE / 2, q, m);
    }
    // The bins as `store` wrote them into the control block `top`.
    __device__ __forceinline__ static TopBins of(const u32 *top) {
        const u64 *w = reinterpret_cast<const u64 *>(top);
        return {w[TOP_BASE / 2], w[TOP_SCALE / 2], w[TOP_W0 / 2], w[TOP_N / 2], w[TOP_DLIM / 2], top[TOP_PIECES],
                w + TOP_TABLE / 2};
    }
};

__device__ __forceinline__ u32 TopBins::bin(u64 w, u64 pos) const {
    return m ? top_quantile_bin_call(coord(w, pos), pos, m, q) : bin_of<false>(w, pos);
}
__device__ __forceinline__ u32 TopBins::part(u64 w, u64 pos, u32 bits, u32 &b) const {
    u32 f;
    const u64 c = coord(w, pos);
    b = m ? bin_part_of<true>(c, pos, bits, f) : bin_part_of<false>(c, pos, bits, f);
    return f;
}
