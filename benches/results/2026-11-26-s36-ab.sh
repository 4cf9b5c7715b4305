#!/usr/bin/env bash
# Session 36, call 1 (carry [".gpu"]): Q2 at k = 10^5 and 10^6 (250M rows, device only, 5 runs
# each) for the sample's clusters (SAMPLE_CLUSTER 1 = the strided sample as before, 8, 32: one
# kernel directory each, GPU_TOPK_KERNEL_DIR), the coarser first sample (GPU_TOPK_AB_COARSE=0
# turns it off) and the denser sample's factor (GPU_TOPK_AB_REFINE), one binary. The bundle is
# the tree's `fused` and kernels/ three times with SAMPLE_CLUSTER set (xz of /tmp/stage).
set -uo pipefail
OUT=${OUT:-/tmp/s36-ab}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { # name cluster coarse refine
    local name=$1
    GPU_TOPK_CACHE_DIR=$PWD/.kc-$2 GPU_TOPK_KERNEL_DIR=$PWD/.b/k-c$2 GPU_TOPK_AB_COARSE=$3 GPU_TOPK_AB_REFINE=$4 \
        timeout 120 .b/fused --rows 250000000 --only "Q2 k=100000" --runs 5 --device-only \
        --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
    echo "== $name (cluster $2, coarse $3, refine $4) rc $?"
    grep -E '^Q[0-9]' "$OUT/$name.log"
}
for v in "${@:-base c32 c8 coarse c32coarse c32coarse-r32 base-2 c32coarse-2}"; do
    for w in $v; do
        case "${w%-2}" in
        base) run "$w" 1 0 16 ;;
        c32) run "$w" 32 0 16 ;;
        c8) run "$w" 8 0 16 ;;
        coarse) run "$w" 1 1 16 ;;
        c32coarse) run "$w" 32 1 16 ;;
        c8coarse) run "$w" 8 1 16 ;;
        c32coarse-r32) run "$w" 32 1 32 ;;
        esac
    done
done
