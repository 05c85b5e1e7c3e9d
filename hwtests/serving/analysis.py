"""The serving benchmark's numbers, from the load generator's per-request records, the offline
job's progress samples and the gate's trace (`valvectl --json gate trace`). Standard library only,
so CI tests it without torch (test_analysis.py).

All times are CLOCK_MONOTONIC nanoseconds (Python's time.monotonic_ns, bpf_ktime_get_ns).
"""

import bisect
import math
import random


def percentile(xs, p):
    """Nearest-rank percentile (p in 0..100) of the values; None when there are none."""
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    k = max(1, math.ceil(p / 100 * len(s)))
    return s[k - 1]


def union_ns(intervals, lo, hi):
    """Total length of the union of [start, end) intervals, clipped to [lo, hi)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def progress_at(samples, t):
    """Offline progress (iterations) at time t, interpolated between (t_ns, iters) samples."""
    if not samples:
        return None
    ts = [s[0] for s in samples]
    i = bisect.bisect_right(ts, t)
    if i == 0:
        return samples[0][1]
    if i >= len(samples):
        return samples[-1][1]
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0)


def window_of(requests):
    """The measured window: first send to last end."""
    return min(r["send_ns"] for r in requests), max(r["end_ns"] for r in requests)


def request_stats(requests):
    """TTFT (send -> first streamed token) and TPOT ((last - first) / (tokens - 1)), in ms."""
    ok = [r for r in requests if ttft_ms(r) is not None]
    ttft = [ttft_ms(r) for r in ok]
    tpot = [t for t in map(tpot_ms, ok) if t is not None]
    return {
        "requests": len(requests),
        "errors": len(requests) - len(ok),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_max_ms": percentile(ttft, 100),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
    }


def busy_share(requests):
    """Share of the window in which at least one request was in flight (send -> end)."""
    return busy_share_runs([requests])


def busy_share_runs(runs):
    """busy_share over several runs (lists of records) of one configuration: busy time over window time."""
    busy = window = 0
    for requests in runs:
        lo, hi = window_of(requests)
        busy += union_ns([(r["send_ns"], r["end_ns"]) for r in requests], lo, hi)
        window += max(1, hi - lo)
    return busy / window


def harvest(requests, progress, rate_alone):
    """Offline throughput against alone, and the share of online-idle time harvested: offline's
    progress in the window, in seconds at its rate alone, over the window's online-idle seconds."""
    return harvest_runs([(requests, progress)], rate_alone)


def bracket_alone(start, end):
    """Offline's rate alone from measurements before the first run and after the last: their mean
    (the harvest's reference), and how far they moved (|end - start| over the mean). Either may be
    None (not measured); then the other one is used and the move is unknown."""
    if start and end:
        mean = (start + end) / 2
        return mean, abs(end - start) / mean
    return (start or end), None


def harvest_runs(runs, rate_alone):
    """harvest over several runs ((records, progress samples) pairs) of one configuration: offline's
    progress and the windows' idle seconds are summed before dividing."""
    done_s = window_s = idle_s = 0.0
    for requests, progress in runs:
        lo, hi = window_of(requests)
        p0, p1 = progress_at(progress, lo), progress_at(progress, hi)
        if p0 is None or not rate_alone:
            return {"offline_vs_alone": None, "harvested": None}
        done_s += (p1 - p0) / rate_alone
        window_s += (hi - lo) / 1e9
        idle_s += (hi - lo - union_ns([(r["send_ns"], r["end_ns"]) for r in requests], lo, hi)) / 1e9
    return {
        "offline_vs_alone": done_s / window_s if window_s > 0 else None,
        "harvested": done_s / idle_s if idle_s > 0 else None,
    }


