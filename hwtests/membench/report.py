"""Turns the memory benchmark's raw results into numbers and a report: latency percentiles, offline
throughput, reclaims per minute, reclaim latency, the cost of waiting for an iteration boundary,
valve-churn's reclaims while gates restart and the control socket is flooded, and the
issues' targets with pass/fail. Pure functions over JSON: tested in test_report.py.
"""

from __future__ import annotations

import json
import random

import common
from common import pct

TARGETS = dict(reclaim_1gib_p99_ms=10.0, rate_within=0.25, offline_vs_static=1.5, ttft_p99_pct=5.0,
               tpot_p99_pct=2.0)
# Configurations whose online latency and offline throughput are not compared with alone or static:
# valve-churn stops the gate again and again, and offline runs ungated until the next start.
NOT_COMPARED = ("valve-churn",)
MIN_RECLAIMS_FOR_P99 = 10  # fewer reclaims than this do not make a p99 to judge a target on


def request_latencies(online: dict) -> dict:
    """Per request id: (is it a burst request, TTFT ms from arrival, TPOT ms or None under 2 tokens)."""
    out = {}
    for i, q in enumerate(online.get("requests", [])):
        ts = q["timestamps"]
        if q["error"] or not ts or q["arrival"] is None:
            continue
        tpot = (ts[-1] - ts[0]) / (len(ts) - 1) * 1e3 if len(ts) >= 2 else None
        out[q.get("rid", f"#{i}")] = (q["burst"], (ts[0] - q["arrival"]) * 1e3, tpot)
    return out


def latencies(online: dict) -> dict:
    """TTFT (arrival to first token) and TPOT (mean gap between later tokens), ms, per request kind."""
    per = request_latencies(online).values()
    ttft = [t for burst, t, _ in per if not burst]
    ttft_burst = [t for burst, t, _ in per if burst]
    tpot = [p for _, _, p in per if p is not None]
    every = ttft + ttft_burst
    return dict(requests=len(online.get("requests", [])), failed=online.get("failed"),
                ttft_p50=pct(every, 50), ttft_p99=pct(every, 99), ttft_short_p50=pct(ttft, 50),
                ttft_short_p99=pct(ttft, 99), ttft_burst_p50=pct(ttft_burst, 50), ttft_burst_p99=pct(ttft_burst, 99),
                tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99))


def bracket(per_run_alone: dict, per_run_alone2: dict) -> dict:
    """Per request id in both: the mean of alone's and alone-2's latencies. alone runs first in a
    command and alone-2 last, so against their mean a drift linear in time (the GPU warming over
    the command) cancels for the configurations run between them."""
    out = {}
    for rid, (burst, t1, p1) in per_run_alone.items():
        if rid in per_run_alone2:
            _, t2, p2 = per_run_alone2[rid]
            out[rid] = (burst, (t1 + t2) / 2, (p1 + p2) / 2 if p1 is not None and p2 is not None else None)
    return out


def pooled(runs: list[dict], resamples: int = 2000, seed: int = 0) -> dict:
    """Online latency over several benchmark runs, each a {config: raw result} of one trace (its own
    seed), so that a p99 is not one run's slowest burst request. Per configuration: the pooled
    TTFT/TPOT percentiles and their change against pooled alone, the median per-request TPOT ratio
    against alone's same request in the same run, and a paired bootstrap (requests drawn again within
    each run, the same draw for both configurations) of the TPOT p99 change: its 5th and 95th
    percentiles. The same against `bracket` (alone and alone-2 averaged per request), in runs that
    have both: `*_vs_bracket`."""
    per_run = [{c: request_latencies(r[c]["online"]) for c in r if (r[c] or {}).get("online")} for r in runs]
    for pr in per_run:
        if "alone" in pr and "alone-2" in pr:
            pr["bracket"] = bracket(pr["alone"], pr["alone-2"])
    configs = [c for c in ("alone", "valve-miad", "alone-2", "static") if any(c in pr for pr in per_run)]
    rng = random.Random(seed)

    def p(vals, q):
        return pct([v for v in vals if v is not None], q)

    out: dict = dict(runs=len(runs), configs={})
    for c in configs:
        mine = [lat for pr in per_run if c in pr for lat in pr[c].values()]
        n = dict(runs=sum(1 for pr in per_run if c in pr), requests=len(mine),
                 ttft_p50=p([x[1] for x in mine], 50), ttft_p99=p([x[1] for x in mine], 99),
                 tpot_p50=p([x[2] for x in mine], 50), tpot_p99=p([x[2] for x in mine], 99))
        for ref, suffix in (("alone", ""), ("bracket", "_vs_bracket")):
            if ref == "bracket" and c in ("alone", "alone-2"):
                continue
            by_run = [[(pr[ref][rid], lat) for rid, lat in pr[c].items() if rid in pr[ref]]
                      for pr in per_run if c in pr and ref in pr]
            pairs = [pair for run in by_run for pair in run]
            if not pairs:
                continue
            n["tpot_ratio_median" + suffix] = pct([b[2] / a[2] for a, b in pairs if a[2] and b[2]], 50)
            if ref == "bracket":
                for m, i in (("ttft_p99", 1), ("tpot_p99", 2)):
                    n[f"{m}_vs_bracket_pct"] = delta(p([b[i] for _, b in pairs], 99),
                                                     p([a[i] for a, _ in pairs], 99))
            if c == ref:
                continue
            draws = []
            for _ in range(resamples):
                d = [pair for run in by_run for pair in rng.choices(run, k=len(run))]
                r0, got = p([a[2] for a, _ in d], 99), p([b[2] for _, b in d], 99)
                if r0 and got:
                    draws.append((got / r0 - 1) * 100)
            n["tpot_p99_change_pct_90ci" + suffix] = [pct(draws, 5), pct(draws, 95)] if draws else None
        out["configs"][c] = n
    alone = out["configs"].get("alone", {})
    for c, n in out["configs"].items():
        if c != "alone":
            for m in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
                n[f"{m}_vs_alone_pct"] = delta(n.get(m), alone.get(m))
    return out


