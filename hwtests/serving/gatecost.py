"""What the gate's own machinery costs an online server per token, with nothing to preempt: a
closed-loop load (a fixed number of requests always in flight) on the serving benchmark's server,
offline SIGSTOPped throughout, in short blocks where online alone takes turns with the gate in
several modes. Far more tokens per configuration than the open-loop benchmark, and no queueing.
With `--concurrency 1 --think-ms 100` every request arrives at an idle server instead, so each
one costs a disable and an enable; `--offline running` lets offline train in the gate's blocks.

Configurations (--configs): alone, alone-2 (the noise floor), gate (arrivals, launch edges and
waits: the serving benchmark's gate-offline-stopped), gate-launch (--no-arrivals: no arrival
program), gate-old (--no-arrivals --no-waits: launch probes only, no probes on synchronising
calls). Each gate block is compared with the alone blocks of its own round.

    sudo python3 hwtests/serving/gatecost.py --valvectl .carry/bin/valvectl --out DIR
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import analysis  # noqa: E402
import bench  # noqa: E402

# Each configuration's `valvectl gate start` options (None: no gate).
CONFIGS = {
    "alone": None,
    "alone-2": None,
    "gate": {"arrivals": True, "waits": True},
    "gate-launch": {"arrivals": False, "waits": True},
    "gate-old": {"arrivals": False, "waits": False},
}


async def closed_loop(url, concurrency, seconds, prompt, max_tokens, stagger_s, model, think_s=0.0, seed=0):
    """`concurrency` clients, each sending its next request when the previous one ends (after a
    pause drawn uniformly from 0.5-1.5 x `think_s`), for `seconds`; client k starts k * stagger_s
    late. Returns the records (with every token's time)."""
    import random

    import aiohttp

    import loadgen

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    state, recs = {"in_flight": 0}, []
    stop_ns = time.monotonic_ns() + int(seconds * 1e9)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:

        async def client(k):
            rng = random.Random(seed * 1000 + k)
            await asyncio.sleep(k * stagger_s)
            while time.monotonic_ns() < stop_ns:
                rec = {"i": len(recs), "tokens": 0, "error": None, "token_ns": []}
                recs.append(rec)
                await loadgen.one(s, url, body, rec, state)
                if think_s:
                    await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return recs


def cpu_times():
    """The host's CPU time so far (/proc/stat's first line): (busy, steal, total) in ticks; steal is
    time the hypervisor ran something else on this VM's CPUs."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:9]]
    return sum(v) - v[3] - v[4] - v[7], v[7], sum(v)


def share_between(before, after):
    """Busy and steal shares of all CPUs between two cpu_times()."""
    total = max(1, after[2] - before[2])
    return {"busy_pct": 100 * (after[0] - before[0]) / total, "steal_pct": 100 * (after[1] - before[1]) / total}


def inter_token_ms(records):
    """Every gap between consecutive streamed tokens of a request (ms), over all requests."""
    return [(b - a) / 1e6 for r in records if not r["error"]
            for a, b in zip(r["token_ns"], r["token_ns"][1:])]


def block_stats(records):
    itl = inter_token_ms(records)
    s = analysis.request_stats(records)
    s.update(tokens=sum(r["tokens"] for r in records), itl_n=len(itl),
             itl_mean_ms=statistics.fmean(itl) if itl else None,
             itl_p50_ms=analysis.percentile(itl, 50), itl_p99_ms=analysis.percentile(itl, 99))
    return s


def counters_between(before, after, tokens):
    """The gate's edges, preemptions and probed calls between two statuses, per generated token."""
    out = {k: after.get(k, 0) - before.get(k, 0) for k in ("edges", "preemptions", "arrivals")}
    hits = bench.probe_hits_between(before, after) or {}
    out.update(hits)
    return {k: v / tokens if tokens else None for k, v in out.items()}


def summarize(blocks, configs):
    """Per configuration: its blocks' tokens pooled, and each round's block against that round's
    alone block (mean inter-token time and TPOT p50, as a change in %)."""
    alone = {b["round"]: b for b in blocks if b["config"] == "alone"}
    rows = {}
    for cfg in configs:
        mine = [b for b in blocks if b["config"] == cfg]
        if not mine:
            continue
        recs = [r for b in mine for r in b["records"]]
        row = block_stats(recs)
        row["blocks"] = len(mine)
        for m in ("busy_pct", "steal_pct"):
            vals = [b["stats"][m] for b in mine if b["stats"].get(m) is not None]
            row[m] = statistics.fmean(vals) if vals else None
        for m in ("itl_mean_ms", "tpot_p50_ms", "itl_p99_ms", "ttft_p50_ms"):
            ch = [analysis.pct_change(b["stats"][m], alone[b["round"]]["stats"][m])
                  for b in mine if b["round"] in alone and cfg != "alone"]
            ch = [c for c in ch if c is not None]
            row[f"{m}_change_pct"] = {"mean": statistics.fmean(ch), "min": min(ch), "max": max(ch),
                                      "rounds": ch} if ch else None
        ppr = [b["preemptions_per_request"] for b in mine if "preemptions_per_request" in b]
        row["preemptions_per_request"] = statistics.fmean(ppr) if ppr else None
        per_token = [b["per_token"] for b in mine if b.get("per_token")]
        if per_token:
            row["per_token"] = {k: statistics.fmean(p[k] for p in per_token if p.get(k) is not None)
                                for k in per_token[0] if any(p.get(k) is not None for p in per_token)}
        rows[cfg] = row
    return rows


def report_text(device, meta, rows):
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    def ch(c):
        return "n/a" if not c else f"{c['mean']:+.2f}% ({c['min']:+.2f} .. {c['max']:+.2f})"

    lines = [f"# The gate's own cost per token: {device}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| configuration | blocks | tokens | inter-token mean / p50 / p99 (ms) | TPOT p50 / p99 (ms) "
              "| TTFT p50 / p99 (ms) | mean inter-token vs alone, same round | TPOT p50 vs alone | TTFT p50 vs alone "
              "| edges per token / preemptions per request | CPUs busy / steal |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, r in rows.items():
        pt = r.get("per_token") or {}
        lines.append(
            f"| {cfg} | {r['blocks']} | {r['tokens']} | {f(r['itl_mean_ms'])} / {f(r['itl_p50_ms'])} / "
            f"{f(r['itl_p99_ms'])} | {f(r['tpot_p50_ms'])} / {f(r['tpot_p99_ms'])} | "
            f"{f(r['ttft_p50_ms'], '.2f')} / {f(r['ttft_p99_ms'], '.2f')} | {ch(r.get('itl_mean_ms_change_pct'))} | "
            f"{ch(r.get('tpot_p50_ms_change_pct'))} | {ch(r.get('ttft_p50_ms_change_pct'))} | "
            f"{f(pt.get('edges'))} / {f(r.get('preemptions_per_request'), '.2f')} | "
            f"{f(r.get('busy_pct'), '.1f')}% / {f(r.get('steal_pct'), '.2f')}% |")
    probes = {c: r["per_token"] for c, r in rows.items() if r.get("per_token", {}).get("syncs") is not None}
    if probes:
        lines += ["", "Probed online calls per token: " + "; ".join(
            f"{c}: {p['kernel_launches']:.2f} launches, {p['graph_launches']:.2f} graph launches, "
            f"{p['syncs']:.2f} synchronising calls" for c, p in probes.items())]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gatecost-"))
    ap.add_argument("--valvectl", default="valvectl")
    ap.add_argument("--server", choices=["cb", "graph"], default="cb")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-size", default="3b")
    ap.add_argument("--offline-size", default="1b")
    ap.add_argument("--configs", default="alone,gate,gate-launch,gate-old,alone-2",
                    help="comma-separated, forward then backward each round: " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block-s", type=float, default=12.0, help="seconds of load per block")
    ap.add_argument("--concurrency", type=int, default=2, help="clients, each with one request in flight")
    ap.add_argument("--think-ms", type=float, default=0.0,
                    help="each client pauses 0.5-1.5x this long between its requests (with --concurrency 1 "
                         "and a pause past the gate's cooldown, every request arrives at an idle server)")
    ap.add_argument("--offline", choices=["stopped", "running"], default="stopped",
                    help="stopped: SIGSTOPped throughout (the gate's own cost); running: it trains during "
                         "the gate's blocks, so the gate preempts real work (stopped in the alone blocks)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-memory", type=float, default=0.2)
    ap.add_argument("--cb-attention", choices=["sdpa", "varlen"], default="varlen")
    ap.add_argument("--cb-cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--start-timeout", type=float, default=240)
    ap.add_argument("--deadline-s", type=float, default=480, help="start no block after this many seconds")
    a = ap.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad or "alone" not in a.configs:
        ap.error(f"--configs: unknown {bad} or no 'alone' (every change is against it); choose from {', '.join(CONFIGS)}")
    return a


def run_block(a, valve, url, prompt, cfg, stagger_s, offline_pid, seed):
    """One block of one configuration: offline resumed (with --offline running) and the gate (if
    any) started, load, the gate stopped and offline stopped again."""
    opts = CONFIGS[cfg]
    before, resumed, gated = None, False, False
    try:
        if opts is not None and a.offline == "running":
            os.kill(offline_pid, signal.SIGCONT)
            resumed = True
        if opts is not None:
            valve.gate_start(a.port, arrivals=opts["arrivals"], waits=opts["waits"])
            gated = True
            bench.settle(url, prompt, a.max_tokens, 0.3)
            before = valve.gate_status()
        cpu = cpu_times()
        recs = asyncio.run(closed_loop(url, a.concurrency, a.block_s, prompt, a.max_tokens, stagger_s,
                                       bench.MODEL_NAME[0], a.think_ms / 1e3, seed))
        block = {"config": cfg, "records": recs, "stats": block_stats(recs)}
        block["stats"].update(share_between(cpu, cpu_times()))
        if before is not None:
            after = valve.gate_status()
            block["per_token"] = counters_between(before, after, block["stats"]["tokens"])
            block["preemptions_per_request"] = (after["preemptions"] - before["preemptions"]) / max(1, len(recs))
            block["gate_status"] = after
    finally:
        if gated:
            valve.gate_stop()
        if resumed:
            os.kill(offline_pid, signal.SIGSTOP)
            time.sleep(1.0)  # what it had queued on the GPU drains before the next block
    return block


def main(argv=None):
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="valve-gatecost-")
    t0 = time.time()
    device = bench.device_name(False)
    bench.log(f"== device: {device}; server: {a.server}; out: {a.out}")
    procs, valve = [], None
    try:
        model_dir = None
        if a.server == "cb":
            import make_model

            model_dir = os.path.join(work, "model")
            bench.log(f"   {make_model.build(model_dir, a.model_size, 0, device=a.device)}")
        valve = bench.Valve(a.valvectl, work, a.out, False)
        env = dict(os.environ, VALVE_LABEL=bench.OFFLINE_LABEL)
        off = bench.Proc("offline", [sys.executable, os.path.join(HERE, "training.py"), "--progress",
                                     os.path.join(work, "progress"), "--size", a.offline_size,
                                     "--device", a.device], a.out, env=env)
        procs.append(off)
        off.wait_line("READY", 300)
        # Stopped throughout: the gate has channels to gate, and no offline work runs beside online.
        os.kill(off.p.pid, signal.SIGSTOP)
        a.port = bench.free_port()
        senv = {k: v for k, v in os.environ.items() if k != "VALVE_LABEL"}
        senv.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        procs.append(bench.start_server(a, model_dir, a.port, a.out, senv))
        url = f"http://127.0.0.1:{a.port}"
        prompt = bench.prompt_text(model_dir, a.prompt_tokens)
        bench.MODEL_NAME[0] = model_dir or a.model_size
        service_s = bench.service_time(url, prompt, a.max_tokens)
        stagger_s = service_s / a.concurrency
        bench.log(f"== service time alone {service_s * 1e3:.1f} ms; warm-up block, not recorded")
        asyncio.run(closed_loop(url, a.concurrency, a.block_s, prompt, a.max_tokens, stagger_s, bench.MODEL_NAME[0]))
        blocks = []
        for rnd, order in enumerate(bench.round_orders(a.configs, a.rounds)):
            for cfg in order:
                if time.time() - t0 > a.deadline_s:
                    bench.log(f"== deadline: skipping round {rnd + 1} {cfg}")
                    continue
                b = run_block(a, valve, url, prompt, cfg, stagger_s, off.p.pid, rnd)
                b["round"] = rnd
                blocks.append(b)
                s = b["stats"]
                bench.log(f"   round {rnd + 1} {cfg}: {s['tokens']} tokens, inter-token mean/p50/p99 "
                          f"{s['itl_mean_ms']:.3f}/{s['itl_p50_ms']:.3f}/{s['itl_p99_ms']:.3f} ms, "
                          f"TPOT p50 {s['tpot_p50_ms']:.3f} ms, CPUs busy {s['busy_pct']:.1f}% "
                          f"steal {s['steal_pct']:.2f}%, errors {s['errors']}")
        rows = summarize(blocks, a.configs)
        meta = {"server": f"{a.server} ({a.model_size}), {a.concurrency} closed-loop client(s), pause "
                          f"{a.think_ms:.0f} ms (0.5-1.5x) between requests, {a.prompt_tokens}-token prompts, "
                          f"{a.max_tokens} tokens each",
                "offline": f"training.py --size {a.offline_size}, " + (
                    "SIGSTOPped throughout" if a.offline == "stopped" else
                    "training in the gate's blocks, SIGSTOPped in the alone blocks"),
                "blocks": f"{a.rounds} rounds of {a.block_s:.0f} s blocks, forward then backward",
                "service time alone (ms)": f"{service_s * 1e3:.1f}",
                "duration (s)": f"{time.time() - t0:.0f}"}
        text = report_text(device, meta, rows)
        with open(os.path.join(a.out, "gatecost.json"), "w") as fh:
            json.dump({"device": device, "meta": meta, "rows": rows,
                       "blocks": [{k: v for k, v in b.items() if k != "records"} for b in blocks]},
                      fh, indent=1, default=str)
        with open(os.path.join(a.out, "gatecost.md"), "w") as fh:
            fh.write(text)
        print(text)
        return 0
    finally:
        bench.stop_all(procs, valve)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
