#!/usr/bin/env python3
"""The README's two figures, drawn as SVG from the result reports in docs/results/.

Standard library only. `python3 scripts/figures.py` rewrites docs/results/figures/*.svg;
`--check` redraws them in memory and fails if a committed figure differs from its report.
"""

import argparse
import json
import os
import sys
from xml.sax.saxutils import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
FIGURES = os.path.join(RESULTS, "figures")

# Figure (a): the hardware test's gate benchmark, one report per device.
LATENCY_REPORTS = ["2026-11-26-h100-hwtest-15.json", "2026-11-26-h200-hwtest-13.json"]
# Which of the benchmark's configurations to draw, by the start of their name in the report.
LATENCY_CONFIGS = [
    ("online alone", "alone"),
    ("no control (time-slicing)", "time-sliced"),
    ("valvectl gate", "under the gate"),
]
# Figure (b): the memory benchmark's static split against the pool with MIAD.
THROUGHPUT_REPORT = "2026-11-24-h100-membench-11.json"
THROUGHPUT_CONFIGS = [("static", "static split"), ("valve-miad", "Valve pool (MIAD)")]

COLOURS = ["#4c72b0", "#dd8452", "#55a868"]
FONT = 'font-family="sans-serif"'


class ReportError(Exception):
    """A report lacks a field a figure needs."""


def load(name):
    path = os.path.join(RESULTS, name)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path} is missing: restore it or change the report list in {__file__}")
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not valid JSON ({e}): restore it from git")


def field(obj, *keys, source):
    """obj[k1][k2]..., or a ReportError naming the report and the missing path."""
    for k in keys:
        if not isinstance(obj, dict) or k not in obj or obj[k] is None:
            raise ReportError(f"{source}: no field {'.'.join(keys)}")
        obj = obj[k]
    return obj


def latency_series(name):
    """(device, date, [(label, p50 ms, p99 ms)]) from one hardware-test report."""
    report = load(name)
    device = field(report, "gpus", source=name)[0]["name"].replace("NVIDIA ", "")
    configs = field(report, "gate", "configurations", source=name)
    rows = []
    for prefix, label in LATENCY_CONFIGS:
        match = [c for c in configs if c.get("name", "").startswith(prefix)]
        if not match:
            raise ReportError(f"{name}: no gate configuration named '{prefix}...'")
        serving = field(match[0], "serving", source=name)
        p50 = field(serving, "p50_us", source=name) / 1000.0
        p99 = field(serving, "p99_us", source=name) / 1000.0
        rows.append((label, p50, p99))
    return device, field(report, "date", source=name), rows


def throughput_series(name):
    """(device, [(label, offline tokens/s, TTFT p99 vs alone %)]) from the memory benchmark."""
    report = load(name)
    bench = field(report, "runs", "bench", source=name)
    rows = []
    for key, label in THROUGHPUT_CONFIGS:
        cfg = field(bench, "configs", key, source=name)
        rows.append((label, field(cfg, "offline_tokens_per_s", source=name),
                     field(cfg, "ttft_p99_vs_alone_pct", source=name)))
    return field(bench, "device", source=name).replace("NVIDIA ", ""), rows


def nice_max(value):
    """The smallest 1, 2 or 5 times a power of ten at or above value (the axis' top)."""
    step = 1.0
    while step * 10 <= value:
        step *= 10
    while step > value and step > 1e-9:
        step /= 10
    for m in (1, 2, 5, 10):
        if m * step >= value:
            return m * step
    return 10 * step


def fmt(v):
    if v == 0:
        return "0"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def svg_doc(width, height, body):
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {FONT} font-size="12">\n'
            f'<rect width="{width}" height="{height}" fill="white"/>\n')
    return head + "".join(body) + "</svg>\n"


def text(x, y, s, size=12, anchor="middle", weight="normal"):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}">{escape(s)}</text>\n')


