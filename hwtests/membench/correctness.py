"""Offline outputs under reclamation against an unreclaimed run, token for token (greedy).

    python3 correctness.py generate --model DIR --mode plain|valve --max-batch-tokens N --out out.json
    python3 correctness.py pressure --stop FILE --out out.json [--cycles 20] [--keep 2]

`generate` runs batch generation over fixed prompts and writes every request's tokens. With
`--max-batch-tokens 1` each forward pass computes one token of one request, so a recomputed request
repeats exactly the computations of the reference run (see integrations/transformers/DESIGN.md,
"Batch invariance"); with larger batches, batch composition may change the numerics.
`pressure` is an online client of the pool that repeatedly takes all but `--keep` handles (each a
reclaim from offline, mid-kernel), holds them, and gives them back, `--cycles` times or until the
stop file appears; then offline can finish.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import now  # noqa: E402

PROMPTS = 8
PROMPT_TOKENS = (32, 96)
NEW_TOKENS = 32
BLOCK_SIZE = 32  # small blocks (4 MiB of KV, 16 per 64 MiB handle): a reclaim hits a few requests


def generate(a) -> int:
    import random

    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.use_deterministic_algorithms(True, warn_only=True)
    if a.mode == "valve":
        import valve_transformers as vt

        vt.install("offline", memory_wait_s=120, **({"placement": "compact"} if a.placement == "compact" else {}))
    model, _ = common.load_model(a.model)
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 4 + common.WORDS) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(PROMPTS)]
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(block_size=BLOCK_SIZE, num_blocks=None if a.mode == "valve" else 512,
                                   max_batch_tokens=a.max_batch_tokens, scheduler_type="fifo", safety_margin=0.0,
                                   use_cuda_graph=False, use_async_batching=False)
    if a.started:
        open(a.started, "w").close()
    t = now()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg, warmup=False)
    result = dict(mode=a.mode, max_batch_tokens=a.max_batch_tokens, seconds=now() - t,
                  outputs={rid: list(o.generated_tokens) for rid, o in sorted(out.items())},
                  errors={rid: str(o.error) for rid, o in out.items() if o.error})
    if a.mode == "valve":
        import valve_transformers as vt

        result["shim"] = vt.stats()[-1] if vt.stats() else {}
    common.write_json(a.out, result)
    return 0


def pressure(a) -> int:
    """Takes all but `keep` handles, holds them, gives them back; repeats. Each take is a reclaim
    from offline while offline's kernels run."""
    import valve

    c = valve.Client("online", gpu=common.GPU)
    info = c.kv_space(1, 0, 2 << 20)
    total = info["slots"]
    grows, errors = [], []
    while not os.path.exists(a.stop) and len(grows) < a.cycles:
        time.sleep(a.gap_ms / 1000)
        t = now()
        try:
            slots = c.grow(total - a.keep)
        except valve.ValveError as e:
            errors.append(str(e))
            time.sleep(0.05)
            continue
        grows.append((now() - t, len(slots), c.stats()["last_grow_reclaimed"]))
        time.sleep(a.hold_ms / 1000)
        c.shrink(slots)
    c.close()
    common.write_json(a.out, dict(grows=grows, errors=errors[:10], handles=total))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--mode", choices=("plain", "valve"), required=True)
    g.add_argument("--max-batch-tokens", type=int, default=1)
    g.add_argument("--out", required=True)
    g.add_argument("--started", help="file to create when generation starts")
    g.add_argument("--placement", choices=("default", "compact"), default="default",
                   help="valve mode: the shim's block placement (compact: a request's blocks on as few handles as possible)")
    p = sub.add_parser("pressure")
    p.add_argument("--stop", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hold-ms", type=float, default=30)
    p.add_argument("--gap-ms", type=float, default=150)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--keep", type=int, default=2)
    a = ap.parse_args()
    return generate(a) if a.cmd == "generate" else pressure(a)


if __name__ == "__main__":
    sys.exit(main())
