"""Tests of scripts/figures.py: axis arithmetic, field errors and the committed figures' check."""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import figures  # noqa: E402


class NiceMax(unittest.TestCase):
    def test_rounds_up_to_one_two_or_five(self):
        self.assertEqual(figures.nice_max(0.9), 1.0)
        self.assertEqual(figures.nice_max(1.3), 2.0)
        self.assertEqual(figures.nice_max(3.0), 5.0)
        self.assertEqual(figures.nice_max(479.3), 500.0)
        self.assertEqual(figures.nice_max(895.7), 1000.0)

    def test_exact_value_is_kept(self):
        self.assertEqual(figures.nice_max(200.0), 200.0)


class Fields(unittest.TestCase):
    def test_missing_field_names_report_and_path(self):
        with self.assertRaises(figures.ReportError) as e:
            figures.field({"a": {"b": None}}, "a", "b", source="x.json")
        self.assertIn("x.json: no field a.b", str(e.exception))

    def test_missing_report_says_what_to_do(self):
        with self.assertRaises(figures.ReportError) as e:
            figures.load("no-such-report.json")
        self.assertIn("restore it", str(e.exception))


class Check(unittest.TestCase):
    def test_check_fails_on_a_stale_figure_and_passes_after_redraw(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(figures.main(["--out", d]), 0)
            self.assertEqual(figures.main(["--check", "--out", d]), 0)
            path = os.path.join(d, "online-latency.svg")
            with open(path, "a", encoding="utf-8") as f:
                f.write("<!-- edited -->")
            self.assertEqual(figures.main(["--check", "--out", d]), 1)

    def test_figures_carry_the_reports_values(self):
        _, _, rows = figures.latency_series(figures.LATENCY_REPORTS[0])
        svg = figures.latency_figure()
        for _, p50, p99 in rows:
            self.assertIn(figures.fmt(p50), svg)
            self.assertIn(figures.fmt(p99), svg)


if __name__ == "__main__":
    unittest.main()
