"""The offline side of the memory benchmark: batch generation with HF transformers' continuous
batching over a backlog that never runs dry, measuring useful throughput.

    VALVE_LABEL=batch python3 offline.py --model DIR --mode static|valve --out out.json \
        [--num-blocks N] [--fifo] [--ready FILE] [--stop FILE]

`static` is plain transformers with a KV cache of `--num-blocks` blocks (a static split); `valve`
backs the cache with the pool through `valve_transformers` (offline role: free memory only, and
requests whose blocks a reclaim took are recomputed). Throughput counts the tokens of requests that
finished while measuring; tokens a reclaim made it recompute are not counted twice. Every step's end
time is logged, for the comparison with waiting for an iteration boundary. With VALVE_PROGRESS_DIR and
SLURM_JOB_ID set (a Valve job), the tokens of finished requests so far are reported there as they
finish (`UNIX_MS TOKENS` lines, at most 4 a second; docs/cluster.md), from start, not only after --go.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import now  # noqa: E402


class Generated:
    """Tokens generated so far, counted at every step: each request's generated tokens, counted once
    (a requeued request keeps its generated tokens, and they are not counted again when recomputed),
    so a window's tokens are the work offline did in it, whenever the requests finish. Finished
    requests are settled from their outputs (their last token comes after the last step saw them)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.total = 0
        self.timeline: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def step(self, scheduler) -> None:
        with self.lock:
            for rid, st in list(scheduler.active_requests.items()):
                self._add(rid, generated_len(st))
            self.timeline.append((now(), self.total))

    def finished(self, rid: str, tokens: int) -> None:
        with self.lock:
            self._add(rid, tokens)
            self.seen.pop(rid, None)
            self.timeline.append((now(), self.total))

    def forget(self, rid: str) -> None:
        """A cancelled request: it will never finish, so its count is dropped (the tokens stay counted)."""
        with self.lock:
            self.seen.pop(rid, None)

    def _add(self, rid: str, n: int) -> None:
        d = n - self.seen.get(rid, 0)
        if d > 0:
            self.seen[rid] = n
            self.total += d


def generated_len(state) -> int:
    """Tokens a request has generated, requeues included: a requeued state (transformers'
    `create_equivalent_initial_request`) starts with no generated tokens, the earlier ones folded into
    its prompt, whose original length `_true_initial_tokens` keeps."""
    n = len(getattr(state, "generated_tokens", ()) or ())
    true = getattr(state, "_true_initial_tokens", None)
    if true:
        n += len(getattr(state, "initial_tokens", ()) or ()) - true
    return n


def log_steps(steps: list, generated: Generated | None = None) -> None:
    """Appends the end time of every continuous-batching step (after the shim's own wrapper), and
    counts the tokens generated so far into `generated`."""
    from transformers.generation.continuous_batching import continuous_api

    cbp = continuous_api.ContinuousBatchProcessor
    inner = cbp.update_batch

    def update_batch(self):
        inner(self)
        steps.append(now())
        if generated is not None:
            generated.step(self.scheduler)

    cbp.update_batch = update_batch


def count_offloads(counter: list) -> None:
    """Counts the requests transformers' offloading manager evicts (to CPU or reset) when the cache
    runs out, into counter[0]: a full cache that evicts is one way a job's rate moves on its own."""
    from transformers.generation.continuous_batching import offloading_manager

    om = offloading_manager.OffloadingManager
    inner = om.offload_requests

    def offload_requests(self):
        n = inner(self)
        counter[0] += n
        return n

    om.offload_requests = offload_requests


class Timeline:
    """One row a second for --timeline: time, tokens finished, requests evicted so far, active and
    waiting requests, free cache blocks: where a job's rate moves, what the cache was doing."""

    def __init__(self, path: str | None, manager, offloads: list) -> None:
        self.path, self.manager, self.offloads = path, manager, offloads
        self.rows: list[list] = []
        self.next = time.monotonic()
        self.error: str | None = None

    def sample(self, tokens: int) -> None:
        if not self.path or self.error or time.monotonic() < self.next:
            return
        self.next += 1.0
        try:  # transformers' internals: a change there ends the timeline, never the job
            sched = self.manager.batch_processor.scheduler
            cache = self.manager.batch_processor.cache
            self.rows.append([round(now(), 3), tokens, self.offloads[0], len(sched.active_requests),
                              len(sched.waiting_requests), cache.get_num_free_blocks()])
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"

    def write(self) -> None:
        if self.path:
            common.write_json(self.path, {"columns": ["t", "tokens", "evicted", "active", "waiting", "free_blocks"],
                                          "rows": self.rows, "error": self.error})


