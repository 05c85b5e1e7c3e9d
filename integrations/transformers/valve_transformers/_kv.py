"""One transformers KV cache backed by a Valve KV space: layout, region tensors, grants, reclaims.

`ValveKV` is the Valve side of the integration. It owns the KV space (from the Valve client or
the fake), hands out the per-layer K/V tensors while `PagedAttentionCache.__init__` runs, keeps
transformers' `BlockManager` limited to blocks in slots this process holds, and does the per-step
bookkeeping (block owners for Algorithm 1, MIAD usage for online, growth for offline).

Lines that change what transformers' own data structures hold are marked `# [FW]`; they are the
integration's changed lines of framework logic (DESIGN.md lists them, tests/test_budget.py counts
them). Everything else only reads transformers' state or talks to the Valve client.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from typing import Any

logger = logging.getLogger("valve_transformers")

DEFAULT_MAX_BATCH_TOKENS = 2048
# How an offline reclaim picks handles (policy `selection`), all through the client's Algorithm 1
# (`fifo=False`), by what the shim reports as block owners: `alg1` the real owners and their tokens;
# `fifo` none, so every handle costs 0 and Algorithm 1's tie-break (oldest grant first) is exactly the
# client's FIFO; `random` one made-up request per held handle with a random cost, redrawn when the
# held handles change and every `random_redraw_s`.
# The sweep (hwtests/membench) switches between them in one process.
SELECTIONS = ("alg1", "fifo", "random")
RANDOM_OWNER_BASE = 1 << 40  # request ids of the made-up owners: above any real request's index


class ValveKV:
    """The Valve KV space behind one `PagedAttentionCache`."""

    def __init__(self, space: Any, role: str, *, cache_shape: tuple, block_size: int, dtype: Any,
                 device: Any, max_batch_tokens: int, policy: dict) -> None:
        self.space = space
        self.role = role
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.cache_shape = cache_shape
        self.max_batch_tokens = max_batch_tokens
        self.bps = space.blocks_per_slot
        self.num_blocks = space.slots * space.blocks_per_slot
        self.policy = policy
        self.held: set[int] = set()
        self._next_tensor = 0
        self._rows = None  # the region seen as [tokens, tensors, kv_heads, head_dim]
        self._no_grow_until = 0.0  # after a refusal: no growth, and (online) no growable blocks shown
        self._growth_paused = False  # during warmup
        self._release_at_turn: int | None = None
        self._turn = 0
        self._last_usage = float("-inf")
        self._reported: dict[str, tuple[int, ...]] = {}
        self._rid: dict[str, int] = {}
        self._next_rid = 0
        self._pending_blocks: set[int] = set()
        self._pending_shrink: list[int] = []
        self._async = False  # the cache's batching mode, as last seen at a step boundary
        self._selection = "alg1"  # what the owners reported so far are for
        self._random_blocks: list[int] = []  # blocks holding the random selection's made-up owners
        self._random_held: set[int] = set()  # the held slots at the last draw, and its time
        self._random_at = float("-inf")
        self._seed_used = policy.get("selection_seed", 0)
        self._rng = random.Random(self._seed_used)
        # requeued_tokens: the tokens the requeued requests had in the cache, what recomputing them
        # costs at most (their blocks left in the prefix cache are reused)
        self.stats = {"requeued": 0, "requeued_tokens": 0, "invalidated_blocks": 0, "grown_handles": 0,
                      "shrunk_handles": 0, "refusals": 0, "memory_waits": 0, "turns": 0}

    # ------------------------------------------------------------------ creation

    @classmethod
    def open(cls, kv_space_factory, role: str, cache_mod: Any, config: Any, cb_config: Any, device: Any,
             dtype: Any, tp_size: int, policy: dict) -> "ValveKV":
        """Opens the KV space for the cache transformers is about to build (same arithmetic as
        `PagedAttentionCache.__init__`: one K and one V tensor per layer of a layer group).

        The space has one region in which every token's K and V of every layer lie side by side
        (token-major), and each layer's K or V tensor is a strided view of it. CUDA maps a pool
        handle only whole (cuMemMap's offset must be 0), so a handle cannot be split into one piece
        per tensor; interleaved, one handle holds whole blocks of every layer."""
        if tp_size > 1:
            raise NotImplementedError("valve_transformers backs single-GPU caches only (tensor parallelism is not supported)")
        kv_heads = cache_mod.find_num_kv_heads(config)
        head_dim = cache_mod.find_head_dim(config)
        layer_groups, _ = cache_mod.group_layers_by_attn_type(config)
        tensors = 2 * len(layer_groups[0])
        block_size = cb_config.block_size
        block_bytes = block_size * tensors * kv_heads * head_dim * dtype.itemsize  # one block of every tensor
        tail_bytes = 2 * block_bytes  # transformers' read-trash and write-trash blocks, never reclaimed
        space = kv_space_factory(regions=1, capacity_bytes_per_region=policy.get("capacity_bytes_per_region", 0),
                                 block_bytes=block_bytes, tail_bytes=tail_bytes, device=device)
        if space.regions != 1 or space.block_bytes != block_bytes:
            raise RuntimeError(f"the Valve KV space has {space.regions} regions of {space.block_bytes}-byte blocks; "
                               f"the cache needs 1 region of {block_bytes}-byte blocks")
        if space.piece_bytes % block_bytes or space.tail_bytes < tail_bytes:
            raise RuntimeError("the Valve KV space's handles do not hold whole blocks, or its tail is too small")
        num_blocks = space.slots * space.blocks_per_slot
        cache_shape = ((num_blocks + 2) * block_size, kv_heads, head_dim)
        mbt = cb_config.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        v = cls(space, role, cache_shape=cache_shape, block_size=block_size, dtype=dtype, device=device,
                max_batch_tokens=mbt, policy=policy)
        v.tensors = tensors
        v.region_bytes = (num_blocks + 2) * block_bytes
        return v

    def wants(self, args: tuple, kwargs: dict) -> bool:
        """Whether a `torch.empty` call made by `PagedAttentionCache.__init__` is a KV tensor."""
        shape = args[0] if args else kwargs.get("size")
        return (self._next_tensor < self.tensors and shape is not None
                and tuple(shape) == self.cache_shape and kwargs.get("dtype", self.dtype) == self.dtype)

    def next_region_tensor(self) -> Any:
        """The next K or V tensor (transformers allocates K0, V0, K1, V1, ...): tensor i is the i-th
        slice of every token's row in the space's region, a strided view without a copy."""
        if self._rows is None:
            self._rows = self._region_rows()
        i = self._next_tensor
        self._next_tensor += 1
        return self._rows[:, i]

    def _region_rows(self) -> Any:
        """The region as [tokens, tensors, kv_heads, head_dim] (DLPack, or __cuda_array_interface__)."""
        import torch

        region = self.space.region(0)
        if hasattr(region, "__dlpack__"):
            raw = torch.from_dlpack(region)
        else:  # __cuda_array_interface__ (version 3), 1-D uint8
            raw = torch.as_tensor(region, device=self.device)
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() < self.region_bytes:
            raise RuntimeError(f"the Valve region is a {raw.dtype} tensor of {raw.numel()} elements; "
                               f"expected at least {self.region_bytes} bytes")
        if torch.device(self.device).type != raw.device.type:
            raise RuntimeError(f"the Valve region is on {raw.device}, the model on {self.device}")
        tokens, heads, dim = self.cache_shape
        return raw[: self.region_bytes].view(self.dtype).view(tokens, self.tensors, heads, dim)

    def attach(self, cache: Any) -> None:
        """After `PagedAttentionCache.__init__`: the allocator only hands out blocks of held slots."""
        if self._next_tensor != self.tensors:
            raise RuntimeError(f"PagedAttentionCache allocated {self._next_tensor} KV tensors from Valve, expected "
                               f"{self.tensors}: this transformers version allocates differently; update the shim")
        bm = cache._block_manager
        bm._valve = self
        cache._valve = self
        self.group_cache_managers = cache.group_cache_managers
        self.drop_blocks(bm, range(self.num_blocks))
        if self.role == "offline":
            self._grow_up_to(bm, self.policy.get("initial_handles"))
        else:
            self._grow_up_to(bm, self.policy.get("initial_handles", 0) or 0)

    def close(self) -> None:
        """Gives every held handle back (the cache was dropped)."""
        held, self.held = sorted(self.held) + self._pending_shrink, set()
        self._pending_shrink = []
        try:
            held = sorted(set(held).intersection(self.space.held_slots()))
            if held:
                self.space.shrink(held)
            if self._release_at_turn is not None:
                self.space.release_quarantined()
            if hasattr(self.space, "close"):
                self.space.close()
        except Exception as e:  # the process may be exiting
            logger.warning("could not give Valve memory back: %s", e)

    # ------------------------------------------------------------------ allocator

    def slot_blocks(self, slot: int) -> range:
        return range(slot * self.bps, (slot + 1) * self.bps)

    def grant(self, bm: Any, slots: list[int]) -> None:
        """Slots the pool lent this process: their blocks become free blocks of transformers' allocator."""
        self.held.update(slots)
        bm._uninit_block_ids.extend(b for s in sorted(slots) for b in self.slot_blocks(s))  # [FW]

    def drop_blocks(self, bm: Any, blocks, order: Any = None) -> None:
        """Blocks leave transformers' allocator (reclaimed, given back, or never granted): out of the free
        lists, and out of the prefix-sharing tables (their content is gone). `order`, if given, rearranges
        the free blocks that stay (the compact placement, `order_free_blocks`)."""
        gone = set(blocks)
        kept = [b for b in bm._uninit_block_ids if b not in gone]
        bm._uninit_block_ids = deque(order(kept) if order else kept)  # [FW]
        for b in gone.intersection(bm._init_block_ids):
            bm._init_block_ids.pop(b)  # [FW]
            bm._hash_to_id.pop(bm._id_to_block.pop(b).hash, None)  # [FW]

    def growable_blocks(self) -> int:
        """Blocks the allocator may count as free beyond those granted. Online can take any pool handle
        it does not hold (offline's are reclaimed for it); offline only gets what it asks for."""
        if self.role != "online" or time.monotonic() < self._no_grow_until or self._growth_paused:
            return 0
        return (self.space.slots - len(self.held)) * self.bps

    def grow_for(self, bm: Any, need: int) -> None:
        """An allocation needs `need` free blocks: if fewer are granted, ask the pool for the rest first.
        Online's request may reclaim memory from offline; offline's only gets free memory."""
        free = len(bm._uninit_block_ids) + len(bm._init_block_ids)
        if need <= free:
            return
        handles = math.ceil((need - free) / self.bps)
        if self.role == "online" and self.policy.get("reservation", True):
            # One reclaim per shortage: report the use this allocation makes (a pressure event for MIAD)
            # and grow to the target it answers at once. Growing by the shortage first, then to the target
            # at the next report, reclaimed twice per event on the H100; the operator's rate counts both.
            self._last_usage = time.monotonic()
            target = self.space.usage((len(self.held) * self.bps - free + need) * self.space.block_bytes)
            if target is not None:
                handles = max(handles, target - len(self.held))
        self._grow(bm, handles)

    def _grow(self, bm: Any, handles: int) -> int:
        """Asks the pool for `handles` handles; returns how many were lent. Lent less than asked: no more
        asking, and (online) no counting of ungranted blocks, for `refusal_backoff_s`."""
        if self._growth_paused or time.monotonic() < self._no_grow_until:
            return 0
        # The client's own view of what it holds: a reclaim not collected yet already counts there.
        n = asked = min(handles, self.space.slots - len(self.space.held_slots()))
        slots: list[int] = []
        while n >= 1 and not slots:  # a pool answers all or nothing: halve the ask until it fits
            try:
                slots = self.space.grow(n)
            except MemoryError as e:
                logger.debug("Valve pool refused %d handle(s): %s", n, e)
                n //= 2
        if slots:
            self.grant(bm, slots)
            self.stats["grown_handles"] += len(slots)
        if len(slots) < asked or asked < handles:
            self.stats["refusals"] += 1
            self._no_grow_until = time.monotonic() + self.policy.get("refusal_backoff_s", 0.05)
        return len(slots)

    def _grow_up_to(self, bm: Any, handles: int | None) -> None:
        """Holds `handles` handles, or as many as the pool lends (None)."""
        want = (self.space.slots if handles is None else handles) - len(self.held)
        while want > 0:
            self._no_grow_until = 0.0
            got = self._grow(bm, want)
            if not got:
                break
            want -= got
        self._no_grow_until = 0.0

    def wait_for_memory(self, cache: Any, scheduler: Any) -> bool:
        """Offline with nothing to evict: wait for the pool to lend a handle instead of failing. A reclaim
        that lands while it waits is collected here (sync mode: no step is in flight), else its slots would
        stay quarantined and nothing could ever be lent into them."""
        if self.role != "offline":
            return False
        self.stats["memory_waits"] += 1
        bm = cache._block_manager
        deadline = time.monotonic() + self.policy.get("memory_wait_s", 600.0)
        delay = 0.002
        while time.monotonic() < deadline:
            if self.requeue_outside_step(cache, scheduler):
                return True  # requests went back to waiting: let the scheduler look again
            self._release_quarantine(force=True)
            self._no_grow_until = 0.0
            if self._grow(bm, 1):
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        logger.error("no Valve pool memory for offline within %.0f s", self.policy.get("memory_wait_s", 600.0))
        return False

    # ------------------------------------------------------------------ reclaim (offline)

    def collect_doomed(self, cache: Any, scheduler: Any, use_async: bool = False) -> list:
        """The step boundary: blocks invalidated since the last step (Valve's callback) and the requests
        holding any of them, which must go back to waiting. The holders are read from the block tables
        (a block shared through the prefix cache dooms every request that references it); in transformers
        5.17 only active requests hold blocks. The blocks leave the allocator once the requests have
        released them (`drop_invalidated`)."""
        self._async = use_async
        if self.role != "offline":
            return []
        blocks = self.space.take_invalidated()
        if not blocks:
            return []
        gone = set(blocks)
        self._pending_blocks |= gone
        self.held -= {b // self.bps for b in gone}
        self.stats["invalidated_blocks"] += len(gone)
        holders = {rid for cm in cache.group_cache_managers for rid, table in cm.block_table.items()
                   if gone.intersection(table)}
        doomed = [state for rid, state in scheduler.active_requests.items() if rid in holders]
        self.stats["requeued"] += len(doomed)
        self.stats["requeued_tokens"] += sum(int(getattr(state, "position_offset", 0)) for state in doomed)
        logger.info("Valve reclaimed %d block(s): %d request(s) go back to waiting", len(gone), len(doomed))
        return doomed

    def requeue(self, scheduler: Any, doomed: list) -> None:
        """Requests whose blocks were reclaimed go back to waiting with their prompt and generated tokens."""
        from transformers.generation.continuous_batching.requests import RequestStatus

        for state in doomed:
            new_state = state.create_equivalent_initial_request()  # [FW] prompt + generated tokens, same id
            state._status = RequestStatus.FINISHED  # [FW] its token from this step is garbage: the update skips it
            scheduler.finish_request(state.request_id)  # [FW] frees its blocks
            scheduler.add_waiting_request(new_state)  # [FW] recomputed when scheduled again
        if doomed and not scheduler.active_requests:
            # transformers' eviction blocks new requests until an active one finishes; none is left to.
            scheduler.block_new_requests = False  # [FW] as continuous_api.py:476

    def requeue_outside_step(self, cache: Any, scheduler: Any) -> bool:
        """Sync mode, between steps (nothing in flight): a reclaim that came after the last update is collected
        now, not at the next update, which may never come: with every block reclaimed nothing can be scheduled,
        and the reclaimed slots stay quarantined until collected. Returns whether anything was collected."""
        if self.role != "offline" or self._async:
            return False
        before = self.stats["invalidated_blocks"]
        self.requeue_reclaimed(cache, scheduler, False)
        return self.stats["invalidated_blocks"] > before

    def requeue_reclaimed(self, cache: Any, scheduler: Any, use_async: bool) -> list:
        """Collects the blocks reclaimed since the last look, requeues the requests holding any of them and
        drops the blocks from the allocator; returns the requeued (old) states."""
        doomed = self.collect_doomed(cache, scheduler, use_async)
        self.requeue(scheduler, doomed)
        self.drop_invalidated(cache)
        return doomed

    def drop_invalidated(self, cache: Any) -> None:
        """After the requeue and before the update: the reclaimed blocks leave the allocator for good (until
        the slot is refilled). It must run before the update: `mark_shareable_blocks_as_complete`
        (cache_manager.py:258-269) hands a request that completes a block the cached block with the same
        hash, so a reclaimed block left in the hash table would go to a request that was not requeued."""
        if not self._pending_blocks:
            return
        gone, self._pending_blocks = self._pending_blocks, set()
        bm = cache._block_manager
        self.drop_blocks(bm, gone)
        held = {rid for cm in cache.group_cache_managers for rid, table in cm.block_table.items()
                if gone.intersection(table)}
        left = gone.intersection({*bm._id_to_block, *bm._hash_to_id.values(), *bm._uninit_block_ids,
                                  *bm._init_block_ids})
        if held or left:  # going on would hand out, or read, reclaimed memory: wrong tokens, then a corrupt allocator
            raise RuntimeError(f"reclaimed blocks {sorted(left)} are still in transformers' allocator, held by "
                               f"{sorted(held)}, after the requeue: this transformers version keeps blocks where the "
                               "shim does not look; update the shim")
        # Counted in between_steps, whose next turn (right after this update) counts first: sync mode
        # releases after the next update, async mode (whose batch launched before this update may still
        # write into the quarantine) one update later.
        self._release_at_turn = self._turn + (3 if self._async else 2)

    def _release_quarantine(self, force: bool = False) -> None:
        if self._release_at_turn is not None and (force or self._turn >= self._release_at_turn):
            if force:
                self._sync_device()
            self.space.release_quarantined()
            self._release_at_turn = None

    def _sync_device(self) -> None:
        """Waits for every kernel of this process on the cache's device (only off the hot path)."""
        import torch

        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ step boundary

    def between_steps(self, cache: Any, scheduler: Any, use_async: bool) -> None:
        """Each turn of the generation loop, before it schedules: after a step's update, and every 0.1 s while
        idle. Counts turns (the quarantine and deferred shrinks wait for turns, and an idle turn has nothing
        on the GPU), reports owners, gives back what online's reservation no longer wants, and grows offline."""
        self._async = use_async
        self._turn += 1
        self.stats["turns"] += 1
        bm = cache._block_manager
        if self._pending_shrink:  # chosen last step; the batch that was in flight then is done now
            slots, self._pending_shrink = self._pending_shrink, []
            self.space.shrink(slots)
        if self.role == "offline":
            self.requeue_outside_step(cache, scheduler)
            self._release_quarantine()
            self._report_owners(cache, scheduler)
            if self.policy.get("placement") == "compact":
                self.order_free_blocks(bm)
            free = len(bm._uninit_block_ids) + len(bm._init_block_ids)
            low = self.policy.get("grow_below_free_fraction", 0.1) * len(self.held) * self.bps
            # transformers' safety margin is a share of the whole KV space, which offline rarely holds:
            # at the margin it admits no new prefill, so it never runs short, and would never grow.
            low = max(low, getattr(scheduler, "safety_margin", 0.0) * self.num_blocks)
            if scheduler.waiting_requests and free <= low:
                # All the pool lends (offline uses whatever online does not); halved until it fits.
                self._grow(bm, self.policy.get("grow_handles") or self.space.slots - len(self.held))
        else:
            self._online_usage(bm)

    def _report_owners(self, cache: Any, scheduler: Any) -> None:
        """Block owners and their recompute cost (tokens) for the client's Algorithm 1, sent when a
        request's blocks change."""
        if not hasattr(self.space, "set_owners"):
            return
        sel = self.policy.get("selection", "alg1")
        if sel not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, not {sel!r}")
        if sel != self._selection or (sel == "random" and self.policy.get("selection_seed", 0) != self._seed_used):
            self._forget_owners()
            self._selection = sel
            self._seed_used = self.policy.get("selection_seed", 0)
            self._rng = random.Random(self._seed_used)
        if sel == "fifo":
            return
        if sel == "random":
            # Redrawn when the held slots change and every `random_redraw_s` (0.5 s): a draw is a client call
            # per held slot, too many for every turn.
            now = time.monotonic()
            if (self._random_blocks and set(self.held) == self._random_held
                    and now - self._random_at < self.policy.get("random_redraw_s", 0.5)):
                return
            self._random_held, self._random_at = set(self.held), now
            if self._random_blocks:
                self.space.clear_owners(self._random_blocks)
            owners = random_owners(self.held, self.bps, self._rng)
            for block, request, tokens in owners:
                self.space.set_owners([block], request, tokens)
            self._random_blocks = [b for b, _, _ in owners]
            return
        current: dict[str, tuple[int, ...]] = {}
        for rid in scheduler.active_requests:
            current[rid] = tuple(b for cm in cache.group_cache_managers for b in cm.block_table.get(rid, ()))
        stale = [rid for rid, blocks in self._reported.items() if current.get(rid) != blocks]
        for rid in stale:
            self.space.clear_owners(list(self._reported.pop(rid)))
            if rid not in current:
                self._rid.pop(rid, None)
        for rid, blocks in current.items():
            if rid not in self._reported and blocks:
                if rid not in self._rid:
                    self._next_rid += 1
                    self._rid[rid] = self._next_rid
                idx = self._rid[rid]
                tokens = scheduler.active_requests[rid].position_offset
                self.space.set_owners(list(blocks), idx, tokens)
                self._reported[rid] = blocks

    def order_free_blocks(self, bm: Any) -> None:
        """Placement `compact` (policy, default off): before the scheduler allocates, the uninitialised free
        blocks of wholly free held handles come first, both blocks of a handle together, so a request's
        blocks share handles with as few other requests as possible (docs/memory.md, "Why Algorithm 1 has
        not beaten FIFO")."""
        free = set(bm._uninit_block_ids)
        if len(free) < 2:
            return
        self.drop_blocks(bm, (), order=lambda kept: compact_order(kept, free, self.held, self.bps))

    def _forget_owners(self) -> None:
        """The selection changed: every owner reported for the old one is cleared."""
        for blocks in self._reported.values():
            self.space.clear_owners(list(blocks))
        self._reported.clear()
        self._rid.clear()
        if self._random_blocks:
            self.space.clear_owners(self._random_blocks)
            self._random_blocks = []

    def _online_usage(self, bm: Any) -> None:
        """MIAD reservation: report usage; hold the number of handles the daemon asks for (grow ahead of
        demand, give back slots with no block in use)."""
        now = time.monotonic()
        if now - self._last_usage < self.policy.get("usage_interval_s", 0.01):
            return
        self._last_usage = now
        free = len(bm._uninit_block_ids) + len(bm._init_block_ids)
        used_blocks = len(self.held) * self.bps - free
        if self.policy.get("reservation", True):
            target = self.space.usage(used_blocks * self.space.block_bytes)
        else:  # no reservation: hold what is in use, give every other slot back at once
            target = math.ceil(used_blocks / self.bps)
        if target is None:
            return
        if target > len(self.held):
            self._grow(bm, target - len(self.held))
        elif target < len(self.held):
            self.shrink_free(bm, len(self.held) - target)

    def shrink_free(self, bm: Any, count: int) -> list[int]:
        """Gives back up to `count` held slots none of whose blocks is in use."""
        free = set(bm._uninit_block_ids).union(bm._init_block_ids)
        slots = [s for s in sorted(self.held, reverse=True) if all(b in free for b in self.slot_blocks(s))][:count]
        if not slots:
            return []
        self.drop_blocks(bm, (b for s in slots for b in self.slot_blocks(s)))
        self.held.difference_update(slots)
        if self._async:
            # A batch launched before this update may still write into blocks freed by it: the
            # handles go back at the next step boundary, once that batch is done.
            self._pending_shrink += slots
        else:
            self.space.shrink(slots)
        self.stats["shrunk_handles"] += len(slots)
        return slots


def random_owners(slots, blocks_per_slot: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """The `random` selection's owners: (block, request, tokens) with one made-up request per slot,
    owning the slot's first block, at a random cost. No two slots share a request, so Algorithm 1's
    marginal costs are these costs and its choice (cheapest first) is a uniformly random set of slots."""
    return [(s * blocks_per_slot, RANDOM_OWNER_BASE + s, rng.randrange(1, 1 << 40)) for s in sorted(slots)]


def compact_order(blocks: list[int], free, held, blocks_per_slot: int) -> list[int]:
    """The free blocks in compact-placement order: first the blocks of held slots all of whose blocks are
    free (uninitialised), slot by slot in slot order, then the others in the order they had. Only the
    order changes: the same blocks come back."""
    whole = sorted(s for s in held if all(b in free for b in range(s * blocks_per_slot, (s + 1) * blocks_per_slot)))
    first = [b for s in whole for b in range(s * blocks_per_slot, (s + 1) * blocks_per_slot)]
    taken = set(first)
    return first + [b for b in blocks if b not in taken]
