#!/usr/bin/env bash
# Session 35's A/B on the device tool (carry [".gpu"], a bundle holding the `fused` benchmark):
# Q2 at k = 10^5 and 10^6 (250M rows, device only, 5 runs) with the fused selection's denser
# sample on (GPU_TOPK_FUSED_REFINE=16, main's) or off (0), and the first sample's margin
# (GPU_TOPK_FUSED_SIGMA, σ) at 4, 5 and 6 without it; one invocation per variant (the knobs are
# read once per process), each checked against DataFusion's answer by the benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/s35-ab}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in "$@"; do
    r=${v%%:*} s=${v##*:}
    name="r$r-s$s"
    GPU_TOPK_FUSED_REFINE=$r GPU_TOPK_FUSED_SIGMA=$s timeout 120 .b/fused --rows 250000000 \
        --only "Q2 k=100000" --runs 5 --device-only --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
    echo "== $name rc $?"
    grep '^Q2' "$OUT/$name.log"
done
