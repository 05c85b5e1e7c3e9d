"""The KV-space surface the shim uses (DESIGN.md §8; `_fake_valve.FakeKvSpace` has the same), over
Valve's real client: the `valve` Python package (`ctl/client-py`, `scripts/build-python-wheel.sh`).

`kv_space_factory(role)` is what `install(role)` uses when no `kv_space=` is passed. Differences
from the fake, and what the client does not do yet:

- **The tail.** transformers' two trash blocks after the real blocks are backed by the client's
  `tail_bytes` (`kv_space(..., tail_bytes=)`): one private zeroed block of the process mapped after
  every region's slots, never lent or reclaimed.
- **Quarantine release is explicit** (`valve.Client(explicit_release=True)`): a reclaimed slot is
  refilled only after `release_quarantined()`, which the shim calls once no batch of its own can
  still touch the slot (at once in sync batching, one update later in async batching).
- `grow` raises `valve.PoolExhausted` (a `MemoryError`) for the daemon's codes 11 and 12, and also
  for the client's "no empty slot" (code 106), as the shim expects.
- The daemon numbers GPUs by index (`register`'s `gpu`): the CUDA device index is used unless
  `VALVE_GPU` says otherwise (set it when CUDA_VISIBLE_DEVICES renumbers the GPUs). `VALVE_SOCKET`
  overrides the pool socket.
"""

from __future__ import annotations

import os
from typing import Any, Callable

CODE_NO_SPACE = 106  # valve-client's `code::NO_SPACE`


class RealKvSpace:
    """One Valve KV space (one `valve.Client`) with the fake's attributes and methods."""

    def __init__(self, valve: Any, client: Any, info: dict) -> None:
        self._valve = valve
        self.client = client
        self.role = client.role
        self.regions = info["regions"]
        self.slots = info["slots"]
        self.piece_bytes = info["piece_bytes"]
        self.block_bytes = info["block_bytes"]
        self.blocks_per_slot = info["blocks_per_slot"]
        self.handle_bytes = info["handle_bytes"]
        self.tail_bytes = info["tail_bytes"]
        self.region_bytes = info["region_bytes"] + self.tail_bytes

    def region(self, i: int) -> Any:
        """A `valve.RegionView` (`__cuda_array_interface__` v3, 1-D uint8); it keeps the client alive."""
        return self.client.region(i)

    def held_slots(self) -> list[int]:
        return self.client.held_slots()

    def grow(self, count: int) -> list[int]:
        try:
            return self.client.grow(count)
        except self._valve.ValveError as e:
            if e.code == CODE_NO_SPACE and not isinstance(e, MemoryError):
                raise self._valve.PoolExhausted(str(e), e.code) from e
            raise

    def shrink(self, slots: list[int]) -> None:
        self.client.shrink(list(slots))

    def set_owners(self, blocks: list[int], request: int, tokens: int) -> None:
        self.client.set_blocks_owner(list(blocks), request, tokens)

    def clear_owners(self, blocks: list[int]) -> None:
        self.client.clear_blocks(list(blocks))

    def take_invalidated(self) -> list[int]:
        return self.client.take_invalidated()

    def release_quarantined(self) -> None:
        self.client.release_quarantined()

    def usage(self, used_bytes: int) -> int | None:
        if self.role != "online":
            return None
        return self.client.usage(used_bytes)

    def close(self) -> None:
        self.client.close()


def kv_space_factory(role: str, socket: str | None = None, gpu: str | int | None = None,
                     **client_kwargs: Any) -> Callable[..., RealKvSpace]:
    """The factory `install(role, kv_space=...)` takes, over the real client. `client_kwargs` go to
    `valve.Client` (premap, fifo, cuda_ordinal, grant_timeout_s, explicit_release). `valve` is imported when the
    first space is made, so installing the shim does not need it."""

    def factory(*, regions, capacity_bytes_per_region, block_bytes, tail_bytes, device):
        try:
            import valve  # the Valve client's Python package (ctl/client-py)
        except ImportError as e:
            raise ImportError("valve_transformers needs the Valve client's Python package `valve` (build it with "
                              "scripts/build-python-wheel.sh), or pass kv_space=") from e
        sock = socket or os.environ.get("VALVE_SOCKET") or valve.DEFAULT_SOCKET
        kwargs = {"explicit_release": role == "offline", **client_kwargs}
        client = valve.Client(role, gpu=_daemon_gpu(gpu, device), socket=sock, **kwargs)
        try:
            info = client.kv_space(regions, capacity_bytes_per_region, block_bytes, tail_bytes)
        except BaseException:
            client.close()
            raise
        return RealKvSpace(valve, client, info)

    return factory


def _daemon_gpu(gpu: str | int | None, device: Any) -> str:
    if gpu is not None:
        return str(gpu)
    if os.environ.get("VALVE_GPU"):
        return os.environ["VALVE_GPU"]
    import torch

    index = torch.device(device).index
    return str(torch.cuda.current_device() if index is None else index)
