// parquet.cu: Parquet data pages decoded on the device into a column cache image.
//
//   parquet_decode  one warp per data page: its definition levels and values (PLAIN, or
//                   dictionary indices into a PLAIN dictionary page) become the image's values
//                   at the page's rows (NULLs as zeros) and bits of its validity bitmap.
//
// A page is described by eight u64s (src/device/engine/parquet.rs builds them):
//   0 bytes (device address of the page's levels and values, decompressed)
//   1 length of those bytes
//   2 first row of the page in the image
//   3 rows (the page's level count: a flat column has one level a row)
//   4 definition levels: offset | length << 32 (length 0: every row is valid)
//   5 values: offset | length << 32
//   6 dictionary (device address of its PLAIN values; 0: the values are PLAIN)
//   7 dictionary entries
//
// Levels and dictionary indices are RLE / bit-packed hybrid runs. A warp walks a stream's runs
// in order, every lane reading each run's header, and expands a run 32 values at a time. A
// page's dictionary indices are expanded first into `scratch` (one u32 at each of the page's
// rows), then its levels are walked: a valid row takes the next value, counted with a ballot.
//
// Malformed input (a stream ending early, an index past the dictionary, a NULL where the image
// has no validity) sets a bit of `*error` and the host decodes the files instead.

#include "common.cuh"

#define PQ_WARPS 8

#define PQ_TRUNCATED 1u
#define PQ_BAD_INDEX 2u
#define PQ_UNEXPECTED_NULL 4u
#define PQ_BAD_WIDTH 8u

// One run of a hybrid stream: `count` values, each `value` (RLE) or packed at bit `bit` of
// the stream onwards.
struct Run {
    u32 count;
    bool packed;
    u32 value;
    u64 bit;
};

// Reads the run at `*at` of the stream [p, end) of `bits`-bit values; false past its end.
__device__ __forceinline__ bool next_run(const u8 *p, u32 *at, u32 end, u32 bits, Run *run) {
    u32 header = 0, shift = 0;
    while (true) {
        if (*at >= end || shift > 28) return false;
        const u8 b = p[(*at)++];
        header |= (u32)(b & 0x7f) << shift;
        shift += 7;
        if (!(b & 0x80)) break;
    }
    if (header & 1) {
        const u32 groups = header >> 1;
        run->count = groups * 8;
        run->packed = true;
        run->bit = (u64)*at * 8;
        const u64 bytes = (u64)groups * bits;
        if (*at + bytes > end) {
            // The last run may be cut short: only its values up to the end are read.
            run->count = bits == 0 ? run->count : (u32)(((u64)(end - *at) * 8) / bits);
            *at = end;
        } else {
            *at += (u32)bytes;
        }
    } else {
        run->count = header >> 1;
        run->packed = false;
        u32 value = 0;
        const u32 bytes = (bits + 7) / 8;
        if (*at + bytes > end) return false;
        for (u32 i = 0; i < bytes; ++i) value |= (u32)p[*at + i] << (8 * i);
        *at += bytes;
        run->value = value;
    }
    return true;
}

// Value i of a run (i < run.count).
__device__ __forceinline__ u32 run_value(const u8 *p, const Run &run, u32 i, u32 bits) {
    if (bits == 0) return 0;
    if (!run.packed) return run.value;
    const u64 bit = run.bit + (u64)i * bits;
    const u64 byte = bit >> 3;
    const u32 shift = (u32)(bit & 7);
    // At most 40 bits span a 32-bit value at any shift; the stream's bytes were checked.
    u64 word = 0;
    const u32 span = (shift + bits + 7) / 8;
    for (u32 j = 0; j < span; ++j) word |= (u64)p[byte + j] << (8 * j);
    return (u32)((word >> shift) & ((bits == 32) ? 0xffffffffull : ((1ull << bits) - 1)));
}

__device__ __forceinline__ void store_value(u8 *dst, u64 row, u32 width, u64 v) {
    switch (width) {
    case 1: dst[row] = (u8)v; break;
    case 2: ((u16 *)dst)[row] = (u16)v; break;
    case 4: ((u32 *)dst)[row] = (u32)v; break;
    default: ((u64 *)dst)[row] = v;
    }
}

__device__ __forceinline__ u64 load_value(const u8 *src, u64 i, u32 width) {
    // Page bytes are not aligned to the value width: read them a byte at a time.
    u64 v = 0;
    for (u32 j = 0; j < width; ++j) v |= (u64)src[i * width + j] << (8 * j);
    return v;
}

