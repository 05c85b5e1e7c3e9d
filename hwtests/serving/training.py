"""The offline job: PyTorch training of a random-weight Llama (AdamW, bf16 on a GPU), with
deterministic algorithms. Every iteration appends `<monotonic_ns> <iteration>` to the progress
file; on SIGTERM it prints a sha256 of its weights and exits (offline results must not change
under the gate). With VALVE_PROGRESS_DIR and SLURM_JOB_ID set (a Valve job), it also reports the
tokens trained so far there, at most 4 times a second (`UNIX_MS TOKENS` lines, docs/cluster.md).

    VALVE_LABEL=batch python3 training.py --progress FILE --size small --device cuda
"""

import argparse
import hashlib
import os
import signal
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small", "1b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hash-every", type=int, default=0,
                    help="also print `HASH <iteration> <sha256 of the weights>` every N iterations")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention kernels: eager is deterministic (cuDNN's SDPA backward is not)")
    a = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {
        # hidden, layers, heads, kv_heads, intermediate
        "tiny": (64, 2, 4, 2, 128),
        "small": (512, 4, 8, 4, 1408),
        "1b": (2048, 16, 16, 8, 5632),
    }
    hidden, layers, heads, kv, inter = sizes[a.size]
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=a.seq,
        attn_implementation=a.attn,
    )
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(cfg).to(a.device, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    valve_dir, job = os.environ.get("VALVE_PROGRESS_DIR"), os.environ.get("SLURM_JOB_ID")
    valve = open(os.path.join(valve_dir, job), "a", buffering=1) if valve_dir and job else None
    reported = 0.0
    with open(a.progress, "a", buffering=1) as prog:
        it = 0
        print(f"READY {sum(p.numel() for p in model.parameters())}", flush=True)
        while not stop:
            x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(a.device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # One host sync per iteration: progress is counted when the GPU has done it.
            loss_v = loss.item()
            it += 1
            prog.write(f"{time.monotonic_ns()} {it}\n")
            if valve and time.monotonic() - reported >= 0.25:
                reported = time.monotonic()
                valve.write(f"{int(time.time() * 1000)} {it * a.batch * a.seq}\n")
            if a.hash_every and it % a.hash_every == 0:
                print(f"HASH {it} {weights_sha(model)}", flush=True)
    print(f"DONE {it} loss {loss_v:.4f} sha256 {weights_sha(model)}", flush=True)


def weights_sha(model):
    """sha256 of every parameter's bytes, in order: equal weights give equal digests."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