def disabled_intervals(trace):
    """[(stopped_ns, resumed_ns)]: from each whole-offline disable's end to the next enable's
    start (the last one open-ended). An enable before any disable closes a freeze that began
    before the trace (a gate's hold from before the window): it counts from the trace's first
    record, since the trace cannot say when it began."""
    out, start = [], None
    ordered = sorted(trace, key=lambda r: r["t_ns"])
    for r in ordered:
        if r["event"] == "disable" and r.get("pid", 0) == 0 and r.get("ok", True):
            if start is None:
                start = r["end_ns"]
        elif r["event"] == "enable" and r.get("pid", 0) == 0 and start is None and not out:
            out.append((ordered[0]["t_ns"], r["t_ns"]))
        elif r["event"] == "enable" and start is not None:
            out.append((start, r["t_ns"]))
            start = None
    if start is not None:
        out.append((start, float("inf")))
    return out


def per_request(requests, trace, online_pids=None):
    """For each request that arrived at an idle server (nothing else in flight): arrival ->
    offline stopped and arrival -> first online kernel (ms; the kernel is the first launch edge
    after the arrival, which is how an idle server's first launch shows in the trace)."""
    launches = sorted(
        r["t_ns"]
        for r in trace
        if r["event"] == "launch" and (online_pids is None or r["pid"] in online_pids)
    )
    stopped = disabled_intervals(trace)
    arrivals = sorted(
        (r["t_ns"], r.get("recv_ns"), r.get("read_ns")) for r in trace if r["event"] == "arrival"
    )
    rows = []
    for q in requests:
        if not q.get("idle_at_send"):
            continue
        a = q["send_ns"]
        j = bisect.bisect_left(arrivals, (a,))
        seen = arrivals[j] if j < len(arrivals) and arrivals[j][0] < q["end_ns"] else None
        i = bisect.bisect_left(launches, a)
        kernel = launches[i] if i < len(launches) and launches[i] < q["end_ns"] else None
        # When offline was (or became) stopped for this request: the first stopped interval
        # that reaches past the arrival and starts before the request ended.
        stop = None
        for s, e in stopped:
            if e > a and s < q["end_ns"]:
                stop = s
                break
        rows.append(
            {
                "send_ns": a,
                "arrival_to_stopped_ms": None if stop is None else (stop - a) / 1e6,
                "arrival_to_kernel_ms": None if kernel is None else (kernel - a) / 1e6,
                "stopped_first": stop is not None and kernel is not None and stop <= kernel,
                # Offline was still stopped from before (a cooldown or hold not yet over). Then no
                # resume armed the probe, so the request's first launch need not be an edge, and
                # the first edge can come well after the first kernel.
                "already_stopped": stop is not None and stop <= a,
                # From the arrival program seeing the request's data to the gate thread having
                # it: the ring buffer and two thread wake-ups (4-5 ms twice in 246 on the H100),
                # and the first of them alone (the watcher's thread read it; newer daemons).
                "arrival_to_gate_ms": (seen[1] - seen[0]) / 1e6 if seen and seen[1] else None,
                "arrival_to_watcher_ms": (seen[2] - seen[0]) / 1e6 if seen and seen[2] else None,
            }
        )
    return rows


def gpu_start_rows(requests):
    """For each request that arrived at an idle server: arrival (the client's send, as in
    per_request) -> its first kernel running on the GPU (ms), from the graph server's stamp
    (`gpu_start_ns`, already on CLOCK_MONOTONIC); None where the record has no stamp."""
    rows = []
    for q in requests:
        if not q.get("idle_at_send"):
            continue
        g = q.get("gpu_start_ns")
        rows.append({"send_ns": q["send_ns"],
                     "arrival_to_gpu_start_ms": None if g is None else (g - q["send_ns"]) / 1e6})
    return rows


def gpu_start_stats(requests):
    """p50/p99 of gpu_start_rows over idle arrivals, how many idle arrivals there were, how many had
    no stamp (unknown: counted, not dropped) and how many stamps came before the arrival (a mapping
    off by more than that)."""
    rows = gpu_start_rows(requests)
    known = [r["arrival_to_gpu_start_ms"] for r in rows if r["arrival_to_gpu_start_ms"] is not None]
    return {
        "arrival_to_gpu_start_p50_ms": percentile(known, 50),
        "arrival_to_gpu_start_p99_ms": percentile(known, 99),
        "gpu_start_idle_arrivals": len(rows),
        "gpu_start_unknown": len(rows) - len(known),
        "gpu_start_before_arrival": sum(1 for x in known if x < 0),
    }


