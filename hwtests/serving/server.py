"""The online service for the serving benchmark when `transformers serve` is not used: an
OpenAI-style streaming `/v1/completions` over aiohttp, on one of two engines.

  --engine cb     transformers' continuous batching manager (paged attention) on a local model dir
  --engine graph  the GPU-bound decode loop (decoder.py): one request at a time, CUDA-graph replay
                  and a host sync per token

    python3 server.py --engine cb --model DIR --port 8000 --device cuda
    python3 server.py --engine graph --size 3b --port 8000 --device cuda

Prints `READY <port>` once it serves. Prompts are text (tokenised here) or token ids. The graph
engine's final chunk carries, under `valve`, when the handler got the request (`recv_ns`) and when
the decode thread launched its first GPU work (`launch_ns`), both CLOCK_MONOTONIC. rawserver.py
serves the same decoder over plain TCP, without HTTP or a thread hand-off (`bench.py --server graph-raw`).

`--stamp-first-kernel stamp.ptx` (graph engine, CUDA only; hwtests/cuda/build.sh builds the file):
each request's first kernel is preceded by a kernel that records the GPU time it started
(stamp.py), sent mapped to CLOCK_MONOTONIC in the final chunk as `valve.gpu_start_ns`. POST
`/v1/valve/calibrate` maps the GPU clock again (do it with the GPU otherwise idle) and returns it.
"""

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time

from aiohttp import web

from stamp import stamp_file

HERE = os.path.dirname(os.path.abspath(__file__))


class GraphEngine:
    """One request at a time on a worker thread; tokens go back through the event loop."""

    def __init__(self, size, device, max_len, stamp_path=None):
        from decoder import GraphDecoder

        self.dec = GraphDecoder(size=size, device=device, max_len=max_len)
        self.dec.capture()
        # Warm up (allocator, kernels): a short request.
        for _ in self.dec.generate(list(range(16)), 4):
            pass
        self.stamp_path, self.stamper, self.mapping = stamp_path, None, None
        self.jobs = queue.Queue()
        started = queue.Queue()
        threading.Thread(target=self._run, args=(started,), name="decode", daemon=True).start()
        err = started.get()
        if err is not None:
            raise err

    def _start_stamper(self):
        """On the decode thread: the stamp kernel loaded into torch's context and a first mapping
        of the GPU clock (offline may be running: the bench maps again idle)."""
        import torch
        from stamp import start_stamper

        self.stamper, self.mapping = start_stamper(self.stamp_path, torch, self.dec.device)
        print(f"STAMP mapping at start: {json.dumps(self.mapping)}", file=sys.stderr, flush=True)

    def tokenize(self, prompt):
        if isinstance(prompt, list):
            return [int(t) % self.dec.vocab for t in prompt]
        # Text: one token per byte, enough for a random-weight model.
        return [b % self.dec.vocab for b in prompt.encode()]

    def _run(self, started):
        try:
            if self.stamp_path:
                self._start_stamper()
        except Exception as e:  # noqa: BLE001 - raised again by the constructor
            started.put(e)
            return
        started.put(None)
        while True:
            job = self.jobs.get()
            if job[0] == "calibrate":
                self._calibrate(*job[1:])
                continue
            _, ids, n, loop, q, recv_ns = job
            marks = {"recv_ns": recv_ns}

            def hook():
                marks["launch_ns"] = time.monotonic_ns()
                if self.stamper:
                    marks["slot"] = self.stamper.begin()

            try:
                for tok in self.dec.generate(ids, n, hook):
                    loop.call_soon_threadsafe(q.put_nowait, (str(tok) + " ", False))
                # Where the time went (recv_ns, launch_ns) and the stamp: the request's work is
                # done, so reading the slot waits for nothing.
                loop.call_soon_threadsafe(q.put_nowait, (self._marks_info(marks), False))
            except Exception as e:  # reported to the client as an error chunk
                loop.call_soon_threadsafe(q.put_nowait, (f"error: {e}", True))
            loop.call_soon_threadsafe(q.put_nowait, (None, True))

    def _marks_info(self, marks):
        from stamp import stamp_fields

        slot = marks.pop("slot", None)
        if slot is not None:
            marks.update(stamp_fields(self.stamper.read(slot), self.mapping))
        return marks

    def _calibrate(self, loop, fut):
        """A calibrate job, between requests on the decode thread: the new mapping maps later stamps."""
        try:
            self.mapping = self.stamper.calibrate()
            print(f"STAMP mapping: {json.dumps(self.mapping)}", file=sys.stderr, flush=True)
            loop.call_soon_threadsafe(fut.set_result, self.mapping)
        except Exception as e:  # noqa: BLE001 - answered as an HTTP error
            loop.call_soon_threadsafe(fut.set_exception, e)

    def calibrate(self, loop):
        """A future of a fresh mapping, made on the decode thread after the requests queued before it."""
        fut = loop.create_future()
        self.jobs.put(("calibrate", loop, fut))
        return fut

    def submit(self, ids, n, loop, q, recv_ns=None):
        self.jobs.put(("request", ids, n, loop, q, recv_ns))


