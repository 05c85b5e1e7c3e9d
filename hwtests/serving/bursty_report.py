"""The bursty-traffic comparison: the gate (with and without its hold) and its peers (time-slicing,
MPS, XSched) on the same window, server and job, each as ratios to online alone from the same run.

    python3 bursty_report.py OUT/plain/report.json [OUT/mps/report.json ...] --out OUT/bursty.md

Reads bench.py's report.json files (the first holds `alone`), and writes a table per load: idle
arrivals, the share caught (offline already stopped when they came; gates only), arrival -> first
kernel running on the GPU (p50/p99; caught, uncaught), TTFT p50/p99 and TPOT p99 against alone,
the median of each request's TTFT against the same request alone, idle time harvested and
preemptions per request. A gate's figure is marked "ahead" only where it beats every peer of the
same load. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402

PEER_CONFIGS = ("timeslice", "mps", "xsched")
GATE_CONFIGS = ("gate-hold", "gate-arrival")
# (key, lower is better) of the figures compared for "ahead".
COMPARED = (("first_kernel_p50_ms", True), ("first_kernel_p99_ms", True), ("ttft_p50_ratio", True),
            ("ttft_p99_ratio", True), ("tpot_p99_ratio", True), ("harvested", False))


def idle_arrivals(run):
    """`analysis.per_request` of one run with a gate trace: its idle arrivals, what offline was
    doing when each came, and when its first launch reached the probe."""
    return analysis.per_request(run["records"], run["trace"], set(run.get("online_pids") or []) or None)


def caught_by_send(run):
    """{send_ns: whether offline was already stopped} of a run's idle arrivals (None: no trace)."""
    if "trace" not in run:
        return None
    return {x["send_ns"]: x["already_stopped"] for x in idle_arrivals(run)}


def arrival_stamps(runs) -> dict:
    """{(round, request index): (caught, arrival -> first kernel on the GPU, arrival -> launch
    probe)} of the idle arrivals of the runs with a gate trace (ms; None where a stamp is missing)."""
    out = {}
    for r in runs:
        if "trace" not in r:
            continue
        index = {q["send_ns"]: q["i"] for q in r["records"]}
        gpu = {g["send_ns"]: g["arrival_to_gpu_start_ms"] for g in analysis.gpu_start_rows(r["records"])}
        for x in idle_arrivals(r):
            out[(r.get("round", 0), index[x["send_ns"]])] = (
                bool(x["already_stopped"]), gpu.get(x["send_ns"]), x["arrival_to_kernel_ms"])
    return out


def first_kernels(runs):
    """Arrival -> first kernel running (ms) of every idle arrival of `runs` (one configuration at
    one load), with whether offline was already stopped then (None: no gate trace)."""
    out = []
    for r in runs:
        caught = caught_by_send(r)
        for g in analysis.gpu_start_rows(r["records"]):
            out.append((g["arrival_to_gpu_start_ms"], None if caught is None else caught.get(g["send_ns"], False)))
    return out


def kernel_figures(rows):
    """p50/p99 of the first kernels, all and split by caught."""
    fig = {}
    for name, keep in (("", lambda c: True), ("caught_", lambda c: c is True), ("uncaught_", lambda c: c is not True)):
        ms = [t for t, c in rows if t is not None and keep(c)]
        fig[f"{name}first_kernel_p50_ms"] = analysis.percentile(ms, 50)
        fig[f"{name}first_kernel_p99_ms"] = analysis.percentile(ms, 99)
        fig[f"{name}n"] = len(ms)
    return fig


def ratio(x, base):
    return None if x is None or not base else x / base


def ttft_by_request(runs):
    """{(round, request index): TTFT (ms)} of the runs' requests that streamed a token."""
    return {(r.get("round", 0), q["i"]): t for r in runs for q in r["records"]
            if (t := analysis.ttft_ms(q)) is not None}


def paired_ttft_ratios(runs, alone_runs):
    """Each request's TTFT over the same request's alone (the same round and index)."""
    mine, alone = ttft_by_request(runs), ttft_by_request(alone_runs)
    return [t / alone[k] for k, t in mine.items() if alone.get(k)]


def paired_ttft_ratio(runs, alone_runs):
    """The median over requests of TTFT against the same request alone (None: no pairs). A bursty
    stretch's TTFTs are two clusters (idle arrivals at a few ms, queued ones at hundreds), so its
    p50 is one queued request's wait; the median of paired ratios is every request's."""
    return analysis.percentile(paired_ttft_ratios(runs, alone_runs), 50)


def config_row(runs, stats, alone, alone_runs=()):
    """One configuration's figures at one load (`alone_runs`: alone's, for the paired TTFT)."""
    rows = first_kernels(runs)
    gated = [c for _, c in rows if c is not None]
    row = {"idle_arrivals": len(rows), "caught_share": sum(gated) / len(gated) if gated else None,
           "harvested": stats.get("harvested"), "preemptions_per_request": stats.get("preemptions_per_request"),
           "hold_gaps_at_start": next((r.get("hold_gaps_at_start") for r in runs), None)}
    row.update(kernel_figures(rows))
    for k in ("arrivals_idle", "arrivals_held"):
        counted = [r.get(k) for r in runs]
        row["gate_" + k] = sum(counted) if counted and None not in counted else None
    for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms"):
        row[m] = stats.get(m)
        row[m.replace("_ms", "_ratio")] = ratio(stats.get(m), (alone or {}).get(m))
    row["ttft_paired_ratio"] = paired_ttft_ratio(runs, alone_runs) if alone_runs else None
    if alone:
        row["first_kernel_p50_vs_alone_ms"] = (None if row["first_kernel_p50_ms"] is None or alone.get("first_kernel_p50_ms") is None
                                               else row["first_kernel_p50_ms"] - alone["first_kernel_p50_ms"])
    return row


