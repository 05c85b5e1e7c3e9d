"""Pools several runs of the serving benchmark (their report.json) per load and configuration, so
that the 1-2% latency targets are read over more requests than one 10-minute command holds.

    python3 hwtests/serving/pool.py RUN1/report.json RUN2/report.json [--json OUT]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import analysis  # noqa: E402


def fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def markdown(pooled, paths):
    lines = [f"Pooled over {len(paths)} runs: {', '.join(paths)}"]
    for load in sorted(pooled):
        lines += ["", f"Load {load:.0%}:", "",
                  "| configuration | requests | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | vs alone: TTFT p50 / p99 / TPOT p99 "
                  "| median TTFT ratio to alone's same request | idle arrivals stopped first | preemptions/request |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for cfg, s in pooled[load].items():
            first = s["stopped_first"]
            ppr = s["preemptions"] / s["requests"] if s["preemptions"] is not None and s["requests"] else None
            lines.append(
                f"| {cfg} | {s['requests']} | {fmt(s['ttft_p50_ms'])} / {fmt(s['ttft_p99_ms'])} "
                f"| {fmt(s['tpot_p50_ms'])} / {fmt(s['tpot_p99_ms'])} "
                f"| {fmt(s['ttft_p50_ms_vs_alone_pct'], '+.1f')}% / {fmt(s['ttft_p99_ms_vs_alone_pct'], '+.1f')}% / "
                f"{fmt(s['tpot_p99_ms_vs_alone_pct'], '+.1f')}% | {fmt(s['ttft_ratio_median'], '.3f')} "
                f"| {'n/a' if first is None else f'{first[0]} of {first[1]}'} | {fmt(ppr)} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="report.json of each run")
    ap.add_argument("--json", help="also write the pooled numbers here")
    a = ap.parse_args(argv)
    reports = []
    for p in a.reports:
        try:
            with open(p) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:
            ap.error(f"{p}: not a readable report.json ({e})")
    pooled = analysis.pool_reports(reports)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({str(k): v for k, v in pooled.items()}, f, indent=1)
    print(markdown(pooled, a.reports), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
