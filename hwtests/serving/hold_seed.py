"""The gate's hold history for a serving run, built on the CPU from the trace's stretch before the
window the run replays, as a daemon restarted on a busy node would have kept it (docs/gate.md).

    python3 hold_seed.py azure-code --load 0.1 --run-s 90 --service-s 0.3 --port 18080 \\
        --arrival-seed 0 --out DIR [--budget 8] [--history-s 3600] [--gate-hold BIN]

It writes DIR/history-arrivals.csv (the arrivals of the --history-s before the window, on the
window's own time scale: one timeline with it), DIR/window-arrivals.csv (the window bench.py replays in round 0 at that load: the same
arrivals, loadgen.trace_window) and DIR/gate-hold-history.json: the history that the gate's own
policy learned on the first, replayed by ctl/daemon/examples/gate_hold.rs (no policy here), for
the service `gate start --online-port PORT` keys it by. bench.py --hold-history copies it into
the daemon's state directory before the daemon starts. It then prints the simulation's
prediction for the window: idle arrivals caught and harvest, with and without the history.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import loadgen  # noqa: E402
import trace_windows  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def service_key(port: int) -> str:
    """The hold history's key for `gate start --online-port PORT` (the daemon's
    ActiveGate::history_key_of: ports, label and pids as asked)."""
    return f"ports={port} label= pids="


def window_seed(arrival_seed: int, load: float, rnd: int = 0) -> int:
    """The trace position bench.py's round `rnd` at `load` replays from (its measure() seed)."""
    return arrival_seed + int(load * 100) + 1000 * rnd


def trace_at(trace: list[float], i: int) -> float:
    """Arrival i of the trace repeated end to end (as loadgen.trace_window counts them; i may be
    negative: laps before the first)."""
    laps, k = divmod(i, len(trace) - 1)
    return trace[k] + laps * (trace[-1] - trace[0])


def preceding(trace: list[float], seed: int, n: int, rate: float, history_s: float) -> list[float]:
    """The arrivals of the `history_s` before the window bench.py replays from `seed` (n at `rate`),
    on the window's own time scale (the run's seconds per trace second), so that they and the
    window are one timeline; as offsets from the first of them (s). Never so many that they wrap
    around the trace into the window itself."""
    first = seed % (len(trace) - 1)
    scale = n / rate / (trace_at(trace, first + n) - trace_at(trace, first))
    start, out = trace_at(trace, first), []
    for back in range(len(trace) - 1 - n):
        t = (trace_at(trace, first - back) - start) * scale
        if t < -history_s:
            break
        out.append(t)
    out.reverse()
    return [t - out[0] for t in out]


def part_history(history: list[float], window: list[float], span_s: float, part: tuple[int, int],
                 history_s: float) -> tuple[list[float], list[float]]:
    """For stretch `part` (k, parts) of a window `span_s` long: the history is the `history_s`
    before that stretch (the hour before the window, then the window's earlier stretches, one
    timeline), and the window is the stretch (loadgen.window_part). Both as offsets from their
    own first arrival, as `preceding` gives them."""
    k, parts = part[0], part[1]
    lo = span_s * k / parts
    origin = history[-1]  # `preceding` ends with the arrival the window's offsets count from
    joined = history + [origin + t for t in window if t < lo]
    kept = [t for t in joined if t >= origin + lo - history_s]
    stretch = loadgen.window_part(window, span_s, *part)
    return [t - kept[0] for t in kept], stretch


def default_gate_hold() -> str:
    for p in (os.path.join(ROOT, ".carry", "bin", "gate_hold"),
              os.path.join(ROOT, "target", "release", "examples", "gate_hold")):
        if os.access(p, os.X_OK):
            return p
    return ""


