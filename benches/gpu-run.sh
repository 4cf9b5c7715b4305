#!/usr/bin/env bash
# gpu-run.sh: one full GPU-machine run over the bundle of benches/gpu-bundle.sh.
#
#   run (device tool), carry [".gpu"]:  bash benches/gpu-run.sh
#
# 1. the integration tests (GROUP_QUERIES random per-group queries and AGG_QUERIES random
#    top-k over aggregate queries among them, default 2000 each) and the sqllogictests with the CUDA backend forced, then the integration tests on the CPU
#    path (SKIP_SLT=1, SKIP_CPU_TESTS=1 leave those out);
# 2. `gpu-topk` Q1–Q4 with --backend cuda and --backend cpu: result rows must be identical;
# 3. the end-to-end benchmark (DataFusion, the CPU path, the GPU cold, first and warm, auto,
#    auto first), ROWS rows (default 100M), with CLIENTS concurrent clients (default 16), its
#    CSV and SVG plots under $OUT; PARQUET=DIR: over Parquet files written to DIR instead.
# Logs go to $OUT; the summary is printed last. Set SKIP_BENCH=1 to stop after step 2, SKIP_TESTS=1
# to skip step 1, SKIP_QUERIES=1 to skip step 2, SWEEP=1 for the benchmark's sweep (Q1
# selectivity 0 to 1 by 0.1, Q2 k 1 to 10^6). BASELINE=NAME (a benchmark packed with
# `EXTRA="NAME=PATH"`): step 3 runs it and this build's benchmark alternately, ROUNDS times
# each (default 2), without clients or plots, to compare two builds on one machine.
# USER_PATH=1 adds step 4, benches/user_path.py: fresh `gpu-topk` processes with the default
# settings against DataFusion and DuckDB (wheels carried in .whl/, see the script), ROWS tweets
# and TPC-H lineitem at TPCH_SF (default 10), generated into TPCH (default /tmp/tpch);
# USER_PATH_ONLY lists its sessions (default all); USER_PATH_RUNS the repeats (default 3);
# USER_PATH_SECONDS stops it (default 540), reporting the sessions it finished;
# SYNTHETIC_LINEITEM=N makes lineitem's string columns by SQL (N rows) instead of TPC-H.
# HITS=1 adds step 5, the top-k over an aggregation (`cpu_vs_datafusion --hits`, H01-H13 over
# the ClickBench-shaped hits): HITS_ROWS rows (default 10M), HITS_RUNS runs (default 3),
# HITS_ENGINES (default cpu,first,warm,auto), in memory or with HITS_PARQUET=DIR over Parquet
# files written there; HITS_DUCKDB=1 adds DuckDB (its wheel in .whl/, as for USER_PATH);
# HITS_ONLY=H01,H07 runs only those queries. Its CSV is $OUT/hits.csv.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-run}
ROWS=${ROWS:-100000000}
mkdir -p "$OUT" .b
tar xJf .gpu/bundle.tar.xz -C .b || exit 1
export GPU_TOPK_CACHE_DIR=$PWD/.kernel-cache
summary=()
result() { grep -h "test result" "$1" | tr '\n' ' '; }

if [ -z "${SKIP_TESTS:-}" ]; then
    # --nocapture: the random per-group and aggregate tests print how many of their queries ran
    # on the GPU.
    GPU_TOPK_TEST_BACKEND=cuda GPU_TOPK_GROUP_QUERIES=${GROUP_QUERIES:-2000} \
        GPU_TOPK_AGG_QUERIES=${AGG_QUERIES:-2000} .b/all --nocapture \
        > "$OUT/tests-cuda.log" 2>&1
    summary+=("integration tests, backend cuda (rc $?): $(result "$OUT/tests-cuda.log")")
    summary+=("  $(grep -h 'random per-group queries taken' "$OUT/tests-cuda.log")")
    summary+=("  $(grep -h 'random aggregate top-k queries taken' "$OUT/tests-cuda.log")")
    if [ -z "${SKIP_SLT:-}" ]; then
        GPU_TOPK_TEST_BACKEND=cuda .b/sqllogictests > "$OUT/slt-cuda.log" 2>&1
        summary+=("sqllogictests, backend cuda (rc $?): $(tail -n 3 "$OUT/slt-cuda.log" | tr '\n' ' ')")
    fi
    if [ -z "${SKIP_CPU_TESTS:-}" ]; then
        .b/all > "$OUT/tests-cpu.log" 2>&1
        summary+=("integration tests, backend cpu (rc $?): $(result "$OUT/tests-cpu.log")")
    fi
