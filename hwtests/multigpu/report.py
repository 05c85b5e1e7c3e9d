"""The arithmetic of run.sh and align.sh (standard library only): reads a results folder, writes
report.json and report.md beside it.

    python3 report.py serve OUT      # run.sh: per configuration TTFT / TPOT p50 and p99 (client and
                                     # server side), ratios to alone, offline against alone and
                                     # harvested per GPU, preemptions per request, the gate's disable
    python3 report.py align OUT      # align.sh: per phase the client-side and the daemon's alignment,
                                     # the 2-GPU job measured against alone, predicted against measured
    python3 report.py profile OUT    # align.sh: OUT/profile.json, the job's profile from its rate alone

Layout (what the scripts write): OUT/meta.json; serve: OUT/<config>/{records-0.json, window.json,
alone-window.json, progress-g<K>.txt, gate-status.json, gate-trace.jsonl, harvest.json}; align:
OUT/<phase>/{records-0.json, records-1.json, window.json, harvest.json, prediction.json} and
OUT/progress.txt, OUT/alone-window.json. A file that is missing is a figure that was not measured:
its cell says n/a and nothing is made up for it.
"""

import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serving"))
import analysis  # noqa: E402  (stdlib only: percentiles, union of intervals, progress interpolation)

TARGET_PREDICTION_ERROR = 0.10


def load(path, default=None):
    """JSON (or JSON lines for *.jsonl) from path; default where it is missing."""
    if not os.path.exists(path):
        return default
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


def read_text(path):
    """A small text file's content, stripped; None where it is missing."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return fh.read().strip()


def progress(path):
    """(t_ns, count) samples of a progress file (`<monotonic_ns> <count>` lines)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].isdigit():
                out.append((int(parts[0]), float(parts[1])))
    return out


def rate(samples, lo, hi):
    """Progress per second over [lo, hi] (ns); None without samples or an empty window."""
    if not samples or hi <= lo:
        return None
    p0, p1 = analysis.progress_at(samples, lo), analysis.progress_at(samples, hi)
    return (p1 - p0) / ((hi - lo) / 1e9)


def server_tpot_ms(rec):
    """Decode time per token as rank 0 saw it (its per-token stamps), ms."""
    ts = rec.get("server_token_ns") or []
    return (ts[-1] - ts[0]) / (len(ts) - 1) / 1e6 if len(ts) > 1 else None


def latency(records):
    """Client TTFT / TPOT (hwtests/serving/analysis.py's definitions) and the server's TPOT."""
    s = analysis.request_stats(records)
    ok = [r for r in records if not r.get("error")]
    tp = [t for t in map(server_tpot_ms, ok) if t is not None]
    s["server_tpot_p50_ms"] = analysis.percentile(tp, 50)
    s["server_tpot_p99_ms"] = analysis.percentile(tp, 99)
    return s


def ratio(x, base):
    return x / base if x is not None and base else None


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "server_tpot_p50_ms",
                "server_tpot_p99_ms")


def offline_stats(d, records, gpus):
    """Per GPU: the training job's rate alone (its own lead window), against alone over the load
    window, and the share of online-idle time harvested (analysis.harvest)."""
    alone_w = load(os.path.join(d, "alone-window.json"))
    out = []
    for g in range(gpus):
        samples = progress(os.path.join(d, f"progress-g{g}.txt"))
        if not samples:
            continue
        r_alone = rate(samples, alone_w["start_ns"], alone_w["end_ns"]) if alone_w else None
        h = analysis.harvest(records, samples, r_alone) if records else {}
        out.append(dict(gpu=g, alone_per_s=r_alone, **h))
    return out


ISSUE_RE = re.compile(r"(\d+) GPUs: serial ([\d.]+) us .*?parallel ([\d.]+) us .*?one GPU ([\d.]+) us")


