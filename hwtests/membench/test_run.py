"""Unit tests of run.py's checks made before a benchmark starts (standard library only)."""

import unittest

import run


class Configs(unittest.TestCase):
    def test_every_known_configuration_runs_in_any_order_after_alone(self):
        self.assertIsNone(run.config_problem(list(run.CONFIGS), have_sizes=False))

    def test_a_misspelt_configuration_is_named_with_the_choices(self):
        msg = run.config_problem(["alone", "valve-mad"], have_sizes=False)
        self.assertIn("valve-mad", msg)
        self.assertIn("valve-miad", msg)

    def test_static_without_an_alone_run_before_it_is_refused_unless_sizes_exist(self):
        self.assertIn("alone before static", run.config_problem(["static", "alone"], have_sizes=False))
        self.assertIsNone(run.config_problem(["static"], have_sizes=True))


if __name__ == "__main__":
    unittest.main()
