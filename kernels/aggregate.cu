// aggregate.cu: top-k over an aggregate (GROUP BY keys ORDER BY an aggregate LIMIT k) on the
// device, over the hash table of aggregate.cuh. The engine (src/device/engine/aggregate.rs)
// launches, for KW key words (the `_w1` and `_w2` entries):
//   agg_columns  the aggregation over plain device columns (i64 keys, i64 or f64 values, each
//                with an optional validity bitmap), described by a spec in device memory
//                (aggregate.cuh's AggSpec), over every row; a generated program (src/fusion/
//                aggregate.rs) runs the same pass over the rows its filter passes;
//   agg_compact  the occupied slots' indices, dense (warp-aggregated appends);
//   agg_rank     each dense group's ranking value (an accumulator, an average or a key) as
//                a composite key (the selectors' pairs), its slot as the row id;
//   agg_outputs  every slot's values of the aggregation's output columns (keys, accumulators
//                decoded) with validity bitmaps, the columns a generated HAVING program
//                (src/fusion/aggregate.rs) reads to drop groups before agg_rank;
//   agg_gather   the chosen slots' key words, state words and accumulators, one row each, for
//                the host to read back.
//
// The composite of agg_rank, from its most significant bit down:
//   [rank NULL bit, where the ranking value may be NULL] [ranking value, 64 bits]
//   then per key column, the first one highest: [NULL bit, where the column has NULLs]
//   [the key's order-preserving image, 64 bits].
// The ranking value's bits are complemented for a descending order; the NULL bit is 0 for
// NULLs first. Groups whose ranking values are equal are ordered by their keys, ascending,
// NULL after every value, the first key column first: the selection's ties are broken
// deterministically, by the group key. Distinct groups have distinct composites.

#include "aggregate.cuh"

template <int KW> __device__ void agg_compact(const u64 *slots, u64 cap, u64 width, u64 *out, u64 *count) {
    FOR_BLOCK_ROUNDS(i0, cap) {
        const u64 s = i0 + threadIdx.x;
        const bool occupied = s < cap && __ldcg(slots + s * width + KW) >= AGG_READY;
        const u64 at = warp_append(occupied, count);
        if (occupied) out[at] = s;
    }
}

// Ranking kinds (src/device/engine/aggregate.rs `rank_encoding`).
#define AGG_RANK_U64 0u
#define AGG_RANK_I64 1u
#define AGG_RANK_F64 2u
#define AGG_RANK_ORDERED 3u
#define AGG_RANK_AVG_I64 4u
#define AGG_RANK_AVG_F64 5u
// Key column `rank_acc` (its i64), NULL where the key is.
#define AGG_RANK_KEY 6u
// Rank flags.
#define AGG_RANK_DESC 1u
#define AGG_RANK_NULLS_FIRST 2u
#define AGG_RANK_NULLABLE 4u

// A composite of up to 256 bits, least significant word first (four variables, not an array:
// a run-time word index would put an array on the stack).
struct AggComposite {
    u64 w0, w1, w2, w3;
};

// ORs `v` into the composite at bit `at` (advanced by `width`).
__device__ __forceinline__ void agg_put(AggComposite &w, u32 &at, u64 v, u32 width) {
    const u32 q = at >> 6, r = at & 63;
    const u64 lo = v << r, hi = r != 0 ? v >> (64 - r) : 0;
    w.w0 |= q == 0 ? lo : 0;
    w.w1 |= q == 1 ? lo : q == 0 ? hi : 0;
    w.w2 |= q == 2 ? lo : q == 1 ? hi : 0;
    w.w3 |= q == 3 ? lo : q == 2 ? hi : 0;
    at += width;
}

template <int KW>
__device__ void agg_rank(const u64 *slots, const u64 *acc, u64 width, const u64 *dense, u64 n, u32 kind, u32 rank_acc,
                         u32 count_acc, u32 flags, u32 key_nullable, u32 words, u64 *out_keys, u64 *out_ids) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 s = dense[i];
        const u64 *slot = slots + s * width;
        const u32 nulls = (u32)(slot[KW] >> 2);
        AggComposite w = {0, 0, 0, 0};
        u32 at = 0;
#pragma unroll
        for (int j = KW - 1; j >= 0; --j) {
            const bool null = (nulls >> j) & 1u;
            agg_put(w, at, null ? 0ull : agg_ord_i64((i64)slot[j]), 64);
            if ((key_nullable >> j) & 1u) agg_put(w, at, null ? 1ull : 0ull, 1);
        }
        const bool by_key = kind == AGG_RANK_KEY;
        const u64 a = by_key ? slot[rank_acc] : acc[s * width + rank_acc];
        const u64 count = by_key                    ? (u64)(((nulls >> rank_acc) & 1u) == 0)
                          : count_acc == 0xffffffffu ? 1
                                                     : acc[s * width + count_acc];
        const bool null = (flags & AGG_RANK_NULLABLE) && count == 0;
        u64 v = 0;
        if (!null) {
            switch (kind) {
            case AGG_RANK_U64: v = a; break;
            case AGG_RANK_I64:
            case AGG_RANK_KEY: v = agg_ord_i64((i64)a); break;
            case AGG_RANK_F64: v = agg_ord_f64(__longlong_as_double((i64)a)); break;
            case AGG_RANK_ORDERED: v = a; break;
            case AGG_RANK_AVG_I64:
                v = agg_ord_f64(__ddiv_rn(__ll2double_rn((i64)a), __ull2double_rn(count)));
                break;
            default: v = agg_ord_f64(__ddiv_rn(__longlong_as_double((i64)a), __ull2double_rn(count))); break;
            }
            if (flags & AGG_RANK_DESC) v = ~v;
        }
        agg_put(w, at, v, 64);
        if (flags & AGG_RANK_NULLABLE) agg_put(w, at, null == ((flags & AGG_RANK_NULLS_FIRST) == 0) ? 1ull : 0ull, 1);
        u64 *out = out_keys + i * words;
        out[0] = w.w0;
        out[1] = w.w1;
        if (words == 4) {
            out[2] = w.w2;
            out[3] = w.w3;
        }
        out_ids[i] = s;
    }
}