def issue_probe(text):
    """The gate's one-time issue measurement, from its status's `issue` line, or None."""
    m = ISSUE_RE.search(text or "")
    if not m:
        return None
    return dict(gpus=int(m.group(1)), serial_us=float(m.group(2)), parallel_us=float(m.group(3)),
                single_us=float(m.group(4)), mode=(text or "").split(" ", 1)[0])


def trace_disables_us(trace):
    """Wall time of each successful whole-offline disable in the gate's trace, us."""
    return [(r["end_ns"] - r["t_ns"]) / 1e3 for r in trace or []
            if r.get("event") == "disable" and r.get("pid", 0) == 0 and r.get("ok", True) and r.get("end_ns")]


def gate_stats(d, requests):
    """Preemptions (and per request), time frozen, the disable's wall time (status and trace), the
    issue mode and its serial / parallel measurement; None where no gate ran."""
    st = load(os.path.join(d, "gate-status.json"))
    if not st:
        return None
    dis = trace_disables_us(load(os.path.join(d, "gate-trace.jsonl"), []))
    return dict(preemptions=st.get("preemptions"), resumes=st.get("resumes"),
                preemptions_per_request=ratio(st.get("preemptions"), requests),
                preempted_s=st.get("preempted_s"), offline_gpus=st.get("offline_gpus"),
                offline_pids=len(st.get("offline_pids") or []), online_pids=len(st.get("online_pids") or []),
                disable_status_us=st.get("disable_us"), edge_to_disable_us=st.get("edge_to_disable_us"),
                arrival_to_disable_us=st.get("arrival_to_disable_us"),
                disable_trace_p50_us=analysis.percentile(dis, 50), disable_trace_p99_us=analysis.percentile(dis, 99),
                disable_trace_n=len(dis), issue=st.get("issue"), issue_probe=issue_probe(st.get("issue")),
                errors=st.get("errors"), last_error=st.get("last_error"))


def config_row(d, name, gpus):
    records = load(os.path.join(d, "records-0.json"), [])
    row = dict(config=name, **latency(records))
    row["server_mode"] = read_text(os.path.join(d, "server-mode.txt"))
    row["offline"] = offline_stats(d, records, gpus)
    for k in ("offline_vs_alone", "harvested"):
        xs = [x[k] for x in row["offline"] if x.get(k) is not None]
        row[k] = sum(xs) / len(xs) if xs else None
    row["gate"] = gate_stats(d, row["requests"])
    if row["gate"] and records:
        row["gate"].update(frozen_shares(load(os.path.join(d, "gate-trace.jsonl"), []), records))
    return row


def frozen_shares(trace, records):
    """From the trace: the share of the load window offline was frozen, and the share of
    online's idle time in which it was not (the gate's own harvest, before what the job makes of it)."""
    lo, hi = analysis.window_of(records)
    frozen = analysis.union_ns(analysis.disabled_intervals(trace), lo, hi) / max(hi - lo, 1)
    idle = 1 - analysis.union_ns([(r["send_ns"], r["end_ns"]) for r in records], lo, hi) / max(hi - lo, 1)
    return dict(frozen_share=frozen, idle_share=idle, idle_unfrozen=(1 - frozen) / idle if idle > 0 else None)


def serve_report(out):
    meta = load(os.path.join(out, "meta.json"), {})
    gpus = int(meta.get("gpus", 1))
    rows = [config_row(os.path.join(out, c), c, gpus) for c in meta.get("configs", [])
            if os.path.isdir(os.path.join(out, c))]
    alone = next((r for r in rows if r["config"] == "alone"), None)
    for r in rows:
        r["vs_alone"] = {k: ratio(r[k], alone[k]) if alone else None for k in LATENCY_KEYS}
    return dict(kind="serve", meta=meta, rows=rows)


