// fused.cuh: what the generated kernels of src/fusion are made of.
//
// A generated kernel evaluates the query's predicate and ranking expressions per row, straight
// from the Arrow buffers of the input columns, encodes the keys (bit for bit encode.cu's
// encoding) and appends the rows that pass the predicate and beat the threshold to the
// candidate buffer (candidates.cu's `append`). The helpers below give every operation
// DataFusion's exact semantics:
//   - integer + - * and negation wrap (DataFusion's default, `add_wrapping` & co.);
//   - float arithmetic is IEEE 754 with round-to-nearest and no contraction into FMAs (the
//     explicit `_rn` intrinsics), and NaN results carry the *host's* bits: an operand NaN
//     propagates quieted (first operand first, as x86 and ARM do), an invalid operation gives
//     the host's default NaN (HOST_NAN_F32 / HOST_NAN_F64, defined by the generated source:
//     `0.0 / 0.0` on the host). NaN bits matter: DataFusion orders NaNs by their bits. One
//     case is not reproducible (two different NaNs added or multiplied, see below): the kernel
//     flags it and the query reruns on the host;
//   - float comparisons are IEEE totalOrder (arrow's `total_cmp`) after DataFusion's
//     normalisation of −0.0 to +0.0: −0.0 = 0.0, NaN = NaN, −NaN < −inf;
//   - f32 → f64 keeps a NaN's sign and payload, as the host's conversion does.
#pragma once

#include "common.cuh"

// ---- the sample's rows -----------------------------------------------------------------------

// A sample of one row in `step` takes clusters of SAMPLE_CLUSTER consecutive rows, one cluster
// every SAMPLE_CLUSTER · step rows: a warp's lanes then read a few whole sectors of each column
// where rows `step` apart cost a sector (and a DRAM page) each. Row sample_row(j) ≤ j · step,
// so every position j < ⌈rows / step⌉ is a row. The generated source defines SAMPLE_CLUSTER
// (src/device/plan.rs `FUSED_SAMPLE_CLUSTER`).
#ifndef SAMPLE_CLUSTER
#define SAMPLE_CLUSTER 32
#endif
__device__ __forceinline__ u64 sample_row(u64 j, u64 step) {
    return (j / SAMPLE_CLUSTER) * (SAMPLE_CLUSTER * step) + j % SAMPLE_CLUSTER;
}

// v - v.rem_euclid(step) (DataFusion's date_trunc by arithmetic), wrapping as its release build.
__device__ __forceinline__ i64 trunc_step_i64(i64 v, i64 step) {
    i64 r = v % step;
    if (r < 0) r += step;
    return (i64)((u64)v - (u64)r);
}

// ---- float arithmetic ------------------------------------------------------------------------

__device__ __forceinline__ float quiet_f32(float a) { return __uint_as_float(__float_as_uint(a) | 0x00400000u); }
__device__ __forceinline__ double quiet_f64(double a) {
    return __longlong_as_double(__double_as_longlong(a) | 0x0008000000000000ll);
}
__device__ __forceinline__ float host_nan_f32() { return __uint_as_float(HOST_NAN_F32); }
__device__ __forceinline__ double host_nan_f64() { return __longlong_as_double((i64)HOST_NAN_F64); }

// Subtraction and division: a NaN operand propagates, the first one first (the host does the
// same in scalar and vector code).
#define FLOAT_BINARY(NAME, T, QUIET, HOST_NAN, EXPR)                                               \
    __device__ __forceinline__ T NAME(T a, T b) {                                                  \
        if (isnan(a)) return QUIET(a);                                                             \
        if (isnan(b)) return QUIET(b);                                                             \
        const T r = EXPR;                                                                          \
        return isnan(r) ? HOST_NAN() : r;                                                          \
    }
// Addition and multiplication are commutative, and the host's compiler swaps their operands in
// vectorised loops: with two NaN operands of different bits, which one the host returns depends
// on the row's position in its batch. That case sets `ambiguous` (the query then reruns on the
// host); every other case is exact.
#define FLOAT_COMMUTATIVE(NAME, T, QUIET, BITS, HOST_NAN, EXPR)                                    \
    __device__ __forceinline__ T NAME(T a, T b, bool &ambiguous) {                                 \
        if (isnan(a)) {                                                                            \
            if (isnan(b) && BITS(QUIET(a)) != BITS(QUIET(b))) ambiguous = true;                    \
            return QUIET(a);                                                                       \
        }                                                                                          \
        if (isnan(b)) return QUIET(b);                                                             \
        const T r = EXPR;                                                                          \
        return isnan(r) ? HOST_NAN() : r;                                                          \
    }
