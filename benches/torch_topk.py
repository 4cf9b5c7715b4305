#!/usr/bin/env python3
"""Peer of benches/kernels.rs: torch.topk (sorted=True) on the same n / k / key type /
distribution grid, on the GPU, timed with CUDA events (1 warm-up, median of R, L2 flushed before
every repetition).

    python3 benches/torch_topk.py [--op topk|sort] [--n LIST] [--k LIST] [--keys LIST]
        [--dist LIST] [--reps R] [--csv FILE] [--floor-csv FILE] [--quick] [--seed S]
        [--budget SECONDS]

--op sort times sort-and-choose instead: torch.sort(stable=True), then the first k values and
indices. That is CUB's radix sort of (key, index) pairs, ties by index as ours: the peer for a
k close to n, where any top-k is a sort.

The selection is the k smallest (largest=False), as kernels.rs selects ascending. The data is
generated with torch on the GPU from a fixed seed (the same distributions as kernels.rs, not the
same values). torch.amax over the same tensor is timed too, as torch's own read floor; GPU.md
notes it is a weaker kernel than a good reduction (0.83 ms vs 0.70 ms at 2^29 f32 on the H100),
so with --floor-csv FILE (the CSV of kernels.rs, same machine, ideally the same call) torch's
time is also reported as a multiple of *our* read floor for the same n and key type.
"""

import argparse
import csv
import math
import statistics
import sys
import time

DISTS = ["uniform", "all-equal", "narrow", "sorted-asc", "sorted-desc", "zipf-ties", "nan-mix"]
KEYS = ["f32", "i32", "f64", "i64"]
FLUSH_BYTES = 256 << 20


def parse_size(s):
    s = s.strip()
    if s.startswith("2^"):
        return 1 << int(s[2:])
    return int(s.replace("_", ""))


def parse_list(s, item, allowed=None):
    out = [item(p.strip()) for p in s.split(",") if p.strip()]
    if not out:
        raise SystemExit(f"empty list '{s}'")
    if allowed is not None:
        for v in out:
            if v not in allowed:
                raise SystemExit(f"unknown '{v}' (one of {', '.join(allowed)})")
    return out


def size_name(v):
    if v >= 1024 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return str(v)


def options():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["topk", "sort"], default="topk")
    p.add_argument("--n")
    p.add_argument("--k")
    p.add_argument("--keys")
    p.add_argument("--dist")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--csv")
    p.add_argument("--floor-csv")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--budget", type=float, help="start no new data set after this many seconds")
    a = p.parse_args()
    if a.quick:
        ns, ks, dists = [1 << 20, 1 << 24], [32, 1024, 1 << 16], ["uniform", "all-equal"]
    else:
        ns = [1 << 20, 1 << 24, 1 << 27, 1 << 29]
        ks = [1, 8, 32, 256, 1024, 4096, 1 << 16, 1 << 20]
        dists = list(DISTS)
    a.ns = parse_list(a.n, parse_size) if a.n else ns
    a.ks = parse_list(a.k, parse_size) if a.k else ks
    a.key_list = parse_list(a.keys, str, KEYS) if a.keys else list(KEYS)
    a.dists = parse_list(a.dist, str, DISTS) if a.dist else dists
    if a.reps < 1:
        raise SystemExit("--reps must be positive")
    return a


