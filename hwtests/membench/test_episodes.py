"""episodes.py's plan and arithmetic on made-up episodes (standard library only)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import episodes

HERE = os.path.dirname(os.path.abspath(__file__))


def run_plan(plan, base_s=20.0, drift_per_ep=0.0, lost=None, jitter=None, requeued=None, host=None):
    """The plan's episodes as run: `base_s` seconds to the count (plus `drift_per_ep` per episode run
    before, plus jitter[k] for episode k), plus lost[policy] seconds per reclaim made; 25 steps a
    second, and then the host makes episode k's steps host[k] times as long (its seconds only)."""
    lost, jitter, requeued, host = lost or {}, jitter or {}, requeued or {}, host or {}
    out = []
    for k, e in enumerate(plan):
        d = dict(vars(e), t0=30.0 * k, reclaims=len(e.reclaims_at))
        d["seconds"] = base_s + drift_per_ep * k + jitter.get(k, 0.0)
        if e.kind not in ("warm", "base"):
            d["seconds"] += lost.get(e.policy, 0.0) * len(e.reclaims_at)
            d["requeued"], d["requeued_tokens"] = requeued.get(e.policy, (0, 0))
        d["steps"] = 25 * d["seconds"]
        d["seconds"] *= host.get(k, 1.0)
        out.append(d)
    return out


class Plan(unittest.TestCase):
    def test_warm_ups_then_a_base_before_every_group_and_one_after_the_last(self):
        p = episodes.plan([10], [2, 6], ["alg1", "fifo"], lead=9, measure_s=20, repeat=3)
        kinds = [e.kind for e in p]
        self.assertEqual(kinds[:2], ["warm", "warm"])
        self.assertEqual(kinds[2:], ["base", "iso", "iso"] * 3 + ["base"])

    def test_rates_too_slow_for_a_second_reclaim_share_one_and_fast_ones_run_at_their_spacing(self):
        p = episodes.plan([5], [2, 6, 20], ["alg1"], lead=9, measure_s=30, tail=6)
        iso = [e for e in p if e.kind == "iso"]
        direct = {e.rates[0]: e.reclaims_at for e in p if e.kind == "direct"}
        self.assertEqual([e.rates for e in iso], [[2]])  # 30 s apart: no second reclaim in 9-24 s
        self.assertEqual(direct[6], [9, 19])
        self.assertEqual(direct[20], [9, 12, 15, 18, 21, 24])

    def test_the_policies_order_alternates_between_repeats_with_the_same_times_and_seed(self):
        p = episodes.plan([10], [2], ["alg1", "fifo"], lead=9, measure_s=20, repeat=4, seed=47)
        groups = [[e for e in p if e.kind == "iso" and e.rep == r] for r in range(4)]
        self.assertEqual([[e.policy for e in g] for g in groups],
                         [["fifo", "alg1"], ["alg1", "fifo"], ["fifo", "alg1"], ["alg1", "fifo"]])
        for g in groups:
            self.assertEqual(len({(tuple(e.reclaims_at), e.seed) for e in g}), 1)

    def test_a_lead_that_leaves_no_tail_or_a_misspelt_policy_is_refused(self):
        with self.assertRaises(ValueError) as e:
            episodes.plan([10], [2], ["alg1"], lead=15, measure_s=20, tail=6)
        self.assertIn("--tail", str(e.exception))
        with self.assertRaises(ValueError) as e:
            episodes.plan([10], [2], ["alg1", "lru"], lead=9, measure_s=20)
        self.assertIn("lru", str(e.exception))


