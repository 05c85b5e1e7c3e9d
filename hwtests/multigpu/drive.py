"""Arrivals for run.sh and align.sh: open-loop requests over rawserver.py's plain-TCP protocol
(hwtests/serving/loadgen.py's raw client and arrival times), to one server or to several at once.

    python3 drive.py warm --url raw://127.0.0.1:8000 --out warm.json      # service time, idle server
    python3 drive.py load --url raw://127.0.0.1:8000 --rate 3 --seconds 60 --out DIR
    python3 drive.py load --url raw://H:P0 --url raw://H:P1 --mode same ...   # align.sh: in step

`load` writes DIR/records-K.json per url (loadgen's records, with every token's arrival in
`token_ns` and the server's own `server_token_ns`) and DIR/window.json (start and end,
CLOCK_MONOTONIC ns and unix s). With several urls, `--mode same` sends every url the same arrival
times (services in step) and `--mode independent` draws each url's from its own seed (out of step).
"""

import argparse
import asyncio
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serving"))
import loadgen  # noqa: E402
import rawserver  # noqa: E402


def offsets_for(urls, rate, n, seed, mode, trace=None):
    """Arrival offsets (s) per url: the same list for all (`same`) or one per url's seed."""
    if mode not in ("same", "independent"):
        raise ValueError(f"--mode {mode}: give same or independent")
    seeds = [seed] * len(urls) if mode == "same" else [seed + 7919 * k for k in range(len(urls))]
    return [loadgen.arrivals(rate, n, s, trace) for s in seeds]


def payload(prompt_tokens, max_tokens):
    return rawserver.encode_request([(7 * i + 1) % 1000 for i in range(prompt_tokens)], max_tokens)


async def run_all(urls, offs, body):
    """Every url's requests at its offsets from one common start; their records per url."""
    t0 = time.monotonic_ns() + 50_000_000
    states = [{"in_flight": 0} for _ in urls]
    recs = [[{"i": i, "tokens": 0, "error": None, "token_ns": []} for i in range(len(o))] for o in offs]

    def sender(u, k):
        addr = loadgen.raw_address(u)
        return lambda rec: loadgen.one_raw(addr, body, rec, states[k])

    await asyncio.gather(*(loadgen.open_loop(o, r, t0, sender(u, k)) for k, (u, o, r) in enumerate(zip(urls, offs, recs))))
    return recs


def cmd_load(a):
    trace = loadgen.load_trace(loadgen.trace_path(a.arrivals)) if a.arrivals != "poisson" else None
    n = max(1, math.ceil(a.rate * a.seconds))
    offs = offsets_for(a.url, a.rate, n, a.seed, a.mode, trace)
    os.makedirs(a.out, exist_ok=True)
    w0 = dict(start_ns=time.monotonic_ns(), start_unix_s=time.time())
    recs = asyncio.run(run_all(a.url, offs, payload(a.prompt_tokens, a.max_tokens)))
    window = dict(w0, end_ns=time.monotonic_ns(), end_unix_s=time.time(), urls=a.url, rate=a.rate, requests=n,
                  arrivals=a.arrivals, mode=a.mode, seed=a.seed, max_tokens=a.max_tokens)
    for k, r in enumerate(recs):
        with open(os.path.join(a.out, f"records-{k}.json"), "w") as f:
            json.dump(r, f)
    with open(os.path.join(a.out, "window.json"), "w") as f:
        json.dump(window, f)
    errs = sum(1 for r in recs for x in r if x["error"])
    print(f"drive: {n} requests to each of {len(a.url)} url(s) in {(window['end_ns'] - w0['start_ns']) / 1e9:.1f} s, "
          f"{errs} errors", flush=True)
    return 1 if errs == sum(len(r) for r in recs) else 0


def cmd_warm(a):
    """Sequential requests to an idle server: its service time (mean send -> end, the first left out)."""
    body = payload(a.prompt_tokens, a.max_tokens)
    times = []
    for i in range(a.requests):
        rec = {"i": i, "tokens": 0, "error": None}
        asyncio.run(loadgen.one_raw(loadgen.raw_address(a.url[0]), body, rec, {"in_flight": 0}))
        if rec["error"]:
            raise SystemExit(f"drive warm: request {i} failed: {rec['error']}")
        times.append((rec["end_ns"] - rec["send_ns"]) / 1e9)
    kept = times[1:] or times
    out = dict(service_s=sum(kept) / len(kept), samples_s=times, max_tokens=a.max_tokens)
    with open(a.out, "w") as f:
        json.dump(out, f)
    print(f"drive: service time {out['service_s'] * 1e3:.1f} ms over {len(kept)} requests", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["load", "warm"])
    ap.add_argument("--url", action="append", required=True, help="raw://HOST:PORT; repeat for several servers")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second to each url")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=6, help="warm: how many")
    ap.add_argument("--arrivals", default="poisson", choices=["poisson", *sorted(loadgen.TRACES)])
    ap.add_argument("--mode", default="same", choices=["same", "independent"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.rate <= 0 or a.seconds <= 0:
        ap.error("--rate and --seconds must be positive")
    return cmd_load(a) if a.what == "load" else cmd_warm(a)


if __name__ == "__main__":
    sys.exit(main())
