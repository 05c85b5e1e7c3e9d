"""An open-loop load generator for streaming completions: Poisson arrivals (fixed seed) or a real
trace's (sched/data/azure-llm-2023-*-arrivals-first20min.csv, scaled to the rate), over HTTP
(OpenAI-style, aiohttp) or over rawserver.py's plain TCP protocol (a `raw://host:port` url).

It records per request the send time, the first streamed token (TTFT), the end, the token count and
how many requests were in flight when it was sent, and what the graph servers add (under `valve` in
an HTTP chunk, or in the raw protocol's final line): recv_ns, launch_ns and the first-kernel stamp.

    python3 loadgen.py --url http://127.0.0.1:8000 --rate 5 --requests 40 --out records.json
    python3 loadgen.py --url raw://127.0.0.1:8000 --rate 5 --requests 40   # prompt bytes as token ids
"""

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import time
import urllib.parse

import rawserver


def arrivals(rate, n, seed, trace=None, part=None):
    """Offsets (s) of n arrivals at `rate` per second on average: Poisson, or n consecutive ones of
    `trace` (sorted arrival times, s) from a place the seed picks, their times scaled so that the
    n take n / rate seconds (the bursts and lulls inside them kept in proportion). With `part`
    (k, parts): only the arrivals of the k-th of `parts` equal stretches of that window, timed
    from the stretch's start (window_part)."""
    if part:
        return window_part(arrivals(rate, n, seed, trace), n / rate, *part)
    if trace:
        return trace_window(trace, rate, n, seed)
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def window_part(offsets, span_s, k, parts, last_k=None):
    """The arrivals of the k-th (from 0) of `parts` equal stretches of a window `span_s` long (with
    `last_k`, of the stretches k to last_k together), as offsets from that stretch's start: a
    window too long for one run, replayed a stretch a run (the last stretch keeps an arrival at the
    window's very end)."""
    last_k = k if last_k is None else last_k
    if not 0 <= k <= last_k < parts:
        raise ValueError(f"part {k}-{last_k} of {parts}: parts count from 0 to {parts - 1}")
    lo, hi = span_s * k / parts, span_s * (last_k + 1) / parts
    last = last_k == parts - 1
    return [t - lo for t in offsets if lo <= t < hi or (last and t == hi)]


def parse_part(text):
    """'K/N' (the K-th of N stretches, from 0) as (K, N), 'K-L/N' (stretches K to L together) as
    (K, N, L), or None for ''; ValueError names the form."""
    if not text:
        return None
    try:
        first, n = text.split("/")
        k, _, last = first.partition("-")
        k, n = int(k), int(n)
        last = int(last) if last else None
    except ValueError:
        raise ValueError(f"a window part is K/N or K-L/N (e.g. 0/3: the first of three; 1-2/3: the "
                         f"last two of three), not {text!r}") from None
    if not 0 <= k < n or (last is not None and not k <= last < n):
        raise ValueError(f"a window part K/N or K-L/N needs 0 <= K <= L < N, not {text!r}")
    return (k, n) if last is None else (k, n, last)


def part_stretches(part):
    """How many of the window's stretches a parsed part covers."""
    return 1 if part is None or len(part) == 2 else part[2] - part[0] + 1


def trace_window(trace, rate, n, seed):
    """n consecutive arrivals of `trace` starting after arrival `seed` (mod its length, wrapping
    around with the trace shifted by its span), timed from the arrival before them and scaled so
    that the last comes at n / rate s. Scaled by the window's own rate, not the trace's: a bursty
    trace's windows of n requests span from seconds to hours, and a run must end."""
    if len(trace) < 2:
        raise ValueError("a trace needs at least two arrivals")
    span = trace[-1] - trace[0]
    first = seed % (len(trace) - 1)

    def at(i):  # arrival i of the trace repeated end to end
        laps, k = divmod(i, len(trace) - 1)
        return trace[k] + laps * span

    length = at(first + n) - at(first)
    if length <= 0:
        raise ValueError(f"{n} arrivals from {first} of the trace come at one instant")
    scale = n / rate / length
    return [(at(first + 1 + i) - at(first)) * scale for i in range(n)]


TRACES = {  # sched/data's arrival times of Azure's 2023 LLM inference traces, by --arrivals name
    "azure-code": "azure-llm-2023-code-arrivals-first20min.csv",  # bursty (gaps' CV 14.7)
    "azure-conv": "azure-llm-2023-conv-arrivals-first20min.csv",  # nearly Poisson (CV 1.06)
}


