"""Tests of the eviction cells' shared arithmetic (eviction.py) and of cpu_sweep.py's table: no GPU,
standard library only."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eviction  # noqa: E402


def cell(size, a, f, spread):
    return dict(size_pct=size, rate=6, spread=spread, policies=dict(alg1=dict(loss=a), fifo=dict(loss=f)))


class Trend(unittest.TestCase):
    def test_between_base_points_the_line_and_outside_the_nearest_one_stands(self):
        base = [(5.0, 100.0), (45.0, 80.0)]
        self.assertEqual(eviction.trend_at(base, 0.0), 100.0)
        self.assertEqual(eviction.trend_at(base, 99.0), 80.0)
        self.assertAlmostEqual(eviction.trend_at(base, 25.0), 90.0)
        self.assertEqual(eviction.line((1.0, 4.0), (1.0, 6.0), 1.0), 5.0, "two points at one time: their mean")


class Target(unittest.TestCase):
    def test_small_cells_need_alg1_twenty_percent_below_fifo(self):
        t = eviction.target_check({"a": cell(10, 0.08, 0.10, 0.01), "b": cell(25, 0.085, 0.10, 0.01)})
        self.assertEqual(t["cells"]["a"]["verdict"], "pass")
        self.assertEqual(t["cells"]["b"]["verdict"], "fail")
        self.assertEqual(t["overall"], "fail")

    def test_small_cell_where_fifo_loses_within_the_spread_is_undecided(self):
        t = eviction.target_check({"a": cell(5, 0.0, 0.005, 0.01)})
        self.assertEqual(t["cells"]["a"]["verdict"], "undecided")
        self.assertEqual(t["overall"], "undecided")

    def test_large_cells_may_lose_to_fifo_by_the_spread_only(self):
        t = eviction.target_check({"a": cell(50, 0.30, 0.28, 0.03), "b": cell(50, 0.30, 0.25, 0.03)})
        self.assertEqual(t["cells"]["a"]["verdict"], "pass")
        self.assertEqual(t["cells"]["b"]["verdict"], "fail")


class Tables(unittest.TestCase):
    def test_per_reclaim_table_divides_by_the_reclaims_and_marks_what_is_missing(self):
        a = dict(cells={eviction.cell_key(10, 2): dict(policies=dict(alg1=dict(requeued=6, reclaims=3),
                                                                   fifo=dict(requeued=None, reclaims=3)))})
        t = eviction.per_reclaim_table(a, ["alg1", "fifo"], "requeued", "Requeued", 1)
        self.assertEqual(t[-1], "| 10%@2/min | 2.0 | - |")
        self.assertEqual((eviction.fmt(None), eviction.pct_s(0.0123)), ("-", "1.23%"))


class CpuSweepTable(unittest.TestCase):
    """cpu_sweep.py's table (standard library only: torch is imported only to run)."""

    def test_policies_side_by_side_and_algorithm_1_against_fifo(self):
        import cpu_sweep

        cell = dict(placement="default", every_steps=40, size_pct=5.0)
        cells = [dict(cell, policy="alg1", loss=0.011, requeued_per_handle=0.03),
                 dict(cell, policy="fifo", loss=0.2784, requeued_per_handle=0.4)]
        md = cpu_sweep.table(cells)
        self.assertIn("| default | 40 | 5% | 1.10% (0.03) | 27.84% (0.40) | - | +96% less |", md)
        no_fifo_loss = [dict(c, loss=0.0) if c["policy"] == "fifo" else c for c in cells]
        self.assertTrue(cpu_sweep.table(no_fifo_loss).rstrip().endswith("| - |"))


if __name__ == "__main__":
    unittest.main()
