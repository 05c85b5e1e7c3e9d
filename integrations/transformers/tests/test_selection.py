"""The offline handle choice the shim selects by what it reports as block owners (policy `selection`:
alg1, fifo, random), checked against a copy of the client's Algorithm 1 on a fake layout, and the
compact placement's order of free blocks (policy `placement`). Needs neither torch nor transformers:

    cd integrations/transformers && python3 -m unittest tests.test_selection
"""

import os
import random
import sys
import unittest
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from collections import deque  # noqa: E402

from valve_transformers._kv import RANDOM_OWNER_BASE, ValveKV, compact_order, random_owners  # noqa: E402


def algorithm1(held_in_grant_order, bps, owners, tokens, count):
    """ctl/client/src/select.rs's greedy choice: lowest marginal token cost first; ties: oldest grant."""
    per = {s: {owners[b] for b in range(s * bps, (s + 1) * bps) if b in owners} for s in held_in_grant_order}
    chosen, affected = [], set()
    for _ in range(min(count, len(held_in_grant_order))):
        best = min((s for s in held_in_grant_order if s not in chosen),
                   key=lambda s: (sum(tokens[r] for r in per[s] - affected), held_in_grant_order.index(s)))
        chosen.append(best)
        affected |= per[best]
    return chosen


class Space:
    """The owner calls of a KV space, recorded as the client keeps them (the latest call wins)."""

    slots, blocks_per_slot = 8, 2

    def __init__(self):
        self.owners, self.tokens = {}, {}

    def set_owners(self, blocks, request, tokens):
        for b in blocks:
            self.owners[b] = request
        self.tokens[request] = tokens

    def clear_owners(self, blocks):
        for b in blocks:
            self.owners.pop(b, None)


def kv(policy):
    space = Space()
    v = ValveKV(space, "offline", cache_shape=(1, 1, 1), block_size=256, dtype=None, device="cpu",
                max_batch_tokens=64, policy=policy)
    v.held = {0, 1, 2, 3, 4, 5}
    # Request a: blocks 0, 1, 2 (slots 0, 1); b: blocks 3, 4 (slots 1, 2); c: block 8 (slot 4).
    tables = {"a": [0, 1, 2], "b": [3, 4], "c": [8]}
    cache = SimpleNamespace(group_cache_managers=[SimpleNamespace(block_table=tables)])
    sched = SimpleNamespace(active_requests={r: SimpleNamespace(position_offset=n)
                                             for r, n in (("a", 700), ("b", 300), ("c", 100))})
    return v, space, cache, sched


class Selection(unittest.TestCase):
    def test_alg1_reports_the_requests_and_picks_the_handles_that_cost_least(self):
        v, space, cache, sched = kv({})
        v._report_owners(cache, sched)
        self.assertEqual(len(set(space.owners.values())), 3)
        # Slots 3 and 5 are empty, then slot 4 (c, 100 tokens) costs least.
        self.assertEqual(algorithm1(sorted(v.held), 2, space.owners, space.tokens, 3), [3, 5, 4])

    def test_fifo_reports_nothing_so_the_oldest_grants_go_first(self):
        policy = {}
        v, space, cache, sched = kv(policy)
        v._report_owners(cache, sched)
        policy["selection"] = "fifo"
        v._report_owners(cache, sched)
        self.assertEqual(space.owners, {})
        self.assertEqual(algorithm1([2, 0, 1, 3, 4, 5], 2, space.owners, space.tokens, 3), [2, 0, 1])

    def test_random_gives_each_held_handle_one_owner_and_back_to_alg1_clears_them(self):
        policy = {"selection": "random", "selection_seed": 7}
        v, space, cache, sched = kv(policy)
        v._report_owners(cache, sched)
        self.assertEqual(sorted(space.owners), [0, 2, 4, 6, 8, 10])
        self.assertEqual(sorted(space.owners.values()), [RANDOM_OWNER_BASE + s for s in range(6)])
        policy["selection"] = "alg1"
        v._report_owners(cache, sched)
        self.assertEqual(sorted(space.owners), [0, 1, 2, 3, 4, 8])
        self.assertTrue(all(r < RANDOM_OWNER_BASE for r in space.owners.values()))

    def test_random_draws_again_when_the_held_handles_change_not_at_every_turn(self):
        v, space, cache, sched = kv({"selection": "random", "selection_seed": 5, "random_redraw_s": 60})
        v._report_owners(cache, sched)
        first = dict(space.tokens)
        v._report_owners(cache, sched)
        self.assertEqual(space.tokens, first)
        v.held = v.held | {6}
        v._report_owners(cache, sched)
        self.assertIn(12, space.owners)  # the new slot's first block has its made-up owner

    def test_the_same_seed_draws_the_same_choice(self):
        picks = []
        for _ in range(2):
            v, space, cache, sched = kv({"selection": "random", "selection_seed": 3})
            v._report_owners(cache, sched)
            picks.append(algorithm1(sorted(v.held), 2, space.owners, space.tokens, 2))
        self.assertEqual(picks[0], picks[1])

    def test_random_owners_make_algorithm1_pick_uniformly(self):
        rng, held, counts, trials = random.Random(1), list(range(8)), [0] * 8, 4000
        for _ in range(trials):
            owners = random_owners(held, 2, rng)
            own = {b: r for b, r, _ in owners}
            toks = {r: t for _, r, t in owners}
            for s in algorithm1(held, 2, own, toks, 2):
                counts[s] += 1
        for c in counts:  # each slot in 2 of 8 picks: 1000 expected, sd ~27
            self.assertLess(abs(c - trials * 2 / 8), 120, counts)


class Placement(unittest.TestCase):
    def test_wholly_free_handles_come_first_pair_by_pair_and_nothing_is_lost(self):
        # bps 2; slot 1 (2, 3) and slot 4 (8, 9) wholly free; 5 and 11 free with their siblings in use.
        blocks = [5, 9, 2, 11, 3, 8]
        got = compact_order(blocks, set(blocks), held={0, 1, 2, 4, 5}, blocks_per_slot=2)
        self.assertEqual(got, [2, 3, 8, 9, 5, 11])

    def test_a_free_slot_not_held_is_not_put_first(self):
        got = compact_order([7, 6, 1], {7, 6, 1}, held={0}, blocks_per_slot=2)
        self.assertEqual(got, [7, 6, 1])

    def test_order_free_blocks_rearranges_the_allocators_free_list_in_place(self):
        v, space, cache, sched = kv({"placement": "compact"})
        v.held = {0, 1, 2, 4, 5}
        bm = SimpleNamespace(_uninit_block_ids=deque([5, 9, 2, 11, 3, 8]), _init_block_ids={}, _hash_to_id={},
                             _id_to_block={})
        v.order_free_blocks(bm)
        self.assertIsInstance(bm._uninit_block_ids, deque)
        self.assertEqual(list(bm._uninit_block_ids), [2, 3, 8, 9, 5, 11])

if __name__ == "__main__":
    unittest.main()
