#!/usr/bin/env bash
# cluster.sh: the tweet queries Q1–Q3 over Parquet files in plain DataFusion (the operator
# off), in one process on one GPU, in one process split between the host's GPUs
# (`gpu_topk.devices`), and on datafusion-distributed clusters of `gpu-topk worker`s on this
# host: one worker, and one per GPU (CUDA_VISIBLE_DEVICES); each on the same files in the same
# call.
#
#   benches/cluster.sh GPU_TOPK PARQUET_DIR [RUNS]      (gpu-topk gen --rows N --out PARQUET_DIR)
#
# For each configuration a fresh coordinator (and fresh workers) runs every query once cold
# and RUNS more times; the table printed last has the first run and the median of the others
# (ms, from datafusion-cli's "Elapsed" lines), and each configuration's log is under $OUT.
# WORKERS=N starts N workers and splits between N devices (default: one per GPU); worker
# (device) i is GPU i modulo the GPUs, so one GPU gives two logical devices for N = 2.
# BACKEND=cuda forces the GPU (default auto: a first run over Parquet takes the CPU path and
# loads the columns into the cache in the background; the coordinator waits for that load
# before its next statement, a worker does not, so its next runs may race the load).
# CACHE_BYTES=B sets every process's column cache budget (per device, `--cache-bytes`), e.g.
# to half of what the queries read, so that only the split holds them all. After the timed
# runs each configuration runs every query once more under EXPLAIN ANALYZE, and the first
# table lists what each operator shipped to its device then (`uploaded_bytes`, Q1's operators
# first; 0 where every column read was resident; a worker's operators are not listed).
set -euo pipefail
bin=$(realpath "$1")
data=$(realpath "$2")
runs=${3:-5}
OUT=${OUT:-/tmp/cluster}
mkdir -p "$OUT"
visible=$(nvidia-smi -L | wc -l)
gpus=${WORKERS:-$visible}
queries=(
    "SELECT id FROM tw WHERE tweet_time < '2017-05-04' ORDER BY retweet_count DESC LIMIT 50"
    "SELECT id FROM tw ORDER BY retweet_count + 0.5 * likes_count DESC LIMIT 50"
    "SELECT id FROM tw WHERE lang = 'en' OR lang = 'es' ORDER BY retweet_count DESC LIMIT 50"
)
cache=(--backend "${BACKEND:-auto}")
[ -n "${CACHE_BYTES:-}" ] && cache+=(--cache-bytes "$CACHE_BYTES")
pids=()
stop_workers() {
    for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2> /dev/null || true; done
    pids=()
}
trap stop_workers EXIT

# start_workers N BASE: N workers on ports BASE.., once each port answers; prints their URLs,
# comma-separated. Stops the benchmark if one does not start.
start_workers() {
    local urls=()
    for ((i = 0; i < $1; i++)); do
        local port=$(($2 + i))
        CUDA_VISIBLE_DEVICES=$((i % visible)) "$bin" "${cache[@]}" worker --listen "127.0.0.1:$port" \
            > "$OUT/worker-$1-$i.log" 2>&1 &
        pids+=($!)
        for _ in $(seq 300); do
            (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null && break
            kill -0 "${pids[-1]}" 2> /dev/null || break
            sleep 0.1
        done
        if ! kill -0 "${pids[-1]}" 2> /dev/null; then
            echo "worker $i did not start: $(cat "$OUT/worker-$1-$i.log")" >&2
            exit 1
        fi
        urls+=("http://127.0.0.1:$port")
    done
    local IFS=,
    echo "${urls[*]}"
}

# run_config NAME SETTING [ARGS…]: every query 1 + RUNS times in one process (a coordinator
# with --workers) after `SET SETTING`; one table row each.
run_config() {
    local name=$1 setting=$2
    shift 2
    local statements=(-c "SET $setting"
        -c "CREATE EXTERNAL TABLE tw STORED AS PARQUET LOCATION '$data/'")
    for sql in "${queries[@]}"; do
        for ((r = 0; r <= runs; r++)); do statements+=(-c "$sql"); done
    done
    for sql in "${queries[@]}"; do statements+=(-c "EXPLAIN ANALYZE $sql"); done
    local log="$OUT/$(echo "$name" | tr -d , | tr ' ' '-').log"
    "$bin" "${cache[@]}" "$@" --format csv "${statements[@]}" > "$log" 2>&1
    for pid in "${pids[@]}"; do
        kill -0 "$pid" 2> /dev/null || echo "| $name | a worker exited during the run: see its log |"
    done
    shipped+=("| $name | $( (grep -o 'uploaded_bytes=[^,\]]*' "$log" || true) | cut -d= -f2 | paste -sd' ') |")
    grep -o 'Elapsed [0-9.]* seconds' "$log" | python3 -c '
import statistics, sys
name, runs = sys.argv[1], int(sys.argv[2])
ms = [float(line.split()[1]) * 1000 for line in sys.stdin][2:]  # SET, CREATE
for q in range(3):
    times = ms[q * (runs + 1):(q + 1) * (runs + 1)]
    if len(times) < runs + 1:
        print(f"| {name} | Q{q + 1} | failed | see the log |")
        continue
    print(f"| {name} | Q{q + 1} | {times[0]:.1f} | {statistics.median(times[1:]):.1f} |")
' "$name" "$runs"
}

ordinals=$(for ((i = 0; i < gpus; i++)); do echo $((i % visible)); done | paste -sd,)
table=()
shipped=()
row() { # one configuration's rows (run in this shell, which keeps its shipped bytes)
    local tmp
    tmp=$(mktemp)
    run_config "$@" > "$tmp"
    table+=("$(cat "$tmp")")
    rm -f "$tmp"
}
row "DataFusion" "gpu_topk.enabled = false"
row "one process, 1 device" "gpu_topk.devices = '0'"
row "one process, $gpus devices" "gpu_topk.devices = '$ordinals'"
start_workers 1 50051 > "$OUT/urls"
row "1 worker" "gpu_topk.devices = '0'" --workers "$(cat "$OUT/urls")"
stop_workers
start_workers "$gpus" 50061 > "$OUT/urls"
row "$gpus workers" "gpu_topk.devices = '0'" --workers "$(cat "$OUT/urls")"
stop_workers
rm -f "$OUT/urls"
echo "| configuration | shipped by each operator under EXPLAIN ANALYZE, warm (Q1, Q2, Q3) |"
echo "|---|---|"
printf '%s\n' "${shipped[@]}"
echo
echo "| configuration | query | first ms | warm median ms |"
echo "|---|---|---:|---:|"
printf '%s\n' "${table[@]}"
