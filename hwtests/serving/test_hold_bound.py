"""hold_bound.py's bounds on hand-made gaps whose answers are known."""

import unittest

import hold_bound as hb


class Bounds(unittest.TestCase):
    def test_a_fixed_hold_over_short_and_long_gaps(self):
        gaps = [0.5] * 7 + [30.0] * 3  # idle 93.5 s; H = 0.5 catches 7 for 3.5 + 1.5 s
        caught, hold = hb.best_fixed(gaps, allowed=5.0)
        self.assertEqual((caught, hold), (7, 0.5))
        self.assertEqual(hb.best_fixed(gaps, allowed=4.99)[0], 0)
        self.assertEqual(hb.best_oracle(gaps, allowed=4.99), 7)  # the oracle pays 3.5 s

    def test_the_frontier_rises_in_cost_and_catch(self):
        f = hb.fixed_frontier([3.0, 0.1, 1.0, 1.0, 8.0])
        self.assertEqual(f[0], (0, 0.0, 0.0))
        for a, b in zip(f, f[1:]):
            self.assertLessEqual(a[0], b[0])
            self.assertLess(a[1], b[1])
        self.assertIn((4, 0.1 + 1 + 1 + 3 + 3, 3.0), f)

    def test_a_hold_per_stretch_beats_one_hold_where_stretches_differ(self):
        a, b = [1.0] * 5, [0.2] * 5 + [50.0] * 5
        # One hold: 1 s catches all ten for 5 + 1 + 5 = 11 s; 0.2 s catches b's five for 3 s.
        self.assertEqual(hb.best_fixed(a + b, allowed=8.0)[0], 5)
        self.assertEqual(hb.best_fixed(a + b, allowed=11.0)[0], 10)
        # A hold per stretch: 1 s in a (5 s), 0.2 s in b (2 s): all ten for 7 s.
        self.assertEqual(hb.best_piecewise([a, b], allowed=8.0), 10)
        self.assertEqual(hb.best_piecewise([a, b], allowed=6.9), 5)
        self.assertEqual(hb.best_oracle(a + b, allowed=6.0), 10)

    def test_the_bounds_order_and_harvest_on_a_window(self):
        tg = [(float(t), g) for t, g in enumerate([0.4, 0.6, 20.0, 0.3, 40.0, 0.5, 0.2, 90.0, 0.7, 0.4])]
        r = hb.bounds(tg, (0.0, 9.0), stretches=2, cooldown_s=0.0)
        for h in ("90", "85", "80"):
            a = r["at"][h]
            self.assertLessEqual(a["fixed_pct"], a["piecewise_pct"])
            self.assertLessEqual(a["piecewise_pct"], a["oracle_pct"])
        self.assertEqual(r["at"]["90"]["oracle_pct"], 70.0)  # the seven short gaps cost 3.1 s of 153.1
        self.assertEqual(r["fixed_70_hold_s"], 0.7)

    def test_the_server_finds_idle_arrivals_past_the_cooldown(self):
        gaps = hb.idle_gaps([0.0, 0.1, 1.0, 1.31], service_s=0.3, cooldown_s=0.011)
        self.assertEqual(len(gaps), 1)  # 0.1 queues; 1.0 finds it idle; 1.31 comes inside the cooldown
        self.assertAlmostEqual(gaps[0][1], 1.0 - 0.6 - 0.011)


if __name__ == "__main__":
    unittest.main()
