"""An open-loop HTTP load generator for OpenAI-style streaming completions: Poisson arrivals
(fixed seed), every request streamed; records per request the send time, the first streamed token
(TTFT), the end, the token count and how many requests were in flight when it was sent, and
what the server adds under `valve` in a chunk (the graph server's first-kernel stamp, gpu_start_ns).

    python3 loadgen.py --url http://127.0.0.1:8000 --rate 5 --requests 40 --out records.json
"""

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp


def arrivals(rate, n, seed):
    """Offsets (s) of n Poisson arrivals at `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


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


async def run(url, rate, n, seed, prompt, max_tokens, start_ns=None, model="bench"):
    """Sends n requests at Poisson times from start_ns (default: now); returns their records."""
    offsets = arrivals(rate, n, seed)
    state = {"in_flight": 0}
    recs = [{"i": i, "tokens": 0, "error": None} for i in range(n)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        # One warm connection per expected concurrent request is not needed: keep-alive reuses.
        t0 = start_ns or time.monotonic_ns()
        tasks = []
        for off, rec in zip(offsets, recs):
            delay = (t0 + off * 1e9 - time.monotonic_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            rec["scheduled_ns"] = int(t0 + off * 1e9)
            tasks.append(asyncio.create_task(one(session, url, body, rec, state)))
        await asyncio.gather(*tasks)
    return recs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
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