def panel(x0, y0, w, h, title, groups, series, unit):
    """A bar panel: groups = [(label, [value per series])], series = [legend name]."""
    top = nice_max(max(v for _, vals in groups for v in vals) * 1.1)
    out = [text(x0 + w / 2, y0 - 8, title, 13, weight="bold")]
    out.append(f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="black"/>\n')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + h}" stroke="black"/>\n')
    for i in range(5):
        v = top * i / 4
        y = y0 + h - h * i / 4
        out.append(f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0}" y2="{y:.1f}" stroke="black"/>\n')
        out.append(text(x0 - 6, y + 4, fmt(v), 11, anchor="end"))
    out.append(f'<text transform="translate({x0 - 42},{y0 + h / 2}) rotate(-90)" '
               f'text-anchor="middle" font-size="11">{escape(unit)}</text>\n')
    gw = w / len(groups)
    bw = gw * 0.7 / len(series)
    for gi, (label, vals) in enumerate(groups):
        gx = x0 + gi * gw + gw * 0.15
        for si, v in enumerate(vals):
            bh = h * v / top
            bx = gx + si * bw
            out.append(f'<rect x="{bx:.1f}" y="{y0 + h - bh:.1f}" width="{bw - 2:.1f}" '
                       f'height="{bh:.1f}" fill="{COLOURS[si % len(COLOURS)]}"/>\n')
            out.append(text(bx + bw / 2 - 1, y0 + h - bh - 4, fmt(v), 10))
        out.append(text(x0 + gi * gw + gw / 2, y0 + h + 16, label, 11))
    return out


def legend(x, y, series):
    out = []
    for i, name in enumerate(series):
        out.append(f'<rect x="{x}" y="{y + i * 16}" width="10" height="10" '
                   f'fill="{COLOURS[i % len(COLOURS)]}"/>\n')
        out.append(text(x + 14, y + i * 16 + 9, name, 11, anchor="start"))
    return out


def latency_figure():
    """Figure (a): online request latency alone, time-sliced and under the gate, per device."""
    panels = [latency_series(n) for n in LATENCY_REPORTS]
    width, pw, ph = 340 * len(panels) + 40, 280, 220
    body = [text(width / 2, 20, "Online request latency beside a GPU-bound offline job", 15,
                 weight="bold")]
    for i, (device, date, rows) in enumerate(panels):
        groups = [(label, [p50, p99]) for label, p50, p99 in rows]
        body += panel(70 + i * 340, 60, pw, ph, f"1x {device}, {date}", groups, ["p50", "p99"],
                      "latency (ms)")
    body += legend(width - 80, 60, ["p50", "p99"])
    sources = ", ".join(LATENCY_REPORTS)
    body.append(text(width / 2, 60 + ph + 44, f"scripts/hwtest.sh gate benchmark; from {sources}",
                     10))
    return svg_doc(width, 60 + ph + 56, body)


def throughput_figure():
    """Figure (b): offline throughput under the memory pool against a static split."""
    device, rows = throughput_series(THROUGHPUT_REPORT)
    width, pw, ph = 560, 360, 220
    ratio = rows[1][1] / rows[0][1]
    body = [text(width / 2, 20, "Offline throughput beside online serving, shared GPU memory",
                 15, weight="bold")]
    groups = [(label, [tps]) for label, tps, _ in rows]
    body += panel(90, 60, pw, ph, f"1x {device}: {ratio:.2f}x the static split", groups,
                  ["offline tokens/s"], "offline tokens/s")
    notes = "online TTFT p99 against online alone: " + ", ".join(
        f"{label} {pct:+.1f}%" for label, _, pct in rows)
    body.append(text(width / 2, 60 + ph + 36, notes, 10))
    body.append(text(width / 2, 60 + ph + 52,
                     f"hwtests/membench/run.sh bench; from {THROUGHPUT_REPORT}", 10))
    return svg_doc(width, 60 + ph + 64, body)


FIGURE_FUNCS = {
    "online-latency.svg": latency_figure,
    "offline-throughput.svg": throughput_figure,
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="fail if a committed figure differs from what its report draws")
    ap.add_argument("--out", default=FIGURES, help="folder for the SVG files (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        drawn = {name: f() for name, f in FIGURE_FUNCS.items()}
    except ReportError as e:
        print(f"figures: {e}", file=sys.stderr)
        return 2
    stale = []
    for name, svg in drawn.items():
        path = os.path.join(args.out, name)
        if args.check:
            try:
                with open(path, encoding="utf-8") as f:
                    if f.read() != svg:
                        stale.append(path)
            except FileNotFoundError:
                stale.append(path)
        else:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
            print(f"wrote {path}")
    if stale:
        print("figures: out of date with their reports: " + ", ".join(stale)
              + "; run python3 scripts/figures.py and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