def client_alignment(recs_a, recs_b, lo, hi):
    """Overlap over union of the two services' busy time (a request in flight: send -> end), as
    the clients saw it over [lo, hi]: the harvest document's score, measured from outside."""
    ia = [(r["send_ns"], r["end_ns"]) for r in recs_a if r.get("end_ns")]
    ib = [(r["send_ns"], r["end_ns"]) for r in recs_b if r.get("end_ns")]
    a, b = analysis.union_ns(ia, lo, hi), analysis.union_ns(ib, lo, hi)
    either = analysis.union_ns(ia + ib, lo, hi)
    span = max(hi - lo, 1)
    return dict(busy_a=a / span, busy_b=b / span, union=either / span, overlap=(a + b - either) / span,
                score=(a + b - either) / either if either else 1.0)


def doc_pair(doc, gpus, window_s):
    """The document's alignment of the pair over window_s (None where it has none)."""
    key = sorted(gpus)
    return next((p for p in (doc or {}).get("pairs", []) if p["gpus"] == key and p["window_s"] == window_s), None)


def doc_job_rate(doc, job, window_s):
    j = next((j for j in (doc or {}).get("jobs", []) if j["job"] == job), None)
    r = next((x for x in (j or {}).get("rates", []) if x["window_s"] == window_s), None)
    return r["per_s"] if r else None


def doc_busy(doc, gpus, window_s):
    """busy_fraction (the gate held offline) per GPU of the set over window_s."""
    out = {}
    for g in (doc or {}).get("gpus", []):
        w = next((x for x in g["windows"] if x["window_s"] == window_s), None)
        if g["index"] in gpus and w:
            out[g["index"]] = w["busy_fraction"]
    return out


def unadmitted(pred, alone_per_s):
    """What the model's formula gives without its alignment admission (which makes an out-of-step
    set 0): T_alone x (idle + overlap - interrupted) x memory x speed."""
    if not pred:
        return None
    share = (pred["idle"] + pred.get("overlap", 0.0) - pred.get("interrupted", 0.0)) * pred["memory"]
    return alone_per_s * max(0.0, share) * pred.get("speed", 1.0)


def measured_rate(d, doc, samples, meta):
    """The job's rate over the document's window (its own report in the document; else its
    progress file over the same wall-clock window; else over the load's last window_s)."""
    w, win = meta.get("window_s", 30), load(os.path.join(d, "window.json"))
    r = doc_job_rate(doc, meta.get("job_id", "align"), w)
    if r is not None or not win:
        return r, "document"
    end_unix = doc["generated_unix_ms"] / 1e3 if doc else win["end_unix_s"]
    end_ns = win["start_ns"] + (end_unix - win["start_unix_s"]) * 1e9
    return rate(samples, end_ns - w * 1e9, end_ns), "progress file"


def align_phase(d, name, meta, samples):
    win = load(os.path.join(d, "window.json"))
    if not win:
        return None
    ra, rb = load(os.path.join(d, "records-0.json"), []), load(os.path.join(d, "records-1.json"), [])
    doc, pred = load(os.path.join(d, "harvest.json")), (load(os.path.join(d, "prediction.json")) or {}).get("prediction")
    gpus, w, alone = meta.get("gpu_pair", [0, 1]), meta.get("window_s", 30), meta.get("alone_per_s")
    meas, source = measured_rate(d, doc, samples, meta)
    pair = doc_pair(doc, gpus, w)
    row = dict(phase=name, mode=win.get("mode"), client=client_alignment(ra, rb, win["start_ns"], win["end_ns"]),
               doc_pair=pair, doc_busy=doc_busy(doc, gpus, w), measured_per_s=meas, measured_from=source,
               measured_vs_alone=ratio(meas, alone), prediction=pred,
               latency=[latency(ra), latency(rb)])
    row["predicted_per_s"] = pred["per_s"] if pred else None
    row["unadmitted_per_s"] = unadmitted(pred, alone) if alone else None
    for k in ("predicted", "unadmitted"):
        p = row[f"{k}_per_s"]
        row[f"{k}_error"] = abs(p - meas) / meas if p is not None and meas else None
    return row


def alone_rate(out, name, samples):
    w = load(os.path.join(out, name))
    return rate(samples, w["start_ns"], w["end_ns"]) if w else None