HOST_PATH = (("send_to_recv", "send_ns", "recv_ns"), ("recv_to_launch", "recv_ns", "launch_ns"),
             ("launch_to_gpu_start", "launch_ns", "gpu_start_ns"))


# Buckets of "host launch after the disable's issue" (us) for disable_split: the floor
# experiment's table (g) found a launch that lands late in the disable waiting (+132 us on an
# H100 at 400 us) and one at other offsets not.
LAUNCH_AFTER_ISSUE_BUCKETS_US = (0, 200, 400, 600)


def disable_split_rows(requests, trace):
    """For each idle arrival that the gate stopped offline for (a whole-offline disable issued
    after the send and before the request ended) and that has the server's launch and GPU-start
    marks: the host launch's time after that disable's issue (us; negative: the server launched
    first) and the launch -> GPU start (us)."""
    issues = sorted(r["t_ns"] for r in trace
                    if r["event"] == "disable" and r.get("pid", 0) == 0 and r.get("ok", True))
    rows = []
    for q in requests:
        if not q.get("idle_at_send") or q.get("launch_ns") is None or q.get("gpu_start_ns") is None:
            continue
        i = bisect.bisect_left(issues, q["send_ns"])
        if i == len(issues) or issues[i] >= q["end_ns"]:
            continue
        rows.append({"launch_after_issue_us": (q["launch_ns"] - issues[i]) / 1e3,
                     "launch_to_gpu_start_us": (q["gpu_start_ns"] - q["launch_ns"]) / 1e3})
    return rows


def disable_split_stats(rows):
    """disable_split_rows by bucket of launch after issue: per bucket (label, count, launch -> GPU
    start p50 and p99 in us); empty buckets are left out."""
    edges = LAUNCH_AFTER_ISSUE_BUCKETS_US
    bounds = [(None, edges[0])] + list(zip(edges, edges[1:])) + [(edges[-1], None)]
    out = []
    for lo, hi in bounds:
        xs = [r["launch_to_gpu_start_us"] for r in rows
              if (lo is None or r["launch_after_issue_us"] >= lo) and (hi is None or r["launch_after_issue_us"] < hi)]
        if xs:
            label = f"< {hi}" if lo is None else f">= {lo}" if hi is None else f"{lo}-{hi}"
            out.append({"bucket_us": label, "n": len(xs), "p50_us": percentile(xs, 50), "p99_us": percentile(xs, 99)})
    return out


def host_path_rows(requests):
    """Where an idle arrival's time went before its first kernel ran, from the graph servers'
    marks (ms; None where a mark is missing): the client's send -> the server got the request
    (`recv_ns`) -> it launched the first GPU work (`launch_ns`) -> that work ran (`gpu_start_ns`)."""
    rows = []
    for q in requests:
        if not q.get("idle_at_send"):
            continue
        rows.append({name: (q[b] - q[a]) / 1e6 if q.get(a) is not None and q.get(b) is not None else None
                     for name, a, b in HOST_PATH})
    return rows


def host_path_stats(requests):
    """p50/p99 of each host_path_rows step over idle arrivals ({name}_p50_ms, {name}_p99_ms); only
    the steps some idle arrival has both marks for, so a server without marks adds nothing."""
    rows = host_path_rows(requests)
    out = {}
    for name, _, _ in HOST_PATH:
        xs = [r[name] for r in rows if r[name] is not None]
        if xs:
            out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = percentile(xs, 50), percentile(xs, 99)
    return out


