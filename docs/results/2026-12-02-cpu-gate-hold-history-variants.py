"""Candidate changes to the gate's hold memory, tried on the CPU before any went into the daemon
(docs/results/2026-12-02-cpu-gate-hold-history.md). A re-implementation of the hold's choice
(policy.rs hold_within_budget, HOLD_MIN_GAPS, HOLD_MAX) on a one-at-a-time server with a fixed
11-ms learned cooldown: it gives the current policy's figures within a point of gate_hold
(position 10, 1200 s: 36.6% / 96.7% here, 36.1% / 96.7% there), which is what it is for.

    python3 docs/results/2026-12-02-cpu-gate-hold-history-variants.py
    python3 docs/results/2026-12-02-cpu-gate-hold-history-variants.py --sweep DIR

With --sweep it sums up instead the hold-seed.json files of hold_seed.py runs in DIR/w<W>-s<S>/
(the real gate_hold's predictions).
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "hwtests", "serving"))
import hold_seed  # noqa: E402
import loadgen  # noqa: E402
import trace_windows  # noqa: E402

SERVICE_S, COOLDOWN_S, BUDGET, HOLD_MAX_S, MIN_GAPS = 0.3, 0.011, 0.08, 10.0, 8


def request_gaps(arrivals):
    """(time, idle past the cooldown) of each arrival that finds the server idle that long."""
    return trace_windows.idle_gaps(arrivals, SERVICE_S, COOLDOWN_S)


def hold(gaps, allowed):
    """The largest c with sum(min(g, c)) <= allowed (hold_within_budget)."""
    gaps, below = sorted(gaps), 0.0
    if allowed <= 0 or not gaps:
        return 0.0
    for k, g in enumerate(gaps):
        c = (allowed - below) / (len(gaps) - k)
        if c <= g:
            return c
        below += g
    return gaps[-1]


def by_count(n):
    return lambda kept, t: kept[-n:]


def by_time(span_s):
    return lambda kept, t: [x for x in kept if x[0] > t - span_s]


def replay(history, window, memory, bank=False):
    """Idle arrivals, caught %, harvest % of `window` with the hold chosen over `memory` of
    `history` + the window's own gaps. With `bank`, unspent budget (b x idle - held) is carried
    into the allowance, at most doubling it."""
    kept, caught, idle, lost, carried = list(history), 0, 0.0, 0.0, 0.0
    for t, g in window:
        mem = [x for _, x in memory(kept, t)]
        c = 0.0
        if len(mem) >= MIN_GAPS:
            base = BUDGET * sum(mem)
            extra = max(-base, min(base, carried)) if bank else 0.0
            c = min(hold(mem, base + extra), HOLD_MAX_S)
        caught += g < c
        idle += g + COOLDOWN_S
        lost += min(g, c) + COOLDOWN_S
        carried += BUDGET * g - min(g, c)
        kept.append((t, g))
    return len(window), caught, 100 * (1 - lost / max(idle, 1e-9))


def windows(trace, run_s, seeds, own_rate_history=False):
    rate = loadgen.rate_at(0.1, SERVICE_S)
    n = max(1, round(rate * run_s))
    for a in seeds:
        seed = hold_seed.window_seed(a, 0.1)
        if own_rate_history:  # the preceding hour replayed at the window's rate, as bench.py would
            nh = min(round(rate * 3600), len(trace) - 1 - n)
            h = loadgen.trace_window(trace, rate, nh, seed - nh)
        else:  # hold_seed.py: the preceding hour on the window's own time scale
            h = hold_seed.preceding(trace, seed, n, rate, 3600)
        hg = [(t - h[-1], g) for t, g in request_gaps(h)]
        yield hg, request_gaps(loadgen.arrivals(rate, n, seed, trace))


VARIANTS = {
    "current: newest 256 gaps": dict(memory=by_count(256)),
    "newest 64 gaps": dict(memory=by_count(64)),
    "newest 512 gaps": dict(memory=by_count(512)),
    "gaps of the last 1800 s": dict(memory=by_time(1800)),
    "gaps of the last 3600 s": dict(memory=by_time(3600)),
    "256 gaps + unspent budget carried": dict(memory=by_count(256), bank=True),
    "256 gaps, history at the window's load": dict(memory=by_count(256), own_rate=True),
}


def stretches(trace, run_s=1200):
    """Position 10's history and window by stretch: requests, idle gaps, and the hold the
    stretch's gaps alone would choose at the budget (not capped at HOLD_MAX)."""
    rate = loadgen.rate_at(0.1, SERVICE_S)
    n, seed = round(rate * run_s), hold_seed.window_seed(0, 0.1)
    h = hold_seed.preceding(trace, seed, n, rate, 3600)
    w = loadgen.arrivals(rate, n, seed, trace)
    print(f"{run_s} s window at position {seed}: the history's {len(h)} requests over {h[-1]:.0f} s "
          f"({len(h) / h[-1]:.3f}/s; the window {rate:.3f}/s)")
    for name, times, gaps, starts in (
        ("history", [t - h[-1] for t in h], [(t - h[-1], g) for t, g in request_gaps(h)], range(-3600, 0, 600)),
        ("window", w, request_gaps(w), range(0, run_s, 300)),
    ):
        for a in starts:
            b = a + (600 if name == "history" else 300)
            g = [x for t, x in gaps if a <= t < b]
            c = hold(g, BUDGET * sum(g)) if len(g) >= MIN_GAPS else 0.0
            print(f"  {name} [{a}, {b}) s: {sum(a <= t < b for t in times)} requests, {len(g)} gaps, "
                  f"{sum(g):.0f} s idle, hold {c:.2f} s")


