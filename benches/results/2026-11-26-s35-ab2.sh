#!/usr/bin/env bash
# Session 35's second A/B on the device tool (carry [".gpu"], a bundle holding `fused` and the
# test binary `all`): the merge sort's block size (GPU_TOPK_MSORT_THREADS: tiles of 8 words a
# thread, so 512 threads leave Q2's 1.27M candidates at k = 10^6 nine rounds and 1024 eight).
#   tests T…     the merge sort and resident tests with the CUDA backend forced, at each T
#   bench V…     Q2 k = 10^5 and 10^6 (250M rows, device only, 5 runs), one invocation per
#                variant V = "NAME=VALUE,NAME=VALUE" of GPU_TOPK_ variables (or "main")
set -uo pipefail
OUT=${OUT:-/tmp/s35-ab2}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
mode=${1:-}
shift
case "$mode" in
tests)
    for t in "$@"; do
        GPU_TOPK_MSORT_THREADS=$t GPU_TOPK_TEST_BACKEND=cuda timeout 240 .b/all gpu_merge_sort \
            gpu_packed_merge_sort resident > "$OUT/tests-t$t.log" 2>&1
        echo "threads $t (rc $?): $(grep -h 'test result' "$OUT/tests-t$t.log" | tail -n 1)"
        grep -h "FAILED\|panicked" "$OUT/tests-t$t.log" | head -5
    done
    ;;
bench)
    for v in "$@"; do
        envs=()
        [ "$v" = main ] || for a in ${v//,/ }; do envs+=("GPU_TOPK_$a"); done
        name=${v//[,=]/-}
        env "${envs[@]}" timeout 120 .b/fused --rows 250000000 --only "Q2 k=100000" --runs 5 \
            --device-only --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
        echo "== $v rc $?"
        grep '^Q2' "$OUT/$name.log"
    done
    ;;
*)
    echo "usage: $0 tests T… | bench V…" >&2
    exit 2
    ;;
esac