def signed_pct(v) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def pooled_markdown(pool: dict, labels: list[str]) -> str:
    def ci_text(ci):
        return "-" if not ci else f"{ci[0]:+.1f}% .. {ci[1]:+.1f}%"

    lines = [f"Online latency pooled over {pool['runs']} runs ({', '.join(labels)}):", "",
             "| config | runs | requests | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | TTFT p99 / TPOT p99 vs alone | "
             "TPOT p99 change, 90% bootstrap interval | median per-request TPOT ratio to alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, n in pool["configs"].items():
        lines.append(f"| {c} | {n['runs']} | {n['requests']} | {fmt(n['ttft_p50'])} / {fmt(n['ttft_p99'])} | "
                     f"{fmt(n['tpot_p50'], 2)} / {fmt(n['tpot_p99'], 2)} | {signed_pct(n.get('ttft_p99_vs_alone_pct'))} / "
                     f"{signed_pct(n.get('tpot_p99_vs_alone_pct'))} | "
                     f"{ci_text(n.get('tpot_p99_change_pct_90ci'))} | {fmt(n.get('tpot_ratio_median'), 3)} |")
    bracketed = [(c, n) for c, n in pool["configs"].items() if "tpot_ratio_median_vs_bracket" in n]
    if bracketed:
        lines += ["", "Against alone and alone-2 averaged per request (they run first and last in each command, so a drift "
                  "linear in time cancels):", "",
                  "| config | TTFT p99 / TPOT p99 vs bracket | TPOT p99 change, 90% bootstrap interval | "
                  "median per-request TPOT ratio |", "| --- | --- | --- | --- |"]
        lines += [f"| {c} | {signed_pct(n.get('ttft_p99_vs_bracket_pct'))} / {signed_pct(n.get('tpot_p99_vs_bracket_pct'))} | "
                  f"{ci_text(n.get('tpot_p99_change_pct_90ci_vs_bracket'))} | {fmt(n.get('tpot_ratio_median_vs_bracket'), 3)} |"
                  for c, n in bracketed]
    return "\n".join(lines) + "\n"


def busy_fraction(online: dict) -> float | None:
    """Share of the trace with at least one request in flight (arrival to last token)."""
    spans = sorted((q["arrival"], q["timestamps"][-1]) for q in online.get("requests", [])
                   if q["arrival"] is not None and q["timestamps"])
    if not spans:
        return None
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        a = max(a, end)
        if b > a:
            busy += b - a
            end = b
    return busy / (online["t_end"] - online["t0"])


def reclaim_latency(online: dict, spans: list | None = None) -> dict:
    """Online `grow` calls the daemon served by reclaiming from offline: latency by size (ms), of
    those whose grow overlaps one of `spans` ((t0, t1), common.now() seconds) if given.
    `<=1GiB` (the target) counts every reclaim of 1 to 16 handles, one-handle ones too."""
    out: dict = {}
    grows = [g for g in online.get("grows", []) if g[3] > 0]
    if spans is not None:
        grows = [g for g in grows if any(g[0] <= t1 and g[0] + g[1] >= t0 for t0, t1 in spans)]
    sizes = (("64MiB", 1, 1), ("128MiB-1GiB", 2, 16), ("<=1GiB", 1, 16), (">1GiB", 17, 10**9), ("all", 1, 10**9))
    for label, lo, hi in sizes:
        d = [g[1] * 1e3 for g in grows if lo <= g[2] <= hi]
        out[label] = dict(n=len(d), p50=pct(d, 50), p99=pct(d, 99), max=max(d) if d else None)
    return out


def churn_numbers(churn: dict, online: dict | None) -> dict:
    """valve-churn: its reclaims of up to 1 GiB while the gate cycler ran and during the gate
    commands themselves, and the churn's counts as run.py recorded them."""
    out = {k: v for k, v in churn.items() if k != "commands"}
    t0, t1 = churn.get("t_start"), churn.get("t_cycler_end")
    if online and t0 is not None and t1 is not None:
        out["reclaim_ms_while_churning"] = reclaim_latency(online, [(t0, t1)])["<=1GiB"]
        spans = [(c[1], c[2]) for c in churn.get("commands") or []]
        out["reclaim_ms_during_gate_commands"] = reclaim_latency(online, spans)["<=1GiB"]
    return out


WINDOW_S = 120.0  # reclaims per minute are also reported per window of this length


def reclaim_windows(online: dict, window_s: float = WINDOW_S) -> list[float]:
    """Reclaims per minute in each whole `window_s` window of the trace, from online's grows that reclaimed:
    MIAD starts cold, so a rate over the whole run mixes its transient with what it settles to. A last
    window shorter than half of `window_s` is left out (too few reclaims to say anything)."""
    t0, t_end = online.get("t0"), online.get("t_end")
    if t0 is None or t_end is None or t_end <= t0:
        return []
    times = [g[0] for g in online.get("grows", []) if g[3] > 0 and t0 <= g[0] < t_end]
    out = []
    start = t0
    while t_end - start >= window_s / 2:
        length = min(window_s, t_end - start)
        n = sum(1 for t in times if start <= t < start + length)
        out.append(n * 60.0 / length)
        start += window_s
    return out


def boundary_wait(steps: list[float], samples: int = 20000, seed: int = 0) -> dict:
    """If a reclaim waited for offline's iteration boundary instead of preempting mid-kernel, online
    would wait for the rest of offline's current step. Sampled at uniformly random instants over
    the measured step timeline (long steps are hit more often, as a reclaim would hit them), ms."""
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    if not gaps:
        return dict(n=0, p50=None, p99=None, step_p50=None, step_max=None)
    total = sum(gaps)
    rng = random.Random(seed)
    waits = []
    for _ in range(samples):
        x = rng.random() * total
        for g in gaps:
            if x < g:
                waits.append((g - x) * 1e3)
                break
            x -= g
        if len(waits) >= samples:
            break
    return dict(n=len(gaps), p50=pct(waits, 50), p99=pct(waits, 99), step_p50=pct([g * 1e3 for g in gaps], 50),
                step_max=max(gaps) * 1e3)


KV_BIN = 8192  # tokens read per step: steps are compared within bins of this width


def step_profile(online: dict) -> dict | None:
    """Where online's generation loop spent the trace (online.py's StepLog): seconds in scheduling
    (the shim's turn included), forward passes and updates, and the median forward pass of decode-only
    steps per KV-read bin, so that two configurations can be compared on steps of the same shape."""
    fields = online.get("steps_fields")
    if not fields or not online.get("steps"):
        return None
    rows = [dict(zip(fields, s)) for s in online["steps"]]
    bins: dict[int, list[float]] = {}
    for r in rows:
        if r["q_tokens"] == r["requests"] > 0:  # every request decodes one token
            bins.setdefault(r["kv_read"] // KV_BIN, []).append(r["forward_s"] * 1e3)
    cpu = [r["forward_cpu_s"] for r in rows if "forward_cpu_s" in r]
    return dict(steps=len(rows), prepare_s=sum(r["prepare_s"] for r in rows),
                forward_s=sum(r["forward_s"] for r in rows), update_s=sum(r["update_s"] for r in rows),
                forward_cpu_s=sum(cpu) if cpu else None,
                prepare_p99_ms=pct([r["prepare_s"] * 1e3 for r in rows], 99),
                decode_steps=sum(len(v) for v in bins.values()),
                decode_ms_by_kv_bin={str(b): dict(n=len(v), p50=pct(v, 50)) for b, v in sorted(bins.items())})


def decode_vs(prof: dict | None, ref: dict | None) -> float | None:
    """Mean ratio of median decode-step times in the KV bins both profiles have, weighted by the
    steps of `prof`: above 1, the same work takes longer than in `ref`."""
    if not prof or not ref:
        return None
    a, b = prof["decode_ms_by_kv_bin"], ref["decode_ms_by_kv_bin"]
    pairs = [(a[k]["n"], a[k]["p50"] / b[k]["p50"]) for k in a if k in b and b[k]["p50"]]
    total = sum(n for n, _ in pairs)
    return sum(n * r for n, r in pairs) / total if total else None


FIRST_S = 90.0  # the target: offline against static over the first 90 s after a daemon restart


def first_tokens_per_s(off: dict, seconds: float = FIRST_S) -> float | None:
    """Offline's tokens per second over its first `seconds` after online's go (offline's `t0`), by
    the requests that finished in them; None for a run no longer than that (the whole run says it)
    or without finish times."""
    fin, t0, t1 = off.get("finishes"), off.get("t0"), off.get("t1")
    if not fin or t0 is None or t1 is None or t1 - t0 < seconds + 5:
        return None
    return sum(n for t, n in fin if t0 <= t < t0 + seconds) / seconds


def config_numbers(res: dict) -> dict:
    """The numbers of one configuration."""
    n: dict = dict(config=res.get("config"), error=res.get("error"),
                   gpu_used_mib_before=res.get("gpu_used_mib_before"),
                   gpu_used_mib_after=res.get("gpu_used_mib_after"))
    on, off = res.get("online"), res.get("offline")
    if on:
        n.update(latencies(on), busy=busy_fraction(on), device=on.get("device"),
                 online_peak_blocks=max((k[1] for k in on.get("kv", [])), default=None))
        n["reclaim_ms"] = reclaim_latency(on)
        n["step_profile"] = step_profile(on)
        n["grows_with_reclaim"] = sum(1 for g in on.get("grows", []) if g[3] > 0)
        n["reclaims_per_min_by_window"] = reclaim_windows(on)
        minutes = (on["t_end"] - on["t0"]) / 60
        n["trace_minutes"] = minutes
    if not str(res.get("config")).startswith("alone"):
        n["offline_crashed"] = off is None or res.get("offline_exit") not in (0, None) or bool(off.get("error_count"))
    if off:
        n.update(offline_tokens_per_s=off["tokens_per_s"], offline_first_tokens_per_s=first_tokens_per_s(off),
                 offline_finished=off["finished"],
                 offline_requeued=(off.get("shim") or {}).get("requeued", 0),
                 offline_invalidated_blocks=(off.get("shim") or {}).get("invalidated_blocks", 0))
        # Offline's steps while it ran alone (before the trace): with the gate, steps during the
        # trace also contain the time offline was frozen, which waiting for a boundary would not.
        n["boundary_wait_ms"] = boundary_wait(off.get("solo_steps") or off.get("steps", []))
    pool = res.get("pool") or {}
    before = (res.get("pool_before") or {}).get("reclaims") or {}
    if pool.get("reclaims") and on:
        reclaims = pool["reclaims"]["reclaims"] - before.get("reclaims", 0)
        n.update(reclaims=reclaims, reclaims_per_min=reclaims / n["trace_minutes"],
                 reclaimed_handles=pool["reclaims"]["handles"] - before.get("handles", 0),
                 offline_killed=pool["reclaims"].get("killed", 0))
    samples = (res.get("miad") or {}).get("samples") or []
    if samples:
        t_ms = [x[3] for x in samples]
        n["miad"] = dict(samples=len(samples), interval_ms_first=t_ms[0], interval_ms_min=min(t_ms),
                         interval_ms_last=t_ms[-1], target_handles_max=max(x[1] for x in samples),
                         balance_max=max(x[4] for x in samples), balance_last=samples[-1][4],
                         start=(res.get("miad") or {}).get("start"))
    gate = (res.get("gate") or {}).get("data") or res.get("gate") or {}
    n["gate_preemptions"] = (gate.get("stats") or {}).get("preemptions", gate.get("preemptions"))
    if res.get("churn") is not None:
        n["churn"] = churn_numbers(res["churn"], on)
    return n


def delta(x, ref) -> float | None:
    return None if x is None or not ref else (x / ref - 1) * 100


def build(results: dict, sizes: dict, args: dict) -> dict:
    """Every configuration's numbers, the comparisons against alone and static, and the targets."""
    nums = {k: config_numbers(v) for k, v in results.items()}
    alone = nums.get("alone", {})
    for k, n in nums.items():
        if k in NOT_COMPARED:
            for m in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
                n[f"{m}_vs_alone_pct"] = None
            n.update(decode_step_vs_alone=None, offline_vs_static=None)
        elif k != "alone":
            for m in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
                n[f"{m}_vs_alone_pct"] = delta(n.get(m), alone.get(m))
            n["decode_step_vs_alone"] = decode_vs(n.get("step_profile"), alone.get("step_profile"))
            n["offline_vs_static"] = n["offline_first_vs_static"] = None
            st = nums.get("static", {}).get("offline_tokens_per_s")
            if st and n.get("offline_tokens_per_s") is not None:
                n["offline_vs_static"] = n["offline_tokens_per_s"] / st
            st1 = nums.get("static", {}).get("offline_first_tokens_per_s")
            if st1 and n.get("offline_first_tokens_per_s") is not None:
                n["offline_first_vs_static"] = n["offline_first_tokens_per_s"] / st1
    checks = targets(nums, args)
    device = next((n.get("device") for n in nums.values() if n.get("device")), None)
    return dict(device=device, sizes=sizes, args={k: v for k, v in args.items() if k != "func"},
                configs=nums, checks=checks)



def count_noise(target_per_min, minutes) -> str:
    """What counting alone does to a rate over a run this short: a Poisson count of the reclaims
    expected at the target moves by its square root (one standard deviation)."""
    expected = (target_per_min or 0) * (minutes or 0)
    if expected < 1:
        return ""
    return f"; {expected:.0f} expected at the target, so +-{100 / expected ** 0.5:.0f}% from counting alone"


def targets(nums: dict, args: dict) -> list[dict]:
    """The targets on the runs that exist (MIAD for rate and latency)."""
    out = []

    def check(name, value, ok, detail=""):
        out.append(dict(check=name, value=value, ok=None if value is None else bool(ok), detail=detail))

    # valve-churn has its own row below (its conditions are the point of it).
    r1 = [(nums[k]["reclaim_ms"]["<=1GiB"]["p99"], k) for k in nums if nums[k].get("reclaim_ms")
          and nums[k]["reclaim_ms"]["<=1GiB"]["p99"] is not None and k not in NOT_COMPARED]
    worst, worst_k = max(r1) if r1 else (None, None)
    check("reclaim of up to 1 GiB p99 <= 10 ms (online's grow, preemption included)", worst,
          worst is not None and worst <= TARGETS["reclaim_1gib_p99_ms"],
          f"worst configuration ({worst_k})" if worst_k else "")
    if "valve-churn" in nums:
        out.append(churn_target(nums["valve-churn"]))
    tgt = args.get("target_per_min")
    miads = [k for k in ("valve-miad", "valve-miad-warm") if k in nums] or ["valve-miad"]
    for k in miads:
        m = nums.get(k, {})
        rate = m.get("reclaims_per_min")
        events = (f"{m.get('reclaims')} reclaims in {m.get('trace_minutes', 0):.1f} min"
                  + count_noise(tgt, m.get("trace_minutes")) if rate is not None else "")
        check(f"{k}: MIAD reclaims/min within 25% of the target ({tgt}/min)", rate,
              rate is not None and tgt and abs(rate / tgt - 1) <= TARGETS["rate_within"], events)
    warm = ("valve-miad-warm",) if "valve-miad-warm" in nums else ()
    for k in ("valve-miad", "valve-noreserve") + warm:
        v = nums.get(k, {}).get("offline_vs_static")
        check(f"{k}: offline throughput >= 1.5x static", v, v is not None and v >= TARGETS["offline_vs_static"])
    for k in warm:  # a run longer than 90 s: the first 90 s after the restart, as the issue asks
        v = nums[k].get("offline_first_vs_static")
        if v is not None:
            check(f"{k}: offline >= 1.5x static over the first {FIRST_S:.0f} s after the daemon's restart", v,
                  v >= TARGETS["offline_vs_static"], "requests finished in each run's first 90 s")
    static = nums.get("static", {})
    for k in miads:
        for metric, label, limit in (("ttft_p99", "TTFT p99 <= +5%", "ttft_p99_pct"),
                                     ("tpot_p99", "TPOT p99 <= +2%", "tpot_p99_pct")):
            v = nums.get(k, {}).get(f"{metric}_vs_alone_pct")
            s = static.get(f"{metric}_vs_alone_pct")
            # Static shares compute through the same gate but never reclaims: its figure is what
            # colocation costs online before any memory policy.
            ref = f"static (no reclaims): {s:+.1f}%" if s is not None else ""
            check(f"{k}: {label} vs alone", v,
                  (v or 0) <= TARGETS[limit], ref)
    crashed = [k for k, n in nums.items() if n.get("offline_crashed")]
    with_offline = [k for k in nums if not k.startswith("alone")]
    check("no offline crash", len(crashed) if with_offline else None, not crashed, ", ".join(crashed))
    leaks = [k for k, n in nums.items() if n.get("gpu_used_mib_after") is not None
             and n.get("gpu_used_mib_before") is not None and n["gpu_used_mib_after"] > n["gpu_used_mib_before"] + 64]
    check("NVML used memory back to its level before each configuration", len(leaks), not leaks, ", ".join(leaks))
    return out


CHURN_TARGET = ("valve-churn: a grow that reclaims up to 1 GiB p99 <= 10 ms while gates start/stop and the "
                "socket is flooded")


def churn_target(n: dict) -> dict:
    """The churn target on valve-churn's numbers: judged only on reclaims made while the churn ran,
    when it did run (gate restarts and flood messages), and on at least MIN_RECLAIMS_FOR_P99 of them;
    otherwise `ok` is None and `note` says why."""
    c = n.get("churn") or {}
    r = c.get("reclaim_ms_while_churning") or {}
    count, p99 = r.get("n") or 0, r.get("p99")
    restarts, sent = c.get("restarts") or 0, (c.get("flood") or {}).get("messages") or 0
    during = c.get("reclaim_ms_during_gate_commands") or {}
    detail = (f"over {count} reclaims while the churn ran, max {fmt(r.get('max'), 2)} ms; "
              f"{during.get('n', 0)} during a gate command, max {fmt(during.get('max'), 2)} ms")
    note = None
    if not c or c.get("error") or "reclaim_ms_while_churning" not in c:
        note = "no churn recorded" + (f": {c['error']}" if c.get("error") else "")
    elif not restarts or not sent:
        note = f"the churn did not run in full ({restarts} gate restarts, {sent} flood messages)"
    elif count < MIN_RECLAIMS_FOR_P99:
        note = f"not enough reclaims ({count})"
    ok = None if note or p99 is None else p99 <= TARGETS["reclaim_1gib_p99_ms"]
    return dict(check=CHURN_TARGET, value=p99, ok=ok, detail=detail, note=note)


def one_line(name: str, res: dict) -> str:
    n = config_numbers(res)
    return (f"{name}: error={n.get('error')} ttft p50/p99={fmt(n.get('ttft_p50'))}/{fmt(n.get('ttft_p99'))} ms "
            f"tpot p99={fmt(n.get('tpot_p99'))} ms offline={fmt(n.get('offline_tokens_per_s'))} tok/s "
            f"reclaims={n.get('reclaims')} requeued={n.get('offline_requeued')}" + churn_line(n.get("churn")))


def churn_line(c: dict | None) -> str:
    if c is None:
        return ""
    r = c.get("reclaim_ms_while_churning") or {}
    return (f" churn: error={c.get('error')} restarts={c.get('restarts')} failures={c.get('failures')} "
            f"flood={(c.get('flood') or {}).get('messages')} slow={(c.get('daemon_log') or {}).get('slow_requests')} "
            f"reclaims<=1GiB={r.get('n')} p99={fmt(r.get('p99'), 2)} ms")


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def start_text(start: dict | None) -> str:
    """How the reservation started (the pool's `reservation.start`), as a sentence."""
    if not start:
        return ""
    if start.get("warm"):
        adjusted = "; ".join(start.get("adjusted") or [])
        return (f" Started warm from {start.get('from')}, saved {start.get('saved_s_ago')} s before"
                + (f" (adjusted: {adjusted})." if adjusted else "."))
    return f" Started cold: {start.get('why')}."


def markdown(rep: dict) -> str:
    lines = [f"# Memory benchmark ({rep.get('device')})", "",
             f"Sizes: {json.dumps(rep['sizes'])}. Online replays CUDA graphs: "
             f"{'yes' if rep['args'].get('online_cuda_graphs') else 'no'}.", "",
             "| config | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | vs alone TTFT p99 / TPOT p99 | offline tok/s | "
             "vs static | reclaims/min | reclaim <=1GiB p50/p99 | requeued | busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, n in rep["configs"].items():
        r1 = (n.get("reclaim_ms") or {}).get("<=1GiB", {})
        vs_alone = (f"{fmt(n.get('ttft_p99_vs_alone_pct'))}% / {fmt(n.get('tpot_p99_vs_alone_pct'))}%"
                    if k not in NOT_COMPARED else "not compared")
        vs_static = fmt(n.get("offline_vs_static"), 2) if k not in NOT_COMPARED else "not compared"
        lines.append(f"| {k} | {fmt(n.get('ttft_p50'))} | {fmt(n.get('ttft_p99'))} | {fmt(n.get('tpot_p50'), 2)} | "
                     f"{fmt(n.get('tpot_p99'), 2)} | {vs_alone} | {fmt(n.get('offline_tokens_per_s'))} | "
                     f"{vs_static} | {fmt(n.get('reclaims_per_min'))} | "
                     f"{fmt(r1.get('p50'), 2)}/{fmt(r1.get('p99'), 2)} | {fmt(n.get('offline_requeued'))} | "
                     f"{fmt(n.get('busy'), 2)} |")
    noise = rep["configs"].get("alone-2")
    if noise:
        lines += ["", f"Run-to-run noise: a second online-alone run, last, differs from the first by "
                  f"{fmt(noise.get('ttft_p99_vs_alone_pct'))}% in TTFT p99 and "
                  f"{fmt(noise.get('tpot_p99_vs_alone_pct'))}% in TPOT p99. Read every \"vs alone\" "
                  "figure against that."]
    for k, n in rep["configs"].items():
        if n.get("churn") is not None:
            lines += churn_markdown(n)
    for k, n in rep["configs"].items():
        m = n.get("miad")
        if m:
            lines += ["", f"MIAD ({k}, sampled every second): interval T {m['interval_ms_first']} ms at first, "
                      f"{m['interval_ms_min']} ms at least, {m['interval_ms_last']} ms at the end; reservation up to "
                      f"{m['target_handles_max']} handles; rate balance up to {fmt(m['balance_max'])} events, "
                      f"{fmt(m['balance_last'])} at the end (positive: over the target).{start_text(m.get('start'))}"]
            w = n.get("reclaims_per_min_by_window") or []
            if len(w) > 1:
                lines += ["", f"Reclaims/min ({k}) per {WINDOW_S / 60:.0f}-minute window of the trace, from online's "
                          f"grows that reclaimed: {', '.join(fmt(x) for x in w)}."
                          + ("" if (m.get("start") or {}).get("warm") else " The first window holds MIAD's cold start.")]
    lines += ["", "Online's generation loop (s): scheduling with the shim's turn / forward passes / updates; "
              "decode-only steps against alone at the same KV read:", "",
              "| config | steps | schedule | forward (its CPU time) | update | schedule p99 ms | decode step vs alone |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for k, n in rep["configs"].items():
        p = n.get("step_profile")
        if p:
            lines.append(f"| {k} | {p['steps']} | {fmt(p['prepare_s'], 2)} | {fmt(p['forward_s'], 2)} "
                         f"({fmt(p.get('forward_cpu_s'), 2)}) | {fmt(p['update_s'], 2)} | {fmt(p['prepare_p99_ms'], 2)} | "
                         f"{fmt(n.get('decode_step_vs_alone'), 3)} |")
    lines += ["", "Waiting for offline's iteration boundary instead (ms, sampled over offline's steps):", ""]
    for k, n in rep["configs"].items():
        b = n.get("boundary_wait_ms")
        if b and b.get("n"):
            lines.append(f"- {k}: p50 {fmt(b['p50'])}, p99 {fmt(b['p99'])} (step p50 {fmt(b['step_p50'])}, "
                         f"longest {fmt(b['step_max'])})")
    lines += ["", "| check | value | result |", "| --- | --- | --- |"]
    for c in rep["checks"]:
        res = {True: "PASS", False: "FAIL", None: c.get("note") or "not run"}[c["ok"]]
        lines.append(f"| {c['check']} | {fmt(c['value'], 2)} {c['detail']} | {res} |")
    return "\n".join(lines) + "\n"


def churn_markdown(n: dict) -> list[str]:
    """valve-churn's section: its reclaim latency as a whole, while the churn ran and during gate
    commands; the churn target in words; the churn's counts."""
    c = n["churn"]
    if c.get("error"):
        return ["", f"valve-churn: no churn figures: {c['error']}"]
    rows = (("the whole trace", (n.get("reclaim_ms") or {}).get("<=1GiB")),
            ("while the churn ran", c.get("reclaim_ms_while_churning")),
            ("during a `gate start` or `gate stop` command", c.get("reclaim_ms_during_gate_commands")))
    t = churn_target(n)
    verdict = t["note"] or {True: "met", False: "missed", None: "not judged"}[t["ok"]]
    lines = ["", f"valve-churn: the gate restarted every {fmt(c.get('gate_every_s'))} s (`gate stop`, "
             f"`gate start`) and {c.get('flooders')} threads flooded the daemon's control socket with bad input "
             "while online played the trace. Its online latency and offline throughput are not compared with "
             "alone or static, and it is left out of those targets: each gate stop lets offline run ungated "
             "until the next start.", "",
             "| online grows that reclaimed up to 1 GiB | reclaims | p50 (ms) | p99 (ms) | max (ms) |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {label} | {fmt((r or {}).get('n'))} | {fmt((r or {}).get('p50'), 2)} | "
              f"{fmt((r or {}).get('p99'), 2)} | {fmt((r or {}).get('max'), 2)} |" for label, r in rows]
    lines += ["", f"Target, p99 <= {TARGETS['reclaim_1gib_p99_ms']:g} ms while the churn ran: **{verdict}** "
              f"(p99 {fmt(t['value'], 2)} ms {t['detail']}).", "", churn_counts(c)]
    return lines


def churn_counts(c: dict) -> str:
    """The churn's counts as one line."""
    st, sp, fl, log = c.get("start") or {}, c.get("stop") or {}, c.get("flood") or {}, c.get("daemon_log") or {}
    first = "; ".join(c.get("first_errors") or [])
    final = c.get("final_gate") or {}
    return (f"Churn: {c.get('restarts')} gate restarts; `gate stop` p50 {fmt(sp.get('p50_ms'))} ms, max "
            f"{fmt(sp.get('max_ms'))} ms ({sp.get('n')} made); `gate start` p50 {fmt(st.get('p50_ms'))} ms, max "
            f"{fmt(st.get('max_ms'))} ms ({st.get('n')} made); {c.get('failures')} failed"
            + (f" (first: {first})" if first else "")
            + f"; {fl.get('messages')} flood messages over {fl.get('connections')} connections "
            f"({fl.get('held')} held open without a request, {fl.get('errors')} socket errors); "
            f"{fmt(log.get('slow_requests'))} slow-request lines in the daemon log (longest handled "
            f"{fmt(log.get('slow_handled_ms_max'))} ms, waited {fmt(log.get('slow_waited_ms_max'))} ms); "
            f"the daemon logged {fmt(log.get('reclaims'))} reclaims ({fmt(log.get('reclaims_le_1gib'))} of up to "
            f"1 GiB, its own p99 {fmt(log.get('reclaim_le_1gib_total_ms_p99'), 2)} ms; longest lane queue "
            f"{fmt(log.get('reclaim_queued_ms_max'), 2)} ms). Gate at the end: {final.get('action')}"
            + (f" ({final.get('error')})" if final.get("error") else "")
            + f"; threads left running: {', '.join(c.get('threads_left_running') or []) or 'none'}.")


def compare_outputs(ref_path: str, got_path: str, pressure_path: str, exit_code) -> dict:
    """The correctness comparison: every request's tokens, reference against reclaimed."""
    try:
        ref = common.read_json(ref_path)
        got = common.read_json(got_path)
    except (OSError, ValueError) as e:
        return dict(identical=False, requeued=0, error=f"missing output: {e}", exit=exit_code)
    pressure = {}
    try:
        pressure = common.read_json(pressure_path)
    except (OSError, ValueError):
        pass
    diff = [rid for rid in ref["outputs"] if ref["outputs"][rid] != got["outputs"].get(rid)]
    shim = got.get("shim") or {}
    reclaims = sum(1 for g in pressure.get("grows", []) if g[2] > 0)
    return dict(identical=not diff and not got.get("errors") and len(ref["outputs"]) == len(got["outputs"]),
                differing=diff, requests=len(ref["outputs"]), requeued=shim.get("requeued", 0),
                invalidated_blocks=shim.get("invalidated_blocks", 0), reclaims=reclaims,
                reference_s=ref.get("seconds"), reclaimed_s=got.get("seconds"), errors=got.get("errors"),
                exit=exit_code)


def correctness_markdown(out: dict) -> str:
    lines = [f"# Offline outputs under reclamation ({out.get('device')})", "",
             "| forward pass | requests | reclaims | requests requeued | blocks invalidated | identical |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mbt, r in out["runs"].items():
        label = "one token of one request" if str(mbt) == "1" else f"batched ({mbt} tokens)"
        lines.append(f"| {label} | {r.get('requests')} | {r.get('reclaims')} | {r.get('requeued')} | "
                     f"{r.get('invalidated_blocks')} | {r.get('identical')} {r.get('error') or ''} |")
    lines.append(f"\nThe shim's block placement: {out.get('placement', 'default')}.")
    lines.append(f"\nBatched reference equals the one-token reference (batching alone keeps the tokens): "
                 f"{out.get('batch_invariant')}.")
    lines.append(f"\nNVML used memory: {out.get('gpu_used_mib_before')} MiB before, "
                 f"{out.get('gpu_used_mib_after')} MiB after.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    ap = argparse.ArgumentParser(description="Pool the online latency of several `run.py bench` output "
                                 "directories (each with alone, valve-miad and alone-2 of one trace).")
    ap.add_argument("dirs", nargs="+", help="bench output directories (<config>.json in each)")
    ap.add_argument("--json", help="write the pooled numbers here too")
    a = ap.parse_args(argv)
    runs = []
    for d in a.dirs:
        run = {}
        for c in ("alone", "valve-miad", "alone-2", "static"):
            path = os.path.join(d, f"{c}.json")
            if os.path.exists(path):
                run[c] = common.read_json(path)
        if "alone" not in run:
            raise SystemExit(f"{d}: no alone.json (every pooled run needs its own alone configuration)")
        runs.append(run)
    pool = pooled(runs)
    if a.json:
        common.write_json(a.json, pool)
    print(pooled_markdown(pool, a.dirs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