class Progress:
    """The job's progress for Valve's node agent: tokens of finished requests so far."""

    def __init__(self) -> None:
        d, job = os.environ.get("VALVE_PROGRESS_DIR"), os.environ.get("SLURM_JOB_ID")
        self.f = open(os.path.join(d, job), "a", buffering=1) if d and job else None
        self.tokens, self.last = 0, 0.0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        if self.f and time.monotonic() - self.last >= 0.25:
            self.last = time.monotonic()
            self.f.write(f"{int(time.time() * 1000)} {self.tokens}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("static", "valve"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-blocks", type=int)
    ap.add_argument("--fifo", action="store_true", help="valve: FIFO handle choice instead of Algorithm 1")
    ap.add_argument("--placement", choices=("default", "compact"), default="default",
                    help="valve: the shim's block placement (compact: wholly free handles' blocks first, at each turn)")
    ap.add_argument("--prompt", type=int, nargs=2, default=(512, 1024), help="prompt length range (tokens)")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--attention", choices=("sdpa", "varlen"), default="sdpa",
                    help="paged|sdpa (cost grows with the batch squared) or PyTorch's varlen flash kernel")
    ap.add_argument("--max-requests", type=int, default=96, help="requests per forward pass at most")
    ap.add_argument("--backlog", type=int, default=256, help="requests kept queued")
    ap.add_argument("--episode-requests", type=int, default=600,
                    help="--episodes: the fixed list's length (an episode that runs out of it fails)")
    ap.add_argument("--safety-margin", type=float, default=0.0,
                    help="transformers' FIFO scheduler admits no new prefill while fewer than this share of the "
                         "whole cache's blocks is free (its own default is 0.2); through the shim the whole cache is "
                         "the pool, so a margin keeps that share of the pool free")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay transformers' CUDA graphs for each padded batch shape (as online.py --cuda-graphs). "
                         "Without them each step is bound by the host's Python (about 30 ms a step for this model "
                         "on an H200), and the job's rate follows the host, not the GPU share it gets")
    ap.add_argument("--ready")
    ap.add_argument("--go", help="measuring starts when this file appears")
    ap.add_argument("--stop", help="measuring ends when this file appears")
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--timeline", help="write one row a second (tokens, evictions, active/waiting requests, free "
                                       "blocks) to this JSON file: what the cache did where the rate moved")
    ap.add_argument("--episodes", metavar="DIR",
                    help="run fixed episodes instead of an endless backlog (episodes.py; run.py episodes): each "
                         "DIR/episode-K.json starts one, DIR/episode-K.done.json says how it went, DIR/stop ends")
    a = ap.parse_args()
    faulthandler.enable()  # a fatal signal prints the Python stacks into the log

    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # No code loading while frozen: run.py sets CUDA_MODULE_LOADING=EAGER, and cuDNN's SDPA (which
    # compiles kernels at run time) is off, so offline uses the precompiled SDPA backends. Tried
    # after an offline job hung in cuKernelSetAttribute under cuDNN after a reclaim; the hang
    # stayed (then in cuStreamSynchronize), see 2026-11-24-h100-membench.md (archived in
    # docs/results/README.md). Kept in every configuration alike: it also made offline steps
    # about 2x faster here.
    torch.backends.cuda.enable_cudnn_sdp(False)

    if a.mode == "valve":
        import valve_transformers as vt
        from valve_transformers._real_valve import kv_space_factory

        policy = dict(placement="compact") if a.placement == "compact" else {}
        vt.install("offline", kv_space=kv_space_factory("offline", fifo=a.fifo), **policy)
    steps: list[float] = []
    generated = Generated() if a.episodes else None
    log_steps(steps, generated)
    offloads = [0]
    count_offloads(offloads)
    model, tok = common.load_model(a.model, a.attention)
    gen = GenerationConfig(max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(block_size=common.BLOCK_SIZE, num_blocks=a.num_blocks,
                                   max_batch_tokens=a.max_batch_tokens, max_requests_per_batch=a.max_requests,
                                   scheduler_type="fifo", safety_margin=a.safety_margin,
                                   use_cuda_graph=a.cuda_graphs, use_async_batching=False,
                                   **common.cb_extra(a.attention))
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    if a.episodes:
        return serve_episodes(a, manager, tok, generated, offloads, steps)
    added = 0

    def top_up(n: int) -> None:
        # Every request has its own prompt (the same ones in every configuration): no prefix-cache
        # hits to flatter one configuration's throughput.
        nonlocal added
        for _ in range(n):
            prompt = tok(common.text(random.Random(added), common.offline_prompt_len(added, tuple(a.prompt))))
            manager.add_request(prompt["input_ids"], f"off{added}", max_new_tokens=a.new_tokens)
            added += 1

    top_up(a.backlog)
    if a.ready:
        open(a.ready, "w").close()
    progress = Progress()
    solo_from = len(steps)  # until `go`, offline runs alone: its undisturbed step times
    while a.go and not os.path.exists(a.go):
        out = manager.get_result(timeout=0.05)
        if out is not None:
            if not out.error:
                progress.add(len(out.generated_tokens))
            top_up(1)
    timeline = Timeline(a.timeline, manager, offloads)
    t0, done, errors = now(), [], []
    steps_before = len(steps)
    solo_steps = steps[solo_from:steps_before]
    deadline = time.monotonic() + a.max_seconds
    while not (a.stop and os.path.exists(a.stop)) and time.monotonic() < deadline:
        if not manager.is_running():
            errors.append("the generation loop stopped")
            break
        out = manager.get_result(timeout=0.05)
        timeline.sample(progress.tokens)
        if out is None:
            continue
        if out.error:
            errors.append(str(out.error))
        else:
            done.append((now(), len(out.generated_tokens)))
            if generated is not None and getattr(out, "request_id", None) is not None:
                generated.finished(out.request_id, len(out.generated_tokens))
            progress.add(len(out.generated_tokens))
        top_up(1)
    t1 = now()
    result = dict(mode=a.mode, fifo=a.fifo, cuda_graphs=a.cuda_graphs, placement=a.placement, t0=t0, t1=t1, finished=len(done), tokens=sum(n for _, n in done),
                  tokens_per_s=sum(n for _, n in done) / (t1 - t0), errors=errors[:10], error_count=len(errors),
                  steps=steps[steps_before:], solo_steps=solo_steps, device=common.device_name(),
                  finishes=done,
                  generated=generated.timeline if generated is not None else None)
    cache = manager.batch_processor.cache
    v = getattr(cache, "_valve", None)
    result["num_blocks"] = cache.num_blocks
    if v is not None:
        result["shim"] = dict(v.stats)
        result["client"] = v.space.client.stats()
        result["client"].pop("space", None)
    result["evicted"] = offloads[0]
    common.write_json(a.out, result)
    timeline.write()
    manager.stop(block=True, timeout=30, hard_stop=True)  # not FLUSH_AND_STOP: the backlog is endless
    return 0 if not errors else 3


def serve_episodes(a, manager, tok, generated: Generated, offloads: list, steps: list) -> int:
    """--episodes: the same requests in every episode (request i's prompt is the backlog's request i),
    run when the driver asks for one; writes what each episode did and what offline is at the end."""
    prompts = [tok(common.text(random.Random(i), common.offline_prompt_len(i, tuple(a.prompt))))["input_ids"]
               for i in range(a.episode_requests)]
    if a.ready:
        open(a.ready, "w").close()
    k, status = 1, 0
    while not os.path.exists(os.path.join(a.episodes, "stop")):
        path = os.path.join(a.episodes, f"episode-{k}.json")
        if not os.path.exists(path):
            time.sleep(0.01)
            continue
        spec = common.read_json(path)
        res = run_episode(spec, manager, prompts, a, generated, offloads)
        res.update(episode_steps(steps, res["t0"], res["seconds"]))
        common.write_json(os.path.join(a.episodes, f"episode-{k}.done.json.new"), res)
        os.replace(os.path.join(a.episodes, f"episode-{k}.done.json.new"),
                   os.path.join(a.episodes, f"episode-{k}.done.json"))
        if res["errors"] or not res["drained"]:
            status = 3
            break
        k += 1
    manager.stop(block=True, timeout=30, hard_stop=True)
    return status


def shim_stats(manager) -> dict | None:
    v = getattr(manager.batch_processor.cache, "_valve", None)
    return dict(v.stats) if v is not None else None


def run_episode(spec: dict, manager, prompts: list, a, generated: Generated, offloads: list) -> dict:
    """One episode (episodes.py): from spec["start_at"] (CLOCK_MONOTONIC), `backlog` of the prompts in
    the system, a finished one replaced by the next, until offline has generated spec["tokens"] tokens
    (or for spec["measure_s"] seconds); then what is left is cancelled and the cache drains."""
    import episodes

    if a.mode == "valve":
        import valve_transformers as vt

        vt.set_policy(selection=spec.get("selection", "alg1"), selection_seed=int(spec.get("seed", 0)))
    shim0, off0 = shim_stats(manager), offloads[0]
    time.sleep(max(0.0, spec["start_at"] - now()))
    t0 = now()
    with generated.lock:
        g0, mark = generated.total, len(generated.timeline)
    in_system: set[str] = set()
    nxt, finished, errors = 0, 0, []

    def fill() -> None:
        nonlocal nxt
        while len(in_system) < spec["backlog"] and nxt < len(prompts):
            rid = f"e{spec['k']}-{nxt}"
            manager.add_request(prompts[nxt], rid, max_new_tokens=a.new_tokens)
            in_system.add(rid)
            nxt += 1

    def reached() -> bool:
        if spec.get("tokens"):
            return generated.total - g0 >= spec["tokens"]
        return now() - t0 >= spec["measure_s"]

    fill()
    deadline = t0 + spec.get("max_s", 300)
    while not reached():
        if now() > deadline or not manager.is_running() or nxt >= len(prompts) and not in_system:
            errors.append("the episode ran out of time, requests or its generation loop before its count "
                          f"({generated.total - g0} tokens in {now() - t0:.1f} s, {nxt} requests used)")
            break
        out = manager.get_result(timeout=0.01)
        if out is None or out.request_id not in in_system:
            continue  # nothing yet, or a cancelled request of an earlier episode
        in_system.discard(out.request_id)
        if out.error:
            errors.append(str(out.error))
        else:
            finished += 1
            generated.finished(out.request_id, len(out.generated_tokens))
        fill()
    t_stop, shim1, off1 = now(), shim_stats(manager), offloads[0]
    with generated.lock:
        line = [(t, n - g0) for t, n in generated.timeline[mark:]]
    for rid in in_system:
        manager.cancel_request(rid)
        generated.forget(rid)
    drained = wait_drained(manager, 60)
    tokens = spec.get("tokens") or episodes.tokens_by(line, t0, spec["measure_s"])
    res = dict(k=spec["k"], t0=t0, late_s=t0 - spec["start_at"], t_stop=t_stop, tokens=tokens,
               seconds=episodes.time_to_tokens(line, t0, tokens), finished=finished, used=nxt,
               cb_offloads=off1 - off0, errors=errors[:10], drained=drained)
    if shim0 is not None and shim1 is not None:
        res.update({key: shim1[key] - shim0[key] for key in ("requeued", "requeued_tokens", "grown_handles")
                    if key in shim0 and key in shim1})
    return res


def episode_steps(steps: list, t0: float, seconds: float | None) -> dict:
    """The continuous-batching steps an episode took to its count, and their median length: without
    CUDA graphs a step's length is the host's Python, which drifts with the host, while the count
    of steps is the work (episodes.py)."""
    import bisect

    if seconds is None:
        return {}
    i0, i1 = bisect.bisect_right(steps, t0), bisect.bisect_right(steps, t0 + seconds + 1e-6)
    gaps = sorted(b - a for a, b in zip(steps[i0:i1], steps[i0 + 1:i1]))
    return dict(steps=i1 - i0, step_ms_median=1000 * gaps[len(gaps) // 2] if gaps else None)


def wait_drained(manager, timeout: float) -> bool:
    """Waits until transformers' scheduler holds no request (cancelled ones leave at its next step)."""
    sched = manager.batch_processor.scheduler
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not sched.active_requests and not sched.waiting_requests:
            return True
        time.sleep(0.01)
    return False


if __name__ == "__main__":
    sys.exit(main())
