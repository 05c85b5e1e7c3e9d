"""A stand-in for Valve's daemon and client library, backed by ordinary CPU tensors.

It has the KV-space interface the shim uses (DESIGN.md, "What the shim needs from the Valve
client"), so the shim's logic runs without a GPU, and it plays the daemon's part too:

- `FakePool(handles, handle_bytes)`: one GPU's pool; handle ids 0..handles-1, each free or lent.
- `pool.kv_space_factory(role)`: what `valve_transformers.install(role, kv_space=...)` takes.
- A space's regions are uint8 CPU tensors (`region(i)`, DLPack-capable like the real ones). Memory
  a process does not hold, a fresh grant, and a reclaimed slot are filled with finite garbage, so a
  block that is read before it was written, or after it was reclaimed, changes the output.
- `space.reclaim(count, policy)` is the daemon's reclaim callback on an offline space: it picks
  slots (Algorithm 1 over the reported owners, FIFO, or the slots holding most tokens), "maps the
  quarantine" (garbage), records the invalidated blocks and returns the handles to the pool.
- An online space is premapped: slot = pool handle id. Its `grow` takes free handles first, then
  reclaims from offline spaces, as the daemon does.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

MIB = 1 << 20


class PoolExhausted(MemoryError):
    """The pool cannot lend what was asked (the daemon's codes 11 and 12)."""


class FakePool:
    def __init__(self, handles: int, handle_bytes: int, granularity: int = 2 * MIB, seed: int = 0,
                 garbage_dtype: torch.dtype = torch.float32) -> None:
        self.handles = handles
        self.handle_bytes = handle_bytes
        self.granularity = granularity
        self.lender: list[FakeKvSpace | None] = [None] * handles
        self.spaces: list[FakeKvSpace] = []
        self.lock = threading.RLock()
        self.gen = torch.Generator().manual_seed(seed)
        self.garbage_dtype = garbage_dtype

    def free_handles(self) -> list[int]:
        with self.lock:
            return [h for h, s in enumerate(self.lender) if s is None]

    def kv_space_factory(self, role: str, **space_kwargs) -> Callable[..., "FakeKvSpace"]:
        def factory(*, regions, capacity_bytes_per_region, block_bytes, tail_bytes, device):
            if torch.device(device).type != "cpu":
                raise RuntimeError("the fake Valve backs CPU tensors only")
            return FakeKvSpace(self, role, regions, capacity_bytes_per_region, block_bytes, tail_bytes, **space_kwargs)

        return factory

    def take_from_offline(self, count: int, policy: str = "greedy") -> list[int]:
        """The daemon's reclaim: takes `count` handles back from offline spaces (first space first)."""
        taken: list[int] = []
        with self.lock:
            for s in self.spaces:
                if s.role == "offline" and len(taken) < count:
                    taken += s.reclaim(count - len(taken), policy)
        return taken

    def garbage(self, t: torch.Tensor) -> None:
        t.view(self.garbage_dtype).normal_(0.0, 3.0, generator=self.gen)


class FakeKvSpace:
    """A KV space: `regions` ranges, slot s = bytes [s*piece, (s+1)*piece) of every region, plus a tail
    that is always mapped (transformers' trash blocks). One pool handle backs one slot."""

    def __init__(self, pool: FakePool, role: str, regions: int, capacity_bytes_per_region: int, block_bytes: int,
                 tail_bytes: int, usage_target: Callable[[int, int], int] | None = None) -> None:
        piece = pool.handle_bytes // regions
        if pool.handle_bytes % regions or piece % pool.granularity or piece == 0:
            raise ValueError(f"a {pool.handle_bytes}-byte handle split into {regions} regions does not give pieces of "
                             f"whole {pool.granularity}-byte pages")
        if piece % block_bytes:
            raise ValueError(f"{block_bytes}-byte blocks do not tile a {piece}-byte piece")
        self.pool = pool
        self.role = role
        self.regions = regions
        self.piece_bytes = piece
        self.block_bytes = block_bytes
        self.blocks_per_slot = piece // block_bytes
        self.handle_bytes = pool.handle_bytes
        if role == "online" or capacity_bytes_per_region == 0:
            self.slots = pool.handles
        else:
            self.slots = capacity_bytes_per_region // piece
        self.tail_bytes = math.ceil(tail_bytes / pool.granularity) * pool.granularity
        self.region_bytes = self.slots * piece + self.tail_bytes
        self._regions = [torch.zeros(self.region_bytes, dtype=torch.uint8) for _ in range(regions)]
        for s in range(self.slots):
            self._scribble(s)
        # Per slot: ("free",) | ("pool", handle, seq) | ("quarantine", pending)
        self._slot: list[tuple] = [("free",)] * self.slots
        self._seq = 0
        self._owner: dict[int, int] = {}  # block -> request
        self._tokens: dict[int, int] = {}  # request -> tokens to recompute
        self._invalidated: list[int] = []
        self.usage_target = usage_target
        self.usage_reports: list[int] = []
        self.pressure_reports = 0  # usage reports at or above 90% of what is held: MIAD's pressure events
        self.reclaims = 0  # online grows that took handles back from offline
        self.reclaimed_handles = 0
        pool.spaces.append(self)

    # -- what the shim calls ------------------------------------------------------

    def region(self, i: int) -> torch.Tensor:
        return self._regions[i]

    def held_slots(self) -> list[int]:
        with self.pool.lock:
            return [s for s, st in enumerate(self._slot) if st[0] == "pool"]

    def grow(self, count: int) -> list[int]:
        with self.pool.lock:
            if self.role == "online":
                return self._grow_online(count)
            free = self.pool.free_handles()
            empty = [s for s, st in enumerate(self._slot) if st == ("quarantine", False)]
            empty += [s for s, st in enumerate(self._slot) if st == ("free",)]
            if len(free) < count:
                raise PoolExhausted(f"the pool has {len(free)} free handle(s), {count} asked")
            if len(empty) < count:
                raise PoolExhausted(f"the KV space has {len(empty)} empty slot(s), {count} asked")
            slots = empty[:count]
            for s, h in zip(slots, free):
                self._place(s, h)
            return slots

    def _grow_online(self, count: int) -> list[int]:
        mine = [s for s, st in enumerate(self._slot) if st[0] == "pool"]
        if count > self.slots - len(mine):
            raise PoolExhausted(f"online holds {len(mine)} of {self.slots} handles; {count} more asked")
        free = self.pool.free_handles()
        if len(free) < count:
            self.reclaims += 1
            self.pool.take_from_offline(count - len(free))
            free = self.pool.free_handles()
        if len(free) < count:
            raise PoolExhausted("offline could not give back enough handles")
        for h in free[:count]:
            self._place(h, h)  # premapped: slot = handle id; content is whatever the last user left
        return free[:count]

    def _place(self, slot: int, handle: int) -> None:
        self._seq += 1
        self.pool.lender[handle] = self
        self._slot[slot] = ("pool", handle, self._seq)
        self._scribble(slot)

    def shrink(self, slots: list[int]) -> None:
        with self.pool.lock:
            for s in slots:
                st = self._slot[s]
                if st[0] != "pool":
                    raise ValueError(f"slot {s} holds no memory lent to this client")
            for s in slots:
                self.pool.lender[self._slot[s][1]] = None
                self._slot[s] = ("free",)
                self._scribble(s)

    def set_owners(self, blocks: list[int], request: int, tokens: int) -> None:
        with self.pool.lock:
            for b in blocks:
                self._owner[b] = request
            self._tokens[request] = tokens

    def clear_owners(self, blocks: list[int]) -> None:
        with self.pool.lock:
            for b in blocks:
                self._owner.pop(b, None)

    def take_invalidated(self) -> list[int]:
        with self.pool.lock:
            out, self._invalidated = self._invalidated, []
            return out

    def release_quarantined(self) -> None:
        with self.pool.lock:
            self._slot = [("quarantine", False) if st == ("quarantine", True) else st for st in self._slot]

    def usage(self, used_bytes: int) -> int | None:
        self.usage_reports.append(used_bytes)
        if used_bytes >= 0.9 * len(self.held_slots()) * self.handle_bytes:
            self.pressure_reports += 1
        if self.usage_target is None:
            return None
        return self.usage_target(used_bytes, self.handle_bytes)

    # -- the daemon's side ------------------------------------------------------------

    def reclaim(self, count: int, policy: str = "greedy", slots: list[int] | None = None) -> list[int]:
        """Offline: gives back `count` held handles as a reclaim does (quarantine, invalidated blocks);
        `slots` names them instead of a policy."""
        with self.pool.lock:
            held = [(st[2], s) for s, st in enumerate(self._slot) if st[0] == "pool"]
            if slots is not None:
                chosen = [s for s in slots if self._slot[s][0] == "pool"]
            else:
                chosen = self._choose([s for _, s in sorted(held)], count, policy)
            handles = []
            for s in chosen:
                handles.append(self._slot[s][1])
                self.pool.lender[self._slot[s][1]] = None
                self._slot[s] = ("quarantine", True)
                self._scribble(s)
                blocks = range(s * self.blocks_per_slot, (s + 1) * self.blocks_per_slot)
                self._invalidated.extend(blocks)
                for b in blocks:
                    self._owner.pop(b, None)
            self.reclaimed_handles += len(handles)
            return handles

    def owned_blocks(self) -> dict[int, int]:
        """Block -> request, as the shim reported them."""
        with self.pool.lock:
            return dict(self._owner)

    def _choose(self, held: list[int], count: int, policy: str) -> list[int]:
        if policy == "fifo":
            return held[:count]
        owners = {s: {self._owner[b] for b in range(s * self.blocks_per_slot, (s + 1) * self.blocks_per_slot)
                      if b in self._owner} for s in held}
        if policy == "most":  # the slots whose requests cost most: makes a test's reclaim hurt
            return sorted(held, key=lambda s: -sum(self._tokens.get(r, 0) for r in owners[s]))[:count]
        chosen: list[int] = []
        affected: set[int] = set()
        for _ in range(min(count, len(held))):  # Algorithm 1: lowest marginal token cost first
            best = min((s for s in held if s not in chosen),
                       key=lambda s: sum(self._tokens.get(r, 0) for r in owners[s] - affected))
            chosen.append(best)
            affected |= owners[best]
        return chosen

    def _scribble(self, slot: int) -> None:
        lo, hi = slot * self.piece_bytes, (slot + 1) * self.piece_bytes
        for r in self._regions:
            self.pool.garbage(r[lo:hi])