def job_profile(alone_per_s, meta, unix_ms):
    """The 2-GPU job's profile for `valve-scheduler predict`: T_alone measured here, memory not a
    factor (one curve point at 1 GiB, far below what an H200 leaves offline), no interruption
    costs (not profiled: the model then charges the held time only)."""
    return {"version": 1, "name": "align-ddp", "units": "steps", "gpus": len(meta.get("gpu_pair", [0, 1])),
            "alone_per_s": alone_per_s, "curve": [{"memory_bytes": 1 << 30, "per_s": alone_per_s}],
            "deficit_penalty": 0.0,
            "measured": {"device": meta.get("device", "n/a"), "unix_ms": unix_ms,
                         "seconds_per_point": float(meta.get("alone_s", 0))}}


def write_profile(out):
    meta = load(os.path.join(out, "meta.json"), {})
    r = alone_rate(out, "alone-window.json", progress(os.path.join(out, "progress.txt")))
    if not r:
        print(f"report.py: no rate alone in {out}/progress.txt over alone-window.json: the job made no progress",
              file=sys.stderr)
        return 1
    with open(os.path.join(out, "profile.json"), "w") as fh:
        json.dump(job_profile(r, meta, int(__import__("time").time() * 1000)), fh, indent=1)
    print(f"profile: the job alone {r:.2f} steps/s")
    return 0


def align_report(out):
    meta = load(os.path.join(out, "meta.json"), {})
    samples = progress(os.path.join(out, "progress.txt"))
    meta["alone_per_s"] = alone_rate(out, "alone-window.json", samples)
    meta["alone_end_per_s"] = alone_rate(out, "alone-window-end.json", samples)
    rows = [r for p in meta.get("phases", []) if (r := align_phase(os.path.join(out, p), p, meta, samples))]
    return dict(kind="align", meta=meta, rows=rows)


def f(x, spec=".2f", none="n/a"):
    return none if x is None else format(x, spec)


def pct(x):
    return f(x, ".1%")


