"""Two runs of one configuration on the same stretch (two builds on one host, or one build on two
hosts), request by request: whether they caught the same arrivals, and where a caught one's first
kernel differs (before the launch probe: the server; after it: the trap, the submission, the GPU).

    python3 bursty_ab.py A/plain/report.json B/plain/report.json [--config gate-hold] --out AB.md

Each argument: one call's bench.py report.json files, comma-separated (as bursty_pool.py takes
them). Differences are A - B, medians over the arrivals both caught. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402
import bursty_pool  # noqa: E402
import bursty_report  # noqa: E402


def compare(a_runs, b_runs) -> dict:
    """A against B: each one's caught count and caught arrivals' medians, split at the probe, and
    over the arrivals both caught the median of A - B (first kernel, probe -> GPU start)."""
    a, b = bursty_report.arrival_stamps(a_runs), bursty_report.arrival_stamps(b_runs)
    med = lambda xs: analysis.percentile(list(xs), 50)  # noqa: E731
    out = {"idle_arrivals": [len(a), len(b)], "same_verdict": sum(1 for k in a if k in b and a[k][0] == b[k][0])}
    for name, s in (("a", a), ("b", b)):
        caught = [v for v in s.values() if v[0] and v[1] is not None]
        out[name] = {"caught": sum(1 for v in s.values() if v[0]),
                     "first_kernel_p50_ms": med(v[1] for v in caught),
                     "arrival_to_probe_p50_ms": med(v[2] for v in caught if v[2] is not None),
                     "probe_to_gpu_p50_ms": med(v[1] - v[2] for v in caught if v[2] is not None)}
    both = [k for k in a if k in b and a[k][0] and b[k][0] and a[k][1] is not None and b[k][1] is not None]
    out["caught_by_both"] = len(both)
    out["first_kernel_diff_p50_ms"] = med(a[k][1] - b[k][1] for k in both)
    out["probe_to_gpu_diff_p50_ms"] = med((a[k][1] - a[k][2]) - (b[k][1] - b[k][2])
                                          for k in both if a[k][2] is not None and b[k][2] is not None)
    return out


def markdown(c: dict, names: tuple[str, str], cfg: str) -> str:
    f = bursty_report.fmt
    lines = [f"# {cfg}: A = {names[0]}, B = {names[1]}", "",
             "| run | idle arrivals | caught | caught: first kernel p50 (ms) | arrival -> probe | probe -> GPU start |",
             "|---|---|---|---|---|---|"]
    for n, key in enumerate(("a", "b")):
        r = c[key]
        lines.append(f"| {key.upper()} | {c['idle_arrivals'][n]} | {r['caught']} | {f(r['first_kernel_p50_ms'])} "
                     f"| {f(r['arrival_to_probe_p50_ms'])} | {f(r['probe_to_gpu_p50_ms'])} |")
    lines += ["", f"Same verdict (caught or not) on {c['same_verdict']} of {c['idle_arrivals'][0]} arrivals; over "
              f"the {c['caught_by_both']} both caught, A - B: first kernel {f(c['first_kernel_diff_p50_ms'], '+.3f')} ms, "
              f"probe -> GPU start {f(c['probe_to_gpu_diff_p50_ms'], '+.3f')} ms (medians)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="run A: one call's report.json files, comma-separated")
    ap.add_argument("b", help="run B, the same stretch")
    ap.add_argument("--config", default="gate-hold", help="the configuration both ran (default gate-hold)")
    ap.add_argument("--out", required=True, help="the markdown; a .json beside it gets the figures")
    x = ap.parse_args(argv)
    runs = []
    for spec in (x.a, x.b):
        call = bursty_pool.calls_of([spec])[0]
        if x.config not in call:
            raise SystemExit(f"bursty_ab: {spec} has no {x.config} run (it has {', '.join(sorted(call))}); "
                             f"pick one with --config")
        if "trace" not in call[x.config][0][0]:
            raise SystemExit(f"bursty_ab: {spec}: {x.config} has no gate trace; only gated runs catch arrivals")
        runs.append(call[x.config][0])
    c = compare(*runs)
    md = markdown(c, (x.a, x.b), x.config)
    with open(x.out, "w") as f:
        f.write(md)
    with open(os.path.splitext(x.out)[0] + ".json", "w") as f:
        json.dump(c, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
