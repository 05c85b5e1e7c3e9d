"""What any hold could catch on a window's arrivals, in hindsight: the best fixed hold, the best hold
per stretch of the window, and the oracle that holds through exactly the gaps it catches.

    python3 hold_bound.py DIR_OR_CSV [DIR_OR_CSV ...] [--service-s 0.3] [--cooldown-s 0.011] \\
        [--stretches K] [--json OUT]

Each input is a window-arrivals.csv as hold_seed.py writes it (offset_us), or a hold_seed.py --out
directory (its window-arrivals.csv, and its hold-seed.json's prediction of the gate's policy beside
the bounds). The server serves one request at a time, each --service-s long; an idle arrival is
one that finds it idle longer than --cooldown-s since its last request, and its gap g is that idle
time past the cooldown (trace_windows.idle_gaps, as the variants script of
docs/results/2026-12-02-cpu-gate-hold-history.md counts them). Idle time is the sum of g + cooldown
over the idle arrivals; the cooldown is always lost, a hold H loses min(g, H) more and catches the
arrival if g <= H. No tail after the window's last request is counted (nor by the variants script
or gate_hold). Every bound is exact: the fixed frontier over the gaps themselves, the piecewise one
by dynamic programming over the caught count (a multiple-choice knapsack, K stretches by when the
server went idle), the oracle by taking the smallest gaps first. Switch costs are not counted.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trace_windows  # noqa: E402

HARVESTS = (0.90, 0.85, 0.80)
TARGET_CAUGHT = 0.70
STRETCH_S = 150.0
EPS = 1e-9


def read_window(path: str) -> list[float]:
    """Arrival offsets (s) from a window CSV (offset_us column), in order."""
    with open(path) as f:
        return sorted(int(r["offset_us"]) / 1e6 for r in csv.DictReader(f))


def gaps_of(offsets: list[float], service_s: float, cooldown_s: float) -> list[tuple[float, float]]:
    """(when the server went idle, gap past the cooldown) of each idle arrival; gaps to the
    nanosecond, so that equal gaps tie whatever the sums' rounding."""
    return [(t - g - cooldown_s, round(g, 9)) for t, g in trace_windows.idle_gaps(offsets, service_s, cooldown_s)]


def fixed_frontier(gaps: list[float]) -> list[tuple[int, float, float]]:
    """Every useful fixed hold: (caught, lost past the cooldowns, H), H = 0 then each distinct gap;
    caught and lost both rise with H, and no H between two gaps catches more than the lower one."""
    g = sorted(gaps)
    out, below = [(0, 0.0, 0.0)], 0.0
    for j, x in enumerate(g, 1):
        below += x
        if j < len(g) and g[j] == x:
            continue  # ties: the hold at x catches them all
        out.append((j, below + (len(g) - j) * x, x))
    return out


def piecewise_frontier(groups: list[list[float]]) -> dict[int, tuple[float, list[float]]]:
    """For each total caught count reachable with one hold per group: the least lost idle time
    (past the cooldowns) and the holds that give it. Exact (dynamic programming over the count)."""
    best: dict[int, tuple[float, list[float]]] = {0: (0.0, [])}
    for grp in groups:
        nxt: dict[int, tuple[float, list[float]]] = {}
        for c0, (l0, hs) in best.items():
            for c, l, h in fixed_frontier(grp):
                k, v = c0 + c, l0 + l
                if k not in nxt or v < nxt[k][0] - EPS:
                    nxt[k] = (v, hs + [h])
        best = nxt
    return best


def harvest(lost: float, cooldowns: float, idle: float) -> float:
    return 1.0 - (lost + cooldowns) / idle if idle > 0 else float("nan")


def point(caught: int, lost: float, n: int, cooldowns: float, idle: float, **extra) -> dict:
    return {"caught": caught, "caught_pct": 100.0 * caught / n if n else float("nan"),
            "harvest_pct": 100.0 * harvest(lost, cooldowns, idle), **extra}


def best_caught(points: list[tuple[int, float, object]], n: int, cooldowns: float, idle: float,
                min_harvest: float, key: str) -> dict | None:
    """The point with most caught at harvest >= min_harvest (least lost among ties)."""
    ok = [p for p in points if harvest(p[1], cooldowns, idle) >= min_harvest - EPS]
    if not ok:
        return None
    c, l, h = max(ok, key=lambda p: (p[0], -p[1]))
    return point(c, l, n, cooldowns, idle, **{key: h})