def serve_markdown(rep):
    m = rep["meta"]
    lines = [f"# Tensor-parallel serving on {m.get('gpus')} GPUs: alone, time-sliced, gated ({m.get('device', 'n/a')})",
             "", note(m), "",
             "| config (server) | requests (errors) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | server TPOT p50 / p99 ms "
             "| TTFT p99 / TPOT p99 vs alone | offline vs alone | harvested | preemptions / request |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        g, v = r["gate"] or {}, r["vs_alone"]
        lines.append(f"| {r['config']} ({r.get('server_mode') or 'n/a'}) | {r['requests']} ({r['errors']}) | {f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} "
                     f"| {f(r['tpot_p50_ms'])} / {f(r['tpot_p99_ms'])} | {f(r['server_tpot_p50_ms'])} / "
                     f"{f(r['server_tpot_p99_ms'])} | {f(v['ttft_p99_ms'], '.3f')}x / {f(v['tpot_p99_ms'], '.3f')}x "
                     f"| {pct(r['offline_vs_alone'])} | {pct(r['harvested'])} | {f(g.get('preemptions_per_request'))} |")
    lines += gate_lines(rep["rows"])
    return "\n".join(lines) + "\n"


def gate_lines(rows):
    gated = [r for r in rows if r["gate"]]
    if not gated:
        return ["", "No gate ran: no preemption, disable or issue figure."]
    out = ["", "| config | offline GPUs (pids) | frozen share of the window (online idle share) | disable p50 / p99 us (status) | disable p50 / p99 us (trace, n) "
           "| edge -> offline stopped p50 / p99 us | issue: one GPU / serial / parallel us | mode |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in gated:
        g = r["gate"]
        ds, es, ip = g["disable_status_us"] or {}, g["edge_to_disable_us"] or {}, g["issue_probe"] or {}
        out.append(f"| {r['config']} | {g['offline_gpus']} ({g['offline_pids']}) | {pct(g.get('frozen_share'))} "
                   f"({pct(g.get('idle_share'))}) | {f(ds.get('p50_us'), '.0f')} / "
                   f"{f(ds.get('p99_us'), '.0f')} | {f(g['disable_trace_p50_us'], '.0f')} / "
                   f"{f(g['disable_trace_p99_us'], '.0f')} ({g['disable_trace_n']}) | {f(es.get('p50_us'), '.0f')} / "
                   f"{f(es.get('p99_us'), '.0f')} | {f(ip.get('single_us'), '.0f')} / {f(ip.get('serial_us'), '.0f')} / "
                   f"{f(ip.get('parallel_us'), '.0f')} | {g['issue'] or 'n/a'} |")
    return out


def note(m):
    """The run's provenance line; a dry run or a fake engine says it measured nothing."""
    s = (f"Date {m.get('date', 'n/a')}; engine {m.get('engine', 'n/a')}, model {m.get('size', 'n/a')}, "
         f"{m.get('arrivals', 'n/a')} arrivals at load {m.get('load', 'n/a')} ({f(m.get('rate'))} req/s, service "
         f"{f((m.get('service_s') or 0) * 1e3, '.1f')} ms), {m.get('seconds', 'n/a')} s per configuration. "
         f"Command: `{m.get('command', 'n/a')}`.")
    if m.get("dry_run"):
        s += (" **Dry run on a CPU** (gloo or the fake engine, no Valve): it checks the harness; no figure here "
              "says anything about GPUs.")
    return s


def align_markdown(rep):
    m = rep["meta"]
    lines = [f"# Alignment on real GPUs: two online services, a {len(m.get('gpu_pair', [0, 1]))}-GPU offline job "
             f"({m.get('device', 'n/a')})", "", note(m),
             f"Offline job alone: {f(m.get('alone_per_s'))} steps/s before the phases, {f(m.get('alone_end_per_s'))} "
             f"after; window {m.get('window_s')} s; target "
             f"|predicted - measured| / measured <= {TARGET_PREDICTION_ERROR:.0%}.", "",
             "| phase | client busy A / B, union, score | document score (union) | gate busy A / B | measured steps/s "
             "(vs alone) | predicted (aligned?) | error | formula without admission | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        c, p, pr = r["client"], r["doc_pair"] or {}, r["prediction"] or {}
        busy = " / ".join(f(v, ".3f") for v in r["doc_busy"].values()) or "n/a"
        lines.append(f"| {r['phase']} ({r['mode']}) | {f(c['busy_a'], '.3f')} / {f(c['busy_b'], '.3f')}, "
                     f"{f(c['union'], '.3f')}, {f(c['score'], '.3f')} | {f(p.get('score'), '.3f')} "
                     f"({f(p.get('union_fraction'), '.3f')}) | {busy} | {f(r['measured_per_s'])} "
                     f"({pct(r['measured_vs_alone'])}, {r['measured_from']}) | {f(r['predicted_per_s'])} "
                     f"({pr.get('aligned', 'n/a')}) | {pct(r['predicted_error'])} | {f(r['unadmitted_per_s'])} "
                     f"| {pct(r['unadmitted_error'])} |")
    lines += ["", "The model admits a multi-GPU set only if every pair scores at least the threshold (0.8): "
              "an out-of-step pair is predicted 0 by design; the formula without admission is what the "
              "same factors give, to check the idle term (pairs' union) against the measured rate."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("serve", "align", "profile"):
        helped = argv[:1] in (["-h"], ["--help"])
        print(__doc__, file=sys.stdout if helped else sys.stderr)
        return 0 if helped else 2
    kind, out = argv
    if not os.path.isfile(os.path.join(out, "meta.json")):
        print(f"report.py: {out}/meta.json is missing: give the folder run.sh or align.sh wrote", file=sys.stderr)
        return 2
    if kind == "profile":
        return write_profile(out)
    rep = serve_report(out) if kind == "serve" else align_report(out)
    md = serve_markdown(rep) if kind == "serve" else align_markdown(rep)
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(rep, fh, indent=1)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