def summarise(d):
    """Sums up hold_seed.py's predictions in d/w<W>-s<S>/hold-seed.json by window length."""
    print("| window | windows | idle arrivals | seeded: caught, mean harvest | fresh: caught, mean harvest "
          "| seeded ahead / behind |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run_s in (90, 300, 1200):
        runs = [json.load(open(p)) for p in glob.glob(f"{d}/w{run_s}-s*/hold-seed.json")]
        if not runs:
            continue
        s = [r["predicted_seeded"] for r in runs]
        f = [r["predicted_fresh"] for r in runs]
        n = sum(p["idle_arrivals"] for p in s)

        def caught(ps):
            return sum(p["idle_arrivals"] * p["caught_pct"] for p in ps) / n

        def harvest(ps):
            return sum(p["harvest_pct"] for p in ps) / len(ps)

        ahead = sum(a["caught_pct"] > b["caught_pct"] for a, b in zip(s, f))
        behind = sum(a["caught_pct"] < b["caught_pct"] for a, b in zip(s, f))
        print(f"| {run_s} s | {len(runs)} | {n} | {caught(s):.1f}%, {harvest(s):.1f}% | {caught(f):.1f}%, "
              f"{harvest(f):.1f}% | {ahead} / {behind} |")


def main():
    if sys.argv[1:2] == ["--sweep"] and len(sys.argv) == 3:
        return summarise(sys.argv[2])
    trace = loadgen.load_trace(loadgen.trace_path("azure-code"))
    stretches(trace)
    sweep = list(range(0, 3600, 120))
    print("| window | seeds | variant | seeded: caught, mean harvest | fresh: caught, mean harvest |")
    print("| --- | --- | --- | --- | --- |")
    for run_s in (90, 300, 1200):
        for label, seeds in (("position 10", [0]), ("30 positions", sweep)):
            for name, v in VARIANTS.items():
                tot = {"s": [0, 0, 0.0, 0], "f": [0, 0, 0.0, 0]}
                for hg, wg in windows(trace, run_s, seeds, v.get("own_rate", False)):
                    for key, hist in (("s", hg), ("f", [])):
                        n, c, h = replay(hist, wg, v["memory"], v.get("bank", False))
                        x = tot[key]
                        x[0], x[1], x[2], x[3] = x[0] + n, x[1] + c, x[2] + h, x[3] + 1
                s, f = tot["s"], tot["f"]
                print(f"| {run_s} s | {label} | {name} | {100 * s[1] / max(s[0], 1):.1f}%, {s[2] / s[3]:.1f}% "
                      f"| {100 * f[1] / max(f[0], 1):.1f}%, {f[2] / f[3]:.1f}% |")


if __name__ == "__main__":
    main()
