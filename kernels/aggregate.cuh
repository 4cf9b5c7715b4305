// aggregate.cuh: a hash aggregation on the device, row by row: a kernel (aggregate.cu's
// `agg_columns_w*`, or a generated program of src/fusion/aggregate.rs that filters the rows)
// runs `agg_columns`, which finds each row's group in an open-addressing table and updates the
// group's accumulators with atomics.
//
// The table: `cap` slots (a power of two) of `width` words (a power of two), slot s at
// `slots + s · width`: KW key words (KW ≤ 2: one for integer and date keys, two for 128-bit
// keys), a state word, then the group's accumulators; a row's lookup and its updates touch one
// slot, so one random memory access, not one for the key and one per accumulator column. The
// state word:
//   AGG_EMPTY   no group (the table is zeroed before the pass);
//   AGG_BUSY    claimed by a thread that is writing the key words;
//   AGG_READY | nulls << 2   the group of those key words and null mask (bit j: key column j
//               is NULL, its key word then 0), published once the key words are visible.
// Occupancy lives in the state word, not in a sentinel key, so every key value (all ones
// included) is a group of its own, and so is each NULL combination. Linear probing from a
// splitmix64 hash of the key words and the null mask.
//
// Accumulator a of slot s is the u64 at `acc[s · width + a]` (`acc`: slot 0's first
// accumulator, `slots + KW + 1`), initialised by the host (zero, or all ones for a minimum):
//   COUNT        u64, +1 a row (COUNT(x): a row whose x is not NULL);
//   SUM i64      wrapping two's complement, as DataFusion 55's integer SUM (its
//                `PrimitiveGroupsAccumulator` adds with `add_wrapping`): exact in any order;
//   SUM f64      atomicAdd on the double: the rounding of the sum depends on the order of the
//                additions, which differs from DataFusion's (its last bits);
//   MIN/MAX i64  atomicMin/Max of the order-preserving image (sign bit flipped);
//   MIN/MAX f64  atomicMin/Max of the order-preserving image (fused.cuh `ord_f64`) of the
//                value after DataFusion 55's grouped MIN/MAX: it compares with `partial_cmp`
//                from a start of f64::MAX (MIN) or f64::MIN (MAX), so +inf never lowers a MIN
//                (MIN(+inf) = f64::MAX) nor −inf raises a MAX; −0.0 and +0.0 compare equal
//                and the device keeps +0.0 (DataFusion the first zero it meets). A NaN makes
//                DataFusion's result depend on the rows' order (a NaN replaces the value and
//                the next value replaces the NaN): the pass sets AGG_STATUS_NAN and the host
//                answers instead.
// NULL inputs are skipped; a SUM, MIN or MAX over a nullable column is NULL where its
// column's COUNT (an accumulator the host adds) is 0.
//
// A full table is never a wrong answer: past `limit` groups, or after probing every slot,
// AGG_STATUS_FULL is set, the pass stops and the host grows the table and runs it again. The
// groups claimed are counted per block and added to the table's count (ctl[0]) AGG_CLAIM_BATCH
// at a time, and the rest when the block ends: one counter word that every new group updated
// would serialise tens of millions of atomics on one address. The limit is therefore checked
// at those additions (a table may pass it by the blocks' unadded claims before it is flagged),
// and the count is exact once the pass ends.
#pragma once

#include "common.cuh"

#define AGG_EMPTY 0ull
#define AGG_BUSY 1ull
#define AGG_READY 2ull
// The control words: groups claimed (u64 at 0), status bits (u64 at 1).
#define AGG_STATUS_FULL 1ull
#define AGG_STATUS_NAN 2ull
// A row of a generated program's filter that only the host evaluates (one DataFusion fails on,
// or a NaN whose bits the device cannot reproduce): the host answers instead.
#define AGG_STATUS_HOST 4ull
#define AGG_NO_SLOT (~0ull)
// Groups a block claims between two additions to the table's count.
#define AGG_CLAIM_BATCH 64ull
// Rows a thread takes between two reads of the status word (one word every thread reads).
#define AGG_STATUS_EVERY 8u

