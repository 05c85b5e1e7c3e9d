"""The eviction cells without a GPU: which handles a reclaim takes, counted in work.

Continuous batching (transformers >= 5) with a tiny random-weight Llama on the CPU, its KV cache in the
fake Valve pool (`valve_transformers._fake_valve`), the shim's real placement and requeue code and the
fake pool's Algorithm 1 ("greedy": lowest marginal token cost first), FIFO (oldest grant first) and
random. The geometry is the GPU sweep's: 256-token blocks, 2 per handle, 192 handles, prompts of
1,024-2,048 tokens, 128 generated, 512 batch tokens a step, so that memory, not the step's token
budget, bounds how many requests run (about 55-60, as on the H100). Every `--every` steps a reclaim
takes `size`% of the handles offline holds, in the middle of a step, as the daemon's reclaim does.

The loss is in tokens, not seconds: every token the model computes (prompt, recomputed prompt and
generated) over the same requests run without reclaims, less one. That is the work a requeue redoes;
what it costs in time on a GPU also depends on the step's shape, which this does not model. It has no
run-to-run noise, so it can decide cells the GPU sweep could not (FIFO's loss within the spread).

    python3 hwtests/membench/cpu_sweep.py --out DIR [--sizes 5,10,25,50] [--every 75,250,750]
        [--policies alg1,fifo,random] [--placements default,compact] [--requests 480]

Needs torch and transformers >= 5 (the GPU hosts' 5.17 or a CPU install); writes DIR/cpu-sweep.json
and prints a table.
"""

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integrations", "transformers"))

BLOCK = 256  # tokens per block, as on the GPU
NEW_TOKENS = 128
BATCH_TOKENS = 512
PROMPT_TOKENS = (1024, 2048)
HANDLES = 192  # the GPU sweep's 12 GiB pool of 64 MiB handles
BLOCK_BYTES = BLOCK * 4 * 2 * 16 * 4  # tokens x (2 layers x K, V) x 2 KV heads x 16 dims x fp32
HANDLE_BYTES = 2 * BLOCK_BYTES  # 2 blocks per handle, as on the GPU
PAGE = 512
POLICIES = {"alg1": "greedy", "fifo": "fifo", "random": None}


def model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    m = LlamaForCausalLM(config).eval()
    m.config._attn_implementation = "sdpa"
    return m


