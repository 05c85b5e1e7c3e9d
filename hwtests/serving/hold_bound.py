"""What any hold could catch on a window, in hindsight: the upper bounds the gate's hold policy
is measured against (issue 49's >= 70% of idle arrivals caught at >= 90% of idle time harvested).

    python3 hold_bound.py DIR [DIR ...] [--service-s 0.3] [--cooldown-s 0.011] [--stretches 8]
        [--json OUT]

Each DIR is a `hold_seed.py --out` directory (its window-arrivals.csv, and hold-seed.json for the
policy's own prediction beside the bounds). The server is one request at a time with a fixed
service, as in the prediction. An idle arrival's gap is its idle time past the cooldown; a hold H
catches it if gap <= H and costs min(gap, H) of offline time; the cooldown is never harvested.
Three bounds, each the most idle arrivals caught at a harvest of at least 90% (85%, 80%):
  fixed      one hold for the whole window, chosen knowing every gap;
  piecewise  a hold per stretch (--stretches equal parts of the window), chosen knowing every gap
             (exact multiple-choice knapsack over idle time in 10-ms steps, rounded down: an upper
             bound within 10 ms a stretch);
  oracle     a freeze through exactly the gaps it catches, the shortest first: no policy that
             must be frozen when the arrival comes can do better.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

HARVESTS = (0.90, 0.85, 0.80)
STEP_S = 0.01  # the piecewise bound's idle-time resolution


def read_offsets(path: str) -> list[float]:
    """Arrival times (s) of hold_seed.py's window-arrivals.csv (column offset_us)."""
    with open(path, newline="") as f:
        return sorted(float(r["offset_us"]) / 1e6 for r in csv.DictReader(f))


def idle_gaps(arrivals: list[float], service_s: float, cooldown_s: float) -> list[tuple[float, float]]:
    """(time, gap) of each arrival that finds the server idle past the cooldown (the same server
    as the prediction's replay: docs/results/2026-12-02-cpu-gate-hold-history-variants.py)."""
    free, out = None, []
    for t in arrivals:
        if free is not None and t > free + cooldown_s:
            out.append((t, t - free - cooldown_s))
        free = max(t, free if free is not None else t) + service_s
    return out


def fixed_frontier(gaps: list[float]) -> list[tuple[int, float, float]]:
    """(caught, lost, hold) for every hold worth considering: 0 and each gap, ascending."""
    g = sorted(gaps)
    n, out, below = len(g), [(0, 0.0, 0.0)], 0.0
    for k, h in enumerate(g):
        below += h
        if k + 1 < n and g[k + 1] == h:
            continue  # equal gaps: the last of them stands for the hold
        # Holding h catches g[0..k], costs them and h for every longer one.
        out.append((k + 1, below + h * (n - k - 1), h))
    return out


def best_fixed(gaps: list[float], allowed: float) -> tuple[int, float]:
    """Most caught by one hold costing at most `allowed`, and that hold."""
    best = (0, 0.0)
    for caught, lost, h in fixed_frontier(gaps):
        if lost <= allowed + 1e-9 and caught > best[0]:
            best = (caught, h)
    return best


def best_piecewise(stretches: list[list[float]], allowed: float) -> int:
    """Most caught with one hold per stretch, the holds' cost summed at most `allowed`."""
    units = int(allowed / STEP_S + 1e-9)
    best = [0] * (units + 1)  # best[u]: most caught so far within u steps of cost
    for gaps in stretches:
        options = {}
        for caught, lost, _ in fixed_frontier(gaps):
            u = int(lost / STEP_S)  # rounded down: the bound errs on the generous side
            if u <= units and options.get(u, -1) < caught:
                options[u] = caught
        nxt = [0] * (units + 1)
        for u in range(units + 1):
            nxt[u] = max(best[u - c] + k for c, k in options.items() if c <= u)
        best = nxt
    return best[units]


def best_oracle(gaps: list[float], allowed: float) -> int:
    """Most caught by freezing through exactly the caught gaps, shortest first."""
    spent, caught = 0.0, 0
    for g in sorted(gaps):
        if spent + g > allowed + 1e-9:
            break
        spent, caught = spent + g, caught + 1
    return caught


