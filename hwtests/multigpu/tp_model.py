"""The tensor-parallel decoder of tp_server.py (torch): one rank's shard of a random-weight
Llama-shaped model. Per layer: QKV column-parallel (heads / world and kv heads / world per rank), O
row-parallel + all-reduce, gate/up column-parallel, down row-parallel + all-reduce. The embedding is
replicated; the LM head is split over the vocabulary and the next token is the argmax over all
ranks' (max, index) pairs, all-reduced (the same on every rank, so no token is sent between them).
Static KV cache; prefill of a fixed length and one decode step, both CUDA graphs on CUDA (the
all-reduces captured inside), eager on CPU (gloo). Mirrors hwtests/serving/decoder.py.
"""

import datetime
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_server import SIZES


def init_distributed(device, rank, world, index, threads):
    """The process group (NCCL on CUDA, gloo on CPU) and this rank's torch device."""
    if device == "cuda":
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        torch.set_num_threads(threads)
        dev = torch.device("cpu")
    if world > 1:
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    return dev


class TPDecoder:
    def __init__(self, size, device, max_len, prompt_len, rank, world, graphs=True, seed=0):
        vocab, hidden, layers, heads, kv, inter = SIZES[size]
        self.rank, self.world, self.layers, self.device = rank, world, layers, device
        self.hd = hidden // heads
        self.h, self.kv, self.vl = heads // world, kv // world, vocab // world
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.max_len, self.plen = max_len, prompt_len
        # Every rank draws the whole model from one seed, tensor by tensor, and keeps its shard: the
        # ranks together hold exactly the one-GPU model (test_tp_torch.py checks the tokens agree).
        g = torch.Generator(device=device).manual_seed(seed)
        hq, hk = heads * self.hd, kv * self.hd
        self.embed = self._w(g, vocab, hidden)
        self.wqkv, self.wo, self.w13, self.w2 = [], [], [], []
        for _ in range(layers):
            self.wqkv.append(self._shard(self._w(g, hq + 2 * hk, hidden), [hq, hk, hk], 0))
            self.wo.append(self._shard(self._w(g, hidden, hq), [hq], 1))
            self.w13.append(self._shard(self._w(g, 2 * inter, hidden), [inter, inter], 0))
            self.w2.append(self._shard(self._w(g, hidden, inter), [inter], 1))
        self.lm_head = self._shard(self._w(g, vocab, hidden), [vocab], 0)
        shape = (layers, 1, self.kv, max_len, self.hd)
        self.k_cache = torch.zeros(shape, device=device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=self.dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos().to(device, self.dtype), ang.sin().to(device, self.dtype)
        self.pick = torch.zeros(2 * world, device=device, dtype=torch.float32)
        self._static_buffers()
        self.graph = self.p_graph = None
        if graphs and device.type == "cuda":
            self.p_graph = self._captured(self._prefill_step)
            self.graph = self._captured(self._step)

    def _w(self, g, *shape):
        t = torch.randn(*shape, generator=g, device=self.device, dtype=self.dtype)
        return t.mul_(1.0 / math.sqrt(shape[-1]))

    def _shard(self, full, blocks, dim):
        """This rank's part of `full`: of each block along `dim` (e.g. Q, K, V rows), its 1/world
        slice, concatenated; the full tensor is freed."""
        parts, start = [], 0
        for b in blocks:
            step = b // self.world
            parts.append(full.narrow(dim, start + self.rank * step, step))
            start += b
        return torch.cat(parts, dim).contiguous()

    def _static_buffers(self):
        d = self.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=d)
        self.pos = torch.zeros(1, dtype=torch.long, device=d)
        self.out = torch.zeros(1, dtype=torch.long, device=d)
        self.p_ids = torch.zeros(1, self.plen, dtype=torch.int32, device=d)
        self.p_pos = torch.arange(self.plen, device=d)
        self.host_ids = torch.zeros(self.plen, dtype=torch.int32, pin_memory=d.type == "cuda")

    def params(self):
        per = sum(t.numel() for t in (self.wqkv[0], self.wo[0], self.w13[0], self.w2[0]))
        return per * self.layers + self.embed.numel() + self.lm_head.numel()

    def _reduce(self, x):
        if self.world > 1:
            dist.all_reduce(x)
        return x

    @staticmethod
    def _norm(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def _rope(self, x, pos):
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _attend(self, i, h, pos, length):
        t = h.shape[1]
        qkv = F.linear(h, self.wqkv[i]).view(1, t, self.h + 2 * self.kv, self.hd)
        q, k, v = qkv.split([self.h, self.kv, self.kv], dim=2)
        q, k = self._rope(q.transpose(1, 2), pos), self._rope(k.transpose(1, 2), pos)
        self.k_cache[i].index_copy_(2, pos, k)
        self.v_cache[i].index_copy_(2, pos, v.transpose(1, 2))
        rep = self.h // self.kv
        kk = self.k_cache[i][:, :, :length].repeat_interleave(rep, dim=1)
        vv = self.v_cache[i][:, :, :length].repeat_interleave(rep, dim=1)
        if t > 1:
            a = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        else:
            mask = torch.arange(length, device=self.device)[None, None, None] <= pos[-1]
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        return self._reduce(F.linear(a.transpose(1, 2).reshape(1, t, -1), self.wo[i]))

    def _forward(self, tokens, pos, length):
        """The next token (argmax over every rank's vocabulary shard) after tokens [1, T] at pos."""
        x = self.embed[tokens]
        for i in range(self.layers):
            x = x + self._attend(i, self._norm(x), pos, length)
            g, u = F.linear(self._norm(x), self.w13[i]).chunk(2, dim=-1)
            x = x + self._reduce(F.linear(F.silu(g) * u, self.w2[i]))
        logits = F.linear(self._norm(x[:, -1]), self.lm_head).float()
        val, idx = logits.max(-1)
        self.pick.zero_()
        self.pick[2 * self.rank] = val[0]
        self.pick[2 * self.rank + 1] = idx[0].float() + self.rank * self.vl
        self._reduce(self.pick)
        pairs = self.pick.view(self.world, 2)  # a gather, not an index by a tensor: no host sync in a graph
        return pairs[:, 1].gather(0, pairs[:, 0].argmax().view(1)).long()

    def _step(self):
        self.out.copy_(self._forward(self.tok, self.pos, self.max_len))

    def _prefill_step(self):
        ids = self.p_ids.long().remainder_(self.embed.shape[0])
        self.out.copy_(self._forward(ids, self.p_pos, self.plen))

    @staticmethod
    def _captured(step):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            step()
        torch.cuda.synchronize()
        return graph

    @torch.no_grad()
    def generate(self, ids_bytes, n):
        """n tokens after the prompt (prompt_len int32 ids, as bytes): prefill, then n - 1 decode
        steps, one host sync per token."""
        self.host_ids.copy_(torch.frombuffer(bytearray(ids_bytes), dtype=torch.int32))
        self.p_ids.view(-1).copy_(self.host_ids, non_blocking=True)
        self._run(self.p_graph, self._prefill_step)
        tok = int(self.out.item())
        yield tok
        for i in range(1, n):
            self.tok.fill_(tok)
            self.pos.fill_(self.plen + i - 1)
            self._run(self.graph, self._step)
            tok = int(self.out.item())
            yield tok

    @staticmethod
    def _run(graph, step):
        if graph is not None:
            graph.replay()
        else:
            step()
