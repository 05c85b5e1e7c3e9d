"""Tests of hold_bound.py: hand-made windows with known answers (standard library only)."""

import io
import json
import os
import random
import tempfile
import unittest
from contextlib import redirect_stdout

import hold_bound as hb
import trace_windows

S = 0.3


def from_gaps(gaps, service_s=S, cooldown_s=0.0, start=0.0):
    """Arrivals whose idle gaps past the cooldown are `gaps`, one request each."""
    t, out = start, [start]
    for g in gaps:
        t += service_s + cooldown_s + g
        out.append(t)
    return out


class IdleGaps(unittest.TestCase):
    def test_queue_and_cooldown(self):
        # 0.1 queues behind 0 (free at 0.6); 0.705 finds 0.094 past the cooldown; 1.01 comes within
        # the cooldown of 1.005 and is no idle arrival; 2.0 finds 2.0 - 1.31 - 0.011.
        got = trace_windows.idle_gaps([0.0, 0.1, 0.705, 1.01, 2.0], S, 0.011)
        self.assertEqual([t for t, _ in got], [0.705, 2.0])
        self.assertAlmostEqual(got[0][1], 0.094)
        self.assertAlmostEqual(got[1][1], 2.0 - 1.31 - 0.011)


class KnownAnswers(unittest.TestCase):
    gaps = [0.5] * 7 + [30.0] * 3

    def test_fixed_catches_70_at_half_a_second(self):
        b = hb.bound(from_gaps(self.gaps), S, 0.0, 1)
        self.assertEqual(b["idle_arrivals"], 10)
        self.assertAlmostEqual(b["idle_s"], 93.5)
        f90 = b["fixed"]["at_harvest_90"]
        self.assertEqual(f90["caught"], 7)
        self.assertAlmostEqual(f90["hold_s"], 0.5)
        self.assertAlmostEqual(f90["harvest_pct"], 100 * (1 - (3.5 + 1.5) / 93.5))
        f70 = b["fixed"]["for_70pct_caught"]
        self.assertEqual(f70["caught"], 7)
        self.assertAlmostEqual(f70["harvest_pct"], 100 * (1 - 5.0 / 93.5))
        # The oracle holds through the seven short gaps only.
        self.assertEqual(b["oracle"]["at_harvest_90"]["caught"], 7)
        self.assertAlmostEqual(b["oracle"]["for_70pct_caught"]["harvest_pct"], 100 * (1 - 3.5 / 93.5))
        # The frontier: H = 0, 0.5, 30.
        self.assertEqual([p["caught"] for p in b["fixed_frontier"]], [0, 7, 10])
        self.assertAlmostEqual(b["fixed_frontier"][-1]["harvest_pct"], 0.0)

    def test_cooldown_is_always_lost(self):
        c = 0.011
        b = hb.bound(from_gaps(self.gaps, cooldown_s=c), S, c, 1)
        idle = 93.5 + 10 * c
        self.assertAlmostEqual(b["idle_s"], idle)
        self.assertAlmostEqual(b["harvest_at_no_hold_pct"], 100 * (1 - 10 * c / idle))
        self.assertAlmostEqual(b["fixed"]["at_harvest_90"]["harvest_pct"], 100 * (1 - (5.0 + 10 * c) / idle))

    def test_nothing_caught_when_the_budget_buys_no_gap(self):
        b = hb.bound(from_gaps([10.0] * 5), S, 0.0, 1)
        self.assertEqual(b["fixed"]["at_harvest_90"]["caught"], 0)
        self.assertAlmostEqual(b["fixed"]["at_harvest_90"]["harvest_pct"], 100.0)
        self.assertEqual(b["piecewise"]["at_harvest_90"]["caught"], 0)
        self.assertEqual(b["oracle"]["at_harvest_90"]["caught"], 0)
        # 70% is 4 of 5, but the hold that catches 4 equal gaps catches the fifth.
        self.assertEqual(b["fixed"]["for_70pct_caught"]["caught"], 5)
        self.assertEqual(b["oracle"]["for_70pct_caught"]["caught"], 4)


class Piecewise(unittest.TestCase):
    def test_beats_fixed(self):
        # Stretch 0: five 0.6-s gaps. Stretch 1: five 0.1-s gaps among twenty 3-s ones. Idle 63.5 s,
        # 6.35 s may be lost. One hold: 0.1 s (5 caught, 3.0 s lost); 0.6 s would lose 15.5 s.
        # Per stretch: 0.6 s then 0.1 s, 10 caught for 3.0 + 2.5 s.
        first = from_gaps([0.6] * 5)
        rng = random.Random(1)
        second = [0.1] * 5 + [3.0] * 20
        rng.shuffle(second)
        arr = first + from_gaps(second, start=first[-1])[1:]
        span = 2 * first[-1] + 0.15  # the boundary falls inside the request that ends stretch 0
        b = hb.bound(arr, S, 0.0, 2, span)
        self.assertEqual(b["stretch_idle_arrivals"], [5, 25])
        self.assertAlmostEqual(b["idle_s"], 63.5)
        self.assertEqual(b["fixed"]["at_harvest_90"]["caught"], 5)
        self.assertAlmostEqual(b["fixed"]["at_harvest_90"]["hold_s"], 0.1)
        p90 = b["piecewise"]["at_harvest_90"]
        self.assertEqual(p90["caught"], 10)
        self.assertEqual([round(h, 6) for h in p90["holds_s"]], [0.6, 0.1])
        self.assertAlmostEqual(p90["harvest_pct"], 100 * (1 - 5.5 / 63.5))
        # With one stretch the piecewise bound is the fixed one.
        one = hb.bound(arr, S, 0.0, 1, span)
        self.assertEqual(one["piecewise"]["at_harvest_90"]["caught"], 5)


