#!/usr/bin/env bash
# Session 34's A/B on the device tool (carry [".gpu"]): Q2 at k = 10^6 (250M rows) with the
# fused selection's denser sample (GPU_TOPK_FUSED_REFINE, R) and the packed merge sort's words
# per thread (GPU_TOPK_MSORT_WORD_ITEMS, V) varied in one binary (both are read once per
# process, so one invocation each). Built here with
#   cargo build --release --bench fused --bench kernels && cargo test --release --no-run --test all
#   KERNELS_ONLY=1 bash benches/gpu-bundle.sh
# `tests`: the packed merge sort's test and the large-k tests with the CUDA backend forced, at
# each V (the suite's own runs use the default); `bench VARIANTS…`: one fused invocation per
# variant "R:V" (e.g. 16:8), each checked against DataFusion's answer by the benchmark; `ncu R:V`:
# the kernels of one run.
set -uo pipefail
OUT=${OUT:-/tmp/s34-ab}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
mode=${1:-}
shift
case "$mode" in
tests)
    for v in "$@"; do
        GPU_TOPK_MSORT_WORD_ITEMS=$v GPU_TOPK_FUSED_REFINE=64 GPU_TOPK_TEST_BACKEND=cuda timeout 200 \
            .b/all packed_merge_sort resident fusion::tweet > "$OUT/tests-v$v.log" 2>&1
        echo "V=$v (rc $?): $(grep -h 'test result' "$OUT/tests-v$v.log" | tail -n 1)"
    done
    ;;
bench)
    for rv in "$@"; do
        name="r${rv%%:*}-v${rv##*:}"
        GPU_TOPK_FUSED_REFINE=${rv%%:*} GPU_TOPK_MSORT_WORD_ITEMS=${rv##*:} timeout 100 .b/fused \
            --rows 250000000 --only "Q2 k=1000000" --runs 5 --device-only --csv "$OUT/$name.csv" \
            > "$OUT/$name.log" 2>&1
        echo "$name rc $?: $(grep '^Q2' "$OUT/$name.log")"
    done
    ;;
ncu)
    rv=$1
    GPU_TOPK_FUSED_REFINE=${rv%%:*} GPU_TOPK_MSORT_WORD_ITEMS=${rv##*:} timeout 150 ncu --clock-control none \
        --metrics gpu__time_duration.sum -k regex:"sample_threshold|refine_threshold|msort|fused_append" \
        .b/fused --rows 250000000 --only "Q2 k=1000000" --runs 1 --device-only > "$OUT/ncu-$rv.log" 2>&1
    echo "ncu $rv rc $?"
    ;;
*)
    echo "usage: $0 tests V… | bench R:V… | ncu R:V" >&2
    exit 2
    ;;
esac