def offline_ran_in_decode(requests, trace):
    """Per request with a first token: ms that offline ran between its first token and its end
    (not inside a stopped interval of the trace). Under a gate this should be 0; a positive value
    is a cooldown that resumed offline mid-request, which TPOT pays for until the next edge."""
    stopped = disabled_intervals(trace)
    out = []
    for q in requests:
        lo, hi = q.get("first_ns"), q["end_ns"]
        if not lo or hi <= lo:
            continue
        covered = union_ns([(s, min(e, hi)) for s, e in stopped if e > lo and s < hi], lo, hi)
        out.append((hi - lo - covered) / 1e6)
    return out


def decode_summary(runs):
    """Over (requests, trace) rounds: how often offline ran inside a request's decode, and the
    edges the resume arm caught."""
    ran = [x for requests, trace in runs for x in offline_ran_in_decode(requests, trace)]
    hit = [x for x in ran if x > 0.05]
    return {
        "requests": len(ran),
        "with_offline_running": len(hit),
        "offline_ran_max_ms": max(ran, default=None),
        "offline_ran_sum_ms": sum(hit),
        "edges_after_resume": sum(1 for _, trace in runs for r in trace
                                  if r["event"] == "launch" and r.get("after_resume")),
    }


def decisions_around(trace, lo, hi, base):
    """The trace records between lo and hi, as text lines with times relative to base."""
    out = []
    for r in sorted(trace, key=lambda r: r["t_ns"]):
        if lo <= r["t_ns"] <= hi:
            rel = (r["t_ns"] - base) / 1e6
            extra = ""
            if "end_ns" in r:
                extra = f" took {(r['end_ns'] - r['t_ns']) / 1e3:.0f} us"
            elif "cooldown_ns" in r:
                extra = f" after {r['cooldown_ns'] / 1e6:.2f} ms idle"
                if r.get("waits_ignored"):  # online still waited on its GPU work: its launches went unseen
                    extra += ", ignoring a wait"
            elif "recv_ns" in r:
                extra = f" (gate got it +{(r['recv_ns'] - r['t_ns']) / 1e3:.0f} us)"
                if r.get("after_resume"):  # an edge only because it was the first launch since the resume
                    extra += ", first since the resume"
            out.append(f"{rel:+.2f} ms {r['event']}{extra}")
    return out


def tails(requests, trace, threshold_ms):
    """Requests whose TTFT exceeds threshold_ms, each with the gate's decisions from its send to
    its first token: what a slow first token waited on."""
    out = []
    for r in requests:
        if not r.get("first_ns"):
            continue
        ttft = (r["first_ns"] - r["send_ns"]) / 1e6
        if ttft > threshold_ms:
            inside = [x for x in trace if r["send_ns"] < x["t_ns"] < r["first_ns"]]
            out.append(
                {
                    "ttft_ms": ttft,
                    # Offline was resumed while the request waited for its first token.
                    "resumed_inside": any(x["event"] == "enable" for x in inside),
                    "disables_inside": sum(x["event"] == "disable" for x in inside),
                    "idle_at_send": r.get("idle_at_send"),
                    "in_flight_at_send": r.get("in_flight_at_send"),
                    "decisions": decisions_around(
                        trace, r["send_ns"] - 1_000_000, r["first_ns"], r["send_ns"]
                    ),
                }
            )
    return out


def late_arrivals(requests, trace, online_pids=None, hop_ms=0.5):
    """Idle arrivals that offline was not stopped before, or that reached the gate thread more
    than hop_ms after the arrival program saw them, each with the gate's decisions from 5 ms
    before the send until offline stopped or the first kernel ran: what the gate was busy with."""
    out = []
    for row in per_request(requests, trace, online_pids):
        hop = row["arrival_to_gate_ms"]
        if row["stopped_first"] and (hop is None or hop <= hop_ms):
            continue
        a = row["send_ns"]
        until = max(x for x in (row["arrival_to_stopped_ms"], row["arrival_to_kernel_ms"], 0.0) if x is not None)
        out.append(dict(row, decisions=decisions_around(trace, a - 5 * 1_000_000, a + int((until + 0.5) * 1e6), a)))
    return out