def trace_path(name):
    """The committed arrival times of trace `name` (a key of TRACES)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sched", "data", TRACES[name])


def rate_at(load, service_s):
    """Requests a second that keep a server of `service_s` per request busy a share `load` of the
    time (with overlapping Poisson requests the busy share is about 1 - exp(-rate * s))."""
    return -math.log(1 - load) / service_s


def load_trace(path):
    """Arrival times (s) from a CSV with an offset_us column (sched/data's arrivals files)."""
    import csv

    with open(path) as f:
        times = sorted(int(r["offset_us"]) / 1e6 for r in csv.DictReader(f))
    if len(times) < 2:
        raise ValueError(f"{path}: fewer than two arrivals")
    return times


async def one(session, url, body, rec, state):
    rec["in_flight_at_send"] = state["in_flight"]
    rec["idle_at_send"] = state["in_flight"] == 0
    state["in_flight"] += 1
    rec["send_ns"] = time.monotonic_ns()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.monotonic_ns()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = event.decode().removeprefix("data: ").strip()
                    if not data or data == "[DONE]":
                        continue
                    msg = json.loads(data)
                    if "valve" in msg:  # server.py --stamp-first-kernel: the first kernel's GPU start
                        rec.update(msg["valve"])
                    if "error" in msg:
                        rec["error"] = str(msg["error"])
                        continue
                    text = msg.get("choices", [{}])[0].get("text", "")
                    if text:
                        rec["tokens"] += 1
                        if "token_ns" in rec:  # asked for: every token's arrival
                            rec["token_ns"].append(now)
                        rec.setdefault("first_ns", now)
                        rec["last_ns"] = now
    except Exception as e:  # noqa: BLE001 - any failure is recorded with the request
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        state["in_flight"] -= 1
        rec["end_ns"] = rec.get("last_ns") or time.monotonic_ns()


async def open_loop(offsets, recs, start_ns, send):
    """Starts send(rec) for each record at its offset (s) from start_ns (default: now); waits for all."""
    t0 = start_ns or time.monotonic_ns()
    tasks = []
    for off, rec in zip(offsets, recs):
        delay = (t0 + off * 1e9 - time.monotonic_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        rec["scheduled_ns"] = int(t0 + off * 1e9)
        tasks.append(asyncio.create_task(send(rec)))
    await asyncio.gather(*tasks)


async def run(url, rate, n, seed, prompt, max_tokens, start_ns=None, model="bench", trace=None,
              part=None):
    """Sends n requests at Poisson times (or `trace`'s, see arrivals; with `part`, those of one
    stretch of that window) from start_ns (default: now); returns their records."""
    offsets = arrivals(rate, n, seed, trace, part)
    state = {"in_flight": 0}
    recs = [{"i": i, "tokens": 0, "error": None} for i in range(len(offsets))]
    if url.startswith("raw://"):
        payload = rawserver.encode_request(raw_ids(prompt), max_tokens)
        await open_loop(offsets, recs, start_ns, lambda rec: one_raw(raw_address(url), payload, rec, state))
        return recs
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        # One warm connection per expected concurrent request is not needed: keep-alive reuses.
        await open_loop(offsets, recs, start_ns, lambda rec: one(session, url, body, rec, state))
    return recs


def raw_ids(prompt):
    """The raw protocol's token ids: a list as it is, text as its UTF-8 bytes (the graph decoder's
    tokenizer: one token per byte)."""
    return list(prompt) if isinstance(prompt, list) else list(prompt.encode())


def raw_address(url):
    """(host, port) of a raw://host:port url."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "raw" or not u.hostname or not u.port:
        raise ValueError(f"{url}: expected raw://HOST:PORT")
    return u.hostname, u.port


async def one_raw(addr, payload, rec, state, timeout_s=600):
    """One request over the raw protocol: connect, then send_ns right before the write, then one
    line per token and a final line of marks (or an error line)."""
    rec["in_flight_at_send"] = state["in_flight"]
    rec["idle_at_send"] = state["in_flight"] == 0
    state["in_flight"] += 1
    rec["send_ns"] = time.monotonic_ns()  # if the connect fails; taken again before the write
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), timeout_s)
        rec["send_ns"] = time.monotonic_ns()
        writer.write(payload)  # asyncio writes to the socket here, the buffer being empty
        await asyncio.wait_for(read_raw_answer(reader, rec), timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure is recorded with the request
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        state["in_flight"] -= 1
        rec["end_ns"] = rec.get("last_ns") or time.monotonic_ns()
        if writer is not None:
            writer.close()


async def read_raw_answer(reader, rec):
    """Token lines until the server closes; the final line's marks go into the record."""
    done = False
    while line := await reader.readline():
        now = time.monotonic_ns()
        if line[:1] != b"{":
            rec["tokens"] += 1
            if "token_ns" in rec:  # asked for: every token's arrival
                rec["token_ns"].append(now)
            rec.setdefault("first_ns", now)
            rec["last_ns"] = now
            continue
        msg = json.loads(line)
        if "error" in msg:
            rec["error"] = str(msg["error"])
            return
        done = True
        rec.update({k: v for k, v in msg.items() if k not in ("done", "tokens")})
    if not done:
        rec["error"] = f"the server closed the connection after {rec['tokens']} tokens, before its final line"


def raw_control(url, msg, timeout=60):
    """One control message to a raw server ({"calibrate": true}, {"health": true}): its JSON answer."""
    with socket.create_connection(raw_address(url), timeout=timeout) as s:
        s.sendall(json.dumps(msg).encode() + b"\n")
        line = s.makefile("rb").readline()
    if not line:
        raise ConnectionError(f"{url} closed the connection without an answer to {msg}")
    return json.loads(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="http://HOST:PORT, or raw://HOST:PORT for rawserver.py")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt", default="hello " * 16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="bench", help="the model name the server expects")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    recs = asyncio.run(
        run(a.url, a.rate, a.requests, a.seed, a.prompt, a.max_tokens, model=a.model)
    )
    text = json.dumps(recs)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
