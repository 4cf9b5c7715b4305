#!/usr/bin/env python3
"""The kernel issue's targets, checked against kernel-benchmark CSVs (benches/kernels.rs) and,
optionally, the torch.topk peer's CSVs (benches/torch_topk.py) of the same machine and call.

    python3 benches/targets.py KERNELS.csv [KERNELS.csv ...] [--torch TORCH.csv ...]

"Ours" in a cell is the selection the engine makes: the algorithm the calibrated cost model
predicts fastest when the CSV has predictions (`kernels --cost-model`), else the sampled
selection (`sample`, the default route for these sizes); the fastest algorithm measured is
printed beside it. A cell whose check failed (ok column not `ok`) is reported and counts as a
miss. Targets (n = 2^29 unless said otherwise; multiples of the read floor measured in the same
run):
  - f32 / i32 uniform, k <= 1024: <= 1.2x;  k = 2^16: <= 1.4x;  k = 2^20: <= 2x;
  - f64 / i64 uniform: the same multiples of their own floor;
  - every other distribution within 1.3x of the uniform time of the same key type and k;
  - n = 2^20: <= 50 us, every cell.
Exit status 0 whatever the outcome: this prints, it does not judge a build.
"""

import csv
import signal
import sys
from collections import defaultdict

from torch_topk import size_name  # the peer's script, beside this one (torch is imported lazily)

N29, N20 = 1 << 29, 1 << 20


def load(paths):
    cells = defaultdict(dict)  # (n, key, dist, k) -> algo -> row
    for path in paths:
        for r in csv.DictReader(open(path)):
            if r.get("sel", "1") not in ("1", "1.0", ""):
                continue
            cells[(int(r["n"]), r["key"], r["dist"], int(r["k"]))][r["algo"]] = r
    return cells


def ours(algos):
    """(algo, ms, x_floor, ok) of the engine's choice, and (algo, ms) of the fastest measured."""
    done = {a: r for a, r in algos.items() if r["ok"] in ("ok", "WRONG", "ERROR")}
    timed = {a: r for a, r in done.items() if r["ok"] == "ok"}
    predicted = {a: float(r["predicted_ms"]) for a, r in done.items() if r.get("predicted_ms")}
    choice = min(predicted, key=predicted.get) if predicted else "sample"
    fastest = min(timed, key=lambda a: float(timed[a]["median_ms"])) if timed else None
    r = done.get(choice)
    if r is None:
        return None, fastest and (fastest, float(timed[fastest]["median_ms"]))
    return (choice, float(r["median_ms"]), float(r["x_floor"]), r["ok"]), fastest and (
        fastest,
        float(timed[fastest]["median_ms"]),
    )


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    kpaths, tpaths, into = [], [], None
    for a in argv:
        if a == "--torch":
            into = tpaths
        else:
            (into if into is not None else kpaths).append(a)
    cells = load(kpaths)
    torch = {}
    for path in tpaths:
        for r in csv.DictReader(open(path)):
            if r.get("op", "topk") == "topk" and r["ok"] == "ok":
                torch[(int(r["n"]), r["key"], r["dist"], int(r["k"]))] = float(r["torch_ms"])
    misses = []

    def note(ok, what):
        if not ok:
            misses.append(what)
        return "met" if ok else "MISS"

    print("== n = 2^29, uniform, x read floor (ours: algorithm, ms, x; fastest measured; torch.topk ms, x slower)")
    uniform = {}
    for (n, key, dist, k), algos in sorted(cells.items()):
        if n != N29 or dist != "uniform":
            continue
        o, f = ours(algos)
        if o is None:
            continue
        uniform[(key, k)] = o[1]
        limit = 1.2 if k <= 1024 else 1.4 if k <= 1 << 16 else 2.0
        t = torch.get((n, key, dist, k))
        peer = f"  torch {t:.3f} ms ({t / o[1]:.1f}x slower)" if t else ""
        verdict = note(o[3] == "ok" and o[2] <= limit, f"2^29 {key} uniform k={size_name(k)} {o[2]:.3f}x > {limit}")
        print(f"{key} k={size_name(k):>5}: {o[0]} {o[1]:.3f} ms {o[2]:.3f}x (<= {limit}: {verdict});"
              f" fastest {f[0]} {f[1]:.3f}{peer}")
    print("\n== n = 2^29, other distributions against uniform (same key, same k; target <= 1.3)")
    worst = defaultdict(lambda: (0.0, None))
    for (n, key, dist, k), algos in sorted(cells.items()):
        if n != N29 or dist == "uniform" or (key, k) not in uniform:
            continue
        o, _ = ours(algos)
        if o is None:
            continue
        ratio = o[1] / uniform[(key, k)]
        note(o[3] == "ok" and ratio <= 1.3, f"2^29 {key} {dist} k={size_name(k)} {ratio:.2f}x uniform")
        if ratio > worst[dist][0]:
            worst[dist] = (ratio, f"{key} k={size_name(k)}")
    for dist, (ratio, where) in sorted(worst.items()):
        print(f"{dist:12s} worst {ratio:.2f}x uniform ({where}): {'met' if ratio <= 1.3 else 'MISS'}")
    print("\n== n = 2^20, us (target <= 50): cells over, by k")
    by_k = defaultdict(list)
    for (n, key, dist, k), algos in sorted(cells.items()):
        if n != N20:
            continue
        o, _ = ours(algos)
        if o is None:
            continue
        us = o[1] * 1e3
        by_k[k].append((us, key, dist, o[3]))
        note(o[3] == "ok" and us <= 50, f"2^20 {key} {dist} k={size_name(k)} {us:.1f} us")
    for k, rows in sorted(by_k.items()):
        over = [f"{key}/{dist} {us:.1f}" for us, key, dist, ok in rows if us > 50 or ok != "ok"]
        lo, hi = min(r[0] for r in rows), max(r[0] for r in rows)
        print(f"k={size_name(k):>5}: {len(rows)} cells, {lo:.1f}-{hi:.1f} us; over: {', '.join(over) or 'none'}")
    wrong = [c for c, algos in cells.items() for a, r in algos.items() if r["ok"] in ("WRONG", "ERROR")]
    print(f"\n{len(cells)} cells, {len(wrong)} with a failed check; {len(misses)} target misses")
    for m in misses:
        print("  MISS", m)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    sys.exit(main(sys.argv[1:]))