extern "C" __global__ void __launch_bounds__(32 * PQ_WARPS)
    parquet_decode(const u64 *pages, u32 count, u32 src_width, u32 width, u8 *dst,
                   u32 *dst_valid, u32 *scratch, u64 scratch_first, u32 *error) {
    grid_dependency_wait();
    const u32 lane = lane_id();
    const u32 page = blockIdx.x * PQ_WARPS + threadIdx.x / 32;
    if (page >= count) return;
    const u64 *d = pages + 8 * (u64)page;
    const u8 *bytes = (const u8 *)d[0];
    const u32 length = (u32)d[1];
    const u64 first = d[2];
    const u32 rows = (u32)d[3];
    const u32 def_at = (u32)d[4], def_len = (u32)(d[4] >> 32);
    const u32 val_at = (u32)d[5], val_len = (u32)(d[5] >> 32);
    const u8 *dict = (const u8 *)d[6];
    const u64 entries = d[7];
    if (def_at + (u64)def_len > length || val_at + (u64)val_len > length) {
        if (lane == 0) atomicOr(error, PQ_TRUNCATED);
        return;
    }
    const u8 *levels = bytes + def_at;
    const u8 *values = bytes + val_at;

    // Valid rows: all, or the level runs' ones (max definition level 1: one bit a level).
    u32 valid = rows;
    if (def_len > 0) {
        valid = 0;
        u32 at = 0, seen = 0;
        Run run;
        while (seen < rows) {
            if (!next_run(levels, &at, def_len, 1, &run) || (run.count == 0 && at >= def_len)) {
                if (lane == 0) atomicOr(error, PQ_TRUNCATED);
                return;
            }
            const u32 n = min(run.count, rows - seen);
            for (u32 i = lane; i < n; i += 32) valid += run_value(levels, run, i, 1);
            seen += n;
        }
        for (int o = 16; o > 0; o >>= 1) valid += __shfl_xor_sync(0xffffffffu, valid, o);
    }

    // Dictionary indices, expanded at the page's rows of the scratch.
    if (dict) {
        if (val_len == 0) {
            if (lane == 0 && valid > 0) atomicOr(error, PQ_TRUNCATED);
            if (valid > 0) return;
        } else {
            const u32 bits = values[0];
            if (bits > 32) {
                if (lane == 0) atomicOr(error, PQ_BAD_WIDTH);
                return;
            }
            u32 at = 1, seen = 0;
            Run run;
            while (seen < valid) {
                if (!next_run(values, &at, val_len, bits, &run) ||
                    (run.count == 0 && at >= val_len)) {
                    if (lane == 0) atomicOr(error, PQ_TRUNCATED);
                    return;
                }
                const u32 n = min(run.count, valid - seen);
                for (u32 i = lane; i < n; i += 32) {
                    const u32 index = run_value(values, run, i, bits);
                    if (index >= entries) atomicOr(error, PQ_BAD_INDEX);
                    scratch[first - scratch_first + seen + i] = index;
                }
                seen += n;
            }
        }
        __syncwarp();
    } else if ((u64)valid * src_width > val_len) {
        if (lane == 0) atomicOr(error, PQ_TRUNCATED);
        return;
    }

    // The rows, 32 at a time: each valid one takes the next value.
    const u8 *source = dict ? dict : values;
    u32 at = 0, seen = 0, taken = 0;
    Run run;
    run.count = rows;
    run.packed = false;
    run.value = 1;
    while (seen < rows) {
        if (def_len > 0 && !next_run(levels, &at, def_len, 1, &run)) {
            if (lane == 0) atomicOr(error, PQ_TRUNCATED);
            return;
        }
        const u32 n = min(run.count, rows - seen);
        for (u32 base = 0; base < n; base += 32) {
            const u32 i = base + lane;
            const bool here = i < n;
            const bool is_valid = here && run_value(levels, run, i, 1) != 0;
            const u32 mask = __ballot_sync(0xffffffffu, is_valid);
            const u32 before = __popc(mask & ((1u << lane) - 1u));
            const u64 row = first + seen + i;
            if (here) {
                u64 v = 0;
                if (is_valid) {
                    const u64 j = dict ? (u64)scratch[first - scratch_first + taken + before] : taken + before;
                    if (!dict || j < entries) v = load_value(source, j, src_width);
                }
                store_value(dst, row, width, v);
            }
            const u32 in_run = min(32u, n - base);
            const u32 all = in_run == 32 ? 0xffffffffu : ((1u << in_run) - 1u);
            if (dst_valid) {
                if (lane == 0 && mask) {
                    const u64 g = first + seen + base;
                    const u32 shift = (u32)(g & 31);
                    atomicOr(&dst_valid[g >> 5], mask << shift);
                    if (shift && (mask >> (32 - shift))) atomicOr(&dst_valid[(g >> 5) + 1], mask >> (32 - shift));
                }
            } else if (lane == 0 && mask != all) {
                atomicOr(error, PQ_UNEXPECTED_NULL);
            }
            taken += __popc(mask);
        }
        seen += n;
    }
    if (lane == 0 && taken != valid) atomicOr(error, PQ_TRUNCATED);
}
