// Run on the GPU machine: nvcc -O3 -arch=sm_90 benches/micro/launch_graph.cu -o /tmp/g && /tmp/g
// (session 27: a chain of 12 dependent kernels: plain launches, a graph captured and
// instantiated per call, a cached graph with its kernels' parameters set per call, a replay).
#include <cstdio>
#include <cuda_runtime.h>
#include <vector>
#include <algorithm>
#include <chrono>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void step(const unsigned *in, unsigned *out, unsigned n, unsigned spin) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned v = in[i];
        for (unsigned s = 0; s < spin; ++s) v = v * 1664525u + 1013904223u;
        out[i] = v + 1;
    }
}
using clk = std::chrono::steady_clock;
static double us(clk::time_point a) { return std::chrono::duration<double, std::micro>(clk::now() - a).count(); }

int main() {
    unsigned *a, *b;
    const unsigned N = 1u << 22;
    CK(cudaMalloc(&a, N * 4)); CK(cudaMalloc(&b, N * 4));
    CK(cudaMemset(a, 0, N * 4)); CK(cudaMemset(b, 0, N * 4));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const int CHAIN = 12;
    struct Case { unsigned n, grid, spin; };
    for (Case c : {Case{4096, 16, 0}, Case{1u << 20, 528, 0}, Case{1u << 20, 132, 100}}) {
        auto enqueue = [&](cudaStream_t s, unsigned off) {
            for (int i = 0; i < CHAIN; ++i) {
                const unsigned *in = ((i & 1) ? b : a) + off; unsigned *out = ((i & 1) ? a : b) + off;
                step<<<c.grid, 256, 0, s>>>(in, out, c.n, c.spin);
            }
            CK(cudaGetLastError());
        };
        cudaGraphExec_t cached = nullptr;
        std::vector<cudaGraphNode_t> nodes(CHAIN);
        for (int mode = 0; mode < 4; ++mode) {
            std::vector<float> dev; std::vector<double> host;
            for (int r = 0; r < 30; ++r) {
                unsigned off = (r & 1) * 1024; // different pointers each call
                CK(cudaStreamSynchronize(st));
                CK(cudaEventRecord(e0, st));
                auto h0 = clk::now();
                if (mode == 0) {
                    enqueue(st, off);
                } else if (mode == 1 || (mode >= 2 && !cached)) {
                    cudaGraph_t g; cudaGraphExec_t ex;
                    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    enqueue(st, off);
                    CK(cudaStreamEndCapture(st, &g));
                    CK(cudaGraphInstantiate(&ex, g, 0));
                    CK(cudaGraphLaunch(ex, st));
                    if (mode >= 2) {
                        cached = ex; size_t nn = CHAIN; CK(cudaGraphGetNodes(g, nodes.data(), &nn));
                    } else { CK(cudaGraphExecDestroy(ex)); CK(cudaGraphDestroy(g)); }
                } else if (mode == 2) {
                    // topological order of a chain: find order via params? nodes from capture are in order.
                    for (int i = 0; i < CHAIN; ++i) {
                        const unsigned *in = ((i & 1) ? b : a) + off; unsigned *out = ((i & 1) ? a : b) + off;
                        unsigned n = c.n, spin = c.spin;
                        void *args[] = {&in, &out, &n, &spin};
                        cudaKernelNodeParams p = {};
                        p.func = (void *)step; p.gridDim = dim3(c.grid); p.blockDim = dim3(256); p.kernelParams = args;
                        CK(cudaGraphExecKernelNodeSetParams(cached, nodes[i], &p));
                    }
                    CK(cudaGraphLaunch(cached, st));
                } else {
                    CK(cudaGraphLaunch(cached, st));
                }
                double h = us(h0);
                CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 6) { dev.push_back(ms * 1000); host.push_back(h); }
            }
            std::sort(dev.begin(), dev.end()); std::sort(host.begin(), host.end());
            static const char *names[] = {"plain launches", "capture+instantiate", "cached+setparams", "cached replay"};
            printf("n=%-8u grid=%-4u spin=%-3u %-20s chain of %d: device %7.1f us, host %7.1f us\n", c.n, c.grid, c.spin, names[mode], CHAIN, dev[dev.size()/2], host[host.size()/2]);
        }
        if (cached) CK(cudaGraphExecDestroy(cached));
    }
    return 0;
}
