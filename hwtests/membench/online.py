"""The online side of the memory benchmark: a continuous-batching server (HF transformers) fed by a
bursty request trace in the same process, measuring TTFT and TPOT per request.

    python3 online.py --model DIR --mode alone|static|valve --trace trace.json --out out.json \
        [--num-blocks N] [--reservation on|off] [--gate-signals] [--ready FILE --go FILE]

`alone` and `static` use plain transformers with a KV cache of `--num-blocks` blocks; `valve` backs
the cache with the Valve pool through `valve_transformers` (it grows on demand and may reclaim from
offline). A request's TTFT runs from its arrival (before tokenising) to its first token's
timestamp; TPOT is the mean gap between its later tokens. With `--gate-signals` the server tells the
daemon's gate when it has requests in flight (`online_busy`/`online_idle`), so offline is frozen
from the arrival of a request at an idle server, not from its first kernel.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import queue
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import now  # noqa: E402


class GateSignals:
    """Sends busy/idle to the daemon from one thread, in order, so the server never waits on it."""

    def __init__(self, enabled: bool) -> None:
        self.q: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self.sent = 0
        if enabled:
            threading.Thread(target=self._run, daemon=True).start()
        self.enabled = enabled

    def send(self, busy: bool) -> None:
        if self.enabled:
            self.q.put(busy)

    def _run(self) -> None:
        while True:
            busy = self.q.get()
            try:
                reply = common.daemon_request({"op": "online_busy" if busy else "online_idle"})
                if reply.get("error"):
                    self.errors.append(str(reply["error"]))
                self.sent += 1
            except OSError as e:
                self.errors.append(str(e))


class KvSampler(threading.Thread):
    """Every 20 ms: KV blocks in use and (Valve) handles held. Reads the allocator's state without
    locking it; a sample may be one step stale, which is all the static split needs."""

    def __init__(self, cache) -> None:
        super().__init__(daemon=True)
        self.cache, self.samples, self.stop = cache, [], threading.Event()

    def used(self) -> tuple[int, int]:
        bm = self.cache._block_manager
        free = len(bm._uninit_block_ids) + len(bm._init_block_ids)
        v = getattr(self.cache, "_valve", None)
        if v is None:
            return self.cache.num_blocks - free, 0
        return len(v.held) * v.bps - free, len(v.held)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.samples.append((now(), *self.used()))


class StepLog:
    """Every step of the generation loop: when it started, how long scheduling (`prepare_next_batch`,
    the shim's turn included), the forward pass (sync mode: until its tokens reach the host) and the
    update took, and what it computed (requests, query tokens, KV tokens read). Steps of the same shape
    can then be compared across configurations: a slower forward pass of the same shape is the device
    or the host, a different shape is scheduling. The forward pass's CPU time (this thread's) tells the
    two apart: a step whose wall time is nearly all CPU time is bound by the host, not the GPU."""

    FIELDS = ("t", "prepare_s", "forward_s", "update_s", "requests", "q_tokens", "kv_read", "forward_cpu_s")

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self._shape: tuple = (0, 0, 0)
        self._prep = (0.0, 0.0)
        self._step = self._step_cpu = 0.0

    def install(self) -> None:
        from transformers.generation.continuous_batching import continuous_api, scheduler

        cbp, log = continuous_api.ContinuousBatchProcessor, self
        prepare, step, update = cbp.prepare_next_batch, cbp._generation_step, cbp.update_batch
        schedule = scheduler.FIFOScheduler.schedule_batch

        def schedule_batch(sched, *args, **kwargs):
            out = schedule(sched, *args, **kwargs)
            batch = out[0] or []
            log._shape = (len(batch), out[2], out[3])
            return out

        def prepare_next_batch(bp):
            t = now()
            ok = prepare(bp)
            log._prep = (t, now() - t)
            return ok

        def generation_step(bp, model):
            t, cpu = now(), time.thread_time()
            step(bp, model)
            log._step, log._step_cpu = now() - t, time.thread_time() - cpu

        def update_batch(bp):
            t = now()
            update(bp)
            log.steps.append((round(log._prep[0], 6), round(log._prep[1], 6), round(log._step, 6),
                              round(now() - t, 6), *log._shape, round(log._step_cpu, 6)))

        scheduler.FIFOScheduler.schedule_batch = schedule_batch
        cbp.prepare_next_batch, cbp._generation_step, cbp.update_batch = prepare_next_batch, generation_step, update_batch


def timed_grows(space, log: list) -> None:
    """Records every `grow` of the KV space: start, duration, handles, and how many the daemon took
    from offline for it (the client's `last_grow_reclaimed`)."""
    real = space.grow

    def grow(count):
        t = now()
        try:
            return real(count)
        finally:
            log.append((t, now() - t, count, space.client.stats()["last_grow_reclaimed"]))

    space.grow = grow


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("alone", "static", "valve"), required=True)
    ap.add_argument("--trace", required=True, help="JSON list of common.OnlineRequest fields")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-blocks", type=int, help="alone/static: KV blocks of the cache")
    ap.add_argument("--reservation", choices=("on", "off"), default="on")
    ap.add_argument("--gate-signals", action="store_true")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--attention", choices=("sdpa", "varlen"), default="sdpa",
                    help="paged|sdpa (cost grows with the batch squared) or PyTorch's varlen flash kernel")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay CUDA graphs (transformers' padded shapes), as production servers do: without them "
                         "a decode step is bound by the host's Python, 20-40 ms whatever its GPU work")
    ap.add_argument("--ready", help="file to create once warmed up")
    ap.add_argument("--go", help="file whose appearance starts the trace")
    ap.add_argument("--drain-s", type=float, default=60.0, help="longest wait for requests after the trace")
    a = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    grows: list = []
    if a.mode == "valve":
        import valve_transformers as vt
        from valve_transformers._real_valve import kv_space_factory

        base = kv_space_factory("online")

        def factory(**kw):
            space = base(**kw)
            timed_grows(space, grows)
            return space

        vt.install("online", kv_space=factory, reservation=a.reservation == "on", usage_interval_s=0.01)
    steps = StepLog()
    steps.install()  # after the shim's patches: a step's times include the shim's work
    model, tok = common.load_model(a.model, a.attention)
    gen = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(block_size=common.BLOCK_SIZE, num_blocks=a.num_blocks,
                                   max_batch_tokens=a.max_batch_tokens, scheduler_type="fifo", safety_margin=0.0,
                                   use_cuda_graph=a.cuda_graphs, use_async_batching=False,
                                   **common.cb_extra(a.attention))
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    # Warm-up in the shapes the trace uses (a full prefill chunk next to short decodes), so the
    # first configuration does not pay for kernel loading and autotuning the others skip.
    wrng = random.Random(3)
    warm = [common.text(wrng, n) for n in (a.max_batch_tokens + 512, 200, 40, 8)]
    with torch.no_grad():
        for i, text in enumerate(warm):
            manager.add_request(tok(text)["input_ids"], f"warmup{i}", max_new_tokens=8)
        for i in range(len(warm)):
            manager.get_result(f"warmup{i}", timeout=300)
    if manager.batch_processor is None:
        raise SystemExit("the continuous-batching manager did not start (its error is logged above)")
    cache = manager.batch_processor.cache
    trace = [common.OnlineRequest(**r) for r in common.read_json(a.trace)]
    rng = random.Random(7)
    texts = [common.text(rng, r.prompt) for r in trace]
    sampler = KvSampler(cache)
    sampler.start()
    if a.ready:
        open(a.ready, "w").close()
    while a.go and not os.path.exists(a.go):
        time.sleep(0.005)
    steps.steps.clear()  # the warm-up's steps are not the trace's
    result = run_trace(manager, tok, trace, texts, GateSignals(a.gate_signals), a.drain_s)
    sampler.stop.set()
    result.update(mode=a.mode, reservation=a.reservation, cuda_graphs=a.cuda_graphs, num_blocks=cache.num_blocks, kv=sampler.samples,
                  grows=grows, device=common.device_name(),
                  steps=steps.steps, steps_fields=list(StepLog.FIELDS))
    v = getattr(cache, "_valve", None)
    if v is not None:
        result["shim"] = dict(v.stats)
        result["client"] = v.space.client.stats()
        result["client"].pop("space", None)
    manager.stop(block=True, timeout=30, hard_stop=True)
    common.write_json(a.out, result)
    return 0 if not result["failed"] else 3


