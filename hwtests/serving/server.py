"""The online service for the serving benchmark when `transformers serve` is not used: an
OpenAI-style streaming `/v1/completions` over aiohttp, on one of two engines.

  --engine cb     transformers' continuous batching manager (paged attention) on a local model dir
  --engine graph  the GPU-bound decode loop (decoder.py): one request at a time, CUDA-graph replay
                  and a host sync per token

    python3 server.py --engine cb --model DIR --port 8000 --device cuda
    python3 server.py --engine graph --size 3b --port 8000 --device cuda

Prints `READY <port>` once it serves. Prompts are text (tokenised here) or token ids.
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

HERE = os.path.dirname(os.path.abspath(__file__))


class GraphEngine:
    """One request at a time on a worker thread; tokens go back through the event loop."""

    def __init__(self, size, device, max_len):
        from decoder import GraphDecoder

        self.dec = GraphDecoder(size=size, device=device, max_len=max_len)
        self.dec.capture()
        # Warm up (allocator, kernels): a short request.
        for _ in self.dec.generate(list(range(16)), 4):
            pass
        self.jobs = queue.Queue()
        threading.Thread(target=self._run, name="decode", daemon=True).start()

    def tokenize(self, prompt):
        if isinstance(prompt, list):
            return [int(t) % self.dec.vocab for t in prompt]
        # Text: one token per byte, enough for a random-weight model.
        return [b % self.dec.vocab for b in prompt.encode()]

    def _run(self):
        while True:
            ids, n, loop, q = self.jobs.get()
            try:
                for tok in self.dec.generate(ids, n):
                    loop.call_soon_threadsafe(q.put_nowait, (str(tok) + " ", False))
            except Exception as e:  # reported to the client as an error chunk
                loop.call_soon_threadsafe(q.put_nowait, (f"error: {e}", True))
            loop.call_soon_threadsafe(q.put_nowait, (None, True))

    def submit(self, ids, n, loop, q):
        self.jobs.put((ids, n, loop, q))


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

    def submit(self, ids, n, loop, q):
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
        body = await request.json()
        ids = engine.tokenize(body.get("prompt", ""))
        n = int(body.get("max_tokens", 16))
        loop = asyncio.get_running_loop()
        q = asyncio.Queue()
        engine.submit(ids, n, loop, q)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        count = 0
        while True:
            text, done = await q.get()
            if text is None:
                break
            if text.startswith("error: ") and done:
                chunk = {"error": text}
            else:
                count += 1
                chunk = {"choices": [{"index": 0, "text": text}], "model": model_name}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"completion_tokens": count, "prompt_tokens": len(ids)}}
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    async def health(_request):
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


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
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.engine == "graph":
        engine = GraphEngine(a.size, a.device, a.max_len)
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
