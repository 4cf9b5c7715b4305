// encode.cu: Arrow key columns → order-preserving composite keys, on the device.
//
// Bit for bit the encoding of src/keys/mod.rs (the module documentation there is the
// specification): each key column becomes a *field* of `value_bits` value bits, plus one null
// bit above them when the key is nullable, placed `shift` bits up in the composite. The kernel
// runs once per column; the first column writes the composite, later ones OR their field into
// it (fields are disjoint).
//
// Value bits, ascending (`native` codes match `Native` in src/device/plan.rs):
//   bool (bit-packed, with a bit offset)  false = 0, true = 1
//   unsigned                              as is
//   signed (incl. decimal128 as lo, hi)   sign bit flipped
//   float (f16, f32, f64 as raw bits)     sign set: all bits flipped, else sign bit flipped
// then XOR `xor` (all value bits for DESC). Valid rows get the `valid` bit (the null bit under
// NULLS FIRST); NULL rows get only the `null` bit (under NULLS LAST) and zero value bits,
// whatever the values buffer holds under the slot. Validity is Arrow's bit-packed bitmap
// (1 = valid) with a bit offset; a null pointer means all rows are valid.

#include "common.cuh"

enum Native {
    NATIVE_BOOL = 0,
    NATIVE_U8 = 1,
    NATIVE_U16 = 2,
    NATIVE_U32 = 3,
    NATIVE_U64 = 4,
    NATIVE_I8 = 5,
    NATIVE_I16 = 6,
    NATIVE_I32 = 7,
    NATIVE_I64 = 8,
    NATIVE_I128 = 9,
    NATIVE_F16 = 10,
    NATIVE_F32 = 11,
    NATIVE_F64 = 12,
};

// Flags.
#define ENC_FIRST 1u       // first column: write instead of OR
#define ENC_NULLABLE 2u    // the field has a null bit
#define ENC_NULLS_FIRST 4u // NULLS FIRST (else NULLS LAST)

// Ascending value bits of row i.
template <int NATIVE> __device__ __forceinline__ U128 ordered(const u8 *values, u64 bit_offset, u64 i) {
    U128 v = {0, 0};
    if (NATIVE == NATIVE_BOOL) {
        v.lo = get_bit(values, bit_offset + i);
    } else if (NATIVE == NATIVE_U8) {
        v.lo = values[i];
    } else if (NATIVE == NATIVE_U16) {
        v.lo = ((const u16 *)values)[i];
    } else if (NATIVE == NATIVE_U32) {
        v.lo = ((const u32 *)values)[i];
    } else if (NATIVE == NATIVE_U64) {
        v.lo = ((const u64 *)values)[i];
    } else if (NATIVE == NATIVE_I8) {
        v.lo = (u8)(values[i] ^ 0x80u);
    } else if (NATIVE == NATIVE_I16) {
        v.lo = (u16)(((const u16 *)values)[i] ^ 0x8000u);
    } else if (NATIVE == NATIVE_I32) {
        v.lo = ((const u32 *)values)[i] ^ 0x80000000u;
    } else if (NATIVE == NATIVE_I64) {
        v.lo = ((const u64 *)values)[i] ^ 0x8000000000000000ull;
    } else if (NATIVE == NATIVE_I128) {
        v.lo = ((const u64 *)values)[2 * i];
        v.hi = ((const u64 *)values)[2 * i + 1] ^ 0x8000000000000000ull;
    } else if (NATIVE == NATIVE_F16) {
        const u32 b = ((const u16 *)values)[i];
        v.lo = (u16)(b ^ ((b & 0x8000u) ? 0xffffu : 0x8000u));
    } else if (NATIVE == NATIVE_F32) {
        const u32 b = ((const u32 *)values)[i];
        v.lo = b ^ ((b & 0x80000000u) ? 0xffffffffu : 0x80000000u);
    } else if (NATIVE == NATIVE_F64) {
        const u64 b = ((const u64 *)values)[i];
        v.lo = b ^ ((b >> 63) ? ~0ull : 0x8000000000000000ull);
    }
    return v;
}

