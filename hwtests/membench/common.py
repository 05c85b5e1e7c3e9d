"""What the memory benchmark's processes share: the random-weight model and its locally built
tokenizer, the workloads (seeded), the daemon's socket, and small helpers for timing and JSON.

Everything runs without a model hub: the model is a `LlamaConfig` with random weights saved with
`save_pretrained`, and the tokenizer is a word-level `tokenizers` model over made-up words.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import time
from dataclasses import asdict, dataclass

# The benchmark model: a ~0.86B-parameter decoder with full multi-head attention (no GQA), so its
# KV cache is large per token (16 layers x K,V x 32 heads x 64 dims x 2 bytes = 128 KiB), as in the
# 7B MHA models of the paper, and memory, not compute, limits how many requests run at once.
MODEL = dict(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
             rope_theta=500000.0)
KV_BYTES_PER_TOKEN = 16 * 2 * 32 * 64 * 2
BLOCK_SIZE = 256  # tokens per KV block; a block of one layer's K (or V) is 1 MiB
HANDLE_BYTES = 64 << 20  # the daemon's default; 32 regions x 2 MiB pieces = 2 blocks per handle

# MEMBENCH_TINY=1 MEMBENCH_DEVICE=cpu: a 2-layer model on the CPU, to try the scripts without a GPU
# (the `alone` and `static` configurations only: Valve's pool needs a GPU). Numbers mean nothing then.
DEVICE = os.environ.get("MEMBENCH_DEVICE", "cuda")
if os.environ.get("MEMBENCH_TINY") == "1":
    MODEL.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4)

# The GPU this run uses, by Valve's index (`valvectl gpus`), and the label its offline processes
# carry. hwtests/lanes.sh runs one benchmark per GPU at once and sets both; alone they are 0, batch.
GPU = int(os.environ.get("VALVE_GPU", "0"))
OFFLINE_LABEL = os.environ.get("VALVE_BENCH_LABEL", "batch")

DAEMON_SOCKET = "/run/valve/valve.sock"
POOL_SOCKET = "/run/valve/pool.sock"
WORDS = 8000  # tokenizer vocabulary besides the special tokens


def now() -> float:
    """CLOCK_MONOTONIC seconds: the same clock in every process here, and the one transformers'
    request timestamps use (`time.perf_counter` is CLOCK_MONOTONIC on Linux)."""
    return time.perf_counter()


def build_model(directory: str, seed: int = 0) -> None:
    """Saves the random-weight model (bf16) and a word-level tokenizer to `directory`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(directory, "config.json")):
        return
    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    with torch.device(DEVICE if torch.cuda.is_available() or DEVICE == "cpu" else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)


def load_model(directory: str, attention: str = "sdpa"):
    """The saved model on the GPU in bf16, and its tokenizer. Attention `sdpa`: continuous batching
    switches it to `paged|sdpa` (flash-attn is not installed on the hosts), whose cost grows with the
    square of the batch; `varlen`: PyTorch's own varlen flash kernel (varlen_attention.py), linear in
    it, which needs `cb_extra(attention)` in the continuous-batching config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="sdpa")
    if attention == "varlen":
        import varlen_attention

        model.set_attn_implementation(varlen_attention.install())
    return model.to(DEVICE).eval(), AutoTokenizer.from_pretrained(directory)


def cb_extra(attention: str) -> dict:
    """Continuous-batching settings an attention needs: varlen reads every key through the cache's
    read index, so no decode fast path (that one is flash-attn's block-table kernel)."""
    return dict(max_blocks_per_request=0) if attention == "varlen" else {}


def lane() -> dict:
    """Which GPU this run used and how many benchmarks ran at once on the host (hwtests/lanes.sh
    sets LANES and LANE_CPUS; a plain run is alone): a report says when others ran beside it, and
    on which CPUs it ran."""
    return dict(gpu=GPU, lanes=int(os.environ.get("LANES", "1")), cpus=os.environ.get("LANE_CPUS", "all"))


def lane_note() -> str:
    """The report line for lane(), empty for a run alone on its host."""
    x = lane()
    if x["lanes"] <= 1:
        return ""
    cpus = "sharing the host's CPUs" if x["cpus"] in ("all", "shared") else f"pinned to CPUs {x['cpus']}"
    return f"GPU {x['gpu']}, one of {x['lanes']} benchmarks run at once on this host's GPUs, {cpus}."


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (MEMBENCH_DEVICE)"


def text(rng: random.Random, words: int) -> str:
    """A made-up prompt of `words` tokens (one token per word with the word-level tokenizer)."""
    return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(words))


@dataclass
class OnlineRequest:
    """One request of the online trace: arrives at `at` seconds, prompt of `prompt` tokens."""

    at: float
    prompt: int
    new_tokens: int
    burst: bool


def online_trace(seconds: float, seed: int, base_rate: float, burst_every: float, burst_size: int,
                 burst_prompt: tuple[int, int], base_prompt: tuple[int, int] = (128, 512),
                 base_new: int = 48, burst_new: int = 16) -> list[OnlineRequest]:
    """A bursty KV demand: Poisson arrivals of short requests, plus bursts of long prompts that
    arrive together (a Poisson process of bursts; the first one within the first quarter)."""
    rng = random.Random(seed)
    out: list[OnlineRequest] = []
    t = rng.expovariate(base_rate)
    while t < seconds:
        out.append(OnlineRequest(t, rng.randint(*base_prompt), base_new, False))
        t += rng.expovariate(base_rate)
    t = rng.uniform(0.1, 0.25) * seconds
    while t < seconds - 10:
        for i in range(burst_size):
            out.append(OnlineRequest(t + 0.01 * i, rng.randint(*burst_prompt), burst_new, True))
        t += max(burst_every * 0.5, rng.expovariate(1 / burst_every))
    return sorted(out, key=lambda r: r.at)


def offline_prompt_len(index: int, prompt: tuple[int, int]) -> int:
    """Prompt length of the offline backlog's request `index` (the same in every run)."""
    return random.Random(1_000_003 * index + 5).randint(*prompt)


def daemon_request(op: dict, sock: str = DAEMON_SOCKET, timeout: float = 5.0) -> dict:
    """One JSON line to the Valve daemon's control socket and its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock)
        s.sendall((json.dumps(op) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf or b"{}")


def gpu_used_mib() -> int | None:
    """Device memory in use on this run's GPU, as NVML (nvidia-smi) reports it; None without a GPU."""
    if DEVICE != "cuda":
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(GPU)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[0])


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank); None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    os.replace(tmp, path)
