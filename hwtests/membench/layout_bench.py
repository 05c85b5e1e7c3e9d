"""What the pool's KV layout and memory cost a decode step: gathering every request's keys from a layer's
cache tensor when the tensor is contiguous (transformers' own cache) or a strided view of one token-major
region (the Valve shim: row t holds token t's K and V of every layer, docs/memory.md "Layout"), with the
region in `cudaMalloc` memory (PyTorch's allocator) or in CUDA VMM memory mapped handle by handle as the
pool maps it (`cuMemCreate` of `--handle-mib`, `cuMemMap` and `cuMemSetAccess` per handle).

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


class VmmRegion:
    """`size` bytes of device memory in handles of `handle` bytes, each created, mapped and given access
    on its own (as the pool's clients map them) into one reserved VA range; `__cuda_array_interface__`
    makes it a uint8 tensor. Freed by `close` (unmap, release, free the range)."""

    def __init__(self, size: int, handle: int, device: int = 0) -> None:
        import ctypes as c

        self.c, self.cu = c, c.CDLL("libcuda.so.1")
        self.size, self.handle, self.handles, self.ptr = size, handle, [], c.c_uint64(0)

        class Location(c.Structure):
            _fields_ = [("type", c.c_int), ("id", c.c_int)]

        class Prop(c.Structure):  # CUmemAllocationProp: pinned device memory, no exportable handle
            _fields_ = [("type", c.c_int), ("handle_types", c.c_int), ("location", Location),
                        ("win32", c.c_void_p), ("compression", c.c_ubyte), ("rdma", c.c_ubyte),
                        ("usage", c.c_ushort), ("reserved", c.c_ubyte * 4)]

        class Access(c.Structure):  # CUmemAccessDesc: read-write from this device
            _fields_ = [("location", Location), ("flags", c.c_int)]

        prop, access = Prop(type=1, location=Location(1, device)), Access(Location(1, device), 3)
        self.check("cuMemAddressReserve", c.byref(self.ptr), c.c_size_t(size), c.c_size_t(handle), c.c_uint64(0),
                   c.c_uint64(0))
        try:
            for off in range(0, size, handle):
                h = c.c_uint64(0)
                self.check("cuMemCreate", c.byref(h), c.c_size_t(handle), c.byref(prop), c.c_uint64(0))
                self.handles.append(h)
                va = c.c_uint64(self.ptr.value + off)
                self.check("cuMemMap", va, c.c_size_t(handle), c.c_size_t(0), h, c.c_uint64(0))
                self.check("cuMemSetAccess", va, c.c_size_t(handle), c.byref(access), c.c_size_t(1))
        except BaseException:
            self.close()
            raise
        self.__cuda_array_interface__ = dict(shape=(size,), typestr="|u1", data=(self.ptr.value, False),
                                             version=3, strides=None)

    def check(self, name: str, *args) -> None:
        rc = getattr(self.cu, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def close(self) -> None:
        c = self.c
        for i, h in enumerate(self.handles):  # the last one may not be mapped: its unmap fails, harmlessly
            self.cu.cuMemUnmap(c.c_uint64(self.ptr.value + i * self.handle), c.c_size_t(self.handle))
            self.cu.cuMemRelease(h)
        self.handles = []
        if self.ptr.value:
            self.cu.cuMemAddressFree(self.ptr, c.c_size_t(self.size))
            self.ptr = c.c_uint64(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=384, help="KV blocks in the cache (384: the 12 GiB pool)")
    ap.add_argument("--keys", type=int, default=80_000, help="tokens a step reads (8 requests of 10k)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--handle-mib", type=int, default=64, help="VMM handle size (the pool's default)")
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
    del views, region
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    handle = a.handle_mib << 20
    size = -(-tokens * tensors * a.heads * a.head_dim * 2 // handle) * handle
    vmm = VmmRegion(size, handle, torch.cuda.current_device())
    try:
        raw = torch.as_tensor(vmm, device="cuda")
        region = raw[: tokens * tensors * a.heads * a.head_dim * 2].view(torch.bfloat16)
        region = region.view(tokens, tensors, a.heads, a.head_dim)
        region.zero_()
        views = [region[:, i] for i in range(tensors)]
        result["vmm_strided_view_ms"] = gather_ms(torch, views, index, a.repeats)
        result["vmm_whole_rows_ms"] = gather_ms(torch, [region], index, a.repeats)
        del views, region, raw
        torch.cuda.synchronize()
    finally:
        vmm.close()
    result["vmm_over_cudamalloc"] = result["vmm_strided_view_ms"] / result["strided_view_ms"]
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