// The spec's bounds (src/device/engine/aggregate.rs checks them).
#define AGG_MAX_VALUES 4
#define AGG_MAX_ACCS 8
// Accumulator kinds (src/device/engine/aggregate.rs `AggregateOp::device_kind`).
#define AGG_COUNT 0u
#define AGG_SUM_I64 1u
#define AGG_SUM_F64 2u
#define AGG_MIN_I64 3u
#define AGG_MAX_I64 4u
#define AGG_MIN_F64 5u
#define AGG_MAX_F64 6u

struct AggTable {
    u64 *slots;
    u64 *acc;
    u64 cap;
    // Groups past which the table counts as full (the load factor's bound).
    u64 limit;
    u64 *ctl;
    // Words per slot.
    u64 width;
};

__device__ __forceinline__ u64 agg_mix(u64 h, u64 w) {
    u64 x = h ^ w;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

template <int KW> __device__ __forceinline__ u64 agg_hash(const u64 (&key)[KW], u32 nulls) {
    u64 h = agg_mix(0x9E3779B97F4A7C15ull, nulls);
#pragma unroll
    for (int j = 0; j < KW; ++j) h = agg_mix(h, key[j]);
    return h;
}

__device__ __forceinline__ u64 agg_load_volatile(const u64 *p) { return *(const volatile u64 *)p; }

__device__ __forceinline__ void agg_flag(const AggTable &t, u64 bits) {
    atomicOr((unsigned long long *)(t.ctl + 1), (unsigned long long)bits);
}

// Whether the pass should stop: the table filled (the host runs it again, larger), or a row
// sends the query to the host.
__device__ __forceinline__ bool agg_stopped(const AggTable &t) {
    return (agg_load_volatile(t.ctl + 1) & (AGG_STATUS_FULL | AGG_STATUS_HOST)) != 0;
}

// Adds `n` claimed groups to the table's count, flagging it full past its limit.
__device__ __forceinline__ void agg_add_claims(const AggTable &t, u64 n) {
    const u64 before = atomicAdd((unsigned long long *)t.ctl, (unsigned long long)n);
    if (before + n > t.limit) agg_flag(t, AGG_STATUS_FULL);
}

// One more group claimed by this block (`claims`: the block's count, in shared memory).
__device__ __forceinline__ void agg_claimed(const AggTable &t, u64 *claims) {
    const u64 mine = atomicAdd((unsigned long long *)claims, 1ull) + 1;
    if (mine % AGG_CLAIM_BATCH == 0) agg_add_claims(t, AGG_CLAIM_BATCH);
}

// The slot of the group (key, nulls), claimed and published where it is new (counted in the
// block's `claims`); AGG_NO_SLOT where every slot is taken. Key words of NULL key columns must
// be 0.
template <int KW> __device__ u64 agg_insert(const AggTable &t, const u64 (&key)[KW], u32 nulls, u64 *claims) {
    const u64 want = AGG_READY | ((u64)nulls << 2);
    const u64 mask = t.cap - 1;
    u64 s = agg_hash<KW>(key, nulls) & mask;
    for (u64 probe = 0; probe < t.cap; ++probe, s = (s + 1) & mask) {
        u64 *slot = t.slots + s * t.width;
        u64 state = agg_load_volatile(slot + KW);
        if (state == AGG_EMPTY) {
            state = atomicCAS((unsigned long long *)(slot + KW), AGG_EMPTY, AGG_BUSY);
            if (state == AGG_EMPTY) {
#pragma unroll
                for (int j = 0; j < KW; ++j) slot[j] = key[j];
                __threadfence();
                atomicExch((unsigned long long *)(slot + KW), want);
                agg_claimed(t, claims);
                return s;
            }
        }
        // Another thread is writing this slot's key: wait for it to publish.
        while (state == AGG_BUSY) state = agg_load_volatile(slot + KW);
        if (state == want) {
            __threadfence();
            bool same = true;
#pragma unroll
            for (int j = 0; j < KW; ++j) same = same && __ldcg(slot + j) == key[j];
            if (same) return s;
        }
    }
    agg_flag(t, AGG_STATUS_FULL);
    return AGG_NO_SLOT;
}

__device__ __forceinline__ u64 *agg_at(const AggTable &t, u32 a, u64 slot) { return t.acc + slot * t.width + a; }

__device__ __forceinline__ u64 agg_ord_i64(i64 v) { return (u64)v ^ 0x8000000000000000ull; }
__device__ __forceinline__ u64 agg_ord_f64(double v) {
    const u64 b = (u64)__double_as_longlong(v);
    return b ^ ((b >> 63) ? ~0ull : 0x8000000000000000ull);
}

__device__ __forceinline__ void agg_count(const AggTable &t, u32 a, u64 slot) {
    atomicAdd((unsigned long long *)agg_at(t, a, slot), 1ull);
}

// COUNT where the lanes that reach the call together count their group's rows with one
// atomic a group (`valid`: the row counts): a hot group (one user's many rows, a single group)
// would otherwise serialise the warp's 32 atomics on one word. Lanes match on the slot and the
// accumulator: lanes at different accumulators of one row loop may reach this call together.
__device__ __forceinline__ void agg_count_warp(const AggTable &t, u32 a, u64 slot, bool valid) {
    const u32 active = __activemask();
    const u64 word = slot * AGG_MAX_ACCS + a;
    const u32 peers = __match_any_sync(active, valid ? word : AGG_NO_SLOT);
    if (valid && lane_id() == (u32)(__ffs(peers) - 1))
        atomicAdd((unsigned long long *)agg_at(t, a, slot), (unsigned long long)__popc(peers));
}

__device__ __forceinline__ void agg_sum_i64(const AggTable &t, u32 a, u64 slot, i64 v) {
    // Unsigned addition is the two's complement wrapping addition.
    atomicAdd((unsigned long long *)agg_at(t, a, slot), (unsigned long long)v);
}

__device__ __forceinline__ void agg_sum_f64(const AggTable &t, u32 a, u64 slot, double v) {
    atomicAdd((double *)agg_at(t, a, slot), v);
}

__device__ __forceinline__ void agg_min_i64(const AggTable &t, u32 a, u64 slot, i64 v) {
    atomicMin((unsigned long long *)agg_at(t, a, slot), (unsigned long long)agg_ord_i64(v));
}

__device__ __forceinline__ void agg_max_i64(const AggTable &t, u32 a, u64 slot, i64 v) {
    atomicMax((unsigned long long *)agg_at(t, a, slot), (unsigned long long)agg_ord_i64(v));
}

// A MIN/MAX f64 input as DataFusion's grouped accumulator sees it (see the top): zeros as
// +0.0, and the infinity its start value beats as that start value. False for a NaN (flagged).
__device__ __forceinline__ bool agg_extreme_f64(const AggTable &t, double &v, bool is_min) {
    if (isnan(v)) {
        agg_flag(t, AGG_STATUS_NAN);
        return false;
    }
    if (v == 0.0) v = 0.0;
    if (is_min && isinf(v) && v > 0.0) v = 1.7976931348623157e308;
    if (!is_min && isinf(v) && v < 0.0) v = -1.7976931348623157e308;
    return true;
}

__device__ __forceinline__ void agg_min_f64(const AggTable &t, u32 a, u64 slot, double v) {
    if (agg_extreme_f64(t, v, true))
        atomicMin((unsigned long long *)agg_at(t, a, slot), (unsigned long long)agg_ord_f64(v));
}

__device__ __forceinline__ void agg_max_f64(const AggTable &t, u32 a, u64 slot, double v) {
    if (agg_extreme_f64(t, v, false))
        atomicMax((unsigned long long *)agg_at(t, a, slot), (unsigned long long)agg_ord_f64(v));
}

// Accumulator a of `slot` by its kind, for a value given as its 8 bytes (i64 or f64 bits);
// `valid`: the value is not NULL (COUNT(*) passes true).
__device__ __forceinline__ void agg_update(const AggTable &t, u32 a, u32 kind, u64 slot, u64 bits, bool valid) {
    if (kind == AGG_COUNT) {
        agg_count_warp(t, a, slot, valid);
        return;
    }
    if (!valid) return;
    switch (kind) {
    case AGG_SUM_I64: agg_sum_i64(t, a, slot, (i64)bits); break;
    case AGG_SUM_F64: agg_sum_f64(t, a, slot, __longlong_as_double((i64)bits)); break;
    case AGG_MIN_I64: agg_min_i64(t, a, slot, (i64)bits); break;
    case AGG_MAX_I64: agg_max_i64(t, a, slot, (i64)bits); break;
    case AGG_MIN_F64: agg_min_f64(t, a, slot, __longlong_as_double((i64)bits)); break;
    default: agg_max_f64(t, a, slot, __longlong_as_double((i64)bits)); break;
    }
}

// ---- the pass over plain device columns -----------------------------------------------------

#define AGG_THREADS 256
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

// Every row (aggregate.cu's agg_columns).
struct AggAllRows {
    __device__ __forceinline__ bool operator()(u64) const { return true; }
};

// values[c] without a run-time index, which would put the array in local memory.
__device__ __forceinline__ u64 agg_pick(const u64 (&values)[AGG_MAX_VALUES], u32 c) {
    u64 v = values[0];
#pragma unroll
    for (u32 j = 1; j < AGG_MAX_VALUES; ++j) v = c == j ? values[j] : v;
    return v;
}

// The pass: every row that `row(i, spec, key, nulls, values, valid)` takes updates its group's
// accumulators, as the spec's descriptors say. `row` says whether row i is aggregated and,
// where it is, sets its key words (0 for a NULL key), their null mask (bit j: key j is NULL),
// the value columns' 8 bytes and their validity (bit c: value c is not NULL). It reads the
// spec's columns (agg_columns) or computes the keys and values itself (a generated program of
// src/fusion/aggregate.rs, which may flag AGG_STATUS_HOST where only the host can tell).
template <int KW, typename Row>
__device__ void agg_rows(const AggSpec *spec_in, u64 rows, const AggTable &t, Row row) {
    __shared__ AggSpec spec;
    __shared__ u64 claims;
    if (threadIdx.x == 0) {
        spec = *spec_in;
        claims = 0;
    }
    __syncthreads();
    const u32 n_accs = (u32)spec.n_accs;
    u32 taken = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += (u64)gridDim.x * blockDim.x) {
        if (taken++ % AGG_STATUS_EVERY == 0 && agg_stopped(t)) break;
        u64 key[KW];
        u32 nulls = 0;
        u64 values[AGG_MAX_VALUES] = {};
        u32 valid = 0;
        if (!row(i, spec, key, nulls, values, valid)) continue;
        const u64 slot = agg_insert<KW>(t, key, nulls, &claims);
        if (slot == AGG_NO_SLOT) break;
        for (u32 a = 0; a < n_accs; ++a) {
            const u64 desc = spec.accs[a];
            u32 kind = (u32)(desc & 0xff);
            const u32 column = (u32)(desc >> 8) & 0xff;
            const bool ok = column == AGG_NO_COLUMN || ((valid >> column) & 1u);
            u64 bits = column != AGG_NO_COLUMN && ok ? agg_pick(values, column) : 0;
            if (kind == AGG_SUM_I64_AS_F64) {
                bits = (u64)__double_as_longlong(__ll2double_rn((i64)bits));
                kind = AGG_SUM_F64;
            }
            agg_update(t, a, kind, slot, bits, ok);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && claims % AGG_CLAIM_BATCH != 0) agg_add_claims(t, claims % AGG_CLAIM_BATCH);
}

// The pass over the spec's columns (a value column's address is 0 where none is read): each
// row that `pass(row)` keeps (a generated program's filter, src/fusion/aggregate.rs, which
// flags AGG_STATUS_HOST where only the host can tell) updates its group's accumulators.
template <int KW, typename Pass>
__device__ void agg_columns(const AggSpec *spec_in, u64 rows, const AggTable &t, Pass pass) {
    agg_rows<KW>(spec_in, rows, t,
                 [&](u64 row, const AggSpec &spec, u64(&key)[KW], u32 &nulls, u64(&values)[AGG_MAX_VALUES],
                     u32 &valid) {
                     if (!pass(row)) return false;
#pragma unroll
                     for (int j = 0; j < KW; ++j) {
                         const bool ok = agg_valid(spec.key_valid[j], spec.key_valid_offset[j], row);
                         key[j] = ok ? ((const u64 *)spec.key_values[j])[row] : 0;
                         nulls |= ok ? 0u : 1u << j;
                     }
#pragma unroll
                     for (int c = 0; c < AGG_MAX_VALUES; ++c) {
                         const bool ok = spec.values[c] != 0 && agg_valid(spec.valid[c], spec.valid_offset[c], row);
                         values[c] = ok ? ((const u64 *)spec.values[c])[row] : 0;
                         valid |= ok ? 1u << c : 0u;
                     }
                     return true;
                 });
}