class CbEngine:
    """transformers' ContinuousBatchingManager, streaming each token to the request's queue.

    `attention` "varlen" is the memory benchmark's PyTorch varlen flash kernel (linear in the batch;
    `paged|sdpa` grows with its square), and `cuda_graphs` replays transformers' padded-shape graphs.
    Without both, a decode step is bound by the host's Python: 40 ms a token for the 3B model on the
    H100, against 8.4 ms with them (TPOT p50, 2026-11-24-h100-serving-4.md,
    archived in docs/results/README.md).
    """

    def __init__(self, model_dir, device, max_memory_percent, attention="sdpa", cuda_graphs=False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        # cuDNN's SDPA builds a plan per new shape at run time, and paged|sdpa's key length changes
        # every step: the first measured run paid for plans later runs reused (TPOT 2x slower alone
        # than in the same configuration run again last, on the H100). The precompiled backends only.
        torch.backends.cuda.enable_cudnn_sdp(False)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        extra = {}
        if attention == "varlen":
            sys.path.insert(0, os.path.join(os.path.dirname(HERE), "membench"))
            import varlen_attention

            model.set_attn_implementation(varlen_attention.install())
            extra = dict(max_blocks_per_request=0)  # varlen reads every key through the read index
        model = model.to(device).eval()
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=64)
        from transformers import ContinuousBatchingConfig

        cb = ContinuousBatchingConfig(max_memory_percent=max_memory_percent, use_cuda_graph=cuda_graphs,
                                      use_async_batching=False, **extra)
        self.mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self.mgr.start()
        self.warm_up()

    def warm_up(self):
        """Batches of 1, 2, 4 and 8 requests of short and long prompts before serving, so graph
        captures and kernel loading happen here and not in the first measured requests."""
        ids = self.tok(" ".join(f"w{i}" for i in range(600)))["input_ids"]
        n = 0
        for batch in (1, 2, 4, 8):
            rids = []
            for i in range(batch):
                n += 1
                rids.append(f"warmup-{n}")
                self.mgr.add_request(ids[: 16 + 500 * (i % 2)], request_id=rids[-1], max_new_tokens=8)
            for rid in rids:
                if self.mgr.get_result(rid, timeout=300) is None:
                    raise RuntimeError(f"warm-up request {rid} got no result in 300 s")

    def tokenize(self, prompt):
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return self.tok(prompt)["input_ids"]

    def submit(self, ids, n, loop, q, recv_ns=None):
        """Called on the event loop: the handler is registered there before the request exists."""
        self.count = getattr(self, "count", 0) + 1
        rid = f"bench-{self.count}"
        seen = [0]

        def on_result(out):
            new = out.generated_tokens[seen[0]:]
            seen[0] = len(out.generated_tokens)
            for t in new:
                q.put_nowait((self.tok.decode([t]), False))
            if out.is_finished():
                if out.error:
                    q.put_nowait((f"error: {out.error}", True))
                q.put_nowait((None, True))

        self.mgr.register_result_handler(rid, on_result)
        self.mgr.add_request(ids, request_id=rid, max_new_tokens=n, streaming=True)


def make_app(engine, model_name):
    async def completions(request):
        recv_ns = time.monotonic_ns()  # the handler's first line: the graph engine reports it
        body = await request.json()
        ids = engine.tokenize(body.get("prompt", ""))
        n = int(body.get("max_tokens", 16))
        loop = asyncio.get_running_loop()
        q = asyncio.Queue()
        engine.submit(ids, n, loop, q, recv_ns)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        count, valve = 0, None
        while True:
            text, done = await q.get()
            if text is None:
                break
            if isinstance(text, dict):  # the graph engine's recv_ns, launch_ns and first-kernel stamp
                valve = text
                continue
            if text.startswith("error: ") and done:
                chunk = {"error": text}
            else:
                count += 1
                chunk = {"choices": [{"index": 0, "text": text}], "model": model_name}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"completion_tokens": count, "prompt_tokens": len(ids)}}
        if valve is not None:
            final["valve"] = valve
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def health(_request):
        return web.json_response({"status": "ok"})

    async def calibrate(_request):
        if getattr(engine, "stamper", None) is None:
            return web.json_response({"error": "the first-kernel stamp is off: start server.py "
                                      "--engine graph --device cuda --stamp-first-kernel stamp.ptx"}, status=409)
        try:
            mapping = await engine.calibrate(asyncio.get_running_loop())
        except Exception as e:  # noqa: BLE001 - the client is told why
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return web.json_response({"mapping": mapping})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/valve/calibrate", calibrate)
    return app


def stamp_choice(a, ap):
    """The stamp file to load, or None (stamp.stamp_file); only the graph engine has the stamp."""
    if a.stamp_first_kernel and a.engine != "graph":
        ap.error("--stamp-first-kernel needs --engine graph")
    return stamp_file(a.stamp_first_kernel, a.device, ap,
                      lambda msg: print(f"server.py: {msg}", file=sys.stderr, flush=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["cb", "graph"], required=True)
    ap.add_argument("--model", help="model dir (cb)")
    ap.add_argument("--size", default="tiny", help="decoder size (graph): tiny or 3b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-memory-percent", type=float, default=0.3)
    ap.add_argument("--attention", choices=["sdpa", "varlen"], default="sdpa",
                    help="cb: paged|sdpa, or PyTorch's varlen flash kernel (linear in the batch)")
    ap.add_argument("--cuda-graphs", action="store_true", help="cb: replay CUDA graphs over padded shapes")
    ap.add_argument("--stamp-first-kernel", metavar="PTX",
                    help="graph: stamp each request's first kernel's GPU start (stamp.ptx from hwtests/cuda/build.sh)")
    a = ap.parse_args(argv)
    stamp_path = stamp_choice(a, ap)
    t0 = time.time()
    if a.engine == "graph":
        engine = GraphEngine(a.size, a.device, a.max_len, stamp_path)
    else:
        if not a.model:
            ap.error("--engine cb needs --model DIR")
        engine = CbEngine(a.model, a.device, a.max_memory_percent, a.attention, a.cuda_graphs)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def serve():
        runner = web.AppRunner(make_app(engine, a.model or a.size))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        print(f"READY {a.port} ({time.time() - t0:.1f} s to start)", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