def run_trace(manager, tok, trace, texts, signals: GateSignals, drain_s: float) -> dict:
    """Plays the trace: each request is tokenised and added at its arrival time; a collector thread
    takes the results. Returns per-request arrival, token timestamps and errors."""
    arrivals: dict[str, float] = {}
    outputs: dict[str, object] = {}
    inflight = {"n": 0}
    lock = threading.Lock()
    done = threading.Event()

    def collect():
        while not done.is_set() or inflight["n"] > 0:
            out = manager.get_result(timeout=0.05)
            if out is None:
                continue
            with lock:
                outputs[out.request_id] = out
                inflight["n"] -= 1
                if inflight["n"] == 0:
                    signals.send(False)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    t0 = now()
    for i, (r, txt) in enumerate(zip(trace, texts)):
        delay = t0 + r.at - now()
        if delay > 0:
            time.sleep(delay)
        rid = f"on{i}"
        arrivals[rid] = now()
        with lock:
            inflight["n"] += 1
            if inflight["n"] == 1:
                signals.send(True)
        manager.add_request(tok(txt)["input_ids"], rid, max_new_tokens=r.new_tokens, record_timestamps=True)
    done.set()
    collector.join(timeout=drain_s)
    requests = []
    for i, r in enumerate(trace):
        rid = f"on{i}"
        out = outputs.get(rid)
        ts = list(getattr(out, "timestamps", None) or [])
        err = getattr(out, "error", None) if out is not None else "no result"
        requests.append(dict(rid=rid, at=r.at, prompt=r.prompt, new_tokens=r.new_tokens, burst=r.burst,
                             arrival=arrivals.get(rid), timestamps=ts, error=None if err is None else str(err)))
    failed = sum(1 for q in requests if q["error"] or len(q["timestamps"]) < 1)
    return dict(t0=t0, t_end=now(), requests=requests, failed=failed, signals_sent=signals.sent,
                signal_errors=signals.errors[:5])


if __name__ == "__main__":
    sys.exit(main())