// Output column kinds of agg_outputs (src/device/engine/aggregate.rs `output_descriptors`).
#define AGG_OUT_KEY 0u
#define AGG_OUT_COUNT 1u
#define AGG_OUT_RAW 2u
#define AGG_OUT_ORD_I64 3u
#define AGG_OUT_ORD_F64 4u

// Every slot's value of the aggregation's output columns, for a generated HAVING program to
// read as plain columns (row s: slot s): column j's words at `out + j · cap`, its validity
// bitmap at `valid + j · cap / 32` (u32 words; cap is a multiple of 32). desc[j]: the kind
// (bits 0-7), a key column or accumulator (bits 8-15), the accumulator counting its non-NULL
// inputs (bits 16-23, 0xff: never NULL). Empty slots' values are left unspecified.
template <int KW>
__device__ void agg_outputs(const u64 *slots, const u64 *acc, u64 cap, u64 width, const u64 *desc, u32 n_cols,
                            u64 *out, u32 *valid) {
    FOR_BLOCK_ROUNDS(i0, cap) {
        const u64 s = i0 + threadIdx.x;
        const bool in = s < cap;
        const u32 nulls = in ? (u32)(__ldcg(slots + s * width + KW) >> 2) : 0u;
        for (u32 j = 0; j < n_cols; ++j) {
            const u64 d = desc[j];
            const u32 kind = (u32)(d & 0xff), at = (u32)(d >> 8) & 0xff, counted = (u32)(d >> 16) & 0xff;
            u64 v = 0;
            bool ok = in;
            if (in) {
                if (kind == AGG_OUT_KEY) {
                    v = slots[s * width + at];
                    ok = ((nulls >> at) & 1u) == 0;
                } else {
                    const u64 a = acc[s * width + at];
                    v = kind == AGG_OUT_ORD_I64   ? a ^ 0x8000000000000000ull
                        : kind == AGG_OUT_ORD_F64 ? ((a >> 63) ? a ^ 0x8000000000000000ull : ~a)
                                                  : a;
                    ok = counted == AGG_NO_COLUMN || acc[s * width + counted] != 0;
                }
                out[(u64)j * cap + s] = v;
            }
            const u32 bits = __ballot_sync(FULL_MASK, ok);
            if (lane_id() == 0 && in) valid[(u64)j * (cap / 32) + s / 32] = bits;
        }
    }
}

template <int KW>
__device__ void agg_gather(const u64 *slots, const u64 *acc, u64 width, u32 n_accs, const u64 *ids, u64 n, u64 *out) {
    const u64 stride = KW + 1 + n_accs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 s = ids[i];
#pragma unroll
        for (int j = 0; j <= KW; ++j) out[i * stride + j] = slots[s * width + j];
        for (u32 a = 0; a < n_accs; ++a) out[i * stride + KW + 1 + a] = acc[s * width + a];
    }
}

#define AGG_ENTRIES(KW)                                                                                            \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_columns_w##KW(const AggSpec *spec, u64 rows, u64 *slots, u64 *acc, u64 cap, u64 limit, u64 *ctl,       \
                          u64 width) {                                                                             \
        grid_dependency_wait();                                                                                    \
        const AggTable t = {slots, acc, cap, limit, ctl, width};                                                   \
        agg_columns<KW>(spec, rows, t, AggAllRows());                                                              \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_compact_w##KW(const u64 *slots, u64 cap, u64 width, u64 *out, u64 *count) {                            \
        grid_dependency_wait();                                                                                    \
        agg_compact<KW>(slots, cap, width, out, count);                                                            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_rank_w##KW(const u64 *slots, const u64 *acc, u64 width, const u64 *dense, u64 n, u32 kind,             \
                       u32 rank_acc, u32 count_acc, u32 flags, u32 key_nullable, u32 words, u64 *out_keys,         \
                       u64 *out_ids) {                                                                             \
        grid_dependency_wait();                                                                                    \
        agg_rank<KW>(slots, acc, width, dense, n, kind, rank_acc, count_acc, flags, key_nullable, words, out_keys, \
                     out_ids);                                                                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_outputs_w##KW(const u64 *slots, const u64 *acc, u64 cap, u64 width, const u64 *desc, u32 n_cols,       \
                          u64 *out, u32 *valid) {                                                                  \
        grid_dependency_wait();                                                                                    \
        agg_outputs<KW>(slots, acc, cap, width, desc, n_cols, out, valid);                                         \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_gather_w##KW(const u64 *slots, const u64 *acc, u64 width, u32 n_accs, const u64 *ids, u64 n,           \
                         u64 *out) {                                                                               \
        grid_dependency_wait();                                                                                    \
        agg_gather<KW>(slots, acc, width, n_accs, ids, n, out);                                                    \
    }
AGG_ENTRIES(1)
AGG_ENTRIES(2)
