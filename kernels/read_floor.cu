// read_floor.cu: the read floor of a selection, for benchmarks (benches/kernels.rs).
//
// The least any top-k over n keys can cost is reading the n keys once. These kernels do only
// that: a grid-stride maximum over the key words with 16-byte vector loads (four independent
// loads in flight per thread per round), one warp-shuffle and shared-memory reduction per
// block, and one atomicMax per block into `*out` (which the host zeroes first). The result is
// the largest word, which the host checks, so the loads cannot be optimised away and the
// kernel is known to have read every word.
//
// Entry points, by word width: read_floor_w32 (32-bit keys), read_floor_w64 (64-bit keys and
// any wider key read as 64-bit words). `words` should be 16-byte aligned (pool buffers are);
// otherwise every word is read with scalar loads.

#include "common.cuh"

#define READ_FLOOR_THREADS 256
#define READ_FLOOR_UNROLL 4

__device__ __forceinline__ u32 wmax(u32 a, u32 b) { return a > b ? a : b; }
__device__ __forceinline__ u64 wmax(u64 a, u64 b) { return a > b ? a : b; }
__device__ __forceinline__ u32 vmax(const uint4 &v) { return wmax(wmax(v.x, v.y), wmax(v.z, v.w)); }
__device__ __forceinline__ u64 vmax(const ulonglong2 &v) { return wmax((u64)v.x, (u64)v.y); }

template <class W, class V>
__device__ __forceinline__ void read_floor(const W *__restrict__ words, u64 n, W *out) {
    const u64 per = sizeof(V) / sizeof(W);
    const u64 nvec = (((u64)words & 15) == 0) ? n / per : 0;
    const V *__restrict__ vec = reinterpret_cast<const V *>(words);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    W m = 0;
    u64 i = tid;
    for (; i + (READ_FLOOR_UNROLL - 1) * stride < nvec; i += READ_FLOOR_UNROLL * stride) {
        V v[READ_FLOOR_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_FLOOR_UNROLL; ++u) v[u] = __ldg(vec + i + u * stride);
#pragma unroll
        for (int u = 0; u < READ_FLOOR_UNROLL; ++u) m = wmax(m, vmax(v[u]));
    }
    for (; i < nvec; i += stride) m = wmax(m, vmax(__ldg(vec + i)));
    // The words after the last whole vector (all of them when unaligned).
    for (u64 j = nvec * per + tid; j < n; j += stride) m = wmax(m, __ldg(words + j));

#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = wmax(m, (W)__shfl_down_sync(0xffffffffu, m, offset));
    __shared__ W s_max[READ_FLOOR_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) s_max[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x / 32) ? s_max[lane] : 0;
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) m = wmax(m, (W)__shfl_down_sync(0xffffffffu, m, offset));
        if (lane == 0) atomicMax(out, m);
    }
}

extern "C" __global__ void __launch_bounds__(READ_FLOOR_THREADS) read_floor_w32(const u32 *words, u64 n, u32 *out) { grid_dependency_wait();
    read_floor<u32, uint4>(words, n, out);
}

extern "C" __global__ void __launch_bounds__(READ_FLOOR_THREADS) read_floor_w64(const u64 *words, u64 n, u64 *out) { grid_dependency_wait();
    read_floor<u64, ulonglong2>(words, n, out);
}
