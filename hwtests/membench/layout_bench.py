"""What the pool's KV layout costs a decode step: gathering every request's keys from a layer's cache
tensor when the tensor is contiguous (transformers' own cache) or a strided view of one token-major region
(the Valve shim: row t holds token t's K and V of every layer, docs/memory.md "Layout").

    python3 hwtests/membench/layout_bench.py [--blocks 384] [--keys 80000] [--json OUT]

Uses the membench model's shapes (16 layers, 32 KV heads of 64, bf16, 256-token blocks) and reads
`--keys` tokens as whole blocks in a shuffled block order, as a paged cache does. Needs one CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import random


def gather_ms(torch, tensors, index, repeats: int) -> float:
    """Mean time of one step's gathers: `index_select` of the rows in `index` from every tensor."""
    for t in tensors:  # warm-up
        t.index_select(0, index)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        for t in tensors:
            t.index_select(0, index)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=384, help="KV blocks in the cache (384: the 12 GiB pool)")
    ap.add_argument("--keys", type=int, default=80_000, help="tokens a step reads (8 requests of 10k)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("layout_bench: no CUDA GPU")
    tokens, tensors = a.blocks * a.block_size, 2 * a.layers
    shape = (tokens, a.heads, a.head_dim)
    rng = random.Random(5)
    blocks = list(range(a.blocks))
    rng.shuffle(blocks)
    used = blocks[: -(-a.keys // a.block_size)]
    index = torch.tensor([b * a.block_size + i for b in used for i in range(a.block_size)][: a.keys],
                         device="cuda", dtype=torch.long)
    result = dict(device=torch.cuda.get_device_name(), tokens=tokens, keys=a.keys, tensors=tensors,
                  bytes_per_step=a.keys * tensors * a.heads * a.head_dim * 2)

    per_layer = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(tensors)]
    result["contiguous_ms"] = gather_ms(torch, per_layer, index, a.repeats)
    del per_layer
    torch.cuda.empty_cache()

    region = torch.zeros((tokens, tensors, a.heads, a.head_dim), device="cuda", dtype=torch.bfloat16)
    views = [region[:, i] for i in range(tensors)]
    result["strided_view_ms"] = gather_ms(torch, views, index, a.repeats)
    result["whole_rows_ms"] = gather_ms(torch, [region], index, a.repeats)  # every layer in one gather
    result["strided_over_contiguous"] = result["strided_view_ms"] / result["contiguous_ms"]
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
