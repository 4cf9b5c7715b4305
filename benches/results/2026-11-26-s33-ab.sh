#!/usr/bin/env bash
# Session 33's A/B for the device work it could not run (no device time was left): the
# patches 2026-11-26-s33-*.patch against the tree they were made on (main after session 33,
# whose device code is 14e748a's).
#
# Here (no GPU), from a clean checkout of that tree:
#   1. (optional: the unpatched binary, as a second baseline) cargo build --release --bench
#      fused; cp target/release/deps/fused-<hash> /tmp/fused-old
#   2. git apply benches/results/2026-11-26-s33-device-sort-enqueue.patch, then the other two
#      (merge-group-search applies on top of the first; translator-casts-fmod on its own);
#      touch src/**/*.rs kernels/* (cargo's fingerprint, after step 1); cargo test --release
#      --no-run --test sqllogictests; then
#      KERNELS_ONLY=1 EXTRA="sqllogictests=target/release/deps/sqllogictests-<hash> [fused-old=/tmp/fused-old]" \
#        bash benches/gpu-bundle.sh
#   3. kernel directories that undo one change each, and all of them, for the same binary:
#      mkdir -p .gpu/kernels-oldsample .gpu/kernels-nogroup .gpu/kernels-allold
#      cp kernels/* .gpu/kernels-oldsample/ && git show 14e748a:kernels/sample.cu > .gpu/kernels-oldsample/sample.cu
#      cp kernels/* .gpu/kernels-nogroup/ && sed -i '1i #define MSORT_GROUP_SEARCH 0' .gpu/kernels-nogroup/merge_sort.cu
#      cp .gpu/kernels-nogroup/* .gpu/kernels-allold/ && cp .gpu/kernels-oldsample/sample.cu .gpu/kernels-allold/
#   ("allold", with GPU_TOPK_SORT_ON_DEVICE=0, runs 14e748a's Q2 k = 10^6 path in the patched
#   binary: the host-planned sort, the old threshold select and the warps' search.)
# There (device tool, carry [".gpu"]), two calls (each fits the 600 s limit; a cold machine's
# CUDA suite took 285–310 s in sessions 31–32):
#   bash benches/results/2026-11-26-s33-ab.sh tests
#   bash benches/results/2026-11-26-s33-ab.sh bench
# Each fused invocation pays ~8 s of data generation and ~20 s of DataFusion's oracle at k = 10^6.
set -uo pipefail
OUT=${OUT:-/tmp/s33-ab}
mkdir -p "$OUT" .b
[ -x .b/fused ] || tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
case "${1:-}" in
tests)
    GPU_TOPK_TEST_BACKEND=cuda timeout 420 .b/all > "$OUT/tests-cuda.log" 2>&1
    echo "CUDA suite (rc $?): $(grep -h 'test result' "$OUT/tests-cuda.log")"
    GPU_TOPK_TEST_BACKEND=cuda timeout 150 .b/sqllogictests > "$OUT/slt-cuda.log" 2>&1
    echo "sqllogictests, CUDA (rc $?): $(tail -n 1 "$OUT/slt-cuda.log")"
    ;;
bench)
    q() { timeout 120 "$@" --rows 250000000 --only "Q2 k=1000000" --runs 5 --device-only; }
    run() { # name, then the command
        local name=$1
        shift
        q "$@" --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
        echo "$name rc $?"
    }
    allold() { GPU_TOPK_SORT_ON_DEVICE=0 GPU_TOPK_KERNEL_DIR=$PWD/.gpu/kernels-allold run "$@"; }
    variants="new-1 allold-1 hostsort oldsample nogroup new-2 allold-2"
    run new-1 .b/fused
    allold allold-1 .b/fused
    GPU_TOPK_SORT_ON_DEVICE=0 run hostsort .b/fused
    GPU_TOPK_KERNEL_DIR=$PWD/.gpu/kernels-oldsample run oldsample .b/fused
    GPU_TOPK_KERNEL_DIR=$PWD/.gpu/kernels-nogroup run nogroup .b/fused
    run new-2 .b/fused
    allold allold-2 .b/fused
    if [ -x .b/fused-old ]; then
        run old .b/fused-old
        variants="$variants old"
    fi
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum \
        -k regex:"sample_threshold|refine_threshold|msort|fused_append" \
        .b/fused --rows 250000000 --only "Q2 k=1000000" --runs 1 --device-only > "$OUT/ncu-new.log" 2>&1
    echo "ncu rc $?"
    for f in $variants; do
        echo "== $f: $(grep '^Q2' "$OUT/$f.log")"
    done
    ;;
*)
    echo "usage: $0 tests|bench" >&2
    exit 2
    ;;
esac
