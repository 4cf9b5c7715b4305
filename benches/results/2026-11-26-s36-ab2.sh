#!/usr/bin/env bash
# Session 36, call 2 (carry [".gpu"]): the packed tile sort enqueued before the read-back,
# which goes on a second stream (GPU_TOPK_AB_EARLY=0 turns it off), with the clustered sample
# (kernel directory k-c32; k-c1: the strided sample as before) and the coarser first sample
# (GPU_TOPK_AB_COARSE), Q2 at k = 10^5 and 10^6 (250M rows, device only, 5 runs each), one
# binary; then the resident and packed-sort tests with the CUDA backend forced.
set -uo pipefail
OUT=${OUT:-/tmp/s36-ab2}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { # name cluster coarse refine early
    local name=$1
    GPU_TOPK_CACHE_DIR=$PWD/.kc-$2 GPU_TOPK_KERNEL_DIR=$PWD/.b/k-c$2 GPU_TOPK_AB_COARSE=$3 GPU_TOPK_AB_REFINE=$4 \
        GPU_TOPK_AB_EARLY=$5 timeout 120 .b/fused --rows 250000000 --only "Q2 k=100000" --runs 5 --device-only \
        --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
    echo "== $name (cluster $2, coarse $3, refine $4, early $5) rc $?"
    grep -E '^Q[0-9]' "$OUT/$name.log"
}
for i in 1 2; do
    run base-$i 1 0 16 0
    run late-$i 32 1 16 0
    run early-$i 32 1 16 1
    run early-r32-$i 32 1 32 1
done
GPU_TOPK_TEST_BACKEND=cuda GPU_TOPK_KERNEL_DIR=$PWD/.b/k-c32 timeout 240 .b/all resident packed sample > "$OUT/tests.log" 2>&1
echo "resident / packed / sample tests, CUDA (rc $?): $(grep -h 'test result' "$OUT/tests.log" | tail -n 1)"
grep -h "FAILED\|panicked" "$OUT/tests.log" | head -8
