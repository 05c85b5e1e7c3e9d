"""Which window of a replayed trace a serving run gets, and how many of its requests find the server
idle: the count that decides whether a run can measure the gate's hold (docs/gate.md).

    python3 trace_windows.py azure-code --load 0.1 --run-s 200 [--service-s 0.345] [--csv SEED OUT.csv]

The serving benchmark (bench.py) replays, at a load, n = rate x run-s consecutive arrivals of the
trace starting after arrival (--arrival-seed + load x 100 + 1000 x round), scaled to the rate
(loadgen.trace_window). This prints, over every window start, how many of those arrivals a server
of one request at a time (each --service-s long) meets idle: their spread, and the base seeds whose
window is the median one. `--csv SEED OUT.csv` writes one window's arrival times (offset_us) and
the rate they come at, for `ctl/daemon/examples/gate_hold.rs OUT.csv --rate R` to simulate the same
requests the GPU run will replay. No GPU, standard library only."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # noqa: E402

trace_file = loadgen.trace_path
rate_at = loadgen.rate_at  # requests a second at a busy share, as bench.py sets it


def idle_arrivals(offsets: list[float], service_s: float) -> int:
    """How many arrivals find a one-at-a-time server (each request `service_s` long) idle."""
    free_at, idle = float("-inf"), 0
    for t in offsets:
        if t >= free_at:
            idle += 1
            free_at = t + service_s
        else:
            free_at += service_s
    return idle


def idle_gaps(offsets: list[float], service_s: float, cooldown_s: float) -> list[tuple[float, float]]:
    """(arrival time, idle past the cooldown) of each arrival that finds a one-at-a-time server
    (each request `service_s` long) idle longer than `cooldown_s` since its last request ended; the
    first arrival has no request before it and is not one."""
    free, out = None, []
    for t in offsets:
        if free is not None and t > free + cooldown_s:
            out.append((t, t - free - cooldown_s))
        free = max(t, free if free is not None else t) + service_s
    return out


def window_counts(trace: list[float], rate: float, n: int, service_s: float, first_seed: int) -> list[int]:
    """Idle arrivals of the window each base seed gives round 0 (seed = base + first_seed), for every
    start the trace has."""
    return [idle_arrivals(loadgen.arrivals(rate, n, base + first_seed, trace), service_s)
            for base in range(len(trace) - 1)]


def median_seeds(counts: list[int], most: int = 5) -> tuple[int, list[int]]:
    """The median count and the first `most` base seeds whose window has it."""
    med = sorted(counts)[len(counts) // 2]
    return med, [i for i, c in enumerate(counts) if c == med][:most]


def write_window(path: str, offsets: list[float]) -> float:
    """One window's arrivals as sched/data's CSV (offset_us); returns the rate they come at
    (gate_hold.rs scales by (n - 1) / span)."""
    with open(path, "w") as f:
        f.write("offset_us\n")
        for t in offsets:
            f.write(f"{round(t * 1e6)}\n")
    span = offsets[-1] - offsets[0]
    return (len(offsets) - 1) / span if span > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", choices=sorted(loadgen.TRACES))
    ap.add_argument("--load", type=float, required=True, help="the benchmark's --loads value, e.g. 0.1")
    ap.add_argument("--run-s", type=float, required=True, help="the benchmark's --run-s (one round)")
    ap.add_argument("--service-s", type=float, default=0.345,
                    help="the server's service time alone (the report's 'service time alone'; graph-raw "
                         "on an H100: 0.345)")
    ap.add_argument("--csv", nargs=2, metavar=("SEED", "OUT"), help="write this base seed's window as a CSV")
    a = ap.parse_args(argv)
    if not 0 < a.load < 1 or a.run_s <= 0 or a.service_s <= 0:
        ap.error("--load must be in (0, 1), --run-s and --service-s above 0")
    trace = loadgen.load_trace(trace_file(a.trace))
    rate = rate_at(a.load, a.service_s)
    n = max(1, round(rate * a.run_s))
    first = int(a.load * 100)
    if a.csv:
        offsets = loadgen.arrivals(rate, n, int(a.csv[0]) + first, trace)
        r = write_window(a.csv[1], offsets)
        print(f"{a.csv[1]}: {n} arrivals, {idle_arrivals(offsets, a.service_s)} find the server idle; "
              f"simulate with --rate {r:.4f} --service-ms {1000 * a.service_s:g}")
        return 0
    counts = window_counts(trace, rate, n, a.service_s, first)
    s = sorted(counts)
    med, seeds = median_seeds(counts)
    print(f"{a.trace} at load {a.load:g} ({rate:.3f}/s), {n} requests a round: idle arrivals per window "
          f"p10 {s[len(s) // 10]}, median {med}, p90 {s[9 * len(s) // 10]}, over {len(s)} windows")
    print(f"base seeds (--arrival-seed) whose round-0 window has the median: {seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
