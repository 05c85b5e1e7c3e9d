"""Tests of the eviction sweep's plan, loss and target check (sweep.py): no GPU, standard library only."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402


class Plan(unittest.TestCase):
    def test_default_plan_covers_every_cell_for_every_policy_and_fits_nine_minutes(self):
        w = sweep.plan()
        cells = {(x.size_pct, r, x.policy) for x in w if x.kind != "base" for r in x.rates}
        self.assertEqual(len(cells), 4 * 3 * 3)
        self.assertGreaterEqual(sum(x.kind == "base" for x in w), 3)
        self.assertEqual((w[0].kind, w[-1].kind), ("base", "base"))
        self.assertLess(sweep.plan_seconds(w, gap=2.0), 9 * 60)

    def test_slow_rates_share_one_isolated_reclaim_and_fast_ones_run_at_their_spacing(self):
        w = [x for x in sweep.plan(sizes=[10], rates=[2, 6, 20], policies=["alg1"], cell_seconds=10, lead=1)
             if x.kind != "base"]
        self.assertEqual([(x.kind, x.rates, x.reclaims_at) for x in w],
                         [("iso", [2, 6], [1]), ("direct", [20], [1, 4, 7])])

    def test_every_policy_of_a_cell_gets_the_same_reclaim_times_and_seed_and_the_order_rotates(self):
        w = [x for x in sweep.plan(sizes=[5, 50]) if x.kind != "base"]
        groups = [w[i:i + 3] for i in range(0, len(w), 3)]
        for g in groups:
            self.assertEqual(len({(tuple(x.reclaims_at), x.seed, x.size_pct) for x in g}), 1)
            self.assertEqual(sorted(x.policy for x in g), sorted(sweep.POLICIES))
        self.assertNotEqual(groups[0][0].policy, groups[1][0].policy)

    def test_consecutive_seeds_put_each_policy_in_each_place_of_every_group_once(self):
        runs = [[x for x in sweep.plan(seed=s) if x.kind != "base"] for s in (30, 31, 32)]
        for g in range(0, len(runs[0]), 3):
            for place in range(3):
                self.assertEqual(sorted(r[g + place].policy for r in runs), sorted(sweep.POLICIES))
        self.assertEqual([x.policy for x in runs[0]], [x.policy for x in sweep.plan(seed=33) if x.kind != "base"])

    def test_repeats_run_every_cell_again_with_the_order_one_step_on_and_new_random_seeds(self):
        w = [x for x in sweep.plan(sizes=[5], rates=[2], repeat=3) if x.kind != "base"]
        self.assertEqual([x.rep for x in w], [0] * 3 + [1] * 3 + [2] * 3)
        groups = [w[i:i + 3] for i in range(0, 9, 3)]
        self.assertEqual([g[0].policy for g in groups], [g[0].policy for g in groups][:1] + [
            sweep.POLICIES[(sweep.POLICIES.index(groups[0][0].policy) + k) % 3] for k in (1, 2)])
        self.assertEqual(len({g[0].seed for g in groups}), 3)
        self.assertEqual(sweep.plan(sizes=[5], rates=[2]), sweep.plan(sizes=[5], rates=[2], repeat=1))
        with self.assertRaises(ValueError):
            sweep.plan(repeat=0)

    def test_a_misspelt_policy_is_refused(self):
        with self.assertRaises(ValueError):
            sweep.plan(policies=["alg1", "lru"])


def run_window(kind, policy, t0, secs, size=None, rates=(), n=0, requeued=None):
    return dict(kind=kind, policy=policy, t0=t0, t1=t0 + secs, size_pct=size, rates=list(rates),
                reclaims_at=[1.0] * n, reclaims=n, requeued=requeued)


class Loss(unittest.TestCase):
    def finishes(self, per_s):
        # One finish of `tokens` every second: (t, tokens) for each window's seconds.
        return [(t + 0.5, n) for t, n in per_s]

    def test_loss_is_rate_times_tokens_lost_per_reclaim_over_base_throughput(self):
        wins = [run_window("base", "alg1", 0, 10), run_window("base", "alg1", 10, 10),
                run_window("iso", "alg1", 20, 10, 10, [2, 6], 1, requeued=4),
                run_window("direct", "fifo", 30, 10, 10, [20], 3)]
        fin = [(t + 0.5, 100) for t in range(20)]  # base: 100 tok/s
        fin += [(t + 0.5, 100) for t in range(20, 30) if t != 25]  # iso: 100 tokens lost to one reclaim
        fin += [(t + 0.5, 100) for t in range(30, 40) if t not in (31, 34, 37)]  # direct: 300 lost to 3
        a = sweep.analyse(wins, fin)
        self.assertAlmostEqual(a["base_tok_s"], 100.0)
        self.assertEqual(a["spread"], 0.0)
        c = a["cells"]
        self.assertAlmostEqual(c["10%@2/min"]["policies"]["alg1"]["loss"], 2 / 60 * 100 / 100)
        self.assertAlmostEqual(c["10%@6/min"]["policies"]["alg1"]["loss"], 6 / 60 * 100 / 100)
        self.assertAlmostEqual(c["10%@20/min"]["policies"]["fifo"]["loss"], 20 / 60 * 100 / 100)
        self.assertEqual(c["10%@2/min"]["policies"]["alg1"]["requeued"], 4)

    def test_spread_is_the_range_of_base_windows_scaled_like_the_loss(self):
        wins = [run_window("base", "alg1", 0, 10), run_window("base", "alg1", 10, 10),
                run_window("iso", "alg1", 20, 10, 5, [6], 1)]
        fin = [(t + 0.5, 90 if t < 10 else 110) for t in range(20)] + [(t + 0.5, 100) for t in range(20, 30)]
        a = sweep.analyse(wins, fin)
        self.assertAlmostEqual(a["spread"], 0.2)
        self.assertAlmostEqual(a["cells"]["5%@6/min"]["spread"], 0.2 * 6 / 60 * 10)
        self.assertAlmostEqual(a["cells"]["5%@6/min"]["policies"]["alg1"]["loss"], 0.0)

    def test_generated_tokens_count_the_work_in_a_window_whenever_requests_finish(self):
        timeline = [(0.0, 0), (1.0, 100), (9.5, 950), (10.5, 1050), (19.9, 1990)]
        self.assertEqual(sweep.generated_between(timeline, 0.5, 10.0), 950)
        self.assertEqual(sweep.generated_between(timeline, 1.5, 10.0), 850)
        self.assertEqual(sweep.generated_between(timeline, -1.0, 0.0), 0)
        wins = [run_window("base", "alg1", 0, 10), run_window("iso", "alg1", 10, 10, 5, [6], 1)]
        a = sweep.analyse(wins, [], [(t / 10, 10 * t) for t in range(200)] + [(20.0, 1900)])
        self.assertEqual(a["counted"], "tokens generated")
        self.assertAlmostEqual(a["base_tok_s"], 99.0)  # the last count before t=10 is at 9.9 s

    def test_no_finished_request_in_base_windows_is_an_error_not_a_division(self):
        a = sweep.analyse([run_window("base", "alg1", 0, 10)], [])
        self.assertIn("error", a)


def base_windows(rates, every):
    """Base windows of 10 s, one every `every` s from 0, running at `rates` tok/s."""
    wins = []
    for i, r in enumerate(rates):
        w = run_window("base", "alg1", every * i, 10)
        w["tokens"] = 10 * r
        wins.append(w)
    return wins


class Repeats(unittest.TestCase):
    def windows(self, base_rates):
        base = base_windows(base_rates, 100)
        cells = []
        for rep, (t0, lost_alg1, lost_fifo) in enumerate([(20, 0, 60), (120, 20, 100), (220, -20, 20)]):
            for k, (pol, lost) in enumerate((("alg1", lost_alg1), ("fifo", lost_fifo))):
                w = run_window("iso", pol, t0 + 20 * k, 10, 5, [2], 1, requeued=rep)
                w.update(rep=rep, tokens=1000 - lost, requeued_tokens=10 * rep)
                cells.append(w)
        return base, cells

    def test_a_repeated_cell_is_the_mean_of_its_windows(self):
        base, cells = self.windows([100, 100, 100])
        a = sweep.analyse(base + cells, [], None)
        self.assertEqual((a["repeats"], a["base_windows"]), (3, 3))
        p = a["cells"]["5%@2/min"]["policies"]
        self.assertAlmostEqual(p["fifo"]["loss"], 2 / 60 * 60 / 100)  # (60 + 100 + 20) / 3 tokens lost
        self.assertAlmostEqual(p["alg1"]["loss"], 0.0)
        self.assertEqual((p["fifo"]["reclaims"], p["fifo"]["requeued"], p["fifo"]["requeued_tokens"]), (3, 3, 30))

    def test_a_repeated_cells_spread_narrows_by_the_root_of_the_repeats(self):
        base, cells = self.windows([100, 110, 100])  # the inner base window 10% off its neighbours' line
        a = sweep.analyse(base + cells, [], None)
        one = sweep.analyse(base + [w for w in cells if w["rep"] == 0], [], None)
        self.assertNotIn("repeats", one)
        self.assertGreater(one["cells"]["5%@2/min"]["spread"], 0)
        self.assertAlmostEqual(a["cells"]["5%@2/min"]["spread"], one["cells"]["5%@2/min"]["spread"] / 3 ** 0.5)


class Trend(unittest.TestCase):
    """The default baseline: the base windows' line at each window's time."""

    def drifting(self, rates):
        # Base windows of 10 s at 0, 40, 80 (and 120) s running at `rates` tok/s; between them, a cell
        # window that ran exactly at the line's rate at its middle, and one that lost 100 tokens.
        return base_windows(rates, 40)

    def test_a_drifting_rate_is_not_charged_to_the_cells_but_a_mean_would_charge_it(self):
        wins = self.drifting([100, 90, 80])
        ok = run_window("iso", "alg1", 20, 10, 5, [6], 1)  # middle 25 s: the line is at 95 there
        ok["tokens"] = 950
        lossy = run_window("iso", "fifo", 60, 10, 5, [6], 1)  # middle 65 s: the line is at 85
        lossy["tokens"] = 850 - 100
        a = sweep.analyse(wins + [ok, lossy], [], None)
        self.assertEqual((a["baseline"], a["counted"]), ("trend", "the windows' tokens as reported"))
        p = a["cells"]["5%@6/min"]["policies"]
        self.assertAlmostEqual(p["alg1"]["loss"], 0.0)
        self.assertAlmostEqual(p["fifo"]["lost_tokens_per_reclaim"], 100.0)
        self.assertAlmostEqual(p["fifo"]["loss"], 6 / 60 * 100 / 85)
        self.assertAlmostEqual(a["spread"], 0.0, msg="the inner base window lies on its neighbours' line")
        self.assertAlmostEqual(a["spread_range"], 20 / 90)
        m = sweep.analyse(wins + [ok, lossy], [], None, baseline="mean")
        self.assertAlmostEqual(m["cells"]["5%@6/min"]["policies"]["alg1"]["loss"], 6 / 60 * (900 - 950) / 90)
        self.assertAlmostEqual(m["spread"], 20 / 90)

    def test_the_spread_is_the_inner_base_window_farthest_off_its_neighbours_line(self):
        a = sweep.analyse(self.drifting([100, 99, 80, 70]), [], None)
        # 99 against (100 + 80) / 2 = 90: 10% off; 80 against (99 + 70) / 2 = 84.5: 5.3% off.
        self.assertAlmostEqual(a["spread"], 9 / 90)
        self.assertEqual(a["base_windows"], 4)

    def test_fewer_than_three_base_windows_fall_back_to_the_mean(self):
        a = sweep.analyse(self.drifting([100, 80]), [], None)
        self.assertEqual(a["baseline"], "mean")
        self.assertAlmostEqual(a["spread"], 20 / 90)
        with self.assertRaises(ValueError):
            sweep.analyse(self.drifting([100, 80]), [], None, baseline="median")

    def test_outside_the_base_windows_the_nearest_one_stands(self):
        base = [(5.0, 100.0), (45.0, 80.0)]
        self.assertEqual(sweep.trend_at(base, 0.0), 100.0)
        self.assertEqual(sweep.trend_at(base, 99.0), 80.0)
        self.assertAlmostEqual(sweep.trend_at(base, 25.0), 90.0)


class Requeues(unittest.TestCase):
    def test_requeues_per_window_come_from_the_switch_before_it_and_the_next(self):
        wins = [{}, {}, {}]
        marks = [0, 0, 3, 3, 10]  # the initial switch, one per window, the last one
        sweep.attach_requeues(wins, [dict(shim=dict(requeued=m)) for m in marks])
        self.assertEqual([w["requeued"] for w in wins], [3, 0, 7])

    def test_the_requeued_requests_tokens_are_attached_and_pooled_where_the_shim_counts_them(self):
        wins = [{}, {}]
        notes = [dict(requeued=0, requeued_tokens=0), dict(requeued=2, requeued_tokens=3000),
                 dict(requeued=3, requeued_tokens=3100)]
        sweep.attach_requeues(wins, [dict(shim=n) for n in notes])
        self.assertEqual([(w["requeued"], w["requeued_tokens"]) for w in wins], [(2, 3000), (1, 100)])
        old = [{}, {}]  # an older shim: no token counter
        sweep.attach_requeues(old, [dict(shim=dict(requeued=n["requeued"])) for n in notes])
        self.assertEqual(old, [dict(requeued=2), dict(requeued=1)])
        q = sweep.pooled([dict(loss=0.1, reclaims=1, requeued=2, requeued_tokens=3000),
                          dict(loss=0.2, reclaims=1, requeued=1, requeued_tokens=100)])
        self.assertEqual((q["requeued"], q["requeued_tokens"]), (3, 3100))
        self.assertIsNone(sweep.pooled([dict(loss=0.1, reclaims=1, requeued=2)])["requeued_tokens"])

    def test_a_missed_switch_leaves_the_requeues_unknown(self):
        wins = [{}, {}]
        sweep.attach_requeues(wins, [dict(shim=dict(requeued=1))])
        self.assertEqual(wins, [{}, {}])

    def test_a_switch_noted_twice_counts_once(self):
        # The H100 run of 2026-11-26 (lane 2): the initial note was not seen, and one switch was noted
        # twice 0.05 s apart, so the last notes fell one window late.
        notes = [(1.0, "alg1", 0, 0), (13.0, "fifo", 30, 2), (25.0, "alg1", 30, 7), (25.05, "alg1", 30, 7),
                 (37.0, "alg1", 0, 9)]
        switches = [dict(t=t, selection=s, seed=k, shim=dict(requeued=q)) for t, s, k, q in notes]
        self.assertEqual(len(sweep.distinct_switches(switches)), 4)
        wins = [{}, {}, {}]
        sweep.attach_requeues(wins, switches)
        self.assertEqual([w["requeued"] for w in wins], [2, 5, 2])
        # The same choice again a window later is a switch of its own.
        later = switches[:3] + [dict(switches[3], t=37.0)]
        self.assertEqual(len(sweep.distinct_switches(later)), 4)

    def test_merge_analyses_each_run_again_with_the_requeues_from_the_notes_beside_it(self):
        import json
        import tempfile
        wins = Trend().drifting([100, 90, 80])
        cellw = run_window("iso", "fifo", 20, 10, 5, [6], 1, requeued=99)
        cellw["tokens"] = 900
        wins.insert(1, cellw)
        notes = [dict(t=float(t), selection="alg1", seed=k, shim=dict(requeued=q))
                 for t, k, q in ((0, 0, 0), (0.1, 0, 0), (18, 1, 0), (38, 2, 4), (78, 3, 4), (130, 0, 4))]
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "run"))
            with open(os.path.join(d, "run", "report.json"), "w") as f:
                json.dump(dict(device="H100", args=dict(policies=["alg1", "fifo"], cell_seconds=10), windows=wins,
                               analysis=dict(cells={})), f)
            with open(os.path.join(d, "run", "sweep-offline.json"), "w") as f:
                json.dump(dict(switches=notes), f)
            out = os.path.join(d, "m")
            self.assertEqual(sweep.main(["merge", os.path.join(d, "run", "report.json"), "--out", out,
                                         "--baseline", "trend"]), 0)
            with open(os.path.join(out, "report.json")) as f:
                m = json.load(f)["analysis"]
        fifo = m["cells"]["5%@6/min"]["policies"]["fifo"]
        self.assertEqual(fifo["requeued"], 4, "the notes' count, not the report's 99")
        self.assertAlmostEqual(fifo["loss"], 6 / 60 * (950 - 900) / 95)


def cell(size, a, f, spread):
    return dict(size_pct=size, rate=6, spread=spread, policies=dict(alg1=dict(loss=a), fifo=dict(loss=f)))


class OfflineState(unittest.TestCase):
    TIMELINE = {"columns": ["t", "tokens", "evicted", "active", "waiting", "free_blocks"],
                "rows": [[t, 0, 0 if t < 12 else 3, 40 if t < 10 else 30, 5, 10 if t < 10 else 50] for t in range(20)]}

    def test_each_window_gets_the_means_of_its_rows_and_the_offloads_made_in_it(self):
        wins = [dict(kind="base", policy="alg1", t0=0, t1=10), dict(kind="iso", policy="fifo", t0=10, t1=20),
                dict(kind="iso", policy="alg1", t0=30, t1=40)]
        sweep.attach_offline_state(wins, self.TIMELINE)
        self.assertEqual((wins[0]["active"], wins[0]["free_blocks"], wins[0]["cb_offloads"]), (40, 10, 0))
        self.assertEqual((wins[1]["active"], wins[1]["free_blocks"], wins[1]["cb_offloads"]), (30, 50, 3))
        self.assertNotIn("active", wins[2], "no rows in the window: no state made up")

    def test_no_timeline_changes_nothing_and_the_table_groups_base_and_policies(self):
        wins = [dict(kind="base", policy="alg1", t0=0, t1=10, tok_s=1000.0),
                dict(kind="iso", policy="fifo", t0=10, t1=20, tok_s=900.0)]
        sweep.attach_offline_state(wins, None)
        sweep.attach_offline_state(wins, {"columns": [], "rows": []})
        self.assertNotIn("active", wins[0])
        self.assertEqual(sweep.offline_state_table(wins), [])
        sweep.attach_offline_state(wins, self.TIMELINE)
        table = "\n".join(sweep.offline_state_table(wins))
        self.assertIn("| base (no reclaim) | 1 | 1000 | 40.0 | 10 | 0.00 |", table)
        self.assertIn("| fifo, with a reclaim | 1 | 900 | 30.0 | 50 | 3.00 |", table)


class Target(unittest.TestCase):
    def test_small_cells_need_alg1_twenty_percent_below_fifo(self):
        t = sweep.target_check({"a": cell(10, 0.08, 0.10, 0.01), "b": cell(25, 0.085, 0.10, 0.01)})
        self.assertEqual(t["cells"]["a"]["verdict"], "pass")
        self.assertEqual(t["cells"]["b"]["verdict"], "fail")
        self.assertEqual(t["overall"], "fail")

    def test_small_cell_where_fifo_loses_within_the_spread_is_undecided(self):
        t = sweep.target_check({"a": cell(5, 0.0, 0.005, 0.01)})
        self.assertEqual(t["cells"]["a"]["verdict"], "undecided")
        self.assertEqual(t["overall"], "undecided")

    def test_large_cells_may_lose_to_fifo_by_the_spread_only(self):
        t = sweep.target_check({"a": cell(50, 0.30, 0.28, 0.03), "b": cell(50, 0.30, 0.25, 0.03)})
        self.assertEqual(t["cells"]["a"]["verdict"], "pass")
        self.assertEqual(t["cells"]["b"]["verdict"], "fail")

    def test_markdown_has_a_table_per_policy_and_the_verdicts(self):
        wins = [run_window("base", "alg1", 0, 10), run_window("base", "alg1", 10, 10)]
        wins += [run_window("iso", p, 20 + 10 * i, 10, 5, [6], 1, requeued=2) for i, p in enumerate(sweep.POLICIES)]
        fin = [(t + 0.5, 100) for t in range(50)]
        a = sweep.analyse(wins, fin)
        rep = dict(device="cpu", args=dict(cell_seconds=10, policies=list(sweep.POLICIES)), analysis=a,
                   target=sweep.target_check(a["cells"]))
        md = sweep.markdown(rep)
        for p in sweep.POLICIES:
            self.assertIn(f"## {p}: offline throughput loss", md)
        self.assertIn("| 5% | 0.00% |", md)
        self.assertIn("5%@6/min | undecided", md)
        self.assertIn("| 5%@6/min | 2.0 | 2.0 | 2.0 |", md)
        self.assertNotIn("Tokens the requeued", md, "no token table from a shim that does not count them")
        for i, w in enumerate(wins[2:]):
            w["requeued_tokens"] = 1000 * (i + 1)
        a = sweep.analyse(wins, fin)
        md = sweep.markdown(dict(rep, analysis=a, target=sweep.target_check(a["cells"])))
        self.assertIn("| 5%@6/min | 1000 | 2000 | 3000 |", md)

class Merge(unittest.TestCase):
    @staticmethod
    def run_analysis(alg1, fifo, spread, requeued=(0, 4)):
        c = cell(5, alg1, fifo, spread)
        c["policies"]["alg1"].update(reclaims=1, requeued=requeued[0])
        c["policies"]["fifo"].update(reclaims=1, requeued=requeued[1])
        return dict(base_tok_s=1000.0, base_windows=5, spread=0.06, cells={"5%@2/min": c}, counted="tokens generated")

    def test_merged_runs_average_the_loss_and_narrow_the_spread_by_sqrt_runs(self):
        runs = [self.run_analysis(0.00, 0.02, 0.025), self.run_analysis(0.01, 0.03, 0.025),
                self.run_analysis(-0.01, 0.025, 0.025), self.run_analysis(0.0, 0.025, 0.025)]
        one = sweep.target_check(runs[0]["cells"])["cells"]["5%@2/min"]
        self.assertEqual(one["verdict"], "undecided", "one run: FIFO's 2% is inside the 2.5% spread")
        m = sweep.merge(runs)
        c = m["cells"]["5%@2/min"]
        self.assertAlmostEqual(c["spread"], 0.0125, msg="2.5% / sqrt(4)")
        self.assertAlmostEqual(c["policies"]["fifo"]["loss"], 0.025)
        self.assertAlmostEqual(c["policies"]["alg1"]["loss"], 0.0)
        self.assertEqual((c["policies"]["alg1"]["requeued"], c["policies"]["fifo"]["requeued"]), (0, 16))
        self.assertEqual(m["runs"], 4)
        self.assertEqual(sweep.target_check(m["cells"])["cells"]["5%@2/min"]["verdict"], "pass",
                         "four runs decide what one could not")

    def test_merge_of_nothing_is_an_error_and_the_cli_refuses_a_file_that_is_not_a_sweep(self):
        self.assertIn("error", sweep.merge([]))
        import json
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.json")
            with open(bad, "w") as f:
                json.dump({"configs": {}}, f)
            with self.assertRaises(SystemExit) as e:
                sweep.main(["merge", bad, "--out", d])
            self.assertNotEqual(e.exception.code, 0)
            good = os.path.join(d, "good.json")
            with open(good, "w") as f:
                json.dump(dict(device="cpu", args=dict(policies=["alg1", "fifo"], cell_seconds=10),
                               analysis=self.run_analysis(0.0, 0.05, 0.01)), f)
            self.assertEqual(sweep.main(["merge", good, good, "--out", os.path.join(d, "m")]), 0)
            with open(os.path.join(d, "m", "report.md")) as f:
                self.assertIn("2 runs merged", f.read())


if __name__ == "__main__":
    unittest.main()


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
