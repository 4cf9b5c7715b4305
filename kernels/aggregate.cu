// aggregate.cu: top-k over an aggregate (GROUP BY keys ORDER BY an aggregate LIMIT k) on the
// device, over the hash table of aggregate.cuh. The engine (src/device/engine/aggregate.rs)
// launches, for KW key words (the `_w1` and `_w2` entries):
//   agg_columns  the aggregation over plain device columns (i64 keys, i64 or f64 values, each
//                with an optional validity bitmap), described by a spec in device memory
//                (AggSpec below); a generated program does the same with aggregate.cuh's
//                functions;
//   agg_compact  the occupied slots' indices, dense (warp-aggregated appends);
//   agg_rank     each dense group's ranking value as a composite key (the selectors' pairs),
//                its slot as the row id;
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

#define AGG_THREADS 256
// The spec's bounds (src/device/engine/aggregate.rs checks them).
#define AGG_MAX_VALUES 4
#define AGG_MAX_ACCS 8
// An accumulator's kind: bits 0-7 (AGG_COUNT …, or AGG_SUM_I64_AS_F64: an i64 column summed
// as f64, DataFusion's AVG of integers), its value column in bits 8-15 (0xff: none, COUNT(*)).
#define AGG_SUM_I64_AS_F64 7u
#define AGG_NO_COLUMN 0xffu

// The spec of agg_columns, u64 words: the key columns' values (2), validity (2) and validity
// bit offsets (2); the value columns' values, validity and bit offsets (AGG_MAX_VALUES each);
// the accumulators (AGG_MAX_ACCS), then their number.
struct AggSpec {
    u64 key_values[2], key_valid[2], key_valid_offset[2];
    u64 values[AGG_MAX_VALUES], valid[AGG_MAX_VALUES], valid_offset[AGG_MAX_VALUES];
    u64 accs[AGG_MAX_ACCS];
    u64 n_accs;
};
static_assert(sizeof(AggSpec) == 8 * (6 + 3 * AGG_MAX_VALUES + AGG_MAX_ACCS + 1), "aggregate.rs spec_bytes' words");

__device__ __forceinline__ bool agg_valid(u64 bitmap, u64 offset, u64 row) {
    return bitmap == 0 || get_bit((const u8 *)bitmap, offset + row);
}

template <int KW>
__device__ void agg_columns(const AggSpec *spec_in, u64 rows, const AggTable &t) {
    __shared__ AggSpec spec;
    if (threadIdx.x == 0) spec = *spec_in;
    __syncthreads();
    const u32 n_accs = (u32)spec.n_accs;
    for (u64 row = (u64)blockIdx.x * blockDim.x + threadIdx.x; row < rows; row += (u64)gridDim.x * blockDim.x) {
        if (agg_stopped(t)) return;
        u64 key[KW];
        u32 nulls = 0;
#pragma unroll
        for (int j = 0; j < KW; ++j) {
            const bool valid = agg_valid(spec.key_valid[j], spec.key_valid_offset[j], row);
            key[j] = valid ? ((const u64 *)spec.key_values[j])[row] : 0;
            nulls |= valid ? 0u : 1u << j;
        }
        const u64 slot = agg_insert<KW>(t, key, nulls);
        if (slot == AGG_NO_SLOT) return;
        for (u32 a = 0; a < n_accs; ++a) {
            const u64 desc = spec.accs[a];
            u32 kind = (u32)(desc & 0xff);
            const u32 column = (u32)(desc >> 8) & 0xff;
            u64 bits = 0;
            bool valid = true;
            if (column != AGG_NO_COLUMN) {
                valid = agg_valid(spec.valid[column], spec.valid_offset[column], row);
                if (valid) bits = ((const u64 *)spec.values[column])[row];
            }
            if (kind == AGG_SUM_I64_AS_F64) {
                bits = (u64)__double_as_longlong(__ll2double_rn((i64)bits));
                kind = AGG_SUM_F64;
            }
            agg_update(t, a, kind, slot, bits, valid);
        }
    }
}