def prompts(n, seed=7):
    """n prompts of PROMPT_TOKENS (4-8 blocks), all distinct."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]


def run(m, reqs, reclaim=None):
    """Generates `reqs` through the shim on a fresh fake pool; `reclaim(pool, step)` runs in the middle
    of every step. Returns (tokens computed, steps, shim stats, outputs)."""
    import torch
    import valve_transformers as vt
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from valve_transformers._fake_valve import FakePool

    pool = FakePool(HANDLES, HANDLE_BYTES, PAGE)
    policy = run.placement_policy
    vt.install("offline", kv_space=pool.kv_space_factory("offline"), **policy)
    count = {"tokens": 0, "step": 0}

    def outer(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            count["tokens"] += int(ids.numel())

    def mid(_module, _args):
        count["step"] += 1
        if reclaim is not None:
            reclaim(pool, count["step"])

    h1 = m.register_forward_pre_hook(outer, with_kwargs=True)
    h2 = m.model.layers[-1].register_forward_pre_hook(mid)
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=2 * HANDLES, max_batch_tokens=BATCH_TOKENS,
                                   scheduler_type="fifo", safety_margin=0.0, use_cuda_graph=False,
                                   use_async_batching=False)
    try:
        with torch.no_grad():
            out = m.generate_batch(reqs, generation_config=gen, continuous_batching_config=cfg, warmup=False)
        stats = vt.stats()[-1]
    finally:
        h1.remove()
        h2.remove()
        vt.uninstall()
    outputs = {rid: list(o.generated_tokens) for rid, o in out.items()}
    return count["tokens"], count["step"], stats, outputs


def reclaimer(size_pct, every, policy, seed, log, limit):
    """Every `every` steps, takes size_pct% of the handles offline holds (at least 1) by `policy`, at most
    `limit` times (the same number for every policy, though a policy that requeues more runs longer)."""
    rng = random.Random(seed)

    def reclaim(pool, step):
        if step % every or len(log) >= limit:
            return
        space = next(s for s in pool.spaces if s.role == "offline")
        held = space.held_slots()
        k = max(1, round(len(held) * size_pct / 100))
        if not held:
            return
        if policy == "random":
            taken = space.reclaim(k, slots=rng.sample(held, min(k, len(held))))
        else:
            taken = space.reclaim(k, POLICIES[policy])
        log.append({"step": step, "held": len(held), "taken": len(taken)})

    return reclaim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="5,10,25,50", help="% of offline's handles one reclaim takes")
    ap.add_argument("--every", default="75,250,750",
                    help="steps between reclaims (the H100 took 1,500-2,000 steps a minute: about 20, 6 and 2 a minute)")
    ap.add_argument("--policies", default="alg1,fifo,random")
    ap.add_argument("--placements", default="default,compact")
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    m = model()
    reqs = prompts(a.requests)
    cells = []
    for placement in a.placements.split(","):
        run.placement_policy = {"placement": "compact"} if placement == "compact" else {}
        t = time.monotonic()
        base_tokens, base_steps, _, ref = run(m, reqs)
        print(f"{placement}: {base_tokens} tokens in {base_steps} steps without reclaims "
              f"({time.monotonic() - t:.0f} s)", flush=True)
        for every in [int(x) for x in a.every.split(",")]:
            for size in [float(x) for x in a.sizes.split(",")]:
                for policy in a.policies.split(","):
                    log: list = []
                    limit = base_steps // every
                    tokens, steps, stats, got = run(m, reqs, reclaimer(size, every, policy, a.seed, log, limit))
                    taken = sum(e["taken"] for e in log)
                    cell = {"placement": placement, "every_steps": every, "size_pct": size, "policy": policy,
                            "reclaims": len(log), "handles_taken": taken, "requeued": stats["requeued"],
                            "requeued_per_handle": stats["requeued"] / taken if taken else None,
                            "tokens": tokens, "base_tokens": base_tokens, "loss": tokens / base_tokens - 1,
                            "steps": steps, "base_steps": base_steps,
                            "identical": got == ref}
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    with open(os.path.join(a.out, "cpu-sweep.json"), "w") as f:
        json.dump({"cells": cells, "args": vars(a)}, f, indent=1)
    print(table(cells))
    return 0


def table(cells):
    """Loss per cell (% more tokens computed), policies side by side, and Algorithm 1 against FIFO."""
    lines = ["| placement | every (steps) | size | " + " | ".join(
        f"{p} loss (requeued per handle)" for p in ("alg1", "fifo", "random")) + " | alg1 vs fifo |",
             "|---|---|---|---|---|---|---|"]
    keyed = {(c["placement"], c["every_steps"], c["size_pct"], c["policy"]): c for c in cells}
    for (pl, ev, sz) in sorted({k[:3] for k in keyed}):
        row = []
        for p in ("alg1", "fifo", "random"):
            c = keyed.get((pl, ev, sz, p))
            row.append("-" if c is None else f"{100 * c['loss']:.2f}% ({c['requeued_per_handle'] or 0:.2f})")
        a, f = keyed.get((pl, ev, sz, "alg1")), keyed.get((pl, ev, sz, "fifo"))
        vs = f"{100 * (1 - a['loss'] / f['loss']):+.0f}% less" if a and f and f["loss"] > 0 else "-"
        lines.append(f"| {pl} | {ev} | {sz:g}% | " + " | ".join(row) + f" | {vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
