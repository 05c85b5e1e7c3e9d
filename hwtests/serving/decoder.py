"""A GPU-bound decode loop: a Llama-shaped decoder with random weights and a
static KV cache; prefill in one eager pass, then one CUDA-graph replay per token with a host sync
per token (`.item()`). On CPU the same code runs eagerly (no graph), for the pipeline's tests.

    d = GraphDecoder(size="3b", device="cuda", max_len=1024)
    for tok in d.generate(prompt_ids, 64): ...

rawserver.py uses a prefill of fixed length instead, captured as a graph too (`capture_prefill`,
`prefill_static`), then the same decode loop (`decode`).
"""

import math

import torch
import torch.nn.functional as F

SIZES = {
    # name: (vocab, hidden, layers, heads, kv_heads, intermediate)
    "tiny": (1024, 64, 2, 4, 2, 128),
    # About 3.2B parameters, bf16.
    "3b": (32000, 3072, 28, 24, 8, 8192),
}


class GraphDecoder:
    def __init__(self, size="tiny", device="cpu", max_len=1024, seed=0, dtype=None):
        vocab, hidden, layers, heads, kv, inter = SIZES[size]
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.heads, self.kv, self.hd = heads, kv, hidden // heads
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_len = max_len
        g = torch.Generator(device=self.device).manual_seed(seed)

        def w(*shape):
            t = torch.randn(*shape, generator=g, device=self.device, dtype=self.dtype)
            return t.mul_(1.0 / math.sqrt(shape[-1]))

        self.embed = w(vocab, hidden)
        self.lm_head = w(vocab, hidden)
        self.wqkv = [w((heads + 2 * kv) * self.hd, hidden) for _ in range(layers)]
        self.wo = [w(hidden, hidden) for _ in range(layers)]
        self.w13 = [w(2 * inter, hidden) for _ in range(layers)]
        self.w2 = [w(hidden, inter) for _ in range(layers)]
        shape = (layers, 1, kv, max_len, self.hd)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        self.cos = ang.cos().to(self.device, self.dtype)
        self.sin = ang.sin().to(self.device, self.dtype)
        # Static decode-step buffers (graph inputs/outputs).
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.out = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph = None
        self.p_len, self.p_graph = None, None

    def params(self):
        per = sum(t.numel() for t in (self.wqkv[0], self.wo[0], self.w13[0], self.w2[0]))
        return per * self.layers + self.embed.numel() + self.lm_head.numel()

    @staticmethod
    def _norm(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def _rope(self, x, pos):
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _forward(self, tokens, pos, length):
        """tokens [1, T] at positions pos [T]; attends to cache[:length]. Returns last logits."""
        x = self.embed[tokens]
        t = tokens.shape[1]
        for i in range(self.layers):
            h = self._norm(x)
            qkv = F.linear(h, self.wqkv[i]).view(1, t, self.heads + 2 * self.kv, self.hd)
            q, k, v = qkv.split([self.heads, self.kv, self.kv], dim=2)
            q, k = self._rope(q.transpose(1, 2), pos), self._rope(k.transpose(1, 2), pos)
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v.transpose(1, 2))
            kk = self.k_cache[i][:, :, :length].repeat_interleave(self.heads // self.kv, dim=1)
            vv = self.v_cache[i][:, :, :length].repeat_interleave(self.heads // self.kv, dim=1)
            if t > 1:
                a = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            else:
                mask = torch.arange(length, device=self.device)[None, None, None] <= pos[-1]
                a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + F.linear(a.transpose(1, 2).reshape(1, t, -1), self.wo[i])
            g, u = F.linear(self._norm(x), self.w13[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, self.w2[i])
        return F.linear(self._norm(x[:, -1]), self.lm_head)

    def _step(self):
        logits = self._forward(self.tok, self.pos, self.max_len)
        self.out.copy_(logits.argmax(-1))

    def capture(self):
        """Captures one decode step as a CUDA graph (no-op on CPU)."""
        if self.device.type == "cuda":
            self.graph = self._captured(self._step)

    @staticmethod
    def _captured(step):
        """`step` warmed up on a side stream, then captured as a CUDA graph."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        return graph

    def _prefill_step(self):
        # Any int32 id is safe: the remainder is part of the graph, not host work per request.
        ids = self.p_ids.long().remainder_(self.vocab)
        self.p_out.copy_(self._forward(ids, self.p_pos, self.p_len).argmax(-1))

    @torch.no_grad()
    def capture_prefill(self, length):
        """Static buffers for a prefill of exactly `length` ids (`p_ids`, int32 [1, length], in; the
        first token `p_out`, out) and, on CUDA, the prefill captured as a graph."""
        if not 0 < length < self.max_len:
            raise ValueError(f"prefill length {length}: must be 1 .. max_len - 1 ({self.max_len - 1})")
        self.p_len = length
        self.p_ids = torch.zeros(1, length, dtype=torch.int32, device=self.device)
        self.p_pos = torch.arange(length, device=self.device)
        self.p_out = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            self.p_graph = self._captured(self._prefill_step)

    def prefill_static(self):
        """Enqueues the prefill of whatever `p_ids` holds (graph replay on CUDA, eager on CPU); the
        first token is left in `p_out`, on the device."""
        if self.p_graph is not None:
            self.p_graph.replay()
        else:
            with torch.no_grad():
                self._prefill_step()

    @torch.no_grad()
    def decode(self, tok, length, n):
        """Yields tok (the prefill's token, the prompt `length` long), then n - 1 more: one graph
        replay and one host sync each."""
        yield tok
        for i in range(1, n):
            self.tok.fill_(tok)
            self.pos.fill_(length + i - 1)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            tok = int(self.out.item())
            yield tok

    @torch.no_grad()
    def generate(self, prompt, n, before_first_kernel=None):
        """Yields n token ids: prefill (eager), then one graph replay + host sync per token.
        before_first_kernel(), if given, is called after the prompt's copy to the device and just
        before the request's first kernel is launched (server.py's first-kernel stamp)."""
        prompt = prompt[: self.max_len - n]
        ids = torch.tensor([prompt], device=self.device)
        if before_first_kernel is not None:
            before_first_kernel()
        pos = torch.arange(len(prompt), device=self.device)
        logits = self._forward(ids, pos, len(prompt))
        yield from self.decode(int(logits.argmax(-1).item()), len(prompt), n)
