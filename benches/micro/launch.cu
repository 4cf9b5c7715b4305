// Run on the GPU machine: nvcc -O3 -arch=sm_90 benches/micro/launch.cu -o /tmp/l && /tmp/l
// (what a chain of dependent kernels pays per launch, with and without programmatic dependent
// launch (PDL) and CUDA graphs, the host's enqueue time per launch beside it; then a graph
// captured per call, or cached and given new parameters per call).
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>
#include <vector>
#include <algorithm>
#include <chrono>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

template <bool WAIT, bool TRIGGER>
__global__ void step(const unsigned *in, unsigned *out, unsigned n, unsigned spin) {
    if (TRIGGER) asm volatile("griddepcontrol.launch_dependents;");
    if (WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned v = in[i];
        for (unsigned s = 0; s < spin; ++s) v = v * 1664525u + 1013904223u;
        out[i] = v + 1;
    }
}

// Part 1: chains of 32 kernels, plain, with PDL (wait only, trigger + wait), and as graphs.
static void pdl_chains(unsigned *a, unsigned *b, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
    struct Case { const char *name; unsigned n, grid, spin; };
    Case cases[] = {{"tiny n=4096 grid=16", 4096, 16, 0},
                    {"n=2^20 grid=528", 1u << 20, 528, 0},
                    {"n=2^21 grid=1056 (one 8MB rw)", 1u << 21, 1056, 0},
                    {"n=2^20 grid=132 spin=200", 1u << 20, 132, 200}};
    const int CHAIN = 32;
    for (auto &c : cases) {
        for (int mode = 0; mode < 5; ++mode) {
            // 0 plain, 1 PDL wait-only, 2 PDL trigger+wait, 3 graph of plain, 4 graph of PDL trigger+wait
            auto enqueue = [&](cudaStream_t s) {
                for (int i = 0; i < CHAIN; ++i) {
                    const unsigned *in = (i & 1) ? b : a; unsigned *out = (i & 1) ? a : b;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(c.grid); cfg.blockDim = dim3(256); cfg.stream = s;
                    cudaLaunchAttribute attr[1];
                    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attr[0].val.programmaticStreamSerializationAllowed = 1;
                    cfg.attrs = attr; cfg.numAttrs = (mode == 0 || mode == 3) ? 0 : 1;
                    if (mode == 0 || mode == 3) CK(cudaLaunchKernelEx(&cfg, step<true, false>, in, out, c.n, c.spin));
                    else if (mode == 1) CK(cudaLaunchKernelEx(&cfg, step<true, false>, in, out, c.n, c.spin));
                    else CK(cudaLaunchKernelEx(&cfg, step<true, true>, in, out, c.n, c.spin));
                }
            };
            cudaGraphExec_t exec = nullptr;
            if (mode >= 3) {
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                enqueue(st);
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&exec, g, 0));
            }
            std::vector<float> ts; double host_us = 0;
            for (int r = 0; r < 25; ++r) {
                CK(cudaEventRecord(e0, st));
                auto h0 = std::chrono::steady_clock::now();
                if (exec) CK(cudaGraphLaunch(exec, st)); else enqueue(st);
                host_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
                if (r >= 5) ts.push_back(ms);
            }
            std::sort(ts.begin(), ts.end());
            static const char *names[] = {"plain", "pdl-wait", "pdl-trigger", "graph-plain", "graph-pdl"};
            printf("%-34s %-12s per kernel %7.2f us (median of 20 chains of %d); host enqueue %.2f us/kernel\n", c.name, names[mode], ts[10] * 1000 / CHAIN, CHAIN, host_us / 25 / CHAIN);
        }
        // single kernel duration
        std::vector<float> ts;
        for (int r = 0; r < 25; ++r) {
            CK(cudaEventRecord(e0, st));
            step<false, false><<<c.grid, 256, 0, st>>>(a, b, c.n, c.spin);
            CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r >= 5) ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        printf("%-34s single kernel alone %7.2f us\n", c.name, ts[10] * 1000);
    }
}

using clk = std::chrono::steady_clock;
static double us(clk::time_point a) { return std::chrono::duration<double, std::micro>(clk::now() - a).count(); }

// Part 2: a chain of 12 kernels: plain launches, a graph captured and instantiated per call, a
// cached graph with its kernels' parameters set per call, a cached graph replayed.
static void graph_chains(unsigned *a, unsigned *b, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
    const int CHAIN = 12;
    struct Case { unsigned n, grid, spin; };
    for (Case c : {Case{4096, 16, 0}, Case{1u << 20, 528, 0}, Case{1u << 20, 132, 100}}) {
        auto enqueue = [&](cudaStream_t s, unsigned off) {
            for (int i = 0; i < CHAIN; ++i) {
                const unsigned *in = ((i & 1) ? b : a) + off; unsigned *out = ((i & 1) ? a : b) + off;
                step<false, false><<<c.grid, 256, 0, s>>>(in, out, c.n, c.spin);
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
                    // The captured chain's nodes come in launch order: node i is kernel i.
                    for (int i = 0; i < CHAIN; ++i) {
                        const unsigned *in = ((i & 1) ? b : a) + off; unsigned *out = ((i & 1) ? a : b) + off;
                        unsigned n = c.n, spin = c.spin;
                        void *args[] = {&in, &out, &n, &spin};
                        cudaKernelNodeParams p = {};
                        p.func = (void *)step<false, false>; p.gridDim = dim3(c.grid); p.blockDim = dim3(256); p.kernelParams = args;
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
}

int main() {
    unsigned *a, *b;
    const unsigned N = 1u << 24;
    CK(cudaMalloc(&a, N * 4)); CK(cudaMalloc(&b, N * 4));
    CK(cudaMemset(a, 0, N * 4)); CK(cudaMemset(b, 0, N * 4));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    pdl_chains(a, b, st, e0, e1);
    graph_chains(a, b, st, e0, e1);
    return 0;
}