def bursty(seed, n=400):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(5.0) if rng.random() < 0.7 else rng.expovariate(0.05)
        out.append(t)
    return out


class Orders(unittest.TestCase):
    def test_frontier_is_monotone(self):
        for seed in range(5):
            b = hb.bound(bursty(seed), S, 0.011, 8)
            fr = b["fixed_frontier"]
            for a, c in zip(fr, fr[1:]):
                self.assertLess(a["caught"], c["caught"])
                self.assertGreaterEqual(a["harvest_pct"], c["harvest_pct"] - 1e-9)
                self.assertLess(a["hold_s"], c["hold_s"])
            for name in ("fixed", "piecewise", "oracle"):
                x = b[name]
                self.assertLessEqual(x["at_harvest_90"]["caught"], x["at_harvest_85"]["caught"])
                self.assertLessEqual(x["at_harvest_85"]["caught"], x["at_harvest_80"]["caught"])

    def test_oracle_above_piecewise_above_fixed(self):
        for seed in range(8):
            for k in (1, 2, 8, 20):
                b = hb.bound(bursty(seed), S, 0.011, k)
                for key in ("at_harvest_90", "at_harvest_85", "at_harvest_80"):
                    f, p, o = (b[n][key]["caught"] for n in ("fixed", "piecewise", "oracle"))
                    self.assertLessEqual(f, p, (seed, k, key))
                    self.assertLessEqual(p, o, (seed, k, key))
                f, p, o = (b[n]["for_70pct_caught"]["harvest_pct"] for n in ("fixed", "piecewise", "oracle"))
                self.assertLessEqual(f, p + 1e-9)
                self.assertLessEqual(p, o + 1e-9)

    def test_piecewise_matches_brute_force(self):
        # Three stretches, every combination of holds from each stretch's own gaps.
        for seed in range(4):
            arr = bursty(seed, 60)
            b = hb.bound(arr, S, 0.0, 3)
            ig = hb.gaps_of(arr, S, 0.0)
            width = arr[-1] / 3
            groups = [[g for t, g in ig if min(2, int(t // width)) == k] for k in range(3)]
            budget = 0.1 * b["idle_s"]
            best = 0
            for h0 in [0.0] + groups[0]:
                for h1 in [0.0] + groups[1]:
                    for h2 in [0.0] + groups[2]:
                        hs = (h0, h1, h2)
                        lost = sum(min(g, hs[k]) for k in range(3) for g in groups[k])
                        if lost <= budget + 1e-9:
                            best = max(best, sum(g <= hs[k] for k in range(3) for g in groups[k]))
            self.assertEqual(b["piecewise"]["at_harvest_90"]["caught"], best)


class Cli(unittest.TestCase):
    def test_json_from_a_hold_seed_directory(self):
        with tempfile.TemporaryDirectory() as d:
            trace_windows.write_window(os.path.join(d, "window-arrivals.csv"), from_gaps(KnownAnswers.gaps, start=1.0))
            with open(os.path.join(d, "hold-seed.json"), "w") as f:
                json.dump({"window_seed": 7, "predicted_seeded": {"idle_arrivals": 10, "caught_pct": 50.0,
                                                                  "harvest_pct": 94.0, "preemptions": 5},
                           "predicted_fresh": None}, f)
            out = os.path.join(d, "bound.json")
            with redirect_stdout(io.StringIO()) as text:
                self.assertEqual(hb.main([d, "--cooldown-s", "0", "--json", out]), 0)
            self.assertIn("| 7 | 10 |", text.getvalue())
            with open(out) as f:
                w = json.load(f)["windows"][0]
            self.assertEqual(w["fixed"]["at_harvest_90"]["caught"], 7)
            self.assertAlmostEqual(w["fixed"]["at_harvest_90"]["harvest_pct"], 100 * (1 - 5.0 / 93.5), places=4)
            self.assertEqual(w["policy_seeded"]["caught_pct"], 50.0)
            self.assertEqual(w["fixed"]["at_policy_harvest"]["caught"], 7)  # 94.65% >= 94%


if __name__ == "__main__":
    unittest.main()
