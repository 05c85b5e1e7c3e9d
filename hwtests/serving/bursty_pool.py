"""One window's figures from its stretches, each replayed in a GPU call of its own (bursty.sh
--window-part K/N): per configuration, the stretches' idle arrivals and requests pooled.

    python3 bursty_pool.py CALL [CALL ...] --out POOLED.md
    CALL: one call's bench.py report.json files, comma-separated (the plain part first)

Caught share, first kernels and TTFT/TPOT percentiles are taken over the pooled arrivals and
requests; ratios compare a configuration with alone pooled over the same calls only (the calls
that ran both), so that each stretch's alone is its own call's. Harvest is the calls' offline
progress over their summed idle time. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import analysis  # noqa: E402
import bursty_report  # noqa: E402


def idle_s(records) -> float:
    """Seconds of a run's window with no request in flight (analysis.harvest_runs' idle time)."""
    lo, hi = analysis.window_of(records)
    return (hi - lo - analysis.union_ns([(r["send_ns"], r["end_ns"]) for r in records], lo, hi)) / 1e9


def calls_of(specs: list[str], skip: set[tuple[int, str]] = frozenset()) -> list[dict]:
    """{config: (runs, stats)} per call, at the calls' one load, without the (call, config) pairs
    in `skip` (a run known to be wrong, kept in the raw data)."""
    out = []
    for n, spec in enumerate(specs):
        reports = []
        for p in spec.split(","):
            with open(p) as f:
                reports.append(json.load(f))
        by_load = bursty_report.collect(reports)
        if len(by_load) != 1:
            raise SystemExit(f"bursty_pool: {spec}: one load a call, found {sorted(by_load)}")
        cfgs = next(iter(by_load.values()))
        out.append({cfg: v for cfg, v in cfgs.items() if (n, cfg) not in skip})
    return out


def paired_kernels(call: dict, cfg: str) -> list[tuple[float, float | None, bool | None]]:
    """(first kernel under cfg, alone's first kernel for the same request of the same call, caught)
    per idle arrival of cfg with a stamp; alone's is None where that request found alone busy."""
    def by_index(runs):
        out = {}
        for r in runs:
            index = {q["send_ns"]: q["i"] for q in r["records"]}
            caught = bursty_report.caught_by_send(r)
            for g in analysis.gpu_start_rows(r["records"]):
                if g["arrival_to_gpu_start_ms"] is not None:
                    out[(r.get("round", 0), index[g["send_ns"]])] = (
                        g["arrival_to_gpu_start_ms"], None if caught is None else caught.get(g["send_ns"], False))
        return out
    mine = by_index(call[cfg][0])
    alone = by_index(call["alone"][0]) if "alone" in call else {}
    return [(ms, alone.get(k, (None,))[0], c) for k, (ms, c) in mine.items()]


def request_kinds(runs) -> dict:
    """{(round, request index): kind} of the runs' requests: "queued" (something was in flight
    when it was sent), else "caught" or "uncaught" (offline frozen already, or not, by the gate's
    trace), or "idle" where the run has no gate trace."""
    out = {}
    for r in runs:
        caught = bursty_report.caught_by_send(r)
        for q in r["records"]:
            if not q.get("idle_at_send"):
                kind = "queued"
            elif caught is None:
                kind = "idle"
            else:
                kind = "caught" if caught.get(q["send_ns"]) else "uncaught"
            out[(r.get("round", 0), q["i"])] = kind
    return out


def ttft_pairs(both: list[dict], cfg: str) -> list[tuple[float, float, str]]:
    """(TTFT under cfg, the same request's TTFT alone, its kind from `request_kinds`) per request,
    over the calls that ran cfg and alone."""
    out = []
    for c in both:
        mine = bursty_report.ttft_by_request(c[cfg][0])
        alone = bursty_report.ttft_by_request(c["alone"][0])
        kinds = request_kinds(c[cfg][0])
        out += [(t, alone[k], kinds.get(k, "idle")) for k, t in mine.items() if alone.get(k)]
    return out


def ttft_by_kind(both: list[dict], cfg: str) -> dict:
    """{kind: requests, median TTFT difference (ms) and ratio against the same request alone},
    over the calls that ran cfg and alone: where a set's TTFT p50 moves (its p50 falls in one
    kind, the idle arrivals or the queued ones, and each kind pays a different price)."""
    pairs: dict = {}
    for t, a, kind in ttft_pairs(both, cfg):
        pairs.setdefault(kind, []).append((t - a, t / a))
    return {kind: {"requests": len(v),
                   "diff_p50_ms": analysis.percentile([d for d, _ in v], 50),
                   "ratio_p50": analysis.percentile([q for _, q in v], 50)}
            for kind, v in sorted(pairs.items())}


IF_CAUGHT_SHARES = (0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def ttft_p50_if_caught(both: list[dict], cfg: str, shares=IF_CAUGHT_SHARES, draws: int = 200) -> list[dict]:
    """The set's TTFT p50 against alone had `share` of the idle arrivals been caught: that many
    uncaught arrivals, drawn at random (`draws` times, seeded), given the same request's TTFT alone
    plus the caught arrivals' median difference. Where the set's p50 lies among the idle arrivals
    it says what share caught the TTFT p50 target needs. Each row gives the share it reached (a
    whole number of arrivals), at most one row per share; the first row is the set as measured
    (paired requests only)."""
    pairs = ttft_pairs(both, cfg)
    idle = [i for i, (_, _, k) in enumerate(pairs) if k in ("caught", "uncaught")]
    uncaught = [i for i in idle if pairs[i][2] == "uncaught"]
    if not uncaught:
        return []
    caught_diff = analysis.percentile([t - a for t, a, k in pairs if k == "caught"], 50) or 0.0
    alone_p50 = analysis.percentile([a for _, a, _ in pairs], 50)

    def ratio(converted: set) -> float:
        return analysis.percentile([a + caught_diff if i in converted else t
                                    for i, (t, a, _) in enumerate(pairs)], 50) / alone_p50

    out = [{"caught_share": 1 - len(uncaught) / len(idle), "ttft_p50_ratio": ratio(set()), "low": None, "high": None}]
    rng, done = random.Random(0), {0}
    for share in shares:
        n = len(uncaught) - round((1 - share) * len(idle))
        if n in done or n < 0:
            continue
        done.add(n)
        r = sorted(ratio(set(rng.sample(uncaught, n))) for _ in range(draws))
        out.append({"caught_share": 1 - (len(uncaught) - n) / len(idle), "ttft_p50_ratio": r[draws // 2],
                    "low": r[int(0.025 * draws)], "high": r[int(0.975 * draws) - 1]})
    return out


def probe_split(runs) -> list[tuple[float, float]]:
    """Caught arrivals' first kernel in two (ms): arrival -> the launch probe's timestamp (the
    server's own work, on the CPU) and the probe -> the kernel running on the GPU (the trap's
    return, the submission, the GPU picking it up). Tells a host's launch path from the server."""
    return [(probe, g - probe) for caught, g, probe in bursty_report.arrival_stamps(runs).values()
            if caught and g is not None and probe is not None]


def call_rows(calls: list[dict], cfg: str) -> list[dict]:
    """Per call that ran cfg beside alone: its caught arrivals against the same requests alone,
    and where their first kernel's time goes (`probe_split`), so one call's host can be told
    from another's."""
    rows = []
    for n, c in enumerate(calls):
        if cfg not in c or "alone" not in c:
            continue
        pairs = [p for p in paired_kernels(c, cfg) if p[1] is not None]
        caught = [a - b for a, b, k in pairs if k is True]
        split = probe_split(c[cfg][0])
        rows.append({"call": n, "idle_arrivals": len(pairs), "caught": len(caught),
                     "caught_vs_alone_ms": analysis.percentile(caught, 50),
                     "alone_first_kernel_p50_ms": analysis.percentile([b for _, b, _ in pairs], 50),
                     "arrival_to_probe_p50_ms": analysis.percentile([a for a, _ in split], 50),
                     "probe_to_gpu_p50_ms": analysis.percentile([b for _, b in split], 50)})
    return rows


def pooled_row(calls: list[dict], cfg: str) -> dict | None:
    """The figures of `cfg` over the calls that ran it; ratios against alone over the calls that
    ran both, and caught first kernels against alone's for the same requests."""
    have = [c for c in calls if cfg in c]
    if not have:
        return None
    runs = [r for c in have for r in c[cfg][0]]
    kernels = bursty_report.first_kernels(runs)
    gated = [c for _, c in kernels if c is not None]
    recs = [x for r in runs for x in r["records"]]
    stats = analysis.request_stats(recs)
    idles = [(c[cfg][1].get("harvested"), sum(idle_s(r["records"]) for r in c[cfg][0])) for c in have]
    total_idle = sum(s for _, s in idles)
    row = {"calls": len(have), "requests": len(recs), "idle_arrivals": len(kernels),
           "caught": sum(gated) if gated else None, "caught_share": sum(gated) / len(gated) if gated else None,
           "harvested": (sum(h * s for h, s in idles) / total_idle
                         if idles and all(h is not None for h, _ in idles) and total_idle > 0 else None)}
    row.update(bursty_report.kernel_figures(kernels))
    for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms"):
        row[m] = stats.get(m)
    both = [c for c in have if "alone" in c]
    if cfg != "alone" and both:
        alone = pooled_row(both, "alone")
        mine = pooled_row(both, cfg) if len(both) < len(have) else row
        for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms"):
            row[m.replace("_ms", "_ratio")] = bursty_report.ratio(mine[m], alone[m])
        row["ttft_paired_ratio"] = analysis.percentile(
            [x for c in both for x in bursty_report.paired_ttft_ratios(c[cfg][0], c["alone"][0])], 50)
        pairs = [p for c in both for p in paired_kernels(c, cfg) if p[1] is not None]
        caught = [p for p in pairs if p[2] is True]
        row["caught_paired"] = len(caught)
        # The median of each caught request's difference from the same request alone: the
        # calls' own offsets (alone's p50 moves by 0.1 ms between calls) cancel.
        row["caught_first_kernel_p50_vs_alone_ms"] = (
            analysis.percentile([p[0] - p[1] for p in caught], 50) if caught else None)
        row["alone_calls"] = len(both)
        row["ttft_by_kind"] = ttft_by_kind(both, cfg)
        row["ttft_p50_if_caught"] = ttft_p50_if_caught(both, cfg)
        row["per_call"] = call_rows(calls, cfg)
    return row


def markdown(rows: dict, specs: list[str]) -> str:
    f = bursty_report.fmt
    lines = ["# One window, its stretches pooled", "", "Calls: " + "; ".join(specs), "",
             "| configuration | calls (with alone) | requests | idle arrivals | caught | first kernel p50 / p99 (ms) "
             "| caught p50 (median difference from the same request alone) | TTFT p50 / p99 vs alone "
             "| TTFT per request vs alone (median) | TPOT p99 vs alone | harvested |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, r in rows.items():
        lines.append(
            f"| {cfg} | {r['calls']} ({r.get('alone_calls', '-')}) | {r['requests']} | {r['idle_arrivals']} "
            f"| {f(r['caught_share'], '.1%')} ({r['caught'] if r['caught'] is not None else '-'}) "
            f"| {f(r['first_kernel_p50_ms'])} / {f(r['first_kernel_p99_ms'])} "
            f"| {f(r['caught_first_kernel_p50_ms'])} ({f(r.get('caught_first_kernel_p50_vs_alone_ms'), '+.3f')}) "
            f"| {f(r.get('ttft_p50_ratio'))} / {f(r.get('ttft_p99_ratio'))} | {f(r.get('ttft_paired_ratio'))} "
            f"| {f(r.get('tpot_p99_ratio'))} "
            f"| {f(r['harvested'], '.1%')} |")
    kinds = [(cfg, kind, v) for cfg, r in rows.items() for kind, v in (r.get("ttft_by_kind") or {}).items()]
    if kinds:
        lines += ["", "TTFT request by request against the same request alone, by kind (median difference "
                  "/ median ratio): where the set's p50 moves.", "",
                  "| configuration | kind | requests | TTFT vs alone (ms) | TTFT ratio |", "|---|---|---|---|---|"]
        lines += [f"| {cfg} | {kind} | {v['requests']} | {f(v['diff_p50_ms'], '+.3f')} | {f(v['ratio_p50'])} |"
                  for cfg, kind, v in kinds]
    what_if = [(cfg, w) for cfg, r in rows.items() for w in (r.get("ttft_p50_if_caught") or [])]
    if what_if:
        lines += ["", "The set's TTFT p50 against alone had more idle arrivals been caught: uncaught arrivals "
                  "drawn at random (200 draws) given their TTFT alone plus the caught ones' median "
                  "difference; the first row per configuration is as measured.", "",
                  "| configuration | idle arrivals caught | TTFT p50 vs alone (median of draws) | 95% of draws |",
                  "|---|---|---|---|"]
        lines += [f"| {cfg} | {f(w['caught_share'], '.1%')} | {f(w['ttft_p50_ratio'])} "
                  f"| {f(w['low']) + '-' + f(w['high']) if w['low'] is not None else 'as measured'} |"
                  for cfg, w in what_if]
    per_call = [(cfg, c) for cfg, r in rows.items() for c in (r.get("per_call") or [])]
    if per_call:
        lines += ["", "Caught arrivals per call (medians, ms): against the same request alone, and their first "
                  "kernel split at the launch probe (arrival -> probe: the server; probe -> GPU start: the "
                  "trap's return, the submission, the GPU).", "",
                  "| configuration | call | idle arrivals | caught | caught vs alone | alone's first kernel "
                  "| arrival -> probe | probe -> GPU start |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {cfg} | {c['call']} | {c['idle_arrivals']} | {c['caught']} | {f(c['caught_vs_alone_ms'], '+.3f')} "
                  f"| {f(c['alone_first_kernel_p50_ms'])} | {f(c['arrival_to_probe_p50_ms'])} "
                  f"| {f(c['probe_to_gpu_p50_ms'])} |" for cfg, c in per_call]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calls", nargs="+", help="one call's report.json files, comma-separated")
    ap.add_argument("--out", required=True, help="the markdown table; a .json beside it gets the figures")
    ap.add_argument("--skip", action="append", default=[], metavar="K:CONFIG",
                    help="leave out call K's (from 0) CONFIG, e.g. a run known to be wrong; repeatable")
    a = ap.parse_args(argv)
    try:
        skip = {(int(k), cfg) for k, cfg in (x.split(":", 1) for x in a.skip)}
    except ValueError:
        ap.error("--skip takes K:CONFIG, e.g. 0:gate-arrival")
    calls = calls_of(a.calls, skip)
    cfgs = list(dict.fromkeys(cfg for c in calls for cfg in c))
    rows = {cfg: pooled_row(calls, cfg) for cfg in cfgs}
    with open(a.out, "w") as f:
        f.write(markdown(rows, a.calls))
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    print(markdown(rows, a.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