// The field of one row placed into a key: `value` at `shift`, and, when `bit` is set, the
// single bit at `bit_pos` (the null bit, just above the value bits: bit 128 of the field for a
// 128-bit value, hence not part of `value`). OR, or overwrite for the first column.
template <class K>
__device__ __forceinline__ void store_field(K *out, u64 i, U128 value, int shift, bool bit, int bit_pos, bool first) {
    const U128 one = {1, 0};
    K k = first ? key_zero<K>() : out[i];
#pragma unroll
    for (int j = 0; j < K::N; ++j) {
        const u64 w = shifted_word(value, shift, j) | (bit ? shifted_word(one, bit_pos, j) : 0ull);
        k.w[j] |= (typename K::Word)w;
    }
    out[i] = k;
}

template <class K, int NATIVE>
__device__ void encode_rows(const u8 *values, u64 value_bit_offset, const u8 *validity, u64 validity_bit_offset,
                            u64 n, u32 value_bits, u32 shift, U128 xor_mask, u32 flags, K *out) {
    const bool first = flags & ENC_FIRST;
    const bool nullable = flags & ENC_NULLABLE;
    const bool nulls_first = flags & ENC_NULLS_FIRST;
    // The null bit sits just above the value bits: set on valid rows under NULLS FIRST, on
    // NULL rows under NULLS LAST.
    const int null_pos = (int)(shift + value_bits);
    const bool valid_bit = nullable && nulls_first;
    const bool null_bit = nullable && !nulls_first;
    const U128 zero = {0, 0};
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (validity != nullptr && !get_bit(validity, validity_bit_offset + i)) {
            store_field(out, i, zero, (int)shift, null_bit, null_pos, first);
        } else {
            U128 v = ordered<NATIVE>(values, value_bit_offset, i);
            v.lo ^= xor_mask.lo;
            v.hi ^= xor_mask.hi;
            store_field(out, i, v, (int)shift, valid_bit, null_pos, first);
        }
    }
}

// One column. `values` points at the column's first row (for bool: at the byte holding bit
// `value_bit_offset`); `validity` likewise, or null.
template <class K>
__device__ void encode_column(const u8 *values, u64 value_bit_offset, const u8 *validity, u64 validity_bit_offset,
                              u64 n, u32 native, u32 value_bits, u32 shift, u64 xor_lo, u64 xor_hi, u32 flags,
                              K *out) {
    const U128 x = {xor_lo, xor_hi};
#define ENCODE_CASE(C)                                                                                            \
    case C:                                                                                                       \
        encode_rows<K, C>(values, value_bit_offset, validity, validity_bit_offset, n, value_bits, shift, x, flags,  \
                          out);                                                                                   \
        break;
    switch (native) {
        ENCODE_CASE(NATIVE_BOOL)
        ENCODE_CASE(NATIVE_U8)
        ENCODE_CASE(NATIVE_U16)
        ENCODE_CASE(NATIVE_U32)
        ENCODE_CASE(NATIVE_U64)
        ENCODE_CASE(NATIVE_I8)
        ENCODE_CASE(NATIVE_I16)
        ENCODE_CASE(NATIVE_I32)
        ENCODE_CASE(NATIVE_I64)
        ENCODE_CASE(NATIVE_I128)
        ENCODE_CASE(NATIVE_F16)
        ENCODE_CASE(NATIVE_F32)
        ENCODE_CASE(NATIVE_F64)
    default:
        break;
    }
#undef ENCODE_CASE
}

#define ENCODE_ENTRY(K, S)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        encode_column_##S(const u8 *values, u64 value_bit_offset, const u8 *validity, u64 validity_bit_offset,    \
                          u64 n, u32 native, u32 value_bits, u32 shift, u64 xor_lo, u64 xor_hi, u32 flags,        \
                          K *out) { grid_dependency_wait();                                                       \
        encode_column<K>(values, value_bit_offset, validity, validity_bit_offset, n, native, value_bits, shift,   \
                         xor_lo, xor_hi, flags, out);                                                             \
    }
INSTANTIATE_KEYS(ENCODE_ENTRY)
