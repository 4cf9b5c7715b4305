#!/usr/bin/env bash
# Session 35's closing calls on the device tool (carry [".gpu"]), bundle built by
#   KERNELS_ONLY=1 EXTRA="sqllogictests=target/release/deps/sqllogictests-<hash> fused-rule=<fused>" \
#     bash benches/gpu-bundle.sh
# where fused-rule is this tree's benchmark with the generated pass's end as before (each
# warp's own atomics for its counts and span words) and fused the tree's (the block's totals).
#   tests  the CUDA suite and sqllogictests with the CUDA backend forced
#   ab     the whole fused benchmark, device only, fused-rule against fused, alternating, twice
#   sweep  the whole fused benchmark, device only (DataFusion as the oracle)
#   full   the whole fused benchmark with DataFusion timed on the machine's 16 cores
set -uo pipefail
OUT=${OUT:-/tmp/s35-final}
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
        for i in 1 2; do
            for v in rule new; do
                bin=.b/fused
                [ $v = rule ] && bin=.b/fused-rule
                timeout 140 $bin --rows 250000000 --runs 5 --device-only \
                    --csv "$OUT/ab-$v-$i.csv" > "$OUT/ab-$v-$i.log" 2>&1
                echo "== $v-$i rc $?"
                grep -E '^Q[0-9]' "$OUT/ab-$v-$i.log"
            done
        done
        ;;
    early)
        # Call 6: the packed tile sort enqueued before the read-back (fused) against 6669bf7's
        # binary (fused-head: the tile sort after it), Q2 at k = 10^5 and 10^6, alternating.
        for i in 1 2; do
            for v in head early; do
                bin=.b/fused
                [ $v = head ] && bin=.b/fused-head
                timeout 120 $bin --rows 250000000 --only "Q2 k=100000" --runs 5 --device-only \
                    --csv "$OUT/early-$v-$i.csv" > "$OUT/early-$v-$i.log" 2>&1
                echo "== $v-$i rc $?"
                grep -E '^Q[0-9]' "$OUT/early-$v-$i.log"
            done
        done
        ;;
    coarse)
        # Call 8: the first sample 8× coarser before the denser one (fused) against 6669bf7's
        # binary (fused-head), Q2 at k = 10^5 and 10^6, alternating; then the resident tests.
        for i in 1 2; do
            for v in head coarse; do
                bin=.b/fused
                [ $v = head ] && bin=.b/fused-head
                timeout 120 $bin --rows 250000000 --only "Q2 k=100000" --runs 5 --device-only \
                    --csv "$OUT/coarse-$v-$i.csv" > "$OUT/coarse-$v-$i.log" 2>&1
                echo "== $v-$i rc $?"
                grep -E '^Q[0-9]' "$OUT/coarse-$v-$i.log"
            done
        done
        GPU_TOPK_TEST_BACKEND=cuda timeout 200 .b/all resident packed_merge_sort > "$OUT/coarse-tests.log" 2>&1
        echo "resident tests (rc $?): $(grep -h 'test result' "$OUT/coarse-tests.log" | tail -n 1)"
        grep -h "FAILED\|panicked" "$OUT/coarse-tests.log" | head -5
        ;;
    sweep)
        timeout 300 .b/fused --rows 250000000 --runs 5 --device-only --csv "$OUT/sweep.csv" > "$OUT/sweep.log" 2>&1
        echo "sweep rc $?"
        grep -E '^(query|Q[0-9])' "$OUT/sweep.log"
        ;;
    full)
        timeout 560 .b/fused --rows 250000000 --runs 3 --csv "$OUT/full.csv" > "$OUT/full.log" 2>&1
        echo "full rc $?"
        grep -E '^(query|Q[0-9])' "$OUT/full.log"
        ;;
    esac
done