def generate(torch, key, dist, n, seed):
    """n values of `key` type from distribution `dist`, on the GPU (see kernels.rs's Dist)."""
    dev = "cuda"
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    dtype = {"f32": torch.float32, "i32": torch.int32, "f64": torch.float64, "i64": torch.int64}[key]
    is_float = key in ("f32", "f64")
    half = n // 2
    if dist == "uniform":
        if is_float:
            return torch.rand(n, generator=g, device=dev, dtype=dtype)
        if key == "i32":
            return torch.randint(-(1 << 31), (1 << 31) - 1, (n,), generator=g, device=dev, dtype=dtype)
        # The whole int64 range from two 32-bit halves.
        hi = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, device=dev, dtype=torch.int64)
        lo = torch.randint(0, 1 << 32, (n,), generator=g, device=dev, dtype=torch.int64)
        return (hi << 32) | lo
    if dist == "all-equal":
        return torch.full((n,), 42.5 if is_float else 0x01234567, device=dev, dtype=dtype)
    if dist == "narrow":
        if is_float:
            return (128.6 + 0.1 * torch.rand(n, generator=g, device=dev, dtype=torch.float64)).to(dtype)
        return 1_000_000 + torch.randint(0, 4096, (n,), generator=g, device=dev, dtype=dtype)
    if dist in ("sorted-asc", "sorted-desc"):
        i = torch.arange(n, device=dev, dtype=torch.int64)
        v = i - half if dist == "sorted-asc" else half - i
        return v.to(dtype)
    if dist == "zipf-ties":
        u = 1.0 - torch.rand(n, generator=g, device=dev, dtype=torch.float64)  # (0, 1]
        count = torch.floor(u.pow(-1.0 / 1.1) - 1.0).clamp(max=1e9)
        return (-count).to(dtype)
    if dist == "nan-mix":
        assert is_float
        x = 2.0 * torch.rand(n, generator=g, device=dev, dtype=dtype) - 1.0
        nan = torch.rand(n, generator=g, device=dev) < 0.1
        m = int(nan.sum().item())
        if m:
            # NaNs of either sign with random non-zero payloads, built from their bits.
            if key == "f32":
                payload = torch.randint(1, 1 << 23, (m,), generator=g, device=dev, dtype=torch.int64)
                sign = torch.randint(0, 2, (m,), generator=g, device=dev, dtype=torch.int64) << 31
                bits = sign | 0x7F800000 | payload
                bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
                x[nan] = bits.view(torch.float32)
            else:
                payload = torch.randint(1, 1 << 52, (m,), generator=g, device=dev, dtype=torch.int64)
                sign = torch.randint(0, 2, (m,), generator=g, device=dev, dtype=torch.int64).bool()
                bits = 0x7FF0000000000000 | payload
                bits = torch.where(sign, bits | (-(1 << 63)), bits)
                x[nan] = bits.view(torch.float64)
        return x
    raise ValueError(dist)


def read_floor_csv(path):
    """(n, key) -> our read floor in ms, from kernels.rs's CSV."""
    floors = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                ms = float(row["floor_ms"])
            except (KeyError, ValueError):
                continue
            if math.isfinite(ms) and ms > 0:
                floors.setdefault((int(row["n"]), row["key"]), []).append(ms)
    return {key: statistics.median(v) for key, v in floors.items()}


def timed(torch, fn, reps, flush):
    """Median ms of `reps` runs of fn() after one warm-up, L2 flushed before each."""
    times = []
    out = None
    for rep in range(reps + 1):
        flush.add_(1)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        if rep > 0:
            times.append(start.elapsed_time(end))
    return statistics.median(times), out


