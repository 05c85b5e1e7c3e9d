"""Attention for transformers' continuous batching whose cost grows linearly with the batch: PyTorch's
own variable-length flash kernel over the packed requests, for GPU hosts without the flash-attn package.

transformers' `paged|sdpa` packs every request of a step into one sequence and masks it with a dense
[queries x keys] matrix, so a step's attention costs (tokens in the step) x (keys of every request):
doubling the batch about quadruples it. On the H100 an offline job with 3.5x the batch (the pool's
memory against a static split) made 3.5x the tokens per step in 3.2x the time: memory bought nothing.
This kernel attends each request to its own keys only, as serving engines do.

    import varlen_attention
    model.set_attn_implementation(varlen_attention.install())   # before init_continuous_batching
    ContinuousBatchingConfig(..., max_blocks_per_request=0)     # no decode fast path (flash-attn's)
"""

from __future__ import annotations

NAME = "valve_varlen"


def _kernel():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def forward(module, query, key, value, attention_mask, cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
            max_seqlen_q=0, max_seqlen_k=0, **kwargs):
    """One layer's attention over the packed batch. `query` is [1, heads, tokens, dim]; the cache returns
    every request's keys and values packed as [keys, kv heads, dim], in the order of `cu_seq_lens_k`."""
    import torch

    if cache is None:
        raise ValueError(f"{NAME} needs transformers' paged cache (continuous batching only)")
    if isinstance(cu_seq_lens_k, dict):  # per layer type; this model has only full attention
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k["full_attention"], max_seqlen_k["full_attention"]
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    out = _kernel()(query.transpose(1, 2).squeeze(0).contiguous(), key.contiguous(), value.contiguous(),
                    cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_seqlen_q),
                    int(max_seqlen_k), scale=module.scaling,
                    window_size=(-1, 0))  # causal, aligned at the end: a chunk's queries are its last keys
    return out, None


def install() -> str:
    """Registers the attention (also under its `paged|` name, which continuous batching switches to) and
    returns the name to pass to `set_attn_implementation`."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, forward)
    AttentionInterface.register(f"paged|{NAME}", forward)
    return NAME