fi

if [ -z "${SKIP_QUERIES:-}" ]; then
    for backend in cuda cpu; do
        .b/gpu-topk --rows "$ROWS" --backend "$backend" tweets --show 100 > "$OUT/queries-$backend.log" 2>&1
    done
    if diff <(grep '^|' "$OUT/queries-cuda.log") <(grep '^|' "$OUT/queries-cpu.log") > /dev/null; then
        same="identical"
    else
        same="DIFFERENT"
    fi
    rows=$(grep -c '^| [0-9]' "$OUT/queries-cuda.log")
    summary+=("gpu-topk Q1-Q4, $ROWS rows, cuda vs cpu: $same ($rows result rows)")
    summary+=("$(grep -E '^(time|top-k):' "$OUT/queries-cuda.log" | paste -sd' ' -)")
fi

if [ -z "${SKIP_BENCH:-}" ] && [ -n "${BASELINE:-}" ]; then
    for round in $(seq "${ROUNDS:-2}"); do
        for build in "$BASELINE" cpu_vs_datafusion; do
            log="$OUT/end-to-end-$build-$round.log"
            .b/"$build" --rows "$ROWS" --runs 3 > "$log" 2>&1
            summary+=("end to end, $build, round $round (rc $?):")
            summary+=("$(cat "$log")")
        done
    done
elif [ -z "${SKIP_BENCH:-}" ]; then
    .b/cpu_vs_datafusion --rows "$ROWS" --runs 3 --csv "$OUT/end-to-end.csv" --plots "$OUT" \
        --clients "${CLIENTS:-16}" ${SWEEP:+--sweep} ${PARQUET:+--parquet "$PARQUET"} \
        > "$OUT/end-to-end.log" 2>&1
    summary+=("end to end (rc $?):")
    summary+=("$(cat "$OUT/end-to-end.log")")
fi
# The Python wheels carried in .whl/ (DuckDB's among them), for the steps that run Python.
install_wheels() {
    if ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
}
if [ -n "${USER_PATH:-}" ]; then
    install_wheels
    logs=/tmp/user-path-logs
    PYTHONUNBUFFERED=1 timeout "${USER_PATH_SECONDS:-540}" python3 benches/user_path.py --cli .b/gpu-topk --rows "$ROWS" \
        --tpch "${TPCH:-/tmp/tpch}" --sf "${TPCH_SF:-10}" --runs "${USER_PATH_RUNS:-3}" --duckdb \
        ${SYNTHETIC_LINEITEM:+--synthetic-lineitem "$SYNTHETIC_LINEITEM"} \
        ${USER_PATH_ONLY:+--only "$USER_PATH_ONLY"} --scratch /tmp/user-path --logs "$logs" \
        --json "$OUT/user-path.json" > "$OUT/user-path.log" 2>&1
    summary+=("user path (rc $?):")
    summary+=("$(sed -n '/^gpu-topk user path/,$p' "$OUT/user-path.log")")
    tar -C "$logs" -cJf "$OUT/user-path-logs.tar.xz" . 2>/dev/null
fi
if [ -n "${HITS:-}" ]; then
    [ -n "${HITS_DUCKDB:-}" ] && install_wheels
    .b/cpu_vs_datafusion --hits --rows "${HITS_ROWS:-10000000}" --runs "${HITS_RUNS:-3}" \
        --engines "${HITS_ENGINES:-cpu,first,warm,auto}" --csv "$OUT/hits.csv" \
        ${HITS_PARQUET:+--parquet "$HITS_PARQUET"} ${HITS_DUCKDB:+--duckdb} \
        ${HITS_ONLY:+--only "$HITS_ONLY"} > "$OUT/hits.log" 2>&1
    summary+=("top-k over an aggregate (rc $?):")
    summary+=("$(cat "$OUT/hits.log")")
fi
printf '%s\n' "${summary[@]}"
