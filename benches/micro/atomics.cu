// Run on the GPU machine: nvcc -O3 -arch=sm_90 benches/micro/atomics.cu -o /tmp/a && /tmp/a
// (the counter layouts and flush orders behind the top-bits selection's scatter and histogram,
// radix_sort.cu `TOP_FILL_STRIDE`; event times include one kernel launch).
// Micro-benchmark: contention of global atomics on a few thousand counters (layout, order).
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
typedef unsigned int u32;
__device__ __forceinline__ u32 hash(u32 x) { x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x; }
// One returned atomic per thread that "keeps" (1 in 16), to one of `bins` counters spaced `stride` words.
__global__ void returned(u32 *ctr, u32 *out, u32 bins, u32 stride, u32 keep_mod) {
    u32 items[16]; u32 slot[16];
    for (int u = 0; u < 16; ++u) {
        u32 i = (blockIdx.x * 16 + u) * blockDim.x + threadIdx.x;
        items[u] = hash(i);
    }
    for (int u = 0; u < 16; ++u) slot[u] = (items[u] % keep_mod == 0) ? atomicAdd(&ctr[(items[u] / keep_mod % bins) * stride], 1u) : ~0u;
    for (int u = 0; u < 16; ++u) if (slot[u] != ~0u) out[(items[u] & 0xfffff)] = slot[u];
}
// Each block flushes `per` nonzero bins (random subset) by RED, in order `rot` (0 same order, 1 rotated per block).
__global__ void flush(u32 *ctr, u32 bins, u32 stride, u32 per, int rot) {
    for (u32 j = threadIdx.x; j < bins; j += blockDim.x) {
        u32 b = rot ? (j + blockIdx.x * 97u) % bins : j;
        if (hash(b * 7919u + blockIdx.x) % bins < per) atomicAdd(&ctr[b * stride], 1u);
    }
}
int main() {
    u32 *ctr, *out; cudaMalloc(&ctr, 4096u * 32 * 4 * 4); cudaMalloc(&out, 4 << 20);
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    float ms;
    for (u32 keep : {16u, 128u}) for (u32 bins : {1200u, 4800u}) for (u32 stride : {1u, 8u, 32u}) {
        for (int r = 0; r < 3; ++r) {
            cudaMemset(ctr, 0, 4096u * 32 * 4 * 4);
            cudaEventRecord(a); returned<<<256, 256>>>(ctr, out, bins, stride, keep); cudaEventRecord(b); cudaEventSynchronize(b);
            cudaEventElapsedTime(&ms, a, b);
        }
        printf("returned keep 1/%u (%u atomics) bins %u stride %u: %.1f us\n", keep, (1u << 20) / keep, bins, stride, ms * 1000);
    }
    for (u32 per : {700u, 2000u}) for (u32 stride : {1u, 8u, 32u}) for (int rot : {0, 1}) {
        for (int r = 0; r < 3; ++r) {
            cudaMemset(ctr, 0, 4096u * 32 * 4 * 4);
            cudaEventRecord(a); flush<<<264, 256>>>(ctr, 3584, stride, per, rot); cudaEventRecord(b); cudaEventSynchronize(b);
            cudaEventElapsedTime(&ms, a, b);
        }
        printf("flush 264 blocks x ~%u REDs over 3584 bins stride %u rot %d: %.1f us\n", per, stride, rot, ms * 1000);
    }
    cudaEventRecord(a); flush<<<264, 256>>>(ctr, 3584, 1, 0, 0); cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b); printf("empty flush launch: %.1f us\n", ms * 1000);
    return 0;
}