class Timeline(unittest.TestCase):
    line = [(100.5, 10), (101.0, 30), (101.5, 30), (102.0, 55)]

    def test_time_to_tokens_is_the_first_step_at_or_past_the_count(self):
        self.assertAlmostEqual(episodes.time_to_tokens(self.line, 100.0, 30), 1.0)
        self.assertAlmostEqual(episodes.time_to_tokens(self.line, 100.0, 31), 2.0)
        self.assertIsNone(episodes.time_to_tokens(self.line, 100.0, 56))

    def test_tokens_by_a_time_are_the_last_count_before_it(self):
        self.assertEqual(episodes.tokens_by(self.line, 100.0, 1.6), 30)
        self.assertEqual(episodes.tokens_by(self.line, 100.0, 0.1), 0)


class Analyse(unittest.TestCase):
    def plan(self, repeat=6, rates=(2, 6)):
        return episodes.plan([10], list(rates), ["alg1", "fifo"], lead=9, measure_s=20, repeat=repeat, seed=47)

    def test_loss_is_rate_times_seconds_lost_per_reclaim_and_drift_is_not_charged(self):
        eps = run_plan(self.plan(), drift_per_ep=0.05, lost={"alg1": 0.1, "fifo": 0.6},
                       requeued={"alg1": (1, 1000), "fifo": (9, 20000)})
        a = episodes.analyse(eps)
        c = a["cells"]["10%@2/min"]
        self.assertAlmostEqual(c["policies"]["fifo"]["loss"], 2 / 60 * 0.6, places=9)
        self.assertAlmostEqual(c["policies"]["alg1"]["loss"], 2 / 60 * 0.1, places=9)
        self.assertAlmostEqual(a["cells"]["10%@6/min"]["policies"]["fifo"]["loss"], 6 / 60 * 0.6, places=9)
        self.assertAlmostEqual(c["paired"][0], 2 / 60 * 0.5, places=9)
        self.assertEqual(c["repeats"], 6)
        self.assertEqual(c["policies"]["fifo"]["requeued_tokens"], 6 * 20000)
        self.assertGreater(a["drift"], 0)

    def test_a_clear_win_passes_and_a_fifo_loss_inside_the_jitter_is_undecided(self):
        jit = {k: (0.2 if k % 2 else -0.2) for k in range(40)}
        win = episodes.analyse(run_plan(self.plan(), lost={"alg1": 0.1, "fifo": 1.0}, jitter=jit))
        t = episodes.eviction.target_check(win["cells"])
        self.assertEqual(t["cells"]["10%@2/min"]["verdict"], "pass")
        self.assertGreater(win["cells"]["10%@2/min"]["margin"][0], 0)
        small = episodes.analyse(run_plan(self.plan(), lost={"alg1": 0.0, "fifo": 0.05}, jitter=jit))
        self.assertEqual(episodes.eviction.target_check(small["cells"])["cells"]["10%@2/min"]["verdict"], "undecided")

    def test_a_host_that_slows_whole_episodes_moves_their_seconds_but_not_their_steps(self):
        host = {k: (1.3 if (k // 3) % 2 == 0 else 0.9) for k in range(40)}
        eps = run_plan(self.plan(), lost={"alg1": 0.1, "fifo": 1.0}, host=host)
        steps, seconds = episodes.analyse(eps, "steps"), episodes.analyse(eps, "seconds")
        c = steps["cells"]["10%@2/min"]
        # the base episodes (2, 5, 8, ...) ran at 1.3, 0.9, 1.3, ...: a step lost is worth their mean step
        mean_host = sum(host[k] for k in range(2, 21, 3)) / 7
        self.assertAlmostEqual(steps["base_seconds"], 20.0 * mean_host, places=9)
        self.assertAlmostEqual(c["policies"]["fifo"]["loss"], 2 / 60 * 1.0 * mean_host, places=9)
        self.assertAlmostEqual(steps["jitter"], 0.0, places=9)
        self.assertEqual(episodes.eviction.target_check(steps["cells"])["cells"]["10%@2/min"]["verdict"], "pass")
        self.assertGreater(seconds["jitter"], 0.1)
        self.assertEqual(episodes.eviction.target_check(seconds["cells"])["cells"]["10%@2/min"]["verdict"], "undecided")
        with self.assertRaises(ValueError):
            episodes.analyse(eps, "tokens")

    def test_algorithm_1_losing_more_than_fifo_fails(self):
        a = episodes.analyse(run_plan(self.plan(), lost={"alg1": 1.0, "fifo": 0.8}))
        self.assertEqual(episodes.eviction.target_check(a["cells"])["cells"]["10%@2/min"]["verdict"], "fail")

    def test_the_spread_is_twice_fifos_standard_error_when_that_is_larger(self):
        eps = run_plan(self.plan(repeat=4, rates=(2,)), lost={"alg1": 0.1, "fifo": 0.6})
        fifo = [e for e in eps if e["policy"] == "fifo" and e["kind"] == "iso"]
        for e, extra in zip(fifo, (0.0, 0.4, 0.0, 0.4)):
            e["seconds"] += extra
        c = episodes.analyse(eps)["cells"]["10%@2/min"]
        losses = c["policies"]["fifo"]["losses"]
        m = sum(losses) / 4
        se = (sum((x - m) ** 2 for x in losses) / 3 / 4) ** 0.5
        self.assertAlmostEqual(c["policies"]["fifo"]["se"], se, places=9)
        self.assertAlmostEqual(c["spread"], 2 * se, places=9)  # the base episodes have no jitter here

    def test_too_few_base_episodes_is_an_error_not_a_division(self):
        eps = [e for e in run_plan(self.plan(repeat=1)) if e["kind"] != "base"][:3]
        a = episodes.analyse(eps)
        self.assertIn("base", a["error"])
        self.assertEqual(a["cells"], {})

    def test_runs_merge_their_repeats_and_the_cli_writes_one_report(self):
        eps1 = run_plan(self.plan(repeat=3), lost={"alg1": 0.1, "fifo": 0.6})
        eps2 = run_plan(self.plan(repeat=2), lost={"alg1": 0.3, "fifo": 0.9})
        reps = [dict(args=dict(policies=["alg1", "fifo"]), device="H100", tokens=9000, analysis=episodes.analyse(e))
                for e in (eps1, eps2)]
        m = episodes.merge([r["analysis"] for r in reps])
        c = m["cells"]["10%@2/min"]
        self.assertEqual(c["repeats"], 5)
        self.assertAlmostEqual(c["policies"]["fifo"]["loss"], 2 / 60 * (3 * 0.6 + 2 * 0.9) / 5, places=9)
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, r in enumerate(reps):
                paths.append(os.path.join(d, f"r{i}.json"))
                with open(paths[-1], "w") as f:
                    json.dump(r, f)
            out = subprocess.run([sys.executable, os.path.join(HERE, "episodes.py"), "merge", *paths, "--out", d],
                                 capture_output=True, text=True, check=True).stdout
            self.assertIn("2 runs merged", out)
            self.assertIn("| 10%@2/min | 5 |", out)
            with open(os.path.join(d, "report.json")) as f:
                self.assertEqual(json.load(f)["target"]["cells"]["10%@2/min"]["verdict"], "pass")

    def test_markdown_has_the_cells_the_requeues_and_the_verdicts(self):
        eps = run_plan(self.plan(repeat=2), lost={"alg1": 0.1, "fifo": 0.6},
                       requeued={"alg1": (1, 1000), "fifo": (9, 20000)})
        rep = dict(args=dict(policies=["alg1", "fifo"]), device="NVIDIA H100", tokens=9000,
                   analysis=episodes.analyse(eps), analysis_seconds=episodes.analyse(eps, "seconds"))
        text = episodes.markdown(rep)
        self.assertIn("run to 9000 generated tokens", text)
        self.assertIn("Measured in steps to the count", text)
        self.assertIn("## The same episodes timed in seconds", text)
        self.assertIn("| 10%@6/min | 2 |", text)
        self.assertIn("20000", text)
        self.assertIn("## Target (steps): pass", text)


if __name__ == "__main__":
    unittest.main()
