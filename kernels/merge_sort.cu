// merge_sort.cu: merge sort of (key, row id) pairs, truncated at k: the sort of a sampled
// selection's survivors beyond the chunk rank sort's ~2·10^5, of a fused pass's candidates at
// large k, and of host-counted inputs that need more than a 32-bit key's digits.
//
// The radix sort (radix_sort.cu) pays one latency-bound pass per digit position, and a
// selection's survivors need their row id's digits too (they arrive in atomic-append order, so
// ties are not in row id order): 7–12 passes. A merge sort compares whole pairs, so its round
// count depends on the pair count only (log2 of the tiles), never on the key width or the row
// ids, and a top-k needs only the first k of every merged run:
//   msort_tiles   block b sorts tiles b, b + grid, … (MSORT_THREADS × MergeItems pairs each;
//                 one a block unless enqueued before the count was known) in shared memory: each
//                 thread sorts its items in registers, then log2(MSORT_THREADS) rounds merge
//                 runs pairwise, each thread producing its items of the merged run after a merge
//                 path search (the split of its output diagonal between the two runs);
//   msort_merge   one round over the whole buffer: runs of `span` input positions merged
//                 pairwise, each merged run truncated at k; a block produces one tile of one
//                 merged run: two warps find the run's split at the tile's first and last
//                 diagonal (a 32-way search, ~4 dependent L2 round trips for 10^6 pairs where a
//                 binary search takes ~20), the block loads both runs' parts into shared memory
//                 and merges as in msort_tiles, and writes the tile out coalesced.
// Packed words (a large k's candidates, candidates.cu): `msort_tiles_packed` packs each pair
// into its 64-bit word as it loads it, and `msort_merge_words` merges the words keys only (no
// row ids: every id reads as 0), moving half the bytes of 64-bit keys' pairs; the last round,
// `msort_merge_unpack`, stores them unpacked into (key, row id) pairs. A fused selection
// enqueues `msort_tiles_packed` right after its pass, with the field read from the span words on
// the device (`device_packed_field`) and the count from the device, while the host reads both
// back on a second stream and then enqueues the rounds: the tile sort overlaps the read-back
// instead of waiting behind it. Words compare without branches (`item_less`, and `merge_items`
// loads both runs' next word every step): the pairs' branchy steps diverge within a warp and
// serialise both sides' loads.
// Sample sorts and key bands of the words lost to these rounds: a block's sort of a bucket or
// band costs as much as a tile's, and the passes that split them cost what they save
// (benches/PERFORMANCE.md, "Approaches tried and not kept").
// Run j of a round (input span s, the sort's k) starts at j · min(s, k) and holds
// min(k, pairs of the input positions [j·s, (j+1)·s) below m): a function of m alone, so every
// round can be enqueued before m is known (m = *m_dev, a selection's survivor count).
// Pairs are distinct (row ids are), so every merge is a permutation; padding pairs (key and
// row id all ones, above every real pair) only fill the last tile and are never written.
// The kernels do nothing once `status` (when not null) is set; msort_tiles sets bit 4 (the
// sample chain's "final set larger than its sort") when m > cap. Rounds are planned for `cap`;
// those after the one that leaves a single run do nothing, so the run ends in the buffer that
// round wrote (the host picks it by the count).
// Both kernels are latency-bound (8 warps a block; each round is a thread's serial search and
// merge), so wider blocks, larger tiles and thread-block clusters did no better
// ("Reshaping the merge sort" in benches/PERFORMANCE.md).

#include "common.cuh"

#define MSORT_THREADS 256
#define MSORT_FINAL_LARGE 4u
// `width` argument of the packed tile sort: read the field from the span words on the device.
#define FIELD_FROM_SPAN 0xffffffffu

// Pairs per thread: the tile is MSORT_THREADS × this (2048 for keys of up to 64 bits).
template <class K> struct MergeItems {
    enum { V = K::BITS <= 64 ? 8 : K::BITS == 128 ? 4 : 2 };
};

