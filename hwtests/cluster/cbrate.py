"""How steady the cluster check's continuous-batching job runs alone: the job (membench's offline.py)
in a static cache, once per setting, with its rate per 10 s and per 30 s and what the cache did.

The cluster check predicts this job's throughput from one profile; a job whose own rate wanders
by more than the 10% target cannot be predicted to 10%. Each setting is MARGIN:BLOCKS (the FIFO
scheduler's safety margin, the static cache's blocks of 256 tokens x 128 KiB = 32 MiB). No daemon,
no pool: what transformers itself does with a full cache.

  python3 hwtests/cluster/cbrate.py --out DIR --settings 0:384,0.2:384 --seconds 130
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MEMBENCH = os.path.join(HERE, "..", "membench")
sys.path.insert(0, MEMBENCH)


def rates(rows, span_s):
    """Tokens per second over consecutive `span_s` windows of the timeline (t, tokens, ...)."""
    out, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] - rows[i][0] < span_s:
            j += 1
        if j == len(rows):
            break
        out.append((rows[j][1] - rows[i][1]) / (rows[j][0] - rows[i][0]))
        i = j
    return out


def spread(xs):
    """(highest - lowest) / mean, or None for fewer than two values."""
    if len(xs) < 2 or sum(xs) <= 0:
        return None
    return (max(xs) - min(xs)) / (sum(xs) / len(xs))


def summary(setting, timeline, warmup_s):
    rows = [r for r in timeline["rows"] if r[0] - timeline["rows"][0][0] >= warmup_s]
    r10, r30 = rates(rows, 10), rates(rows, 30)
    secs = rows[-1][0] - rows[0][0] if len(rows) > 1 else 0
    return dict(setting=setting, seconds=round(secs, 1),
                per_s=(rows[-1][1] - rows[0][1]) / secs if secs else 0.0,
                per_10s=[round(x) for x in r10], spread_10s=spread(r10),
                per_30s=[round(x) for x in r30], spread_30s=spread(r30),
                evicted=rows[-1][2] - rows[0][2] if rows else 0,
                active_mean=sum(r[3] for r in rows) / len(rows) if rows else 0,
                free_blocks_mean=sum(r[5] for r in rows) / len(rows) if rows else 0)


def run_one(a, model, margin, blocks):
    tag = f"m{margin}-b{blocks}-t{a.batch_tokens}" + ("-g" if a.cuda_graphs else "")
    tl = os.path.join(a.out, f"timeline-{tag}.json")
    argv = [sys.executable, os.path.join(MEMBENCH, "offline.py"), "--model", model, "--mode", "static",
            "--out", os.path.join(a.out, f"offline-{tag}.json"), "--num-blocks", str(blocks),
            "--max-batch-tokens", str(a.batch_tokens), "--max-requests", "96", "--new-tokens", "128",
            "--prompt", *a.prompt.split(","), "--attention", "varlen", "--safety-margin", str(margin),
            "--max-seconds", str(a.seconds), "--timeline", tl] + (["--cuda-graphs"] if a.cuda_graphs else [])
    env = dict(os.environ, CUDA_MODULE_LOADING="EAGER", CUBLAS_WORKSPACE_CONFIG=":4096:8",
               TOKENIZERS_PARALLELISM="false")
    with open(os.path.join(a.out, f"offline-{tag}.log"), "w") as log:
        p = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=a.seconds + 240)
    if not os.path.exists(tl):
        raise RuntimeError(f"{tag}: no timeline (exit {p.returncode}): see offline-{tag}.log")
    with open(tl) as f:
        return summary(f"margin {margin}, {blocks} blocks, {a.batch_tokens} tokens a step, CUDA graphs "
                       f"{'on' if a.cuda_graphs else 'off'}", json.load(f), a.warmup)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", default="0:384,0.2:384", help="MARGIN:BLOCKS,... run in this order")
    ap.add_argument("--seconds", type=int, default=130, help="each setting's run")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds left out at the start of each run")
    ap.add_argument("--prompt", default="1536,1536")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--cuda-graphs", action="store_true", help="the job replays CUDA graphs (offline.py --cuda-graphs)")
    ap.add_argument("--model-dir", default="/tmp/cbrate-model", help="the random-weight model (built if missing)")
    a = ap.parse_args()
    settings = []
    for s in a.settings.split(","):
        try:
            m, b = s.split(":")
            settings.append((float(m), int(b)))
        except ValueError:
            ap.error(f"--settings {s!r}: give MARGIN:BLOCKS, e.g. 0.2:384")
    os.makedirs(a.out, exist_ok=True)
    import common

    model = a.model_dir
    common.build_model(model)
    rows = []
    for m, b in settings:
        t = time.monotonic()
        rows.append(run_one(a, model, m, b))
        print(json.dumps(rows[-1]), f"({time.monotonic() - t:.0f} s)", flush=True)
    name = f"cbrate-t{a.batch_tokens}" + ("-g" if a.cuda_graphs else "")
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(dict(device=common.device_name(), args=vars(a), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