def best_harvest(points: list[tuple[int, float, object]], n: int, cooldowns: float, idle: float,
                 share: float, key: str) -> dict | None:
    """The point with the highest harvest that catches at least `share` of the idle arrivals."""
    need = math.ceil(share * n - EPS)
    ok = [p for p in points if p[0] >= need]
    if not ok:
        return None
    c, l, h = min(ok, key=lambda p: (p[1], -p[0]))
    return point(c, l, n, cooldowns, idle, **{key: h})


def bound(offsets: list[float], service_s: float, cooldown_s: float, stretches: int,
          span_s: float | None = None, policy_harvest_pct: float | None = None) -> dict:
    """Every bound of one window, as hold_bound.py prints and writes them."""
    span = span_s if span_s else (offsets[-1] if offsets else 0.0)
    ig = gaps_of(offsets, service_s, cooldown_s)
    g = [x for _, x in ig]
    n = len(g)
    cool = n * cooldown_s
    idle = sum(g) + cool
    k = max(1, stretches)
    width = span / k if span > 0 else 1.0
    groups: list[list[float]] = [[] for _ in range(k)]
    for start, x in ig:
        groups[min(k - 1, max(0, int(start // width)))].append(x)
    fixed = fixed_frontier(g)
    pw = piecewise_frontier(groups)
    pw_points = [(c, l, hs) for c, (l, hs) in sorted(pw.items())]
    srt, prefix = sorted(g), [0.0]
    for x in srt:
        prefix.append(prefix[-1] + x)
    oracle = [(j, prefix[j], srt[j - 1] if j else 0.0) for j in range(n + 1)]
    out = {
        "requests": len(offsets), "span_s": span, "service_s": service_s, "cooldown_s": cooldown_s,
        "idle_arrivals": n, "idle_s": idle, "cooldown_lost_s": cool,
        "harvest_at_no_hold_pct": 100.0 * harvest(0.0, cool, idle),
        "stretches": k, "stretch_s": width,
        "stretch_idle_arrivals": [len(x) for x in groups],
        "fixed_frontier": [point(c, l, n, cool, idle, hold_s=h) for c, l, h in fixed],
        "piecewise_frontier": [point(c, l, n, cool, idle) for c, l, _ in pw_points],
    }
    for name, pts, key in (("fixed", fixed, "hold_s"), ("piecewise", pw_points, "holds_s"),
                           ("oracle", oracle, "largest_caught_gap_s")):
        out[name] = {f"at_harvest_{round(100 * h)}": best_caught(pts, n, cool, idle, h, key) for h in HARVESTS}
        out[name][f"for_{round(100 * TARGET_CAUGHT)}pct_caught"] = best_harvest(pts, n, cool, idle,
                                                                              TARGET_CAUGHT, key)
        if policy_harvest_pct is not None:
            out[name]["at_policy_harvest"] = best_caught(pts, n, cool, idle, policy_harvest_pct / 100.0, key)
    return out


def load_input(path: str) -> tuple[str, list[float], dict | None]:
    """(label, offsets, hold-seed.json or None) of a CSV or a hold_seed.py --out directory."""
    if os.path.isdir(path):
        seed_json = os.path.join(path, "hold-seed.json")
        info = json.load(open(seed_json)) if os.path.exists(seed_json) else None
        return path, read_window(os.path.join(path, "window-arrivals.csv")), info
    return path, read_window(path), None


def pct(p: dict | None, key: str = "caught_pct") -> str:
    return "-" if p is None else f"{p[key]:.1f}%"


def pair(p: dict | None) -> str:
    return "-" if p is None else f"{p['caught_pct']:.1f}% / {p['harvest_pct']:.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="window-arrivals.csv files or hold_seed.py --out directories")
    ap.add_argument("--service-s", type=float, default=0.3, help="each request's service time (s)")
    ap.add_argument("--cooldown-s", type=float, default=0.011, help="the gate's cooldown (s), always lost")
    ap.add_argument("--stretches", type=int, default=0,
                    help=f"stretches of the piecewise hold (default: the window's span / {STRETCH_S:g} s)")
    ap.add_argument("--json", metavar="OUT", help="write every number here")
    a = ap.parse_args(argv)
    if a.service_s <= 0 or a.cooldown_s < 0 or a.stretches < 0:
        ap.error("--service-s must be above 0, --cooldown-s and --stretches at least 0")
    rows = []
    for path in a.inputs:
        label, offsets, info = load_input(path)
        pol = (info or {}).get("predicted_seeded")
        span = offsets[-1] if offsets else 0.0
        k = a.stretches or max(1, round(span / STRETCH_S))
        b = bound(offsets, a.service_s, a.cooldown_s, k, span, pol["harvest_pct"] if pol else None)
        b["input"] = label
        if info:
            b["window_seed"] = info.get("window_seed")
            b["policy_seeded"], b["policy_fresh"] = pol, info.get("predicted_fresh")
        rows.append(b)
    print("Caught share of idle arrivals at harvest >= 90% (fixed hold H, one hold per stretch, oracle);")
    print("the harvest at which 70% would be caught; the policy's prediction (hold-seed.json, seeded).")
    print()
    print("| window | idle arrivals | idle s | fixed @90% (H) | fixed @85% / @80% | fixed for 70% | "
          "piecewise @90% | piecewise for 70% | oracle @90% | oracle for 70% | policy (seeded) | "
          "fixed / piecewise at the policy's harvest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b in rows:
        f, p, o = b["fixed"], b["piecewise"], b["oracle"]
        f90 = f["at_harvest_90"]
        pol = b.get("policy_seeded")
        at_pol = (f"{pct(f.get('at_policy_harvest'))} / {pct(p.get('at_policy_harvest'))}" if pol else "-")
        print(f"| {b.get('window_seed', b['input'])} | {b['idle_arrivals']} | {b['idle_s']:.0f} | "
              f"{pct(f90)} ({f90['hold_s']:.2f} s) | {pct(f['at_harvest_85'])} / {pct(f['at_harvest_80'])} | "
              f"{pct(f['for_70pct_caught'], 'harvest_pct')} | {pct(p['at_harvest_90'])} | "
              f"{pct(p['for_70pct_caught'], 'harvest_pct')} | {pct(o['at_harvest_90'])} | "
              f"{pct(o['for_70pct_caught'], 'harvest_pct')} | {pair(pol)} | {at_pol} |")
    if len(rows) == 1:
        b = rows[0]
        p90 = b["piecewise"]["at_harvest_90"]
        print()
        print(f"{b['requests']} requests over {b['span_s']:.0f} s; {b['idle_arrivals']} idle arrivals, "
              f"{b['idle_s']:.1f} s idle ({b['cooldown_lost_s']:.2f} s of it cooldowns: harvest "
              f"{b['harvest_at_no_hold_pct']:.2f}% with no hold)")
        print(f"piecewise holds at 90% ({b['stretches']} stretches of {b['stretch_s']:.0f} s): "
              + ", ".join(f"{h:.2f} s ({m})" for h, m in zip(p90["holds_s"], b["stretch_idle_arrivals"]))
              + " (s (idle arrivals in the stretch))")
    if len(rows) > 1:
        summary = {}
        n = sum(b["idle_arrivals"] for b in rows)
        print()
        print("| bound at harvest >= 90% | windows | idle arrivals | caught, pooled | caught, mean of windows | "
              "windows reaching 70% |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in ("fixed", "piecewise", "oracle"):
            ps = [b[name]["at_harvest_90"] for b in rows]
            pooled = 100.0 * sum(p["caught"] for p in ps) / max(n, 1)
            mean = sum(p["caught_pct"] for p in ps) / len(ps)
            reach = sum(p["caught_pct"] >= 100 * TARGET_CAUGHT - EPS for p in ps)
            summary[name] = {"pooled_caught_pct": pooled, "mean_caught_pct": mean, "windows_reaching_70": reach}
            print(f"| {name} | {len(rows)} | {n} | {pooled:.1f}% | {mean:.1f}% | {reach} |")
        pols = [b["policy_seeded"] for b in rows if b.get("policy_seeded")]
        if len(pols) == len(rows):
            npol = sum(p["idle_arrivals"] for p in pols)
            pooled = sum(p["idle_arrivals"] * p["caught_pct"] for p in pols) / max(npol, 1)
            mh = sum(p["harvest_pct"] for p in pols) / len(pols)
            reach = sum(p["caught_pct"] >= 70 and p["harvest_pct"] >= 90 for p in pols)
            summary["policy_seeded"] = {"pooled_caught_pct": pooled, "mean_harvest_pct": mh,
                                        "windows_reaching_70_at_90": reach, "idle_arrivals": npol}
            print(f"| policy (seeded, its own harvest: mean {mh:.1f}%) | {len(pols)} | {npol} | {pooled:.1f}% | "
                  f"{sum(p['caught_pct'] for p in pols) / len(pols):.1f}% | {reach} (at >= 90% harvest) |")
    else:
        summary = None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"windows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
