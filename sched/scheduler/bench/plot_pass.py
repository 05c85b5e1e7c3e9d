#!/usr/bin/env python3
"""Draws pass time against cluster size from `valve-scheduler --json bench-pass --sweep` output.

Usage: plot_pass.py OUT.svg [LABEL=]SWEEP.json ...

One line per input, pass and number of job profiles (LABEL, if given, names the input's passes
in the legend), on log-log axes: x is pending jobs + nodes, y the
median wall time of one pass. Only the sizes of 10 jobs per node are drawn (the sweep's diagonal:
1,000 x 100, 10,000 x 1,000, 100,000 x 10,000), so that each line is one way of growing. Where the reference pass ran on the first jobs of its order only
and its time was scaled to the whole queue, its marker is hollow. Standard library only.
"""

import json
import math
import sys

W, H = 720, 480
LEFT, RIGHT, TOP, BOTTOM = 80, 200, 30, 60
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def series(rows, label, out):
    """Adds {(pass, classes): [(size, ms, estimated)]} to `out`, each sorted by size."""
    for row in rows:
        for t in row["timings"]:
            if t["pending"] != 10 * t["nodes"]:
                continue
            est = t["timed_jobs"] < t["pending"]
            ms = t["estimated_ms"] if est else median(t["pass_ms"])
            key = (f'{t["pass"]}{label}', t["classes"])
            out.setdefault(key, []).append((t["pending"] + t["nodes"], ms, est))
    for v in out.values():
        v.sort()


def log_axis(lo, hi):
    """Decades covering [lo, hi]."""
    return math.floor(math.log10(lo)), math.ceil(math.log10(hi))


def svg(data):
    xs = [p[0] for v in data.values() for p in v]
    ys = [p[1] for v in data.values() for p in v]
    x0, x1 = log_axis(min(xs), max(xs))
    y0, y1 = log_axis(min(ys), max(ys))
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x):
        return LEFT + (math.log10(x) - x0) / (x1 - x0) * pw

    def py(y):
        return TOP + ph - (math.log10(y) - y0) / (y1 - y0) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>',
    ]
    for d in range(x0, x1 + 1):
        x = px(10**d)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + ph + 18}" text-anchor="middle">1e{d}</text>')
    for d in range(y0, y1 + 1):
        y = py(10**d)
        label = f"{10**d:g} ms" if d < 3 else f"{10**(d - 3):g} s"
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    out.append(
        f'<text x="{LEFT + pw / 2}" y="{H - 15}" text-anchor="middle">'
        "pending jobs + nodes (8 GPUs each)</text>"
    )
    out.append(
        f'<text x="18" y="{TOP + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 18 {TOP + ph / 2})">one pass, wall time (median)</text>'
    )
    for i, (key, pts) in enumerate(sorted(data.items())):
        c = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        for x, y, est in pts:
            fill = "white" if est else c
            out.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{fill}" stroke="{c}"/>'
            )
        ly = TOP + 16 + i * 20
        out.append(f'<line x1="{LEFT + pw + 12}" y1="{ly}" x2="{LEFT + pw + 32}" y2="{ly}" '
                   f'stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + pw + 38}" y="{ly + 4}">{key[0]}, {key[1]} profiles</text>')
    ly = TOP + 16 + len(data) * 20 + 10
    out.append(f'<circle cx="{LEFT + pw + 22}" cy="{ly}" r="3.5" fill="white" stroke="#444"/>')
    out.append(f'<text x="{LEFT + pw + 38}" y="{ly + 4}">estimated from</text>')
    out.append(f'<text x="{LEFT + pw + 38}" y="{ly + 18}">the first jobs</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: plot_pass.py OUT.svg [LABEL=]SWEEP.json ... (SWEEP.json from "
                 "`valve-scheduler --json bench-pass --sweep`)")
    data = {}
    for arg in sys.argv[2:]:
        label, _, path = arg.rpartition("=")
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as e:
            sys.exit(f"cannot read {path}: {e.strerror}")
        except json.JSONDecodeError as e:
            sys.exit(f"{path} is not JSON ({e}); give `valve-scheduler --json bench-pass` output")
        rows = doc.get("rows") if isinstance(doc, dict) else None
        if not rows:
            sys.exit(f"{path}: no rows; expected `valve-scheduler --json bench-pass` output")
        series(rows, f" ({label})" if label else "", data)
    with open(sys.argv[1], "w") as f:
        f.write(svg(data))


if __name__ == "__main__":
    main()
