"""cbrate.py's arithmetic on made-up timelines (standard library only)."""

import unittest

import cbrate


def timeline(per_s, seconds=130, jump_at=None, jump_per_s=None):
    """Rows (t, tokens, evicted, active, waiting, free) once a second at a rate that may change once."""
    rows, tokens = [], 0
    for t in range(seconds + 1):
        rows.append([float(t), tokens, t // 20, 40, 100, 7])
        tokens += jump_per_s if jump_at is not None and t >= jump_at else per_s
    return {"rows": rows}


class RatesTest(unittest.TestCase):
    def test_a_steady_job_has_no_spread(self):
        s = cbrate.summary("x", timeline(1000), warmup_s=15)
        self.assertAlmostEqual(s["per_s"], 1000)
        self.assertEqual(set(s["per_10s"]), {1000})
        self.assertAlmostEqual(s["spread_30s"], 0.0)

    def test_a_job_whose_rate_moves_shows_the_move_in_its_spread(self):
        s = cbrate.summary("x", timeline(1000, jump_at=70, jump_per_s=1500), warmup_s=15)
        self.assertIn(1500, s["per_10s"])
        self.assertGreater(s["spread_30s"], 0.3)

    def test_the_warmup_is_left_out_and_evictions_are_counted_after_it(self):
        s = cbrate.summary("x", timeline(1000, jump_at=0, jump_per_s=1000), warmup_s=20)
        self.assertEqual(s["seconds"], 110)
        self.assertEqual(s["evicted"], 6 - 1)

    def test_one_window_has_no_spread(self):
        self.assertIsNone(cbrate.spread([1.0]))


if __name__ == "__main__":
    unittest.main()