// Whether a block loads its tile with all of a thread's loads issued before its shared-memory
// stores (one round trip; the loop over the tile kept them in groups of 4): for the packed
// words and 32-bit keys, where it saves time. For 64-bit keys' pairs the loads' registers
// (msort_merge_k64 48 → 64) cost a block an SM, which costs more than the round trip saves.
template <class K, bool KO> struct BatchedLoads {
    enum { V = KO || K::BITS == 32 };
};

// The pair count: `*m_dev` when given, else `m_host`.
__device__ __forceinline__ u64 msort_count(u64 m_host, const u64 *m_dev) { return m_dev ? __ldcg(m_dev) : m_host; }

// Pairs of run j of a round: positions [j·span, (j+1)·span) of [0, m), at most k.
__device__ __forceinline__ u32 run_length(u64 j, u64 span, u64 m, u64 k) {
    const u64 lo = j * span;
    return lo >= m ? 0u : (u32)min(min(m - lo, span), k);
}

// A run of pairs, in global memory (`Padded` false) or in shared memory, where element i sits
// at i + i / (128 / its size): one spare slot per 128 bytes, so that a warp's lanes writing
// V consecutive pairs each (lane l at l·V + e) hit distinct banks.
template <class W> __device__ __forceinline__ u32 spad(u32 i) { return i + i / (128 / (u32)sizeof(W)); }

// Keys only (`KO`): 64-bit words that are whole pairs (common.cuh `packed_word`), no row ids
// (every id reads as 0, none is stored).
template <class K, bool Padded, bool KO = false> struct Run {
    enum { KEYS_ONLY = KO };
    K *keys;
    u64 *ids;
    u32 off;
    __device__ __forceinline__ K key(u32 i) const { return Padded ? keys[spad<K>(off + i)] : keys[off + i]; }
    __device__ __forceinline__ u64 id(u32 i) const {
        return KO ? 0ull : Padded ? ids[spad<u64>(off + i)] : ids[off + i];
    }
    __device__ __forceinline__ void put(u32 i, const K &k, u64 id_) const {
        if (Padded) {
            keys[spad<K>(off + i)] = k;
            if (!KO) ids[spad<u64>(off + i)] = id_;
        } else {
            keys[off + i] = k;
            if (!KO) ids[off + i] = id_;
        }
    }
};

// (a, ia) < (b, ib); for packed words (`KO`) the words alone, compared without a branch.
template <bool KO, class K> __device__ __forceinline__ bool item_less(const K &a, u64 ia, const K &b, u64 ib) {
    if constexpr (KO) {
        return a.w[0] < b.w[0];
    } else {
        return pair_less(a, ia, b, ib);
    }
}

// Whether pair i of run A goes before pair j of run B in their merge (A first on equal pairs,
// which only padding has).
template <class R> __device__ __forceinline__ bool a_first(const R &a, u32 i, const R &b, u32 j) {
    return !item_less<R::KEYS_ONLY>(b.key(j), b.id(j), a.key(i), a.id(i));
}

