"""Does transformers' continuous batching replay CUDA graphs with this benchmark's model and attention, and
what does a step cost with and without them? Also whether greedy tokens stay those of eager mode.

    python3 hwtests/membench/graph_probe.py [--attention sdpa,varlen] [--json OUT]

Per attention and mode: 3 rounds of 8 requests (100-900-token prompts, 32 new tokens), the last round's
median decode and prefill step (online.py's StepLog). Needs one CUDA GPU (on CPU transformers turns graphs
off and both modes are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from online import StepLog  # noqa: E402

PROMPTS = (300, 500, 700, 900, 200, 100, 400, 600)


def probe(model_dir: str, attention: str, graphs: bool, log: StepLog) -> dict:
    """Three rounds of one batch; the step times of the last (graphs captured in the first two)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tok = common.load_model(model_dir, attention)
    gen = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(block_size=common.BLOCK_SIZE, num_blocks=64, max_batch_tokens=2048,
                                   scheduler_type="fifo", use_cuda_graph=graphs, use_async_batching=False,
                                   **common.cb_extra(attention))
    rng = random.Random(1)
    for _ in range(3):
        log.steps.clear()
        prompts = [tok(common.text(rng, n))["input_ids"] for n in PROMPTS]
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg, progress_bar=False)
    rows = [dict(zip(StepLog.FIELDS, s)) for s in log.steps]
    decode = [r["forward_s"] * 1e3 for r in rows if r["q_tokens"] == r["requests"]]
    prefill = [r["forward_s"] * 1e3 for r in rows if r["q_tokens"] != r["requests"]]
    return dict(decode_ms_p50=statistics.median(decode) if decode else None, decode_steps=len(decode),
                prefill_ms_p50=statistics.median(prefill) if prefill else None,
                tokens=[out[k].generated_tokens for k in sorted(out)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="sdpa,varlen")
    ap.add_argument("--workdir", default="/tmp/graph-probe")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    model_dir = os.path.join(a.workdir, "model")
    common.build_model(model_dir)
    log = StepLog()
    log.install()
    result: dict = {"device": common.device_name()}
    for attention in a.attention.split(","):
        runs = {graphs: probe(model_dir, attention, graphs, log) for graphs in (False, True)}
        result[attention] = {f"graphs={g}": {k: v for k, v in r.items() if k != "tokens"} for g, r in runs.items()}
        result[attention]["graph_tokens_equal_eager"] = runs[True]["tokens"] == runs[False]["tokens"]
        print(attention, json.dumps(result[attention]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