FLOAT_COMMUTATIVE(add_f32, float, quiet_f32, __float_as_uint, host_nan_f32, __fadd_rn(a, b))
FLOAT_BINARY(sub_f32, float, quiet_f32, host_nan_f32, __fsub_rn(a, b))
FLOAT_COMMUTATIVE(mul_f32, float, quiet_f32, __float_as_uint, host_nan_f32, __fmul_rn(a, b))
FLOAT_BINARY(div_f32, float, quiet_f32, host_nan_f32, __fdiv_rn(a, b))
FLOAT_COMMUTATIVE(add_f64, double, quiet_f64, __double_as_longlong, host_nan_f64, __dadd_rn(a, b))
FLOAT_BINARY(sub_f64, double, quiet_f64, host_nan_f64, __dsub_rn(a, b))
FLOAT_COMMUTATIVE(mul_f64, double, quiet_f64, __double_as_longlong, host_nan_f64, __dmul_rn(a, b))
FLOAT_BINARY(div_f64, double, quiet_f64, host_nan_f64, __ddiv_rn(a, b))
// The remainder `%`: fmod, exact on the device (0 ulp) as in the host's libm, which returns
// (x·y)/(x·y) for a NaN operand (the first NaN, quieted) and the default NaN for x = ±inf or
// y = 0: the same as the pattern above.
FLOAT_BINARY(rem_f32, float, quiet_f32, host_nan_f32, fmodf(a, b))
FLOAT_BINARY(rem_f64, double, quiet_f64, host_nan_f64, fmod(a, b))
#undef FLOAT_BINARY
#undef FLOAT_COMMUTATIVE

// Negation flips the sign bit, NaNs included (as the host's `-x`).
__device__ __forceinline__ float neg_f32(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }
__device__ __forceinline__ double neg_f64(double a) {
    return __longlong_as_double(__double_as_longlong(a) ^ (i64)0x8000000000000000ull);
}

__device__ __forceinline__ double f32_to_f64(float a) {
    if (!isnan(a)) return (double)a;
    const u64 b = __float_as_uint(a);
    // Sign, all-ones exponent, quiet bit, and the 22 payload bits moved to the top.
    return __longlong_as_double((i64)(((b >> 31) << 63) | 0x7ff8000000000000ull | ((b & 0x003fffffull) << 29)));
}

// ---- ascending value bits (encode.cu's `ordered`, from typed values) ---------------------------

__device__ __forceinline__ u64 ord_bool(bool v) { return v ? 1ull : 0ull; }
__device__ __forceinline__ u64 ord_u8(u8 v) { return v; }
__device__ __forceinline__ u64 ord_u16(u16 v) { return v; }
__device__ __forceinline__ u64 ord_u32(u32 v) { return v; }
__device__ __forceinline__ u64 ord_u64(u64 v) { return v; }
__device__ __forceinline__ u64 ord_i8(i8 v) { return (u8)((u8)v ^ 0x80u); }
__device__ __forceinline__ u64 ord_i16(i16 v) { return (u16)((u16)v ^ 0x8000u); }
__device__ __forceinline__ u64 ord_i32(i32 v) { return (u32)v ^ 0x80000000u; }
__device__ __forceinline__ u64 ord_i64(i64 v) { return (u64)v ^ 0x8000000000000000ull; }
__device__ __forceinline__ u64 ord_f32(float v) {
    const u32 b = __float_as_uint(v);
    return b ^ ((b & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}
__device__ __forceinline__ u64 ord_f64(double v) {
    const u64 b = (u64)__double_as_longlong(v);
    return b ^ ((b >> 63) ? ~0ull : 0x8000000000000000ull);
}

// Comparison order of floats (DataFusion's `apply_cmp`): totalOrder after −0.0 is normalised
// to +0.0, so −0.0 = 0.0 while NaN = NaN and −NaN < −inf.
__device__ __forceinline__ u64 cmp_f32(float v) { return ord_f32(__float_as_uint(v) << 1 == 0 ? 0.0f : v); }
__device__ __forceinline__ u64 cmp_f64(double v) {
    return ord_f64(((u64)__double_as_longlong(v) << 1) == 0 ? 0.0 : v);
}

// ---- key fields ------------------------------------------------------------------------------

// ORs one field into a key held in registers: `value` (≤ 64 bits) at `shift`, and, when `bit`,
// the single bit at `bit_pos` (the null bit).
template <class K> __device__ __forceinline__ void or_field(K &k, u64 value, int shift, bool bit, int bit_pos) {
    const U128 v = {value, 0};
    const U128 one = {1, 0};
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        k.w[j] |= (typename K::Word)(shifted_word(v, shift, j) | (bit ? shifted_word(one, bit_pos, j) : 0ull));
    }
}

// ---- row loads -------------------------------------------------------------------------------

// The N values at p as words of type W (uint4, uint2 or u32), one load per word.
template <class W, class T, int N> __device__ __forceinline__ void load_words(const T *p, T (&out)[N]) {
    constexpr int PER = (int)(sizeof(W) / sizeof(T));
#pragma unroll
    for (int v = 0; v < N / PER; ++v) {
        union {
            W w;
            T t[PER];
        } u;
        u.w = reinterpret_cast<const W *>(p)[v];
#pragma unroll
        for (int e = 0; e < PER; ++e) out[v * PER + e] = u.t[e];
    }
}

// N consecutive values of a column from p, in as few loads as the vector widths allow (one
// 16-byte load for four 32-bit values, where four scalar loads took four load instructions and
// four address computations: the pass over narrow columns was bound by instruction issue).
// p is aligned to min(16, N · sizeof(T)) bytes; the generated entry kernel checks that.
template <class T, int N> __device__ __forceinline__ void load_rows(const T *p, T (&out)[N]) {
    constexpr int BYTES = N * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        load_words<uint4>(p, out);
    } else if constexpr (BYTES == 8) {
        load_words<uint2>(p, out);
    } else if constexpr (BYTES == 4) {
        load_words<u32>(p, out);
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) out[e] = p[e];
    }
}

