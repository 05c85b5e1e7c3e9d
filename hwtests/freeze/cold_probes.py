"""What the launch watcher's probes cost a request's first driver calls after idle time (issue 49).

A request as the raw server makes it: the ids copied to the GPU (pinned, non-blocking), one CUDA
graph replay, the result read back (`.item()`: a copy and a wait). Each call is timed on the host,
after THINK_US of sleep (idle, the CPU free to halt) and with none (hot). Run it alone and with a
gate watching the process (label it with VALVE_LABEL) to see what the probes' traps add per call.
Usage: python3 cold_probes.py --label NAME [--count N] [--think-us U] [--settle-s S]
Prints one JSON line: per phase (copy, replay, item, total; on the GPU by events: gpu_copy from
the stream's first event to the copy's end, gpu_graph) p50 / p90 / p99 in us, idle and hot.
"""

import argparse
import json
import time


def percentiles(v):
    v = sorted(v)
    return [round(v[int(len(v) * q)] / 1e3, 1) for q in (0.5, 0.9, 0.99)]


def build(torch):
    """The graph and its static buffers: ids -> embedding -> one matmul -> argmax."""
    dev = "cuda"
    ids = torch.zeros(16, dtype=torch.int64, device=dev)
    src = torch.randint(0, 1000, (16,), dtype=torch.int64).pin_memory()
    emb = torch.randn(1000, 1024, device=dev, dtype=torch.half)
    w = torch.randn(1024, 1024, device=dev, dtype=torch.half)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            out = (emb[ids] @ w).sum().argmax()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = (emb[ids] @ w).sum().argmax()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    return ids, src, g, out, ev


def request(ids, src, g, out, ev):
    t0 = time.perf_counter_ns()
    ev[0].record()
    ids.copy_(src, non_blocking=True)
    ev[1].record()
    t1 = time.perf_counter_ns()
    g.replay()
    ev[2].record()
    t2 = time.perf_counter_ns()
    out.item()
    t3 = time.perf_counter_ns()
    # On the GPU: from the stream's first event to the copy's end, and the graph (ns).
    gpu_copy = int(ev[0].elapsed_time(ev[1]) * 1e6)
    gpu_graph = int(ev[1].elapsed_time(ev[2]) * 1e6)
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0, gpu_copy, gpu_graph


def sample(bufs, count, think_s):
    rows = []
    for _ in range(count):
        if think_s > 0:
            time.sleep(think_s)
        rows.append(request(*bufs))
    names = ("copy", "replay", "item", "total", "gpu_copy", "gpu_graph")
    return {n: percentiles([r[i] for r in rows]) for i, n in enumerate(names)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--think-us", type=int, default=200000)
    ap.add_argument("--settle-s", type=float, default=4.0, help="before measuring: probes attach")
    a = ap.parse_args()
    import torch

    bufs = build(torch)
    for _ in range(20):
        request(*bufs)
    time.sleep(a.settle_s)
    res = {
        "label": a.label,
        "device": torch.cuda.get_device_name(0),
        "count": a.count,
        "think_us": a.think_us,
        "idle": sample(bufs, a.count, a.think_us / 1e6),
        "hot": sample(bufs, a.count, 0),
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
