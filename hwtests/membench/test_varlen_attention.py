"""The varlen attention's plumbing on CPU: continuous batching with it gives the same greedy tokens as
transformers' own `paged|sdpa`, with PyTorch's flash kernel (CUDA only) replaced by a per-request
reference. Skips where torch or transformers >= 5 do not import (CI); run it in a venv that has them:

    python -m pytest -q hwtests/membench/test_varlen_attention.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # pragma: no cover - CI has no torch
    torch = None

import varlen_attention  # noqa: E402


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1)):
    """What the flash kernel computes: each request's queries attend to its own keys, causally, with its
    queries aligned to its last keys."""
    assert window_size == (-1, 0), "causal"
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]]
        vs = v[cu_k[i]:cu_k[i + 1]]
        nq, nk = len(qs), len(ks)
        rep = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=allowed, scale=scale)
        out[cu_q[i]:cu_q[i + 1]] = o.transpose(0, 1)
    return out


@unittest.skipIf(torch is None, "torch and transformers >= 5 are not installed here")
class VarlenAttention(unittest.TestCase):
    PROMPTS = [[5, 9, 17, 33, 2, 8, 11], [7, 7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [3]]

    def generate(self, attn: str, max_batch_tokens: int) -> dict:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = LlamaForCausalLM(cfg).eval()
        model.set_attn_implementation(attn)
        cb = ContinuousBatchingConfig(block_size=4, num_blocks=64, max_batch_tokens=max_batch_tokens,
                                      scheduler_type="fifo", use_cuda_graph=False, use_async_batching=False,
                                      max_blocks_per_request=0)
        gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
        out = model.generate_batch(self.PROMPTS, generation_config=gen, continuous_batching_config=cb, warmup=False)
        for r in out.values():
            self.assertIsNone(r.error)
        return {rid: list(r.generated_tokens) for rid, r in out.items()}

    def test_same_tokens_as_paged_sdpa_with_chunked_prefill_and_mixed_batches(self):
        original = varlen_attention._kernel
        varlen_attention._kernel = lambda: reference_varlen
        try:
            name = varlen_attention.install()
            for mbt in (5, 64):  # chunked prefills next to decodes; everything in one step
                with self.subTest(max_batch_tokens=mbt):
                    self.assertEqual(self.generate(name, mbt), self.generate("sdpa", mbt))
        finally:
            varlen_attention._kernel = original

    def test_a_plain_forward_is_refused(self):
        with self.assertRaisesRegex(ValueError, "paged cache"):
            varlen_attention.forward(None, None, None, None, None)


if __name__ == "__main__":
    unittest.main()