def bounds(times_gaps: list[tuple[float, float]], span: tuple[float, float], stretches: int,
           cooldown_s: float) -> dict:
    """Every bound at each harvest, and the fixed hold's harvest where it catches 70%."""
    gaps = [g for _, g in times_gaps]
    n = len(gaps)
    idle = sum(gaps) + n * cooldown_s
    start, end = span
    width = (end - start) / stretches
    parts = [[g for t, g in times_gaps if min(int((t - start) / width), stretches - 1) == k] for k in range(stretches)]
    out = {"idle_arrivals": n, "idle_s": idle, "stretches": stretches, "at": {}}
    pct = lambda k: 100.0 * k / n if n else 0.0  # noqa: E731
    for h in HARVESTS:
        allowed = (1 - h) * idle - n * cooldown_s
        f, hold = best_fixed(gaps, allowed) if allowed > 0 else (0, 0.0)
        p = best_piecewise(parts, allowed) if allowed > 0 else 0
        o = best_oracle(gaps, allowed) if allowed > 0 else 0
        out["at"][f"{round(h * 100)}"] = {"fixed_pct": pct(f), "fixed_hold_s": hold, "piecewise_pct": pct(p),
                                          "oracle_pct": pct(o)}
    need = -(-7 * n // 10)  # 70%, rounded up
    for caught, lost, h in fixed_frontier(gaps):
        if caught >= need:
            out["fixed_70_harvest_pct"] = 100.0 * (1 - (lost + n * cooldown_s) / idle) if idle else None
            out["fixed_70_hold_s"] = h
            break
    return out


def one_dir(d: str, service_s: float, cooldown_s: float, stretches: int) -> dict:
    arrivals = read_offsets(os.path.join(d, "window-arrivals.csv"))
    tg = idle_gaps(arrivals, service_s, cooldown_s)
    r = bounds(tg, (arrivals[0], arrivals[-1]), stretches, cooldown_s) if arrivals else {"idle_arrivals": 0}
    r["dir"] = d
    seed = os.path.join(d, "hold-seed.json")
    if os.path.exists(seed):
        with open(seed) as f:
            r["policy"] = json.load(f).get("predicted_seeded")
    return r


def table(rows: list[dict]) -> str:
    head = ("| window | idle arrivals | policy (predicted): caught, harvest | at 90%: fixed (hold) / "
            "piecewise / oracle | at 85% | at 80% | fixed hold catching 70%: harvest |")
    out = [head, "|" + " --- |" * 7]
    for r in rows:
        if not r.get("idle_arrivals"):
            out.append(f"| {r['dir']} | 0 | - | - | - | - | - |")
            continue
        a = r["at"]
        pol = r.get("policy") or {}
        pol_s = f"{pol['caught_pct']:.1f}%, {pol['harvest_pct']:.1f}%" if pol else "-"
        cell = lambda k: f"{a[k]['fixed_pct']:.1f} / {a[k]['piecewise_pct']:.1f} / {a[k]['oracle_pct']:.1f}"  # noqa: E731
        out.append(f"| {r['dir']} | {r['idle_arrivals']} | {pol_s} | {a['90']['fixed_pct']:.1f}% "
                   f"({a['90']['fixed_hold_s']:.2f} s) / {a['90']['piecewise_pct']:.1f}% / {a['90']['oracle_pct']:.1f}% "
                   f"| {cell('85')} | {cell('80')} | {r.get('fixed_70_harvest_pct', 0):.1f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="hold_seed.py --out directories")
    ap.add_argument("--service-s", type=float, default=0.3)
    ap.add_argument("--cooldown-s", type=float, default=0.011)
    ap.add_argument("--stretches", type=int, default=8, help="the piecewise bound's parts (8: 150 s of 1200)")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args(argv)
    if a.stretches < 1:
        ap.error("--stretches must be at least 1")
    missing = [d for d in a.dirs if not os.path.exists(os.path.join(d, "window-arrivals.csv"))]
    if missing:
        ap.error(f"no window-arrivals.csv in {', '.join(missing)}: run hold_seed.py --out DIR first")
    rows = [one_dir(d, a.service_s, a.cooldown_s, a.stretches) for d in a.dirs]
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
