#!/usr/bin/env bash
# Session 36's closing calls on the device tool (carry [".gpu"]); the bundle is one commit's
# `fused`, `all` and `sqllogictests` (xz -T1 --lzma2=preset=6,dict=768MiB of the three; call 3
# ddeef1f's, call 4 f666ad7's with ddeef1f's kernels/ as k-old, calls 5–6 238a8b8's).
#   ab     Q2 at k = 10^6, this tree's kernels against k-old's (the one-block thresholds by
#          their radix rounds), one binary, alternating
#   tests  the CUDA suite and sqllogictests with the CUDA backend forced
#   full   the whole fused benchmark with DataFusion timed on the machine's 16 cores
set -uo pipefail
OUT=${OUT:-/tmp/s36-final}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for mode in "$@"; do
    case "$mode" in
    tests)
        GPU_TOPK_TEST_BACKEND=cuda timeout 420 .b/all > "$OUT/tests-cuda.log" 2>&1
        echo "CUDA suite (rc $?): $(grep -h 'test result' "$OUT/tests-cuda.log" | tail -n 1)"
        grep -h "FAILED\|panicked" "$OUT/tests-cuda.log" | head -8
        GPU_TOPK_TEST_BACKEND=cuda timeout 150 .b/sqllogictests > "$OUT/slt-cuda.log" 2>&1
        echo "sqllogictests, CUDA (rc $?): $(tail -n 1 "$OUT/slt-cuda.log")"
        ;;
    ab)
        for v in new old; do
            dir=()
            [ $v = old ] && dir=(env GPU_TOPK_KERNEL_DIR=$PWD/.b/k-old GPU_TOPK_CACHE_DIR=$PWD/.kc-old)
            "${dir[@]}" timeout 120 .b/fused --rows 250000000 --only "Q2 k=1000000" --runs 5 --device-only \
                --csv "$OUT/ab-$v.csv" > "$OUT/ab-$v.log" 2>&1
            echo "== $v rc $?"
            grep -E '^Q[0-9]' "$OUT/ab-$v.log"
        done
        ;;
    full)
        timeout 560 .b/fused --rows 250000000 --runs 3 --csv "$OUT/full.csv" > "$OUT/full.log" 2>&1
        echo "full rc $?"
        grep -E '^(query|Q[0-9])' "$OUT/full.log"
        ;;
    esac
done
