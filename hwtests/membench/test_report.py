"""Tests of the memory benchmark's arithmetic (report.py, common.py): no GPU, standard library only.

    python3 -m unittest discover -s hwtests/membench -p 'test_*.py'
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import report  # noqa: E402


def request(arrival, stamps, burst=False, error=None):
    return dict(arrival=arrival, timestamps=stamps, burst=burst, error=error)


class Latencies(unittest.TestCase):
    def test_ttft_from_arrival_and_tpot_from_later_tokens(self):
        on = dict(requests=[request(0.0, [0.010, 0.020, 0.040]), request(1.0, [1.5], burst=True),
                            request(2.0, [], error="boom")], failed=1)
        lat = report.latencies(on)
        self.assertAlmostEqual(lat["ttft_short_p50"], 10.0)
        self.assertAlmostEqual(lat["ttft_burst_p99"], 500.0)
        self.assertAlmostEqual(lat["ttft_p99"], 500.0)
        self.assertAlmostEqual(lat["tpot_p50"], 15.0)  # (40 - 10) / 2 gaps

    def test_busy_fraction_merges_overlapping_requests(self):
        on = dict(t0=0.0, t_end=10.0, requests=[request(0.0, [1.0, 2.0]), request(1.0, [3.0]),
                                                request(5.0, [6.0])])
        self.assertAlmostEqual(report.busy_fraction(on), 0.4)

    def test_percentile_is_nearest_rank(self):
        self.assertEqual(common.pct([5, 1, 3, 2, 4], 50), 3)
        self.assertEqual(common.pct(list(range(1, 101)), 99), 99)
        self.assertIsNone(common.pct([], 50))


class CountNoise(unittest.TestCase):
    def test_a_short_run_s_rate_states_what_counting_alone_moves_it_by(self):
        self.assertEqual(report.count_noise(6.0, 3.83), "; 23 expected at the target, so +-21% from counting alone")
        self.assertEqual(report.count_noise(6.0, 10.0), "; 60 expected at the target, so +-13% from counting alone")
        self.assertEqual(report.count_noise(None, 3.0), "")
        self.assertEqual(report.count_noise(6.0, None), "")


class ReclaimWindows(unittest.TestCase):
    def test_rates_per_window_count_only_grows_that_reclaimed(self):
        # (t, latency, handles, reclaimed): 3 reclaims in the first 120 s, 1 in the second, a no-reclaim grow
        grows = [(10.0, 0.001, 1, 1), (50.0, 0.002, 4, 4), (119.0, 0.001, 2, 1), (130.0, 0.001, 1, 0),
                 (200.0, 0.001, 8, 8), (300.0, 0.001, 1, 1)]
        on = dict(t0=0.0, t_end=250.0, grows=grows)
        self.assertEqual(report.reclaim_windows(on), [1.5, 0.5])  # 10 s left over: no window; 300 s is after the end

    def test_a_last_window_of_at_least_half_is_scaled_to_its_length(self):
        on = dict(t0=0.0, t_end=180.0, grows=[(130.0, 0.001, 1, 1), (170.0, 0.001, 1, 1)])
        self.assertEqual(report.reclaim_windows(on), [0.0, 2.0])

    def test_no_trace_no_windows(self):
        self.assertEqual(report.reclaim_windows(dict(grows=[])), [])


class Steps(unittest.TestCase):
    FIELDS = ["t", "prepare_s", "forward_s", "update_s", "requests", "q_tokens", "kv_read", "forward_cpu_s"]

    def online(self, forward_ms_by_kv):
        steps = [(0.0, 0.001, ms / 1e3, 0.0005, 4, 4, kv, ms / 2e3) for kv, ms in forward_ms_by_kv]
        steps.append((0.0, 0.002, 0.5, 0.001, 2, 3000, 5000, 0.1))  # a prefill step: not a decode step
        return dict(steps=steps, steps_fields=self.FIELDS)

    def test_profile_sums_the_loop_and_bins_decode_steps_by_kv_read(self):
        p = report.step_profile(self.online([(100, 10.0), (200, 12.0), (9000, 30.0)]))
        self.assertEqual(p["steps"], 4)
        self.assertEqual(p["decode_steps"], 3)
        self.assertAlmostEqual(p["forward_s"], 0.552)
        self.assertAlmostEqual(p["forward_cpu_s"], 0.126)
        self.assertEqual(p["decode_ms_by_kv_bin"]["0"]["n"], 2)
        self.assertAlmostEqual(p["decode_ms_by_kv_bin"]["1"]["p50"], 30.0)

    def test_decode_comparison_uses_only_bins_both_have(self):
        ref = report.step_profile(self.online([(100, 10.0), (9000, 30.0)]))
        slow = report.step_profile(self.online([(100, 12.0), (100, 12.0), (9000, 30.0), (30000, 99.0)]))
        # bin 0: 1.2 over 2 steps, bin 1: 1.0 over 1 step; bin 3 is not in ref
        self.assertAlmostEqual(report.decode_vs(slow, ref), (2 * 1.2 + 1.0) / 3)
        self.assertIsNone(report.decode_vs(None, ref))
        self.assertIsNone(report.step_profile(dict(requests=[])))


class Miad(unittest.TestCase):
    def test_interval_and_balance_are_summarised_from_the_pool_samples(self):
        res = dict(config="valve-miad", miad=dict(samples=[[1.0, 10, 4, 1000, 3.0, 3], [2.0, 30, 8, 600, 8.5, 9],
                                                            [3.0, 29, 7, 600, 7.2, 9]]))
        m = report.config_numbers(res)["miad"]
        self.assertEqual((m["interval_ms_first"], m["interval_ms_min"], m["interval_ms_last"]), (1000, 600, 600))
        self.assertEqual((m["target_handles_max"], m["balance_max"], m["balance_last"]), (30, 8.5, 7.2))
        self.assertNotIn("miad", report.config_numbers(dict(config="static")))


class Reclaims(unittest.TestCase):
    def test_only_grows_that_reclaimed_count_and_sizes_are_split(self):
        on = dict(grows=[(0, 0.002, 1, 1), (0, 0.050, 4, 0), (0, 0.004, 16, 16), (0, 0.012, 128, 100)])
        r = report.reclaim_latency(on)
        self.assertEqual(r["64MiB"]["n"], 1)
        self.assertEqual(r["128MiB-1GiB"]["n"], 1)
        self.assertAlmostEqual(r["128MiB-1GiB"]["p99"], 4.0)
        # The target's "up to 1 GiB" holds the one-handle reclaims too (they were left out once).
        self.assertEqual(r["<=1GiB"]["n"], 2)
        self.assertAlmostEqual(r["<=1GiB"]["p50"], 2.0, msg="the one-handle reclaim")
        self.assertEqual(r[">1GiB"]["n"], 1)
        self.assertEqual(r["all"]["n"], 3, "the 50 ms grow served from free memory is not a reclaim")

    def test_boundary_wait_is_length_biased(self):
        # One 900 ms step and nine 10 ms steps: most random instants fall in the long step.
        steps = [0.0, 0.9] + [0.9 + 0.01 * i for i in range(1, 10)]
        b = report.boundary_wait(steps, samples=5000)
        self.assertEqual(b["n"], 10)
        self.assertGreater(b["p50"], 100.0)
        self.assertLessEqual(b["p99"], 900.0)
        self.assertAlmostEqual(b["step_max"], 900.0)
        self.assertEqual(report.boundary_wait([])["n"], 0)


class Targets(unittest.TestCase):
    def nums(self, rate, ttft_pct, crashed=False):
        return {"valve-miad": dict(reclaims_per_min=rate, ttft_p99_vs_alone_pct=ttft_pct, tpot_p99_vs_alone_pct=0.5,
                                   offline_vs_static=2.0, offline_crashed=crashed,
                                   reclaim_ms={"<=1GiB": dict(p99=4.0)}, gpu_used_mib_before=0,
                                   gpu_used_mib_after=0)}

    def test_targets_pass_and_fail_on_the_numbers(self):
        ok = {c["check"]: c["ok"] for c in report.targets(self.nums(11.0, 3.0), dict(target_per_min=10.0))}
        self.assertTrue(all(v for k, v in ok.items() if "noreserve" not in k), ok)
        bad = {c["check"]: c["ok"] for c in report.targets(self.nums(13.0, 6.0, True), dict(target_per_min=10.0))}
        self.assertFalse(bad["valve-miad: MIAD reclaims/min within 25% of the target (10.0/min)"])
        self.assertFalse(bad["valve-miad: TTFT p99 <= +5% vs alone"])
        self.assertFalse(bad["no offline crash"])
        self.assertIsNone(bad["valve-noreserve: offline throughput >= 1.5x static"], "not run is not a pass")
        self.assertNotIn("valve-miad-warm: offline throughput >= 1.5x static", ok, "checked only where it ran")
        nums = dict(self.nums(6.0, 1.0), **{"valve-miad-warm": dict(offline_vs_static=1.4)})
        warm = {c["check"]: c["ok"] for c in report.targets(nums, dict(target_per_min=6.0))}
        self.assertFalse(warm["valve-miad-warm: offline throughput >= 1.5x static"])
        self.assertIsNone(warm["valve-miad-warm: MIAD reclaims/min within 25% of the target (6.0/min)"],
                          "the warm run has a rate check of its own; here it has no rate")

    def test_the_warm_run_is_held_to_the_rate_and_latency_targets_beside_static(self):
        nums = dict(self.nums(6.0, 1.0),
                    **{"valve-miad-warm": dict(reclaims_per_min=8.0, reclaims=9, trace_minutes=1.1,
                                               ttft_p99_vs_alone_pct=9.8, tpot_p99_vs_alone_pct=1.0),
                       "static": dict(ttft_p99_vs_alone_pct=2.4, tpot_p99_vs_alone_pct=11.7)})
        checks = {c["check"]: c for c in report.targets(nums, dict(target_per_min=6.0))}
        self.assertFalse(checks["valve-miad-warm: MIAD reclaims/min within 25% of the target (6.0/min)"]["ok"])
        self.assertTrue(checks["valve-miad: MIAD reclaims/min within 25% of the target (6.0/min)"]["ok"])
        ttft = checks["valve-miad-warm: TTFT p99 <= +5% vs alone"]
        self.assertFalse(ttft["ok"])
        self.assertIn("static (no reclaims): +2.4%", ttft["detail"])
        self.assertTrue(checks["valve-miad-warm: TPOT p99 <= +2% vs alone"]["ok"])

    def test_a_long_warm_run_is_judged_on_its_first_90_s_against_static_s(self):
        def off(first, later, seconds):
            # One request of `first` tokens a second for 90 s after go, then `later` a second.
            fin = [(100.0 + t + 0.5, first if t < 90 else later) for t in range(int(seconds))]
            return dict(t0=100.0, t1=100.0 + seconds, finishes=fin, tokens_per_s=1.0, finished=len(fin))

        self.assertEqual(report.first_tokens_per_s(off(300, 900, 450)), 300.0)
        self.assertIsNone(report.first_tokens_per_s(off(300, 900, 90)), "a 90-s run: the whole run says it")
        self.assertIsNone(report.first_tokens_per_s(dict(t0=0.0, t1=400.0)), "no finish times")
        runs = {"static": dict(config="static", offline=off(200, 200, 450), offline_exit=0),
                "valve-miad-warm": dict(config="valve-miad-warm", offline=off(320, 900, 450), offline_exit=0)}
        rep = report.build(runs, {}, dict(target_per_min=6.0))
        self.assertAlmostEqual(rep["configs"]["valve-miad-warm"]["offline_first_vs_static"], 1.6)
        checks = {c["check"]: c for c in rep["checks"]}
        first = checks["valve-miad-warm: offline >= 1.5x static over the first 90 s after the daemon's restart"]
        self.assertTrue(first["ok"])
        runs["valve-miad-warm"]["offline"] = off(280, 900, 450)
        rep = report.build(runs, {}, dict(target_per_min=6.0))
        self.assertFalse({c["check"]: c for c in rep["checks"]}[
            "valve-miad-warm: offline >= 1.5x static over the first 90 s after the daemon's restart"]["ok"])


class Churn(unittest.TestCase):
    """valve-churn: reclaims while the churn ran, its target, and its exclusion."""

    @staticmethod
    def churn(restarts=5, messages=1000):
        # The cycler ran from t=10 to t=100; one `gate start` from 50.0 to 50.3.
        return dict(gate_every_s=2.0, flooders=2, t_start=10.0, t_cycler_end=100.0, t_end=120.0, restarts=restarts,
                    stop=dict(n=5, ok=5, p50_ms=3.0, max_ms=9.0), start=dict(n=5, ok=5, p50_ms=260.0, max_ms=300.0),
                    failures=0, first_errors=[], commands=[["start", 50.0, 50.3, True]],
                    flood=dict(messages=messages, connections=1100, replies=900, held=50, errors=0, first_errors=[]),
                    threads_left_running=[], final_gate=dict(ok=True, action="kept", error=None),
                    daemon_log=dict(slow_requests=2, slow_handled_ms_max=30.0, slow_waited_ms_max=1.0, reclaims=12))

    @staticmethod
    def grows(n_inside, ms=2.0, slow_ms=None):
        """(t, latency s, handles, reclaimed): `n_inside` reclaims of 4 handles while the churn ran, one
        during the gate start (`slow_ms` if given), and some that do not count."""
        g = [(20.0 + i, ms / 1e3, 4, 4) for i in range(n_inside)]
        g.append((50.1, (slow_ms or ms) / 1e3, 16, 16))  # during the gate start
        g += [(5.0, 0.5, 4, 4), (110.0, 0.5, 4, 4)]  # before and after the churn: 500 ms, not judged
        g += [(30.5, 0.5, 4, 0), (31.5, 0.5, 40, 40)]  # no reclaim; over 1 GiB
        return g

    def result(self, grows, **churn):
        on = dict(t0=0.0, t_end=130.0, requests=[request(1.0, [1.1, 1.2])], grows=grows)
        return dict(config="valve-churn", online=on, offline=dict(tokens_per_s=500.0, finished=3), offline_exit=0,
                    churn=self.churn(**churn))

    def test_reclaims_while_the_churn_ran_and_during_gate_commands_are_counted_apart(self):
        c = report.config_numbers(self.result(self.grows(12, slow_ms=8.0)))["churn"]
        self.assertEqual(c["reclaim_ms_while_churning"]["n"], 13)
        self.assertAlmostEqual(c["reclaim_ms_while_churning"]["max"], 8.0)
        self.assertEqual(c["reclaim_ms_during_gate_commands"]["n"], 1)
        self.assertNotIn("commands", c, "the raw command list stays in the config's own JSON")
        whole = report.config_numbers(self.result(self.grows(12)))["reclaim_ms"]["<=1GiB"]
        self.assertEqual((whole["n"], whole["max"]), (15, 500.0), "the whole trace: the 500 ms ones too")

    def target(self, grows, **churn):
        return report.churn_target(report.config_numbers(self.result(grows, **churn)))

    def test_the_target_is_met_missed_or_not_judged_on_too_few_reclaims_or_no_churn(self):
        met = self.target(self.grows(12))
        self.assertTrue(met["ok"])
        self.assertAlmostEqual(met["value"], 2.0)
        missed = self.target(self.grows(12, slow_ms=40.0))
        self.assertFalse(missed["ok"], "one 40 ms reclaim in 13 is the p99")
        few = self.target(self.grows(5))
        self.assertIsNone(few["ok"])
        self.assertEqual(few["note"], "not enough reclaims (6)")
        self.assertIsNone(self.target(self.grows(12), restarts=0)["ok"])
        self.assertIn("did not run", self.target(self.grows(12), messages=0)["note"])
        self.assertEqual(report.churn_target(dict(churn=dict(error="boom")))["note"], "no churn recorded: boom")

    def test_it_is_left_out_of_online_latency_offline_throughput_and_the_general_reclaim_target(self):
        def online(gap):
            return dict(t0=0.0, t_end=10.0, requests=[request(0.0, [0.1, 0.1 + gap, 0.1 + 2 * gap])],
                        grows=[(1.0, 0.004, 4, 4)])

        results = {"alone": dict(config="alone", online=online(0.1)),
                   "static": dict(config="static", online=online(0.1), offline=dict(tokens_per_s=100.0, finished=1),
                                  offline_exit=0),
                   "valve-churn": self.result(self.grows(12, slow_ms=40.0))}
        results["valve-churn"]["online"]["requests"] = online(0.5)["requests"]  # 5x alone's TPOT
        rep = report.build(results, {}, dict(target_per_min=6.0))
        n = rep["configs"]["valve-churn"]
        for k in ("ttft_p99_vs_alone_pct", "tpot_p99_vs_alone_pct", "offline_vs_static", "decode_step_vs_alone"):
            self.assertIsNone(n[k], k)
        checks = {c["check"]: c for c in rep["checks"]}
        general = checks["reclaim of up to 1 GiB p99 <= 10 ms (online's grow, preemption included)"]
        self.assertEqual((general["ok"], general["detail"]), (True, "worst configuration (static)"))
        self.assertFalse(checks[report.CHURN_TARGET]["ok"])
        md = report.markdown(rep)
        self.assertIn("| not compared | 500.0 | not compared |", md)
        self.assertIn("not compared with alone or static", md)
        self.assertIn("**missed**", md)
        self.assertIn("Churn: 5 gate restarts", md)
        self.assertIn("2 slow-request lines", md)
        results["valve-churn"] = self.result(self.grows(3))
        md = report.markdown(report.build(results, {}, dict(target_per_min=6.0)))
        self.assertIn("| not enough reclaims (4) |", md, "the checks table says why instead of PASS")
        self.assertIn("**not enough reclaims (4)**", md)

    def test_one_line_names_the_churn(self):
        self.assertIn("churn: error=None restarts=5", report.one_line("valve-churn", self.result(self.grows(12))))
        self.assertNotIn("churn", report.one_line("static", dict(config="static")))


class WarmStart(unittest.TestCase):
    def test_the_miad_line_says_whether_the_reservation_started_warm(self):
        warm = dict(warm=True, **{"from": "/o/reservations.json"}, saved_s_ago=4, adjusted=["target 300 clamped to 192"])
        self.assertEqual(report.start_text(warm), " Started warm from /o/reservations.json, saved 4 s before "
                                                  "(adjusted: target 300 clamped to 192).")
        self.assertEqual(report.start_text(dict(warm=False, why="warm start is off")),
                         " Started cold: warm start is off.")
        self.assertEqual(report.start_text(None), "", "a pool from before warm start")


class NoiseFloor(unittest.TestCase):
    def test_a_second_alone_run_is_compared_with_the_first_and_is_no_offline_crash(self):
        def online(tpot_gap):
            return dict(t0=0.0, t_end=10.0, requests=[request(0.0, [0.1, 0.1 + tpot_gap, 0.1 + 2 * tpot_gap])])

        results = {"alone": dict(config="alone", online=online(0.100)),
                   "alone-2": dict(config="alone-2", online=online(0.104))}
        rep = report.build(results, {}, dict(target_per_min=6.0))
        self.assertAlmostEqual(rep["configs"]["alone-2"]["tpot_p99_vs_alone_pct"], 4.0, places=6)
        self.assertNotIn("offline_crashed", rep["configs"]["alone-2"])
        crash = {c["check"]: c for c in rep["checks"]}["no offline crash"]
        self.assertIsNone(crash["ok"], "no configuration with offline ran")
        self.assertIn("differs from the first by", report.markdown(rep))


class Trace(unittest.TestCase):
    def test_trace_is_seeded_sorted_and_bursty(self):
        a = common.online_trace(90, 1, base_rate=0.4, burst_every=20, burst_size=5, burst_prompt=(8000, 9000))
        b = common.online_trace(90, 1, base_rate=0.4, burst_every=20, burst_size=5, burst_prompt=(8000, 9000))
        self.assertEqual(a, b)
        self.assertEqual([r.at for r in a], sorted(r.at for r in a))
        bursts = [r for r in a if r.burst]
        self.assertTrue(bursts and len(bursts) % 5 == 0)
        self.assertTrue(all(8000 <= r.prompt <= 9000 for r in bursts))


class Correctness(unittest.TestCase):
    def test_any_differing_token_fails_the_comparison(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            ref, got, pres = (os.path.join(d, f) for f in ("ref", "got", "pres"))
            common.write_json(ref, dict(outputs={"a": [1, 2], "b": [3]}))
            common.write_json(got, dict(outputs={"a": [1, 2], "b": [3]}, shim=dict(requeued=2)))
            common.write_json(pres, dict(grows=[(0.003, 14, 14), (0.002, 14, 0)]))
            r = report.compare_outputs(ref, got, pres, 0)
            self.assertTrue(r["identical"])
            self.assertEqual((r["requeued"], r["reclaims"]), (2, 1))
            common.write_json(got, dict(outputs={"a": [1, 2], "b": [4]}))
            r = report.compare_outputs(ref, got, pres, 0)
            self.assertFalse(r["identical"])
            self.assertEqual(r["differing"], ["b"])
            self.assertFalse(report.compare_outputs(ref, os.path.join(d, "none"), pres, 1)["identical"])


class Pooled(unittest.TestCase):
    @staticmethod
    def online(tpots, slower=1.0):
        """Requests on0.. each with a first token 10 ms after arrival and 3 tokens `tpot * slower` apart."""
        reqs = []
        for i, t in enumerate(tpots):
            gap = t * slower / 1e3
            reqs.append(dict(rid=f"on{i}", arrival=float(i), burst=False, error=None,
                             timestamps=[i + 0.01, i + 0.01 + gap, i + 0.01 + 2 * gap]))
        return dict(online=dict(requests=reqs))

    def test_runs_pool_their_requests_and_pair_each_with_alones_same_request(self):
        a, b = [5.0] * 98 + [40.0, 50.0], [6.0] * 99 + [60.0]
        runs = [dict(alone=self.online(a), **{"valve-miad": self.online(a, 1.1)}),
                dict(alone=self.online(b), **{"valve-miad": self.online(b, 1.1)})]
        pool = report.pooled(runs, resamples=200)
        alone, miad = pool["configs"]["alone"], pool["configs"]["valve-miad"]
        self.assertEqual((alone["requests"], miad["requests"]), (200, 200))
        self.assertAlmostEqual(alone["tpot_p99"], 40.0, places=6)  # the 198th of 200: no single run's slowest
        self.assertAlmostEqual(miad["tpot_p99_vs_alone_pct"], 10.0, places=6)
        self.assertAlmostEqual(miad["tpot_ratio_median"], 1.1, places=6)
        lo, hi = miad["tpot_p99_change_pct_90ci"]
        self.assertAlmostEqual(lo, 10.0, places=6)
        self.assertAlmostEqual(hi, 10.0, places=6)

    def test_the_interval_is_wide_when_one_request_decides_the_p99(self):
        a = [5.0] * 99 + [50.0]
        miad = self.online(a)  # then two requests made 60 ms a token: the slowest and the first
        miad["online"]["requests"][-1]["timestamps"] = [99.01, 99.07, 99.13]  # 60 ms a token
        miad["online"]["requests"][0]["timestamps"] = [0.01, 0.07, 0.13]
        pool = report.pooled([dict(alone=self.online(a), **{"valve-miad": miad})], resamples=500)
        lo, hi = pool["configs"]["valve-miad"]["tpot_p99_change_pct_90ci"]
        self.assertLess(lo, 1.0)
        self.assertGreater(hi, 10.0)


    def test_a_drift_over_the_command_cancels_against_the_bracket(self):
        # alone at 5 ms, alone-2 at 5.5 ms (10% slower by the end), MIAD in between at 5.25.
        a = [5.0] * 100
        runs = [{"alone": self.online(a), "valve-miad": self.online(a, 1.05), "alone-2": self.online(a, 1.1)}]
        pool = report.pooled(runs, resamples=200)
        miad = pool["configs"]["valve-miad"]
        self.assertAlmostEqual(miad["tpot_p99_vs_alone_pct"], 5.0, places=6)
        self.assertAlmostEqual(miad["tpot_p99_vs_bracket_pct"], 0.0, places=6)
        self.assertAlmostEqual(miad["tpot_ratio_median_vs_bracket"], 1.0, places=6)
        self.assertEqual(miad["tpot_p99_change_pct_90ci_vs_bracket"], [0.0, 0.0])
        self.assertNotIn("tpot_ratio_median_vs_bracket", pool["configs"]["alone-2"])
        self.assertIn("averaged per request", report.pooled_markdown(pool, ["r"]))
        # Without alone-2 there is no bracket, and nothing is claimed against one.
        del runs[0]["alone-2"]
        self.assertNotIn("tpot_p99_vs_bracket_pct", report.pooled(runs, resamples=10)["configs"]["valve-miad"])


if __name__ == "__main__":
    unittest.main()
