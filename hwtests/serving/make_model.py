"""Builds the benchmark's model locally (no hub access): a byte-level BPE tokenizer trained on
generated text, and a Llama with random weights; both saved with save_pretrained.

    python3 make_model.py DIR --size tiny|small|3b [--seed 0] [--device cuda]
"""

import argparse
import json
import random
import sys

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "tiny": (64, 2, 4, 2, 128),
    "small": (512, 4, 8, 4, 1408),
    # About 3.2B parameters with the 32k vocabulary (the decode server's size).
    "3b": (3072, 28, 24, 8, 8192),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")


def corpus(seed, lines=20000):
    """Pseudo-words of random syllables: enough distinct strings for a full-size vocabulary."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    for _ in range(lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))


def build_tokenizer(out, vocab_size, seed):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin|>", "<|end|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build(out, size, seed, vocab_size=32000, device="cpu"):
    """Saves the tokenizer and the model to `out`; the weights are made on `device` (fast on a
    GPU) in bfloat16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = build_tokenizer(out, vocab_size, seed)
    hidden, layers, heads, kv, inter = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    # No EOS is ever wanted: requests ask for a fixed number of tokens.
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    info = {"size": size, "params": params, "vocab": len(fast), "layers": layers, "hidden": hidden}
    with open(f"{out}/valve-model.json", "w") as f:
        json.dump(info, f)
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    info = build(a.out, a.size, a.seed, a.vocab, a.device)
    print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