def first_launch_delays(trace):
    """Each arrival's delay to its first launch, where the trace shows it: the next launch edge,
    unless the launch before that edge (its idle gap back) came after the arrival. Then a request
    in flight kept online busy and the arrival's first launch was not an edge: its delay is None
    (unknown; the gate learns nothing from such an arrival either, `GatePolicy::on_edge`)."""
    edges = sorted((r["t_ns"], r.get("idle_ns") or 0) for r in trace if r["event"] == "launch")
    out = []
    for a in sorted(r["t_ns"] for r in trace if r["event"] == "arrival"):
        i = bisect.bisect_right(edges, (a, float("inf")))
        if i == len(edges):
            continue
        t, idle = edges[i]
        out.append(None if idle and t - idle > a else t - a)
    return out


def hold_expiries(trace, learn_expired, ceiling_ns=200_000_000, factor=2.0, floor_ns=1_000_000,
                  window=512):
    """Replays a gate trace's arrival -> first launch delays (`first_launch_delays`) through the
    arrival-hold rule alone (hold = factor x the longest of the last `window` learned delays,
    clamped to [floor, ceiling]; the ceiling until one is learned) and counts the arrivals whose
    first launch came after their hold ran out. `learn_expired`: whether such a late delay is
    still learned (the gate since 12c8d7f) or dropped (before). Every arrival whose first launch
    was an edge counts, also one with requests in flight, so this bounds the resumes the rule
    allows rather than counting the gate's real ones."""
    learned, expired = [], 0
    for delay in first_launch_delays(trace):
        if delay is None:
            continue
        hold = ceiling_ns if not learned else min(ceiling_ns, max(floor_ns, factor * max(learned[-window:])))
        late = delay > hold
        expired += late
        if delay < ceiling_ns and (learn_expired or not late):
            learned.append(delay)
    return expired


def fits_deadline(elapsed_s, run_s, deadline_s):
    """Whether one more run, as long as the longest so far, ends before the deadline: a run
    started just before it would otherwise overrun it (and a `timeout` around the command would
    lose the report)."""
    return elapsed_s + max(run_s, default=0.0) <= deadline_s


def pct_change(x, base):
    if x is None or base in (None, 0):
        return None
    return (x / base - 1) * 100


def check_targets(alone, gated, rows, preemptions, harvested):
    """The targets for one load, against the same run's alone configuration:
    [(name, value text, pass)]."""

    def fmt(v, unit="%"):
        return "n/a" if v is None else f"{v:+.1f}{unit}"

    ttft50 = pct_change(gated["ttft_p50_ms"], alone["ttft_p50_ms"])
    ttft99 = pct_change(gated["ttft_p99_ms"], alone["ttft_p99_ms"])
    tpot99 = pct_change(gated["tpot_p99_ms"], alone["tpot_p99_ms"])
    judged = [r for r in rows if r["arrival_to_kernel_ms"] is not None]
    first = sum(r["stopped_first"] for r in judged) / len(judged) if judged else None
    ppr = preemptions / gated["requests"] if preemptions is not None and gated["requests"] else None
    return [
        ("TTFT p50 vs alone <= +1%", fmt(ttft50), ttft50 is not None and ttft50 <= 1.0),
        ("TTFT p99 vs alone <= +2%", fmt(ttft99), ttft99 is not None and ttft99 <= 2.0),
        ("TPOT p99 vs alone <= +1%", fmt(tpot99), tpot99 is not None and tpot99 <= 1.0),
        (
            "offline stopped before the first kernel, idle arrivals >= 99%",
            "n/a" if first is None else f"{first * 100:.1f}% of {len(judged)}",
            first is not None and first >= 0.99,
        ),
        ("preemptions per request <= 1", "n/a" if ppr is None else f"{ppr:.2f}", ppr is not None and ppr <= 1.0),
        (
            "online-idle time harvested >= 90%",
            "n/a" if harvested is None else f"{harvested * 100:.1f}%",
            harvested is not None and harvested >= 0.90,
        ),
    ]