// Merge path: how many of A's pairs are among the first d of merge(A, B). Binary search (one
// thread; for runs in shared memory).
template <class R> __device__ __forceinline__ u32 merge_path(const R &a, u32 alen, const R &b, u32 blen, u32 d) {
    u32 lo = d > blen ? d - blen : 0u, hi = min(d, alen);
    while (lo < hi) {
        const u32 mid = (lo + hi) >> 1;
        if (a_first(a, mid, b, d - 1 - mid)) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// merge_path by a whole warp (every lane calls it, same arguments): each round probes 32
// evenly spaced positions of the undecided range at once, so a run of 10^6 pairs takes 4
// rounds of loads where a binary search takes 20.
template <class R> __device__ __forceinline__ u32 merge_path_warp(const R &a, u32 alen, const R &b, u32 blen, u32 d) {
    u32 lo = d > blen ? d - blen : 0u, hi = min(d, alen);
    const u32 lane = lane_id();
    while (lo < hi) {
        const u32 step = (hi - lo + 31) / 32;
        const u32 p = lo + lane * step;
        const bool before = p < hi && a_first(a, p, b, d - 1 - p);
        // The predicate holds on a prefix of [lo, hi): c probes hold, so the answer (the first
        // position where it fails) lies in (lo + (c-1)·step, lo + c·step].
        const u32 c = (u32)__popc(__ballot_sync(FULL_MASK, before));
        if (c == 0) return lo;
        hi = min(lo + c * step, hi);
        lo = lo + (c - 1) * step + 1;
    }
    return lo;
}

// `count` (≤ V) pairs of merge(A, B) from A's pair i and B's pair j on, into registers.
template <class K, int V, class R>
__device__ __forceinline__ void merge_items(const R &a, u32 alen, const R &b, u32 blen, u32 i, u32 j, u32 count,
                                            K (&key)[V], u64 (&id)[V]) {
    K ka = i < alen ? a.key(i) : key_max<K>(), kb = j < blen ? b.key(j) : key_max<K>();
    u64 ia = i < alen ? a.id(i) : ~0ull, ib = j < blen ? b.id(j) : ~0ull;
    if constexpr (R::KEYS_ONLY) {
        // Words: each step loads the next word of both runs (in range; past a run's end its
        // word reads as the largest) and keeps the one the step needs, so that lanes whose
        // steps take different runs do not diverge (the branches of the pairs' loop below
        // serialised both sides' loads in every step).
        const u32 last_a = alen ? alen - 1 : 0u, last_b = blen ? blen - 1 : 0u;
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const bool take_a = j >= blen || (i < alen && !(kb.w[0] < ka.w[0]));
            if ((u32)e < count) key[e] = take_a ? ka : kb;
            i += take_a;
            j += !take_a;
            const K na = a.key(min(i, last_a)), nb = b.key(min(j, last_b));
            if (take_a) {
                ka = i < alen ? na : key_max<K>();
            } else {
                kb = j < blen ? nb : key_max<K>();
            }
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < V; ++e) {
        if ((u32)e >= count) continue; // (a `break` here made msort_merge_k256 spill)
        const bool take_a = j >= blen || (i < alen && !pair_less(kb, ib, ka, ia));
        key[e] = take_a ? ka : kb;
        id[e] = take_a ? ia : ib;
        if (take_a) {
            ++i;
            if (i < alen) {
                ka = a.key(i);
                ia = a.id(i);
            }
        } else {
            ++j;
            if (j < blen) {
                kb = b.key(j);
                ib = b.id(j);
            }
        }
    }
}

// Compare-exchange of registers: (ka, ia) becomes the smaller pair.
template <bool KO, class K> __device__ __forceinline__ void order_pair(K &ka, u64 &ia, K &kb, u64 &ib) {
    if constexpr (KO) {
        const u64 lo = min(ka.w[0], kb.w[0]), hi = max(ka.w[0], kb.w[0]);
        ka.w[0] = lo;
        kb.w[0] = hi;
        return;
    }
    if (pair_less(kb, ib, ka, ia)) {
        const K tk = ka;
        const u64 ti = ia;
        ka = kb;
        ia = ib;
        kb = tk;
        ib = ti;
    }
}

// Sorts a thread's V pairs in registers: Batcher's odd-even merge sort (19 compare-exchanges
// for 8 pairs, 5 for 4, 1 for 2).
template <class K, int V, bool KO = false> __device__ __forceinline__ void sort_items(K (&key)[V], u64 (&id)[V]) {
    static_assert(V == 2 || V == 4 || V == 8, "MergeItems");
    constexpr int N8[19][2] = {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {0, 2}, {1, 3}, {4, 6}, {5, 7}, {1, 2}, {5, 6},
                               {0, 4}, {1, 5}, {2, 6}, {3, 7}, {2, 4}, {3, 5}, {1, 2}, {3, 4}, {5, 6}};
    constexpr int N4[5][2] = {{0, 1}, {2, 3}, {0, 2}, {1, 3}, {1, 2}};
    if (V == 8) {
#pragma unroll
        for (int c = 0; c < 19; ++c) order_pair<KO>(key[N8[c][0] % V], id[N8[c][0] % V], key[N8[c][1] % V], id[N8[c][1] % V]);
    } else if (V == 4) {
#pragma unroll
        for (int c = 0; c < 5; ++c) order_pair<KO>(key[N4[c][0] % V], id[N4[c][0] % V], key[N4[c][1] % V], id[N4[c][1] % V]);
    } else if (V == 2) {
        order_pair<KO>(key[0], id[0], key[V - 1], id[V - 1]);
    }
}

// Positions [0, fill) of a tile in shared memory: position t < n from get(t, key, id), the
// others padding (the largest pair). A thread takes positions threadIdx.x + e·MSORT_THREADS.
template <class K, int V, bool KO, class Get>
__device__ __forceinline__ void fill_tile(const Run<K, true, KO> &s, u32 n, u32 fill, Get get) {
    if (BatchedLoads<K, KO>::V) {
        K kk[V];
        u64 ii[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
            kk[e] = key_max<K>();
            ii[e] = ~0ull;
            if (threadIdx.x + e * MSORT_THREADS < n) get(threadIdx.x + e * MSORT_THREADS, kk[e], ii[e]);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) {
            if (threadIdx.x + e * MSORT_THREADS < fill) s.put(threadIdx.x + e * MSORT_THREADS, kk[e], ii[e]);
        }
    } else {
        for (u32 t = threadIdx.x; t < fill; t += MSORT_THREADS) {
            K k = key_max<K>();
            u64 id = ~0ull;
            if (t < n) get(t, k, id);
            s.put(t, k, id);
        }
    }
}

// Dynamic shared memory as a padded run of `n` pairs (keys, then row ids).
template <class K, bool KO> __device__ __forceinline__ Run<K, true, KO> tile_smem(u32 n) {
    extern __shared__ __align__(16) u8 msort_smem[];
    K *keys = reinterpret_cast<K *>(msort_smem);
    return {keys, reinterpret_cast<u64 *>(msort_smem + ((u64)spad<K>(n) * sizeof(K) + 15) / 16 * 16), 0u};
}

// Writes each thread's V pairs (positions t·V …) to shared memory.
template <class K, int V, bool KO>
__device__ __forceinline__ void put_items(const Run<K, true, KO> &s, const K (&key)[V], const u64 (&id)[V]) {
#pragma unroll
    for (int e = 0; e < V; ++e) s.put(threadIdx.x * V + e, key[e], id[e]);
}

// Writes each thread's V pairs to shared memory, then hands the block's first `valid`
// positions to put(t, key, row id), coalesced.
template <class K, int V, bool KO, class Put>
__device__ __forceinline__ void store_tile_with(const Run<K, true, KO> &s, const K (&key)[V], const u64 (&id)[V],
                                                u32 valid, Put put) {
    __syncthreads();
    put_items<K, V, KO>(s, key, id);
    __syncthreads();
    for (u32 t = threadIdx.x; t < valid; t += MSORT_THREADS) put(t, s.key(t), s.id(t));
}

// … to `out`.
template <class K, int V, bool KO>
__device__ __forceinline__ void store_tile_out(const Run<K, true, KO> &s, const K (&key)[V], const u64 (&id)[V],
                                               u32 valid, const Run<K, false, KO> &out) {
    store_tile_with<K, V, KO>(s, key, id, valid, [&](u32 t, const K &k, u64 i) { out.put(t, k, i); });
}

// Where a round's merged pairs go: its output buffer (`KeepWords`)…
struct KeepWords {
    enum { ENABLED = 0 };
    __device__ __forceinline__ void operator()(u64, const K64 &) const {}
};

// … or, in the round that leaves one run, unpacked into (key, row id) pairs (as the round's
// store, which spares a separate unpacking kernel its pass over the words):
// `fixed` holds the bits every candidate's key shares (candidates.cu `key_span`'s words), the
// word's field goes at `lo`, below it the row id.
template <class K> struct UnpackWords {
    enum { ENABLED = 1 };
    K *keys;
    u64 *ids;
    K fixed;
    u32 lo, id_bits;
    __device__ __forceinline__ UnpackWords(K *keys_, u64 *ids_, const u64 *span, u32 lo_, u32 width, u32 id_bits_)
        : keys(keys_), ids(ids_), lo(lo_), id_bits(id_bits_) {
#pragma unroll
        for (int j = 0; j < K::N; ++j) fixed.w[j] = (typename K::Word)~span[j];
        const u64 field_mask = width >= 64 ? ~0ull : (1ull << width) - 1ull;
        const K clear = key_with_field(key_zero<K>(), field_mask, lo);
#pragma unroll
        for (int j = 0; j < K::N; ++j) fixed.w[j] &= ~clear.w[j];
    }
    __device__ __forceinline__ void operator()(u64 at, const K64 &word) const {
        const u64 w = word.w[0];
        keys[at] = key_with_field(fixed, id_bits >= 64 ? 0ull : w >> id_bits, lo);
        ids[at] = id_bits >= 64 ? w : w & ((1ull << id_bits) - 1ull);
    }
};

// The packed field (lo, width) from candidates.cu `key_span`'s words, as the host's
// `packed_field` (src/device/plan.rs) reads them: bits lo up to the highest that
// varies among the keys. False when it and `id_bits` bits of row id do not fit one word.
template <class K> __device__ __forceinline__ bool device_packed_field(const u64 *span, u32 id_bits, u32 &lo,
                                                                       u32 &width) {
    constexpr int W = 8 * sizeof(typename K::Word);
    const u64 mask = W == 64 ? ~0ull : (1ull << W) - 1ull;
    int first = -1, hi = 0;
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        const u64 varies = (__ldcg(&span[K::N + j]) ^ ~__ldcg(&span[j])) & mask;
        if (varies != 0) {
            if (first < 0) first = j * W + __ffsll((long long)varies) - 1;
            hi = j * W + 64 - __clzll((long long)varies);
        }
    }
    lo = first < 0 ? 0u : (u32)first;
    width = hi > (int)lo ? (u32)hi - lo : 0u;
    return width + id_bits <= 64;
}

// Pair g of a tile sort's input: (key, row id) from arrays (row ids null: positions)…
template <class K> struct LoadPairs {
    const K *keys;
    const u64 *ids;
    __device__ __forceinline__ void operator()(u64 g, K &k, u64 &id) const {
        k = keys[g];
        id = ids ? ids[g] : g;
    }
};

// … or the packed word of pair g (common.cuh `packed_word`), keys only.
template <class K> struct LoadPacked {
    const K *keys;
    const u64 *ids;
    u32 lo, width, id_bits;
    __device__ __forceinline__ void operator()(u64 g, K64 &k, u64 &id) const {
        k.w[0] = packed_word(keys[g], ids[g], lo, width, id_bits);
        id = 0;
    }
};

template <class K, bool KO, class Load>
__device__ void msort_tiles(Load load, u64 m_host, const u64 *m_dev, u64 cap, K *out_keys, u64 *out_ids,
                            u32 *status) {
    constexpr int V = MergeItems<K>::V;
    constexpr u32 TILE = MSORT_THREADS * V;
    // Both words loaded before either is tested: one round trip.
    const u32 st = status ? __ldcg(status) : 0u;
    const u64 m = msort_count(m_host, m_dev);
    if (st != 0) return;
    if (m > cap) {
        if (status && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(status, MSORT_FINAL_LARGE);
        return;
    }
    const Run<K, true, KO> s = tile_smem<K, KO>(TILE);
    // Block b sorts tiles b, b + grid, …: one each where the host planned the grid for m, and
    // where it was planned before m was known, a grid of one wave at most (a grid for the
    // buffer's capacity, most of its blocks returning at once, slowed the tile sort).
    for (u64 base = (u64)blockIdx.x * TILE; base < m; base += (u64)gridDim.x * TILE) {
        const u32 valid = (u32)min(m - base, (u64)TILE);
        // Coalesced loads into shared memory, then each thread takes V consecutive pairs.
        fill_tile<K, V>(s, valid, TILE, [&](u32 t, K &k, u64 &id) { load(base + t, k, id); });
        __syncthreads();
        K key[V];
        u64 id[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
            key[e] = s.key(threadIdx.x * V + e);
            id[e] = s.id(threadIdx.x * V + e);
        }
        sort_items<K, V, KO>(key, id);
        // Rounds of pairwise merges of runs of `run` pairs in shared memory.
        for (u32 run = V; run < TILE; run <<= 1) {
            __syncthreads();
            put_items<K, V, KO>(s, key, id);
            __syncthreads();
            const u32 pos = threadIdx.x * V, d = pos & (2 * run - 1), first = pos - d;
            const Run<K, true, KO> a{s.keys, s.ids, first}, b{s.keys, s.ids, first + run};
            const u32 i = merge_path(a, run, b, run, d);
            merge_items<K, V>(a, run, b, run, i, d - i, V, key, id);
        }
        store_tile_out<K, V, KO>(s, key, id, valid,
                                 Run<K, false, KO>{out_keys + base, KO ? nullptr : out_ids + base, 0u});
        __syncthreads(); // the next tile's loads overwrite the shared tile
    }
}

template <class K, bool KO, class Final = KeepWords>
__device__ void msort_merge(const K *in_keys, const u64 *in_ids, u64 m_host, const u64 *m_dev, u64 cap, u64 k,
                            u64 span, K *out_keys, u64 *out_ids, const u32 *status, Final final = Final()) {
    constexpr int V = MergeItems<K>::V;
    constexpr u32 TILE = MSORT_THREADS * V;
    __shared__ u32 s_split[2];
    const u32 st = status ? __ldcg(status) : 0u;
    const u64 m = msort_count(m_host, m_dev);
    if (st != 0 || m > cap) return;
    // One run holds every pair (the rounds were planned for `cap`): it stays where it is (the
    // host picks the buffer by the count).
    if (span >= m) return;
    // Runs are at least a tile (msort_tiles wrote whole tiles); the result is the first
    // `wanted` (`final`'s buffer holds no more).
    const u64 wanted = k;
    k = max(k, (u64)TILE);
    const u64 in_stride = min(span, k), out_stride = min(2 * span, k);
    const u64 tiles_per_run = (out_stride + TILE - 1) / TILE;
    const u64 q = blockIdx.x / tiles_per_run, d0 = (blockIdx.x % tiles_per_run) * TILE;
    const u32 out_len = run_length(q, 2 * span, m, k);
    if (d0 >= out_len) return; // uniform per block
    const u32 d1 = (u32)min(d0 + TILE, (u64)out_len);
    const u32 alen = run_length(2 * q, span, m, k), blen = run_length(2 * q + 1, span, m, k);
    const u64 a_at = 2 * q * in_stride;
    u64 *ids_at = KO ? nullptr : const_cast<u64 *>(in_ids) + a_at;
    const Run<K, false, KO> a{const_cast<K *>(in_keys) + a_at, ids_at, 0u};
    const Run<K, false, KO> b{a.keys + in_stride, KO ? nullptr : ids_at + in_stride, 0u};
    const u32 warp = threadIdx.x / 32;
    if (warp < 2) {
        const u32 i = merge_path_warp(a, alen, b, blen, warp == 0 ? (u32)d0 : d1);
        if (lane_id() == 0) s_split[warp] = i;
    }
    __syncthreads();
    const u32 a0 = s_split[0], a1 = s_split[1], b0 = (u32)d0 - a0, b1 = d1 - a1;
    const u32 na = a1 - a0, nb = b1 - b0, n = na + nb;
    const Run<K, true, KO> s = tile_smem<K, KO>(TILE);
    fill_tile<K, V>(s, n, n, [&](u32 t, K &k, u64 &id) {
        if (t < na) {
            k = a.key(a0 + t);
            id = a.id(a0 + t);
        } else {
            k = b.key(b0 + t - na);
            id = b.id(b0 + t - na);
        }
    });
    __syncthreads();
    K key[V];
    u64 id[V];
    const u32 d = min(threadIdx.x * V, n);
    const Run<K, true, KO> sa{s.keys, s.ids, 0u}, sb{s.keys, s.ids, na};
    const u32 i = merge_path(sa, na, sb, nb, d);
    merge_items<K, V>(sa, na, sb, nb, i, d - i, min((u32)V, n - d), key, id);
    const u64 o = q * out_stride + d0;
    if constexpr (Final::ENABLED) {
        if (2 * span >= m) {
            // This round leaves one run: the sort's result, its first `wanted` stored as `final`
            // takes them.
            const u32 valid = (u32)min((u64)n, wanted > o ? wanted - o : 0ull);
            store_tile_with<K, V, KO>(s, key, id, valid, [&](u32 t, const K &w, u64) { final(o + t, w); });
            return;
        }
    }
    store_tile_out<K, V, KO>(s, key, id, n, Run<K, false, KO>{out_keys + o, KO ? nullptr : out_ids + o, 0u});
}

#define MERGE_SORT_ENTRIES(K, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(MSORT_THREADS)                                                   \
        msort_tiles_##S(const K *keys, const u64 *ids, u64 m_host, const u64 *m_dev, u64 cap, K *out_keys,        \
                        u64 *out_ids, u32 *status) { grid_dependency_wait();                                      \
        msort_tiles<K, false>(LoadPairs<K>{keys, ids}, m_host, m_dev, cap, out_keys, out_ids, status);           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MSORT_THREADS)                                                   \
        msort_merge_##S(const K *in_keys, const u64 *in_ids, u64 m_host, const u64 *m_dev, u64 cap, u64 k,       \
                        u64 span, K *out_keys, u64 *out_ids, const u32 *status) { grid_dependency_wait();         \
        msort_merge<K, false>(in_keys, in_ids, m_host, m_dev, cap, k, span, out_keys, out_ids, status);           \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MSORT_THREADS)                                                   \
        msort_tiles_packed_##S(const K *keys, const u64 *ids, const u64 *span_words, u32 lo, u32 width,          \
                               u32 id_bits, u64 m_host, const u64 *m_dev, u64 cap, K64 *out_words, u32 *status) { \
        grid_dependency_wait();                                                                                   \
        /* FIELD_FROM_SPAN: enqueued before the host read the span; nothing where it does not fit. */             \
        if (width == FIELD_FROM_SPAN && !device_packed_field<K>(span_words, id_bits, lo, width)) return;          \
        msort_tiles<K64, true>(LoadPacked<K>{keys, ids, lo, width, id_bits}, m_host, m_dev, cap, out_words,      \
                               nullptr, status);                                                                  \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(MSORT_THREADS)                                                   \
        msort_merge_unpack_##S(const K64 *in_words, u64 m_host, const u64 *m_dev, u64 cap, u64 k, u64 span,       \
                               K64 *out_words, const u32 *status, const u64 *span_words, u32 lo, u32 width,       \
                               u32 id_bits, K *out_keys, u64 *out_ids) { grid_dependency_wait();                  \
        msort_merge<K64, true>(in_words, nullptr, m_host, m_dev, cap, k, span, out_words, nullptr, status,        \
                               UnpackWords<K>(out_keys, out_ids, span_words, lo, width, id_bits));                \
    }
INSTANTIATE_KEYS(MERGE_SORT_ENTRIES)

// The rounds over packed words (keys only), after msort_tiles_packed.
extern "C" __global__ void __launch_bounds__(MSORT_THREADS)
    msort_merge_words(const K64 *in_keys, u64 m_host, const u64 *m_dev, u64 cap, u64 k, u64 span, K64 *out_keys,
                      const u32 *status) { grid_dependency_wait();
    msort_merge<K64, true>(in_keys, nullptr, m_host, m_dev, cap, k, span, out_keys, nullptr, status);
}