def main():
    a = options()
    try:
        import torch
    except ImportError as e:
        print(f"no GPU: cannot import torch ({e})")
        return 0
    if not torch.cuda.is_available():
        print("no GPU: torch.cuda.is_available() is False")
        return 0
    floors = read_floor_csv(a.floor_csv) if a.floor_csv else {}
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}; "
          f"{a.reps} reps (+1 warm-up), median; L2 flushed before each; "
          + ("topk largest=False sorted=True" if a.op == "topk" else "sort stable=True, first k"))
    flush = torch.zeros(FLUSH_BYTES // 4, device="cuda", dtype=torch.int32)
    writer = None
    if a.csv:
        f = open(a.csv, "w", newline="")
        writer = csv.writer(f)
        writer.writerow(["n", "k", "key", "dist", "reps", "torch_ms", "amax_ms", "x_amax", "floor_ms", "x_floor", "ok", "op"])
    rows = []
    failures = 0
    skipped = 0
    started = time.time()
    for n in a.ns:
        for key in a.key_list:
            elem = 4 if key in ("f32", "i32") else 8
            for dist in a.dists:
                if dist == "nan-mix" and key not in ("f32", "f64"):
                    continue
                if a.budget is not None and time.time() - started > a.budget:
                    skipped += 1
                    continue
                free, _ = torch.cuda.mem_get_info()
                need = n * elem * 3 + n * 8 + FLUSH_BYTES + (1 << 30)
                if need > free:
                    print(f"skipping n={size_name(n)} {key} {dist}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free")
                    continue
                seed = a.seed * 1000003 + n * 31 + KEYS.index(key) * 7 + DISTS.index(dist)
                x = generate(torch, key, dist, n, seed)
                torch.cuda.synchronize()
                amax_ms, _ = timed(torch, lambda: torch.amax(x), a.reps, flush)
                floor = floors.get((n, key))
                for k in [k for k in a.ks if k <= n]:
                    ok = "ok"
                    if a.op == "topk":
                        op = lambda: torch.topk(x, k, largest=False, sorted=True)  # noqa: E731
                    else:
                        def op():
                            values, indices = torch.sort(x, stable=True)
                            return values[:k], indices[:k]
                    try:
                        ms, (values, indices) = timed(torch, op, a.reps, flush)
                        # Light check: k results, indices in range, values are x[indices].
                        if values.numel() != k or indices.numel() != k:
                            ok = "WRONG count"
                        elif int(indices.min()) < 0 or int(indices.max()) >= n:
                            ok = "WRONG index"
                        elif not torch.equal(x[indices].view(-1).to(torch.float64).nan_to_num(7.0),
                                             values.to(torch.float64).nan_to_num(7.0)):
                            ok = "WRONG values"
                    except RuntimeError as e:  # e.g. out of memory
                        ms, ok = float("nan"), "ERROR " + str(e).splitlines()[0]
                    if ok != "ok":
                        failures += 1
                        print(f"!!!!!!!! {ok}: n={size_name(n)} k={size_name(k)} {key} {dist} !!!!!!!!", file=sys.stderr)
                    x_amax = ms / amax_ms
                    x_floor = ms / floor if floor else float("nan")
                    row = (n, k, key, dist, ms, amax_ms, x_amax, floor if floor else float("nan"), x_floor, ok)
                    rows.append(row)
                    print(f"  n={size_name(n)} k={size_name(k)} {key} {dist}: {ms:.3f} ms "
                          f"({x_amax:.1f}x amax" + (f", {x_floor:.1f}x our floor)" if floor else ")") + f" {ok}")
                    if writer:
                        writer.writerow([n, k, key, dist, a.reps, f"{ms:.5f}", f"{amax_ms:.5f}", f"{x_amax:.3f}",
                                         f"{floor:.5f}" if floor else "", f"{x_floor:.3f}" if floor else "",
                                         ok.replace(",", ";"), a.op])
                        f.flush()
                del x
    print(f"\n{len(rows)} cases in {time.time() - started:.1f} s\n")
    print(f"{'n':>6} {'k':>6} {'key':>4} {'dist':>11} {'torch_ms':>9} {'amax_ms':>8} {'x_amax':>7} "
          f"{'floor_ms':>9} {'x_floor':>8} ok")
    for n, k, key, dist, ms, amax_ms, x_amax, floor, x_floor, ok in rows:
        print(f"{size_name(n):>6} {size_name(k):>6} {key:>4} {dist:>11} {ms:>9.4f} {amax_ms:>8.4f} {x_amax:>7.2f} "
              f"{floor:>9.4f} {x_floor:>8.2f} {ok.split()[0]}")
    if skipped:
        print(f"BUDGET: {skipped} data sets left out after --budget {a.budget:.0f} s")
    if failures:
        print(f"WRONG: {failures} case(s) failed (see above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