// ---- strings ---------------------------------------------------------------------------------

// A string column's device image (src/select/table.rs): each row's end offset (i64, the
// table's rows back to back, the first row starting at 0) and the bytes. `Str` is one row's
// value: its bytes and their count. Comparisons are byte-wise, as arrow's for UTF-8.
struct Str {
    const u8 *p;
    u64 n;
};

__device__ __forceinline__ Str load_str(const u8 *ends, u64 bytes, u64 i) {
    const i64 *e = (const i64 *)ends;
    const i64 start = i == 0 ? 0 : e[i - 1];
    return Str{(const u8 *)bytes + start, (u64)(e[i] - start)};
}

// −1, 0 or 1 as `s` sorts before, with or after the literal `lit` of `n` bytes.
__device__ __forceinline__ int str_cmp(Str s, const u8 *lit, u64 n) {
    const u64 m = s.n < n ? s.n : n;
    for (u64 k = 0; k < m; ++k) {
        if (s.p[k] != lit[k]) return s.p[k] < lit[k] ? -1 : 1;
    }
    return s.n < n ? -1 : (s.n > n ? 1 : 0);
}

__device__ __forceinline__ bool str_eq(Str s, const u8 *lit, u64 n) {
    if (s.n != n) return false;
    for (u64 k = 0; k < n; ++k) {
        if (s.p[k] != lit[k]) return false;
    }
    return true;
}

__device__ __forceinline__ bool str_starts(Str s, const u8 *lit, u64 n) {
    return s.n >= n && str_eq(Str{s.p, n}, lit, n);
}

__device__ __forceinline__ bool str_ends(Str s, const u8 *lit, u64 n) {
    return s.n >= n && str_eq(Str{s.p + (s.n - n), n}, lit, n);
}

// Whether `lit` occurs in `s` (the empty literal everywhere).
__device__ __forceinline__ bool str_contains(Str s, const u8 *lit, u64 n) {
    if (n == 0) return true;
    if (s.n < n) return false;
    const u8 first = lit[0];
    for (u64 at = 0; at + n <= s.n; ++at) {
        if (s.p[at] != first) continue;
        u64 k = 1;
        while (k < n && s.p[at + k] == lit[k]) ++k;
        if (k == n) return true;
    }
    return false;
}

// Bytes of the UTF-8 character that starts with byte `b` (1 for a stray continuation byte,
// which valid UTF-8 never starts a character with).
__device__ __forceinline__ u64 utf8_width(u8 b) { return b < 0xC0 ? 1 : (b < 0xE0 ? 2 : (b < 0xF0 ? 3 : 4)); }

// Characters of `s`: the bytes that are no continuation byte (character_length of UTF-8).
__device__ __forceinline__ i64 str_chars(Str s) {
    i64 count = 0;
    for (u64 k = 0; k < s.n; ++k) count += (s.p[k] & 0xC0) != 0x80;
    return count;
}

// SQL LIKE over a pattern the host compiled (src/fusion/translate/strings.rs): literal bytes,
// LIKE_ANY for `%` (any characters), LIKE_ONE for `_` (one character); 0xFF and 0xFE are no
// bytes of UTF-8. The classic wildcard match: on a mismatch, the last `%` takes one more
// character and matching resumes after it (a `%` earlier never needs to take more).
#define LIKE_ANY 0xFF
#define LIKE_ONE 0xFE
__device__ __forceinline__ bool str_like(Str s, const u8 *pat, u64 m) {
    u64 i = 0, j = 0, star_j = ~0ull, star_i = 0;
    while (i < s.n) {
        if (j < m && pat[j] == LIKE_ANY) {
            star_j = j++;
            star_i = i;
        } else if (j < m && pat[j] == LIKE_ONE) {
            i += utf8_width(s.p[i]);
            ++j;
        } else if (j < m && pat[j] == s.p[i]) {
            ++i;
            ++j;
        } else if (star_j != ~0ull) {
            star_i += utf8_width(s.p[star_i]);
            i = star_i;
            j = star_j + 1;
        } else {
            return false;
        }
    }
    while (j < m && pat[j] == LIKE_ANY) ++j;
    return i == s.n && j == m;
}
