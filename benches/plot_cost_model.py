#!/usr/bin/env python3
"""Plots the cost model against measurements: a log-log scatter of predicted vs measured time
per (case, algorithm), from the CSV of `kernels --cost-model` (or of `kernels --replay`), as
an SVG with no dependencies beyond the standard library.

    python3 benches/plot_cost_model.py GRID.csv OUT.svg

Points on the diagonal are exact; the dashed lines are ±25%. A circle marks the algorithm
the model chose for its case.
"""
import csv
import math
import sys
from collections import defaultdict

COLORS = {"bitonic": "#d62728", "radix": "#1f77b4", "sample": "#2ca02c", "delegate": "#9467bd"}
W, H, PAD = 640, 640, 70


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    points = []
    cases = defaultdict(list)
    for r in csv.DictReader(open(src)):
        if r.get("ok", "ok") != "ok":
            continue
        measured = r.get("median_ms") or r.get("measured_ms")
        try:
            m, p = float(measured), float(r["predicted_ms"])
        except (TypeError, ValueError):
            continue
        if not (m > 0 and p > 0):
            continue
        key = (r["n"], r["k"], r["key"], r["dist"], r["sel"])
        points.append((m, p, r["algo"], key))
        cases[key].append((p, r["algo"]))
    if not points:
        sys.exit(f"{src}: no rows with both a measured and a predicted time")
    chosen = {key: min(v)[1] for key, v in cases.items()}
    lo = min(min(m, p) for m, p, _, _ in points) / 1.5
    hi = max(max(m, p) for m, p, _, _ in points) * 1.5
    llo, lhi = math.log10(lo), math.log10(hi)

    def xy(m, p):
        x = PAD + (math.log10(m) - llo) / (lhi - llo) * (W - 2 * PAD)
        y = H - PAD - (math.log10(p) - llo) / (lhi - llo) * (H - 2 * PAD)
        return x, y

    errors = sorted(abs(p - m) / m for m, p, _, _ in points)
    median = errors[len(errors) // 2]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    # Decade grid and labels.
    for e in range(math.floor(llo), math.ceil(lhi) + 1):
        v = 10.0 ** e
        if not lo <= v <= hi:
            continue
        x, _ = xy(v, lo)
        _, y = xy(lo, v)
        svg.append(f'<line x1="{x:.1f}" y1="{PAD}" x2="{x:.1f}" y2="{H - PAD}" stroke="#eee"/>')
        svg.append(f'<line x1="{PAD}" y1="{y:.1f}" x2="{W - PAD}" y2="{y:.1f}" stroke="#eee"/>')
        label = f"{v:g} ms"
        svg.append(f'<text x="{x:.1f}" y="{H - PAD + 16}" text-anchor="middle">{label}</text>')
        svg.append(f'<text x="{PAD - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for factor, dash in ((1.0, ""), (1.25, ' stroke-dasharray="4 4"'), (0.75, ' stroke-dasharray="4 4"')):
        x1, y1 = xy(lo, lo * factor)
        x2, y2 = xy(hi, hi * factor)
        svg.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#888"{dash}/>')
    for m, p, algo, key in points:
        x, y = xy(m, p)
        color = COLORS.get(algo, "black")
        svg.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{color}" fill-opacity="0.6"/>')
        if chosen.get(key) == algo:
            svg.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="none" stroke="{color}"/>')
    svg.append(f'<text x="{W / 2}" y="{H - 20}" text-anchor="middle">measured (median of the run)</text>')
    svg.append(f'<text x="18" y="{H / 2}" text-anchor="middle" transform="rotate(-90 18 {H / 2})">'
               f'predicted by the cost model</text>')
    svg.append(f'<text x="{PAD}" y="24">cost model vs measurement: {len(points)} (case, algorithm) '
               f'pairs, median error {100 * median:.1f}%</text>')
    for i, (algo, color) in enumerate(COLORS.items()):
        svg.append(f'<circle cx="{PAD + 10}" cy="{44 + 16 * i}" r="4" fill="{color}"/>')
        svg.append(f'<text x="{PAD + 20}" y="{48 + 16 * i}">{algo}</text>')
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")
    print(f"{out}: {len(points)} points, median |predicted - measured| / measured {100 * median:.1f}%")


if __name__ == "__main__":
    main()
