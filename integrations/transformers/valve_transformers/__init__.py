"""Valve's shared GPU memory pool behind HF transformers' continuous batching (transformers >= 5).

    import valve_transformers
    valve_transformers.install("offline")   # or "online"; or set VALVE_ROLE before the import

then use transformers as usual (`model.generate_batch(...)`, `model.init_continuous_batching()`):
every `PagedAttentionCache` built afterwards keeps its per-layer K and V tensors in a Valve KV space
instead of `torch.empty`, its `BlockManager` hands out only blocks of pool handles this process
holds, and, offline, requests whose blocks a reclaim invalidated go back to the waiting queue with
their prompt and generated tokens and are recomputed. Nothing of transformers is copied or forked:
the patches wrap its methods (see DESIGN.md for the hook points and the changed lines, marked
`# [FW]` here and in `_kv.py`).

`install(role, kv_space=...)` takes the factory of KV spaces; by default it connects to the Valve
daemon through the `valve` Python package (`_real_valve.kv_space_factory(role)`, which also takes a
socket, a GPU and client options). Tests pass `_fake_valve.FakePool(...).kv_space_factory(role)`.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import threading
import weakref
from typing import Any, Callable

__all__ = ["install", "uninstall", "installed", "caches", "stats", "set_policy", "TESTED_TRANSFORMERS"]

logger = logging.getLogger("valve_transformers")

TESTED_TRANSFORMERS = ("5.17",)

_tls = threading.local()  # .building: the ValveKV of the cache being constructed on this thread
_state: dict[str, Any] = {"role": None, "kv_space": None, "policy": {}, "originals": {}, "caches": weakref.WeakSet(),
                          "stats": collections.deque(maxlen=16)}


def caches() -> list:
    """The ValveKV objects of the live Valve-backed caches (space, held slots, stats)."""
    return list(_state["caches"])


def stats() -> list[dict]:
    """The counters of the last Valve-backed caches built (kept after the cache is gone), newest last."""
    return list(_state["stats"])


def installed() -> bool:
    return bool(_state["originals"])


def install(role: str, kv_space: Callable[..., Any] | None = None, **policy: Any) -> None:
    """Applies the patches (once) and sets the role and KV-space factory for caches built from now on.

    role: "online" (the server: grows on demand, may reclaim from offline, MIAD usage reports) or
        "offline" (batch work: lent free memory only; reclaimed blocks requeue their requests).
    kv_space: called as kv_space(regions=, capacity_bytes_per_region=, block_bytes=, tail_bytes=,
        device=) and returns a KV space (DESIGN.md, "What the shim needs from the Valve client").
    policy: initial_handles (offline default: all it can get; online default 0),
        capacity_bytes_per_region (0: the whole pool), grow_handles, grow_below_free_fraction,
        usage_interval_s, memory_wait_s, refusal_backoff_s, reservation (online, default True: hold
        what the daemon's MIAD reservation asks; False: hold only the slots in use), selection
        (offline: which handles a reclaim takes, "alg1" (default), "fifo" or "random", with
        selection_seed; see `_kv.SELECTIONS`; needs the client's Algorithm 1, i.e. not fifo=True).
    """
    if role not in ("online", "offline"):
        raise ValueError(f"role must be 'online' or 'offline', not {role!r}")
    _apply_patches()
    _state["role"] = role
    _state["kv_space"] = kv_space if kv_space is not None else _valve_client_factory(role)
    _state["policy"] = dict(policy)


def set_policy(**policy: Any) -> None:
    """Changes policy entries of the caches built since `install` (and of later ones), from their next
    step on: e.g. `set_policy(selection="random", selection_seed=3)` between measurements."""
    _state["policy"].update(policy)


def uninstall() -> None:
    """Restores every patched attribute. Caches built while installed keep their Valve memory."""
    for (owner, name), value in _state["originals"].items():
        setattr(owner, name, value)
    _state["originals"].clear()
    _state["role"] = _state["kv_space"] = None


def _valve_client_factory(role: str) -> Callable[..., Any]:
    from ._real_valve import kv_space_factory  # imports `valve` (ctl/client-py) when the first cache is built

    return kv_space_factory(role)


# ---------------------------------------------------------------------------- the patches


class _TorchProxy:
    """Stands in for the `torch` module inside transformers' cache.py: everything is torch's, except
    that `torch.empty` of a KV tensor, while a Valve cache is being built on this thread, returns the
    next Valve region instead of new device memory."""

    def __init__(self, real: Any) -> None:
        self.__dict__["_real"] = real

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        self.__dict__[name] = value  # later lookups skip __getattr__
        return value

    def empty(self, *args: Any, **kwargs: Any) -> Any:
        v = getattr(_tls, "building", None)
        if v is not None and v.wants(args, kwargs):
            return v.next_region_tensor()  # [FW] cache.py:251-252 the K and V torch.empty calls
        return self._real.empty(*args, **kwargs)


def _apply_patches() -> None:
    if _state["originals"]:
        return
    import torch
    import transformers
    from transformers.generation.continuous_batching import cache as cache_mod
    from transformers.generation.continuous_batching import cache_manager, continuous_api, offloading_manager, scheduler

    version = transformers.__version__
    if int(version.split(".")[0]) < 5:
        raise RuntimeError(f"valve_transformers needs transformers >= 5 (continuous batching); found {version}")
    if not version.startswith(TESTED_TRANSFORMERS):
        logger.warning("valve_transformers was written against transformers %s; found %s", TESTED_TRANSFORMERS, version)

    PAC = cache_mod.PagedAttentionCache
    Handler = cache_mod.PagedAttentionMemoryHandler
    BM = cache_manager.BlockManager
    CBP = continuous_api.ContinuousBatchProcessor
    Sched = scheduler.Scheduler
    OM = offloading_manager.OffloadingManager
    from ._kv import ValveKV

    hooks = [(PAC, "__init__"), (PAC, "will_allocation_be_successful"), (Handler, "infer_max_batch_tokens_and_num_blocks"),
             (BM, "num_free_blocks"), (CBP, "update_batch"), (CBP, "prepare_next_batch"), (CBP, "warmup"), (Sched, "_process_candidates"),
             (OM, "offload_requests"), (cache_mod, "torch")]
    missing = [f"{getattr(o, '__name__', o)}.{n}" for o, n in hooks if n not in vars(o)]
    if missing:
        raise RuntimeError(f"transformers {version} has no {', '.join(missing)}: valve_transformers does not fit it")
    orig = {(o, n): vars(o)[n] for o, n in hooks}
    init_sig = inspect.signature(orig[(PAC, "__init__")])
    real_free = orig[(BM, "num_free_blocks")].fget

    # cache.py:148 PagedAttentionCache.__init__ -- open the KV space, build the cache over it, restrict the allocator.
    @functools.wraps(orig[(PAC, "__init__")])
    def cache_init(self, *args, **kwargs):
        if _state["kv_space"] is None:
            return orig[(PAC, "__init__")](self, *args, **kwargs)
        a = init_sig.bind(self, *args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        v = ValveKV.open(_state["kv_space"], _state["role"], cache_mod, p["config"], p["continuous_batching_config"],  # [FW]
                         p["device"], p["dtype"], p["distributed_helper"].tp_size, _state["policy"])
        _tls.building = v
        try:
            orig[(PAC, "__init__")](self, *args, **kwargs)
        finally:
            _tls.building = None
        v.attach(self)  # [FW] cache.py:298 the allocator gets the held slots' blocks only
        _state["caches"].add(v)
        _state["stats"].append(v.stats)
        weakref.finalize(self, v.close)  # the cache is gone: its handles go back to the pool

    # cache.py:652 -- the number of blocks is the KV space's, not what fits in the device's free memory.
    @functools.wraps(orig[(Handler, "infer_max_batch_tokens_and_num_blocks")])
    def infer(self):
        v = getattr(_tls, "building", None)
        if v is None:
            return orig[(Handler, "infer_max_batch_tokens_and_num_blocks")](self)
        return v.max_batch_tokens, v.num_blocks  # [FW] cache.py:216-222 num_blocks from the pool

    # cache_manager.py:88 -- online may count the pool handles it does not hold yet as free.
    def num_free_blocks(self):
        v = getattr(self, "_valve", None)
        return real_free(self) + (v.growable_blocks() if v is not None else 0)  # [FW] cache_manager.py:91

    # cache.py:323 -- on a shortage, ask the pool first. If it lends less than asked, online stops counting
    # ungranted blocks for a moment, so the original test then judges granted blocks only.
    @functools.wraps(orig[(PAC, "will_allocation_be_successful")])
    def will_allocation_be_successful(self, num_requested_blocks, allocated_blocks):
        v = getattr(self, "_valve", None)
        if v is not None:
            v.grow_for(self._block_manager, self.blocks_needed(num_requested_blocks, allocated_blocks))  # [FW] cache.py:325
        return orig[(PAC, "will_allocation_be_successful")](self, num_requested_blocks, allocated_blocks)

    # continuous_api.py:445 -- the step boundary: requeue requests whose blocks were reclaimed, drop those
    # blocks from the allocator, then let the update skip the requeued states.
    @functools.wraps(orig[(CBP, "update_batch")])
    def update_batch(self):
        v = getattr(self.cache, "_valve", None)
        if v is None:
            return orig[(CBP, "update_batch")](self)
        if self.use_async_batching:
            self.inputs_and_outputs.prepare_batch_update()  # [wrap] a patch would collect after line 447, which waits
        # Before the update, which shares cached blocks (cache_manager.py:258): the reclaimed blocks must be gone.
        doomed = v.requeue_reclaimed(self.cache, self.scheduler, self.use_async_batching)  # [FW] owners requeued, blocks dropped
        skip = bool(doomed) and not self.use_async_batching
        if skip:
            self.use_async_batching = True  # [FW] continuous_api.py:454 skip finished states in sync mode too
        try:
            orig[(CBP, "update_batch")](self)
        finally:
            if skip:
                self.use_async_batching = False  # [wrap] a patch changes the condition at line 454 instead

    # continuous_api.py:381 -- every turn of the generation loop: after a step's update, and every 0.1 s while
    # no request is pending (continuous_api.py:965), so online's reservation also shrinks while it is idle.
    @functools.wraps(orig[(CBP, "prepare_next_batch")])
    def prepare_next_batch(self):
        v = getattr(self.cache, "_valve", None)
        if v is not None:
            v.between_steps(self.cache, self.scheduler, self.use_async_batching)  # [FW] owners, quarantine, MIAD, growth
        return orig[(CBP, "prepare_next_batch")](self)

    # continuous_api.py:566 -- warmup allocates the largest batch it can: never grow the pool for it.
    @functools.wraps(orig[(CBP, "warmup")])
    def warmup(self, model):
        v = getattr(self.cache, "_valve", None)
        if v is not None:
            v._growth_paused = True
        try:
            return orig[(CBP, "warmup")](self, model)
        finally:
            if v is not None:
                v._growth_paused = False

    # scheduler.py:208 -- remember whether the last batch came back empty for lack of blocks.
    @functools.wraps(orig[(Sched, "_process_candidates")])
    def process_candidates(self, *args, **kwargs):
        out = orig[(Sched, "_process_candidates")](self, *args, **kwargs)
        self._valve_starved = not out[0] and out[1]
        return out

    # offloading_manager.py:178 (called at continuous_api.py:407) -- offline with nothing scheduled and
    # nothing to evict waits for pool memory instead of failing the whole generation loop.
    @functools.wraps(orig[(OM, "offload_requests")])
    def offload_requests(self):
        n = orig[(OM, "offload_requests")](self)
        v = getattr(self.cache, "_valve", None)
        if n == 0 and v is not None and getattr(self.scheduler, "_valve_starved", False):
            n = int(v.wait_for_memory(self.cache, self.scheduler))  # [FW] continuous_api.py:407
        return n

    patched = {
        (PAC, "__init__"): cache_init,
        (PAC, "will_allocation_be_successful"): will_allocation_be_successful,
        (Handler, "infer_max_batch_tokens_and_num_blocks"): infer,
        (BM, "num_free_blocks"): property(num_free_blocks, doc=orig[(BM, "num_free_blocks")].__doc__),
        (CBP, "update_batch"): update_batch,
        (CBP, "prepare_next_batch"): prepare_next_batch,
        (CBP, "warmup"): warmup,
        (Sched, "_process_candidates"): process_candidates,
        (OM, "offload_requests"): offload_requests,
        (cache_mod, "torch"): _TorchProxy(torch),
    }
    for (owner, name), value in patched.items():
        setattr(owner, name, value)
    _state["originals"].update(orig)


if os.environ.get("VALVE_ROLE") in ("online", "offline"):
    install(os.environ["VALVE_ROLE"])