def parse_row(out: str, label: str) -> dict | None:
    """The gate_hold table row named `label`: idle arrivals, caught %, harvest %, preemptions."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] == label:
            return {"idle_arrivals": int(cells[1]), "caught_pct": float(cells[2].rstrip("%")),
                    "harvest_pct": float(cells[3].rstrip("%")), "preemptions": int(cells[4])}
    return None


def gate_hold(binary: str, csv: str, rate: float, service_s: float, budget: float, extra: list[str]) -> str:
    argv = [binary, csv, "--rate", f"{rate:.6f}", "--service-ms", f"{service_s * 1000:g}",
            "--budgets", f"{budget:g}", "--fixed-ms", "none", *extra]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"hold_seed: {' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def build(a) -> dict:
    """Writes the CSVs and the history; returns what was made and the prediction."""
    trace = loadgen.load_trace(loadgen.trace_path(a.trace))
    rate = loadgen.rate_at(a.load, a.service_s)
    n = max(1, round(rate * a.run_s))
    seed = window_seed(a.arrival_seed, a.load)
    history = preceding(trace, seed, n, rate, a.history_s)
    window = loadgen.arrivals(rate, n, seed, trace)
    if a.part:
        history, window = part_history(history, window, n / rate, a.part, a.history_s)
        if len(window) < 2:
            raise SystemExit(f"hold_seed: stretch {a.window_part} of this window holds {len(window)} "
                             "arrival(s): the trace idles through it, nothing to replay; pick other "
                             "stretches (fewer parts) or another --arrival-seed")
    if len(history) < 2:
        raise SystemExit(f"hold_seed: fewer than 2 arrivals in the {a.history_s:g} s before the window: give a "
                         "longer --history-s")
    m = len(history)
    os.makedirs(a.out, exist_ok=True)
    hist_csv = os.path.join(a.out, "history-arrivals.csv")
    win_csv = os.path.join(a.out, "window-arrivals.csv")
    hist_rate = trace_windows.write_window(hist_csv, history)
    win_rate = trace_windows.write_window(win_csv, window)
    path = os.path.join(a.out, "gate-hold-history.json")
    key = service_key(a.port)
    label = f"hold budget {a.budget:g}%"
    gate_hold(a.gate_hold, hist_csv, hist_rate, a.service_s, a.budget,
              ["--history-out", path, "--history-service", key])
    seeded = parse_row(gate_hold(a.gate_hold, win_csv, win_rate, a.service_s, a.budget,
                                 ["--history-in", path, "--history-service", key]), label)
    fresh = parse_row(gate_hold(a.gate_hold, win_csv, win_rate, a.service_s, a.budget, []), label)
    with open(path) as f:
        gaps = len(json.load(f)["services"][key]["history"]["gaps"])
    return {"trace": a.trace, "load": a.load, "rate_per_s": rate, "window_requests": n,
            "window_seed": seed, "window_idle_arrivals": trace_windows.idle_arrivals(window, a.service_s),
            "history_requests": m, "history_s": history[-1], "history_gaps": gaps, "service": key,
            "budget_pct": a.budget, "service_s": a.service_s, "history_file": path,
            "window_part": list(a.part) if a.part else None,
            "predicted_seeded": seeded, "predicted_fresh": fresh}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", choices=sorted(loadgen.TRACES))
    ap.add_argument("--load", type=float, required=True, help="bench.py's --loads value (one)")
    ap.add_argument("--run-s", type=float, required=True, help="bench.py's --run-s (one round)")
    ap.add_argument("--service-s", type=float, required=True,
                    help="the service time the run's rate comes from (bench.py --nominal-service-s)")
    ap.add_argument("--port", type=int, required=True, help="the online server's port (bench.py --port)")
    ap.add_argument("--arrival-seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=8.0, help="the hold budget, percent (gate start --hold-budget)")
    ap.add_argument("--history-s", type=float, default=3600.0, help="seconds of trace before the window")
    ap.add_argument("--gate-hold", default=default_gate_hold(),
                    help="the CPU replay tool (cargo build --release -p valve-daemon --example gate_hold)")
    ap.add_argument("--window-part", default="", metavar="K/N or K-L/N",
                    help="bench.py's --window-part: seed and predict only that stretch of the window")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        a.part = loadgen.parse_part(a.window_part)
    except ValueError as e:
        ap.error(f"--window-part: {e}")
    if not 0 < a.load < 1 or a.run_s <= 0 or a.service_s <= 0 or a.history_s <= 0:
        ap.error("--load must be in (0, 1); --run-s, --service-s and --history-s above 0")
    if not 0 < a.budget <= 50:
        ap.error("--budget must be above 0 and at most 50 (percent of idle time, as gate start takes)")
    if not 0 < a.port < 65536:
        ap.error("--port must be 1-65535")
    if not a.gate_hold or not os.access(a.gate_hold, os.X_OK):
        ap.error("no gate_hold binary: build it (cargo build --release -p valve-daemon --example gate_hold) "
                 "and copy it to .carry/bin, or give --gate-hold PATH")
    info = build(a)
    with open(os.path.join(a.out, "hold-seed.json"), "w") as f:
        json.dump(info, f, indent=1)
    s, fr = info["predicted_seeded"], info["predicted_fresh"]
    print(f"hold history: {info['history_gaps']} gaps from {info['history_requests']} arrivals "
          f"over {info['history_s']:.0f} s before the window, on its time scale -> {info['history_file']}")
    print(f"window: {info['window_requests']} requests from trace position {info['window_seed']}, "
          f"{info['window_idle_arrivals']} find a one-at-a-time server idle")
    for name, p in (("seeded", s), ("fresh gate", fr)):
        if p:
            print(f"predicted ({name}): {p['idle_arrivals']} idle arrivals, {p['caught_pct']:.1f}% caught, "
                  f"{p['harvest_pct']:.1f}% harvest, {p['preemptions']} preemptions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