def collect(reports):
    """{load: {config: (runs, stats)}} over every report (a later report's same config is kept apart
    by no means: each config is to come from one report)."""
    out = {}
    for res in reports:
        for e in res.get("loads", []):
            for cfg, stats in e["rows"].items():
                runs = [r for r in res.get("runs", []) if r["config"] == cfg and r.get("load") == e["load"]]
                out.setdefault(e["load"], {})[cfg] = (runs, stats)
    return out


def compare(reports):
    """{load: {config: row}} with each gate row's "ahead" list."""
    table = {}
    for load, cfgs in collect(reports).items():
        alone = None
        if "alone" in cfgs:
            alone = config_row(*cfgs["alone"], None)
        alone_runs = cfgs["alone"][0] if "alone" in cfgs else ()
        rows = {cfg: config_row(runs, stats, alone, alone_runs) for cfg, (runs, stats) in cfgs.items()}
        for g in GATE_CONFIGS:
            if g in rows:
                peers = [rows[p] for p in PEER_CONFIGS if p in rows]
                rows[g]["ahead"] = ahead(rows[g], peers)
                rows[g]["ahead_overall"] = ahead_overall(rows[g], peers)
        table[load] = rows
    return table


def ahead(gate, peer_rows):
    """The figures where `gate` beats every peer (none without peers or where a figure is missing)."""
    if not peer_rows:
        return []
    out = []
    for key, lower in COMPARED:
        g = gate.get(key)
        ps = [p.get(key) for p in peer_rows]
        if g is None or any(p is None for p in ps):
            continue
        if all(g < p for p in ps) if lower else all(g > p for p in ps):
            out.append(key)
    return out


def ahead_overall(gate, peer_rows):
    """Whether `gate` is ahead by the benchmark's rule: TTFT p99 and TPOT p99 ratios to alone lower
    than every peer's, at an idle-time harvest no lower than theirs (None without peers or data)."""
    keys = ("ttft_p99_ratio", "tpot_p99_ratio", "harvested")
    if not peer_rows or any(gate.get(k) is None or any(p.get(k) is None for p in peer_rows) for k in keys):
        return None
    return all(gate["ttft_p99_ratio"] < p["ttft_p99_ratio"] and gate["tpot_p99_ratio"] < p["tpot_p99_ratio"]
               and gate["harvested"] >= p["harvested"] for p in peer_rows)


def fmt(v, spec=".3f"):
    return "n/a" if v is None else format(v, spec)


def markdown(table, sources):
    lines = ["# Bursty traffic: the gate and its peers, each against online alone from the same run", "",
             "Sources: " + ", ".join(sources), ""]
    for load, rows in sorted(table.items()):
        lines += [f"## Load {load:.0%}", "",
                  "| configuration | idle arrivals | caught | first kernel p50 / p99 (ms) | caught p50 / p99 | uncaught p50 / p99 "
                  "| TTFT p50 / p99 vs alone | TTFT per request vs alone (median) | TPOT p99 vs alone | harvested "
                  "| preemptions/request |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for cfg, r in rows.items():
            lines.append(
                f"| {cfg} | {r['idle_arrivals']} | {fmt(r['caught_share'], '.0%')} "
                f"| {fmt(r['first_kernel_p50_ms'])} / {fmt(r['first_kernel_p99_ms'])} "
                f"| {fmt(r['caught_first_kernel_p50_ms'])} / {fmt(r['caught_first_kernel_p99_ms'])} "
                f"| {fmt(r['uncaught_first_kernel_p50_ms'])} / {fmt(r['uncaught_first_kernel_p99_ms'])} "
                f"| {fmt(r['ttft_p50_ratio'])} / {fmt(r['ttft_p99_ratio'])} | {fmt(r['ttft_paired_ratio'])} "
                f"| {fmt(r['tpot_p99_ratio'])} | {fmt(r['harvested'], '.0%')} | {fmt(r['preemptions_per_request'], '.2f')} |")
        for g in GATE_CONFIGS:
            if g in rows:
                peers_here = [p for p in PEER_CONFIGS if p in rows]
                overall = {True: "AHEAD", False: "NOT ahead", None: "not decided"}[rows[g].get("ahead_overall")]
                lines += ["", f"{g} against every peer here ({', '.join(peers_here) or 'none measured'}): "
                          f"{overall} (p99 TTFT and TPOT ratios lower at a harvest no lower); "
                          "lower or higher on: " + (", ".join(rows[g]["ahead"]) or "nothing")
                          + (f"; the hold started from {rows[g]['hold_gaps_at_start']} gaps"
                             if rows[g].get("hold_gaps_at_start") is not None else "")]
                if rows[g].get("gate_arrivals_idle") is not None:
                    lines += ["", f"{g}, the gate's own count: {rows[g]['gate_arrivals_held']} of "
                              f"{rows[g]['gate_arrivals_idle']} arrivals after an idle online found offline held "
                              f"(measured here: {round((rows[g]['caught_share'] or 0) * rows[g]['idle_arrivals'])} "
                              f"of {rows[g]['idle_arrivals']} idle arrivals caught)"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="bench.py report.json files; the one with alone first")
    ap.add_argument("--out", required=True, help="the markdown table; a .json beside it gets the figures")
    a = ap.parse_args(argv)
    reports = []
    for p in a.reports:
        try:
            with open(p) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"bursty_report: {p}: {e} (skipped: that part did not run or did not finish)", file=sys.stderr)
    if not reports:
        ap.error("no readable report.json: nothing ran")
    table = compare(reports)
    with open(a.out, "w") as f:
        f.write(markdown(table, a.reports))
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({str(k): v for k, v in table.items()}, f, indent=1)
    print(markdown(table, a.reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
