"""Tests of the `valve` Python package that need neither a GPU nor the Valve daemon: clients use the
library's fake GPU (`_fake=True`) against `mock_daemon.MockDaemon`.

The mock daemon is Python running in this process, so every test that gets a reply from it also
shows that the call released the GIL while it waited.

Run with `python3 -m pytest` or plainly (`python3 test_valve.py`) after installing the wheel;
`../test.sh` does both steps.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import valve  # noqa: E402
from mock_daemon import MIB, MockDaemon  # noqa: E402

REGIONS, BLOCK = 4, 512 * 1024  # 8 MiB handles: 2 MiB pieces of 4 blocks


def raises(exc, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        return e
    raise AssertionError(f"{fn} did not raise {exc}")


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_module_surface_and_error_classes():
    for name in ("Client", "RegionView", "ValveError", "PoolExhausted", "DEFAULT_SOCKET", "__version__"):
        assert hasattr(valve, name), name
    assert valve.DEFAULT_SOCKET == "/run/valve/pool.sock"
    assert issubclass(valve.ValveError, Exception)
    assert issubclass(valve.PoolExhausted, valve.ValveError)
    assert issubclass(valve.PoolExhausted, MemoryError)
    assert not issubclass(valve.ValveError, MemoryError)
    e = valve.PoolExhausted("the pool is exhausted", 12)
    assert e.code == 12 and str(e) == "the pool is exhausted"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is valve.PoolExhausted and back.code == 12
    assert valve.ValveError.__module__ == "valve" and valve.Client.__module__ == "valve"


def test_a_missing_socket_names_the_daemon_command():
    e = raises(valve.ValveError, valve.Client, "offline", socket="/nonexistent/valve/pool.sock")
    assert type(e) is valve.ValveError
    assert e.code == 101
    assert "valvectl daemon --pool" in str(e) and "/nonexistent/valve/pool.sock" in str(e)


def test_argument_validation():
    assert "neither `online` nor `offline`" in str(raises(ValueError, valve.Client, "batch"))
    raises(TypeError, valve.Client, "offline", gpu=1.5)
    raises(ValueError, valve.Client, "offline", grant_timeout_s=0)
    with MockDaemon() as d:
        c = valve.Client("offline", socket=d.path, _fake=True)
        e = raises(valve.ValveError, c.grow, 1)
        assert e.code == 107 and "kv_space" in str(e)  # no KV space yet
        assert c.space() is None and c.take_invalidated() == [] and c.held_slots() == []
        e = raises(valve.ValveError, c.kv_space, REGIONS, 0, 3 * MIB)
        assert e.code == 105 and "block_bytes" in str(e)
        e = raises(valve.ValveError, c.kv_space, 3, 0, BLOCK)  # 8 MiB / 3 is no whole pages
        assert e.code == 105 and "--pool-handle-mib" in str(e)
        raises(OverflowError, c.kv_space, -1, 0, BLOCK)
        c.kv_space(REGIONS, 0, BLOCK)
        assert raises(valve.ValveError, c.kv_space, REGIONS, 0, BLOCK).code == 107
        raises(OverflowError, c.grow, -1)
        raises(TypeError, c.shrink, "0")
        assert raises(valve.ValveError, c.region, REGIONS).code == 100
        c.close()


def test_offline_kv_space_grow_reclaim_and_invalidated_blocks():
    with MockDaemon(handles=8) as d:
        c = valve.Client("offline", gpu=0, socket=d.path, _fake=True)
        assert c.role == "offline"
        reg = c.registration()
        assert reg["handle_bytes"] == 8 * MIB and reg["pool_capacity_handles"] == 8
        s = c.kv_space(REGIONS, 0, BLOCK)
        assert {k: s[k] for k in ("regions", "slots", "piece_bytes", "block_bytes", "blocks_per_slot",
                                  "region_bytes", "handle_bytes")} == {
            "regions": 4, "slots": 8, "piece_bytes": 2 * MIB, "block_bytes": BLOCK, "blocks_per_slot": 4,
            "region_bytes": 16 * MIB, "handle_bytes": 8 * MIB}
        assert len(s["region_ptrs"]) == 4 and c.space() == s
        slots = c.grow(3)
        assert len(slots) == 3 and sorted(c.held_slots()) == sorted(slots)
        client_id = int(reg["client"])
        assert len(d.held(client_id)) == 3
        c.set_blocks_owner([4 * slots[0], 4 * slots[0] + 1], 7, 100)
        c.set_block_owner(4 * slots[1], 8, 5)
        c.set_blocks_owner(list(range(4 * slots[2], 4 * slots[2] + 4)), 9, 1000)
        c.clear_block(4 * slots[0] + 1)
        c.clear_blocks([])
        assert c.stats()["requests"] == 3
        reply = d.reclaim(client_id, 1)
        assert reply["ok"] and len(reply["handles"]) == 1
        # Algorithm 1 gives back the slot whose owners cost least to recompute: request 8's.
        assert slots[1] not in c.held_slots() and len(c.held_slots()) == 2
        st = c.stats()
        assert st["reclaims"] == 1 and st["quarantined_slots"] == 1 and st["pending_invalidated"] == 4
        assert c.take_invalidated() == list(range(4 * slots[1], 4 * slots[1] + 4))
        assert c.take_invalidated() == []
        c.shrink([slots[0]])
        assert len(d.held(client_id)) == 1
        assert c.pool_status()["handles"] == 8
        with d.lock:  # someone else holds all but 2 of the free handles
            for h in [h for h, o in enumerate(d.owner) if o is None][2:]:
                d.owner[h] = 999
        e = raises(valve.PoolExhausted, c.grow, 3)
        assert isinstance(e, MemoryError) and e.code == 12 and "exhausted" in str(e)
        c.close()
        assert c.closed and raises(valve.ValveError, c.stats).code == 107
        wait_for(lambda: d.held(client_id) == [])


def test_online_premapped_grow_and_usage():
    with MockDaemon(handles=6, usage_target=4) as d:
        with valve.Client("online", socket=d.path, _fake=True) as c:
            s = c.kv_space(REGIONS, 1, BLOCK)  # premapped: the whole pool whatever was asked
            assert s["slots"] == 6
            wait_for(lambda: c.stats()["mapped_slots"] == 6)
            assert c.grow(2) == [0, 1] and c.held_slots() == [0, 1]
            assert c.usage(3 * BLOCK) == 4
            c.shrink([1])
            assert c.held_slots() == [0] and c.stats()["premap"] is True
            assert raises(valve.PoolExhausted, c.grow, 7).code == 11
        assert c.closed


def test_region_view_exposes_the_cuda_array_interface_and_keeps_the_client():
    with MockDaemon() as d:
        c = valve.Client("offline", socket=d.path, _fake=True)
        s = c.kv_space(REGIONS, 4 * 2 * MIB, BLOCK)
        assert s["slots"] == 4
        views = [c.region(i) for i in range(REGIONS)]
        for i, v in enumerate(views):
            cai = v.__cuda_array_interface__
            assert cai == {"shape": (8 * MIB,), "typestr": "|u1", "data": (s["region_ptrs"][i], False),
                           "version": 3, "strides": None, "stream": None}
            assert v.ptr == s["region_ptrs"][i] and v.nbytes == len(v) == 8 * MIB and v.index == i
            assert v.client is c
        client_id = int(c.registration()["client"])
        c.grow(2)
        # close() with views alive: calls fail at once, but the regions (and the connection) stay
        # until the last view goes.
        del c
        gc.collect()
        views[0].client.close()
        time.sleep(0.1)
        assert len(d.held(client_id)) == 2
        assert views[1].__cuda_array_interface__["data"][0] == s["region_ptrs"][1]
        del views, v  # `v` is the loop's last view
        gc.collect()
        wait_for(lambda: d.held(client_id) == [])


def test_calls_from_threads_do_not_block_each_other():
    with MockDaemon(handles=16) as d:
        c = valve.Client("offline", socket=d.path, _fake=True)
        c.kv_space(REGIONS, 0, BLOCK)
        got, errors = [], []

        def worker():
            try:
                for _ in range(4):
                    got.extend(c.grow(1))
                    c.stats()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors and sorted(got) == list(range(16))
        c.close()


def test_the_transformers_adapter_gives_the_real_client_the_fakes_surface():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../integrations/transformers"))
    from valve_transformers import _real_valve

    with MockDaemon(handles=4) as d:
        factory = _real_valve.kv_space_factory("offline", socket=d.path, gpu=0, _fake=True)
        space = factory(regions=REGIONS, capacity_bytes_per_region=0, block_bytes=BLOCK, tail_bytes=2 * BLOCK,
                        device="cuda:0")
        # transformers' two trash blocks (1 MiB) get a 2 MiB private tail after every region's slots.
        assert (space.regions, space.slots, space.blocks_per_slot, space.tail_bytes) == (4, 4, 4, 2 * MIB)
        assert space.region_bytes == 4 * 2 * MIB + 2 * MIB
        assert space.region(0).__cuda_array_interface__["shape"] == (space.region_bytes,)
        slots = space.grow(3)
        assert sorted(space.held_slots()) == sorted(slots)
        space.set_owners([4 * slots[0]], 1, 10)
        space.set_owners([4 * slots[1]], 2, 1)
        space.set_owners([4 * slots[2]], 3, 100)
        space.clear_owners([4 * slots[0]])
        client_id = int(space.client.registration()["client"])
        d.reclaim(client_id, 1)
        assert space.take_invalidated() == list(range(4 * slots[0], 4 * slots[0] + 4))  # nobody owns it now
        # Offline spaces release explicitly: the collected slot is not refilled before release.
        assert space.grow(1) != [slots[0]]
        space.release_quarantined()
        assert space.client.release_quarantined() == 0
        assert space.usage(123) is None  # offline reports no usage
        space.shrink([slots[1]])
        assert len(space.held_slots()) == 2
        assert isinstance(raises(MemoryError, space.grow, 4), valve.PoolExhausted)  # 2 empty slots: code 106
        space.close()
        wait_for(lambda: d.held(client_id) == [])


def test_torch_sees_a_region_as_a_uint8_tensor():
    try:
        import torch
    except ImportError:
        print("SKIP test_torch_sees_a_region_as_a_uint8_tensor: no torch")
        return
    if not torch.cuda.is_available():
        print("SKIP test_torch_sees_a_region_as_a_uint8_tensor: no CUDA")
        return
    # With the fake GPU the addresses are made up, so only the metadata path is exercised:
    # torch checks the interface but does not touch the memory until used.
    with MockDaemon() as d:
        c = valve.Client("offline", socket=d.path, _fake=True)
        c.kv_space(REGIONS, 0, BLOCK)
        t = torch.as_tensor(c.region(0), device="cuda")
        assert t.dtype == torch.uint8 and t.shape == (16 * MIB,) and t.data_ptr() == c.region(0).ptr


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted((n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)):
        try:
            fn()
            print(f"PASS {name}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            import traceback

            traceback.print_exc()
    print(f"{failed} failed" if failed else "all passed")
    sys.exit(1 if failed else 0)
