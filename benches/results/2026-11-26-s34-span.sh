#!/usr/bin/env bash
# Session 34: the fused pass's key span in each lane's own shared words (common.cuh WarpBuffer)
# against one shared atomic per pair (main before it), alternating: `base` the binary built
# before the change (packed as fused-old: KERNELS_ONLY=1 EXTRA="fused-old=…" gpu-bundle.sh),
# `new` the one after (the generated program's template changed with it, so the kernel
# directory alone cannot switch it). Device tool, carry [".gpu"]:
# bash benches/results/2026-11-26-s34-span.sh
set -uo pipefail
OUT=${OUT:-/tmp/s34-span}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
run() { # variant, query prefix, tag
    local bin=.b/fused
    [ "$1" = base ] && bin=.b/fused-old
    timeout 150 $bin --rows 250000000 --only "$2" --runs 5 \
        --device-only --csv "$OUT/$1-$3.csv" > "$OUT/$1-$3.log" 2>&1
    echo "$1 $3 rc $?"
}
for q in "Q2 k=1000000:q2a" "Q3:q3" "Q1 sel=1.0:q1" "Q2 k=1000000:q2b"; do
    run base "${q%%:*}" "${q##*:}"
    run new "${q%%:*}" "${q##*:}"
done
for f in "$OUT"/*.log; do echo "== $(basename "$f" .log)"; grep -E '^Q[0-9]' "$f"; done