template <int KW> __device__ void agg_compact(const u64 *slots, u64 cap, u64 *out, u64 *count) {
    FOR_BLOCK_ROUNDS(i0, cap) {
        const u64 s = i0 + threadIdx.x;
        const bool occupied = s < cap && __ldcg(slots + s * (KW + 1) + KW) >= AGG_READY;
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
__device__ void agg_rank(const u64 *slots, const u64 *acc, u64 cap, const u64 *dense, u64 n, u32 kind, u32 rank_acc,
                         u32 count_acc, u32 flags, u32 key_nullable, u32 words, u64 *out_keys, u64 *out_ids) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 s = dense[i];
        const u64 *slot = slots + s * (KW + 1);
        const u32 nulls = (u32)(slot[KW] >> 2);
        AggComposite w = {0, 0, 0, 0};
        u32 at = 0;
#pragma unroll
        for (int j = KW - 1; j >= 0; --j) {
            const bool null = (nulls >> j) & 1u;
            agg_put(w, at, null ? 0ull : agg_ord_i64((i64)slot[j]), 64);
            if ((key_nullable >> j) & 1u) agg_put(w, at, null ? 1ull : 0ull, 1);
        }
        const u64 a = acc[(u64)rank_acc * cap + s];
        const u64 count = count_acc == 0xffffffffu ? 1 : acc[(u64)count_acc * cap + s];
        const bool null = (flags & AGG_RANK_NULLABLE) && count == 0;
        u64 v = 0;
        if (!null) {
            switch (kind) {
            case AGG_RANK_U64: v = a; break;
            case AGG_RANK_I64: v = agg_ord_i64((i64)a); break;
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

template <int KW>
__device__ void agg_gather(const u64 *slots, const u64 *acc, u64 cap, u32 n_accs, const u64 *ids, u64 n, u64 *out) {
    const u64 stride = KW + 1 + n_accs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 s = ids[i];
#pragma unroll
        for (int j = 0; j <= KW; ++j) out[i * stride + j] = slots[s * (KW + 1) + j];
        for (u32 a = 0; a < n_accs; ++a) out[i * stride + KW + 1 + a] = acc[(u64)a * cap + s];
    }
}

#define AGG_ENTRIES(KW)                                                                                            \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_columns_w##KW(const AggSpec *spec, u64 rows, u64 *slots, u64 *acc, u64 cap, u64 limit, u64 *ctl) {     \
        grid_dependency_wait();                                                                                    \
        const AggTable t = {slots, acc, cap, limit, ctl};                                                          \
        agg_columns<KW>(spec, rows, t);                                                                            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_compact_w##KW(const u64 *slots, u64 cap, u64 *out, u64 *count) {                                       \
        grid_dependency_wait();                                                                                    \
        agg_compact<KW>(slots, cap, out, count);                                                                   \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_rank_w##KW(const u64 *slots, const u64 *acc, u64 cap, const u64 *dense, u64 n, u32 kind, u32 rank_acc, \
                       u32 count_acc, u32 flags, u32 key_nullable, u32 words, u64 *out_keys, u64 *out_ids) {       \
        grid_dependency_wait();                                                                                    \
        agg_rank<KW>(slots, acc, cap, dense, n, kind, rank_acc, count_acc, flags, key_nullable, words, out_keys,   \
                     out_ids);                                                                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(AGG_THREADS)                                                      \
        agg_gather_w##KW(const u64 *slots, const u64 *acc, u64 cap, u32 n_accs, const u64 *ids, u64 n, u64 *out) { \
        grid_dependency_wait();                                                                                    \
        agg_gather<KW>(slots, acc, cap, n_accs, ids, n, out);                                                      \
    }
AGG_ENTRIES(1)
AGG_ENTRIES(2)