def pool_reports(reports):
    """Several benchmark reports (report.json) of the same command, pooled per load and
    configuration: latency over every request of every report, the change against pooled alone,
    the median of each request's TTFT against alone's same request (same report, round and
    index: the rounds replay the same arrivals in every configuration), and idle arrivals that
    found offline stopped before the first kernel, summed."""
    out = {}
    for rep_no, rep in enumerate(reports):
        for run in rep["runs"]:
            e = out.setdefault(run["load"], {}).setdefault(run["config"], {"records": {}, "rows": []})
            for x in run["records"]:
                e["records"][(rep_no, run["round"], x["i"])] = x
        for entry in rep["loads"]:
            for cfg, row in entry["rows"].items():
                out[entry["load"]][cfg]["rows"].append(row)
    pooled = {}
    for load, configs in out.items():
        alone = configs.get("alone", {}).get("records", {})
        rows = {}
        for cfg, e in configs.items():
            s = request_stats(list(e["records"].values()))
            ratios = [ttft_ms(x) / ttft_ms(alone[k]) for k, x in e["records"].items()
                      if k in alone and ttft_ms(x) and ttft_ms(alone[k])]
            s["ttft_ratio_median"] = percentile(ratios, 50)
            judged = [p for row in e["rows"] for p in row.get("per_request", [])
                      if p["arrival_to_kernel_ms"] is not None]
            s["stopped_first"] = (sum(p["stopped_first"] for p in judged), len(judged)) if judged else None
            gated = [row for row in e["rows"] if row.get("preemptions_per_request") is not None]
            s["preemptions"] = sum(row["preemptions_per_request"] * row["requests"] for row in gated) if gated else None
            rows[cfg] = s
        base = rows.get("alone", {})
        for s in rows.values():
            for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                s[f"{m}_vs_alone_pct"] = pct_change(s[m], base.get(m))
        pooled[load] = rows
    return pooled


def paired_change_interval(base, other, value, q, level=90, resamples=2000, seed=0):
    """How far one run can pin down a percentile's change from configuration `base` to `other`.
    Each is {(round, index): record}; every configuration replays the same arrivals, so the two
    records of a key saw the same load. Keys are drawn again with replacement, the same draw for
    both, and the q-th percentile of value(record) compared on each draw. Returns the change's
    (100 - level) / 2 and (100 + level) / 2 percentiles, in %, or None below 20 pairs."""
    pairs = [(value(base[k]), value(other[k])) for k in base if k in other]
    pairs = [(b, o) for b, o in pairs if b is not None and o is not None]
    if len(pairs) < 20:
        return None
    rng = random.Random(seed)
    changes = []
    for _ in range(resamples):
        draw = rng.choices(pairs, k=len(pairs))
        changes.append(pct_change(percentile([o for _, o in draw], q), percentile([b for b, _ in draw], q)))
    tail = (100 - level) / 2
    return percentile(changes, tail), percentile(changes, 100 - tail)


def change_intervals(base, other):
    """`paired_change_interval` for the three latency targets: TTFT p50 and p99, TPOT p99."""
    return {
        "ttft_p50_ms": paired_change_interval(base, other, ttft_ms, 50),
        "ttft_p99_ms": paired_change_interval(base, other, ttft_ms, 99),
        "tpot_p99_ms": paired_change_interval(base, other, tpot_ms, 99),
    }


def tpot_ms(record):
    """(last - first streamed token) / (tokens - 1), ms; None for a failed or one-token request."""
    if ttft_ms(record) is None or record["tokens"] < 2:
        return None
    return (record["end_ns"] - record["first_ns"]) / 1e6 / (record["tokens"] - 1)


def ttft_ms(record):
    """Send -> first streamed token (ms); None for a failed request."""
    if not record.get("first_ns") or record.get("error") is not None:
        return None
    return (record["first_ns"] - record["send_ns"]) / 1e6
