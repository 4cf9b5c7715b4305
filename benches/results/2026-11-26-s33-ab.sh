#!/usr/bin/env bash
# Session 33's A/B for the device work it could not run (no device time was left): the
# patches 2026-11-26-s33-*.patch against the tree they were made on (main after session 33,
# whose device code is 14e748a's).
#
# Here (no GPU), from a clean checkout of that tree:
#   1. build the tree as it is:  cargo build --release --bench fused;
#      cp target/release/deps/fused-<hash> /tmp/fused-old
#   2. git apply benches/results/2026-11-26-s33-*.patch (both); touch src/**/*.rs kernels/*
#      (cargo's fingerprint), cargo test --release --no-run --test sqllogictests, then
#      KERNELS_ONLY=1 EXTRA="fused-old=/tmp/fused-old sqllogictests=target/release/deps/sqllogictests-<hash>" \
#        bash benches/gpu-bundle.sh
#   3. mkdir -p .gpu/kernels-oldsample && cp kernels/* .gpu/kernels-oldsample/ &&
#      git show 14e748a:kernels/sample.cu > .gpu/kernels-oldsample/sample.cu
#      (the patched host code with the old one-block threshold: isolates sample.cu's change)
# There (device tool, carry [".gpu"]):  bash benches/results/2026-11-26-s33-ab.sh
# Each fused invocation pays ~8 s of data generation and ~20 s of DataFusion's oracle at k = 10^6.
set -uo pipefail
OUT=${OUT:-/tmp/s33-ab}
mkdir -p "$OUT" .b && tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
GPU_TOPK_TEST_BACKEND=cuda timeout 400 .b/all > "$OUT/tests-cuda.log" 2>&1
echo "CUDA suite (rc $?): $(grep -h 'test result' "$OUT/tests-cuda.log")"
GPU_TOPK_TEST_BACKEND=cuda timeout 200 .b/sqllogictests > "$OUT/slt-cuda.log" 2>&1
echo "sqllogictests, CUDA (rc $?): $(tail -n 1 "$OUT/slt-cuda.log")"
q() { timeout 150 "$@" --rows 250000000 --only "Q2 k=1000000" --runs 5 --device-only; }
for i in 1 2; do
    q .b/fused --csv "$OUT/new-$i.csv" > "$OUT/new-$i.log" 2>&1; echo "new $i rc $?"
    GPU_TOPK_SORT_ON_DEVICE=0 q .b/fused --csv "$OUT/hostsort-$i.csv" > "$OUT/hostsort-$i.log" 2>&1
    echo "hostsort $i rc $?"
    GPU_TOPK_KERNEL_DIR=$PWD/.gpu/kernels-oldsample q .b/fused --csv "$OUT/oldsample-$i.csv" \
        > "$OUT/oldsample-$i.log" 2>&1
    echo "oldsample $i rc $?"
    q .b/fused-old --csv "$OUT/old-$i.csv" > "$OUT/old-$i.log" 2>&1; echo "old $i rc $?"
done
timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum \
    -k regex:"sample_threshold|refine_threshold|msort|fused_append" \
    .b/fused --rows 250000000 --only "Q2 k=1000000" --runs 1 --device-only > "$OUT/ncu-new.log" 2>&1
echo "ncu rc $?"
for f in new hostsort oldsample old; do
    for i in 1 2; do echo "== $f $i"; grep "^Q2" "$OUT/$f-$i.log"; done
done
