"""Unit tests of bench.py's per-configuration control of offline (stdlib only; run by selftest.sh).

aiohttp (the load generator's) is not needed: no request is sent."""

import math
import os
import sys
import tempfile
import types
import unittest

sys.modules.setdefault("aiohttp", types.ModuleType("aiohttp"))
import bench  # noqa: E402


class FakeValve:
    def __init__(self):
        self.calls = []

    def freeze(self, pid):
        self.calls.append(("freeze", pid))

    def thaw(self, pid):
        self.calls.append(("thaw", pid))

    def gate_start(self, *a, **k):
        self.calls.append(("gate_start",))


class Offline:
    class p:
        pid = 4242


class Measure(unittest.TestCase):
    def setUp(self):
        self.kills, self.loads = [], 0
        self.saved = (bench.run_load, bench.os.kill, bench.time.sleep)
        bench.os.kill = lambda pid, sig: self.kills.append((pid, sig))
        bench.time.sleep = lambda s: None

    def tearDown(self):
        bench.run_load, bench.os.kill, bench.time.sleep = self.saved

    def run_config(self, config, load_fails=False):
        def load(*_a, **_kw):
            if load_fails:
                raise RuntimeError("the server went away")
            return [{"send_ns": 0}]

        bench.run_load = load
        v = FakeValve()
        try:
            bench.measure(types.SimpleNamespace(max_tokens=4, port=1), v, "url", "p", Offline, 1.0,
                          config, 0, 1)
        except RuntimeError:
            pass
        return v.calls

    def test_a_frozen_offline_is_frozen_by_valve_for_the_run_not_stopped_by_a_signal(self):
        calls = self.run_config("alone-offline-frozen")
        self.assertEqual(calls, [("freeze", 4242), ("thaw", 4242)])
        self.assertEqual(self.kills, [], "its host threads must keep running")

    def test_a_frozen_offline_is_thawed_when_the_load_fails(self):
        self.assertEqual(self.run_config("alone-offline-frozen", load_fails=True),
                         [("freeze", 4242), ("thaw", 4242)])

    def test_alone_stops_offline_with_signals_and_no_valve(self):
        self.assertEqual(self.run_config("alone-2"), [])
        self.assertEqual([s for _, s in self.kills], [bench.signal.SIGSTOP, bench.signal.SIGCONT])

    def test_every_configuration_has_a_report_name_and_unknown_ones_are_refused(self):
        self.assertIn("alone-offline-frozen", bench.CONFIG_NAMES)
        with tempfile.TemporaryDirectory() as out, self.assertRaises(SystemExit) as e:
            bench.main(["--configs", "alone,alone-froze", "--dry-run", "--out", out])
        self.assertEqual(e.exception.code, 2)



class GateStart(unittest.TestCase):
    def started_with(self, **k):
        v = bench.Valve.__new__(bench.Valve)  # no daemon: only the command line is looked at
        calls = []
        v.call = lambda args, check=True: calls.append(args)
        v.gate_start(8123, arrivals=True, **k)
        return calls[0]

    def test_a_hold_budget_goes_to_gate_start_as_a_percentage(self):
        self.assertNotIn("--hold-budget", self.started_with())
        args = self.started_with(hold_budget=7.5)
        self.assertEqual(args[args.index("--hold-budget") + 1], "7.5%")

    def test_a_hold_budget_out_of_range_or_with_a_fixed_cooldown_is_refused_first(self):
        for bad in (["--gate-hold-budget", "0"], ["--gate-hold-budget", "60"],
                    ["--gate-hold-budget", "10", "--gate-fixed-cooldown", "200ms"]):
            with tempfile.TemporaryDirectory() as out, self.assertRaises(SystemExit) as e:
                bench.main([*bad, "--dry-run", "--out", out])
            self.assertEqual(e.exception.code, 2, bad)

    def test_an_arrival_seed_without_a_trace_or_below_zero_is_refused_first(self):
        for bad in (["--arrival-seed", "5"], ["--arrival-seed", "-1", "--arrivals", "azure-code"]):
            with tempfile.TemporaryDirectory() as out, self.assertRaises(SystemExit) as e:
                bench.main([*bad, "--dry-run", "--out", out])
            self.assertEqual(e.exception.code, 2, bad)

    def test_a_fixed_cooldown_goes_to_gate_start_and_none_leaves_the_cooldown_learned(self):
        self.assertNotIn("--fixed-cooldown", self.started_with())
        args = self.started_with(fixed_cooldown="200ms")
        self.assertEqual(args[args.index("--fixed-cooldown") + 1], "200ms")
        self.assertEqual(args[args.index("--offline-label") + 1], bench.OFFLINE_LABEL)

    def test_a_pinned_lane_s_daemon_starts_on_every_cpu(self):
        from unittest import mock
        started = []

        class Recorder:
            def __init__(self, name, argv, logdir, env=None):
                started.append(argv)

        with tempfile.TemporaryDirectory() as work, mock.patch.object(bench, "Proc", Recorder), \
                mock.patch.object(bench.Valve, "call", lambda self, args, check=True: {}), \
                mock.patch.dict(bench.os.environ, {"VALVE_DAEMON_CPUS": "0,1,2"}):
            bench.Valve("/x/valvectl", work, work, False)
        self.assertEqual(started[0][:5], ["taskset", "-c", "0,1,2", "/x/valvectl", "--socket"])
        self.assertEqual(bench.daemon_cpus_prefix({"VALVE_DAEMON_CPUS": ""}), [], "a shared lane: as it is")

    def test_a_lane_s_label_and_gpu_come_from_the_environment(self):
        import os
        import subprocess
        env = dict(os.environ, VALVE_BENCH_LABEL="batch-g2")
        out = subprocess.run([sys.executable, "-c", "import sys, types; sys.modules['aiohttp'] = "
                              "types.ModuleType('aiohttp'); import bench; print(bench.OFFLINE_LABEL)"],
                             capture_output=True, text=True, env=env, cwd=os.path.dirname(bench.__file__))
        self.assertEqual(out.stdout.strip(), "batch-g2", out.stderr)


class OfflineEnv(unittest.TestCase):
    def test_offline_runs_under_its_label_and_preloads_nothing(self):
        env = bench.offline_env(types.SimpleNamespace())
        self.assertEqual(env["VALVE_LABEL"], bench.OFFLINE_LABEL)
        self.assertEqual(env.get("LD_PRELOAD"), __import__("os").environ.get("LD_PRELOAD"))


class ProbeHits(unittest.TestCase):
    def test_hits_are_the_rounds_differences_over_their_generated_tokens(self):
        hits = lambda k, g, s: {"online_probe_hits": {"kernel_launches": k, "graph_launches": g, "syncs": s}}
        r1 = {"probe_hits": bench.probe_hits_between(hits(100, 1, 2), hits(400, 4, 8)),
              "records": [{"tokens": 10}, {"tokens": 20}]}
        r2 = {"probe_hits": bench.probe_hits_between(hits(0, 0, 0), hits(300, 6, 6)),
              "records": [{"tokens": 30}]}
        self.assertEqual(r1["probe_hits"], {"kernel_launches": 300, "graph_launches": 3, "syncs": 6})
        self.assertEqual(bench.probe_hits_per_token([r1, r2]),
                         {"kernel_launches": 10.0, "graph_launches": 0.15, "syncs": 0.2})

    def test_an_old_daemon_or_an_ungated_round_counts_nothing(self):
        self.assertIsNone(bench.probe_hits_between({}, {"online_probe_hits": {}}))
        self.assertIsNone(bench.probe_hits_per_token([{"records": [{"tokens": 5}]}]))


class Teardown(unittest.TestCase):
    def test_stop_all_continues_live_processes_stops_them_last_first_then_the_daemon(self):
        events = []

        class P:
            def __init__(self, name, pid, alive):
                self.name, self.alive = name, alive
                self.p = types.SimpleNamespace(pid=pid, poll=lambda: None if alive else 0)

            def stop(self):
                events.append(("stop", self.name))

        saved = bench.os.kill
        bench.os.kill = lambda pid, sig: events.append(("kill", pid, sig))
        try:
            bench.stop_all([P("offline", 1, True), P("server", 2, False)],
                           types.SimpleNamespace(stop=lambda: events.append(("daemon",))))
        finally:
            bench.os.kill = saved
        self.assertEqual(events, [("stop", "server"), ("kill", 1, bench.signal.SIGCONT),
                                  ("stop", "offline"), ("daemon",)])


class StampFlag(unittest.TestCase):
    """--stamp-first-kernel: off by default, passed to the graph server, off on CPU."""

    def ns(self, **kw):
        base = dict(server="graph", model_size="3b", device="cuda", dry_run=False, stamp_first_kernel=None)
        return types.SimpleNamespace(**dict(base, **kw))

    def test_default_argv_is_unchanged_and_the_flag_appends_the_file(self):
        plain = bench.server_argv(self.ns(), None, 8000)
        self.assertEqual(plain, [bench.sys.executable, bench.os.path.join(bench.HERE, "server.py"), "--engine",
                                 "graph", "--size", "3b", "--device", "cuda", "--port", "8000"])
        self.assertEqual(bench.server_argv(self.ns(stamp_first_kernel="/o/stamp.ptx"), None, 8000),
                         plain + ["--stamp-first-kernel", "/o/stamp.ptx"])
        # An options object from before the flag (no attribute) builds the same argv.
        old = types.SimpleNamespace(server="graph", model_size="3b", device="cuda")
        self.assertEqual(bench.server_argv(old, None, 8000), plain)

    def test_a_dry_run_or_cpu_turns_it_off_and_other_servers_or_a_missing_file_are_refused(self):
        ap = bench.argparse.ArgumentParser()
        self.assertIsNone(bench.stamp_choice(self.ns(stamp_first_kernel=__file__, dry_run=True), ap))
        self.assertIsNone(bench.stamp_choice(self.ns(stamp_first_kernel=__file__, device="cpu"), ap))
        self.assertEqual(bench.stamp_choice(self.ns(stamp_first_kernel=__file__), ap), bench.os.path.abspath(__file__))
        for bad in (dict(server="cb"), dict(stamp_first_kernel="/nonexistent/stamp.ptx")):
            with self.assertRaises(SystemExit):
                bench.stamp_choice(self.ns(**dict(dict(stamp_first_kernel=__file__), **bad)), ap)

    def test_calibration_stops_offline_and_continues_it_even_when_the_server_fails(self):
        kills, saved = [], (bench.os.kill, bench.time.sleep, bench.calibrate_server)
        bench.os.kill = lambda pid, sig: kills.append(sig)
        bench.time.sleep = lambda s: None

        def fails(_url):
            raise OSError("connection refused")

        bench.calibrate_server = fails
        try:
            with self.assertRaises(OSError):
                bench.calibrate_idle("url", 4242, "test")
        finally:
            bench.os.kill, bench.time.sleep, bench.calibrate_server = saved
        self.assertEqual(kills, [bench.signal.SIGSTOP, bench.signal.SIGCONT])

    def report(self, mapping):
        row = dict(busy_share=0.3, ttft_p50_ms=10, ttft_p99_ms=20, ttft_max_ms=30, tpot_p50_ms=1, tpot_p99_ms=2,
                   preemptions_per_request=None, offline_vs_alone=None, harvested=None,
                   arrival_to_gpu_start_p50_ms=0.25, arrival_to_gpu_start_p99_ms=0.7,
                   gpu_start_idle_arrivals=12, gpu_start_unknown=2, gpu_start_before_arrival=0)
        res = {"server": "graph", "device": "test", "loads": [
            {"load": 0.3, "rate_per_s": 1.0, "rows": {"alone": row}, "checks": {}, "tails": {}}]}
        if mapping:
            res["stamp_mapping"] = mapping
        return bench.report_md(res, {})

    def test_the_report_has_the_column_only_when_stamped_with_the_mapping_beside_it(self):
        self.assertNotIn("GPU", self.report(None))
        ok = bench.stamp.mapping_check({"offset_ns": 0, "bound_ns": 4000}, {"offset_ns": 1000, "bound_ns": 6000})
        md = self.report(ok)
        self.assertIn("| 0.250 / 0.700 |", md)
        self.assertIn("error bound 6.0 us, offset drift over the run 1.0 us", md)
        self.assertIn("2 without a stamp", md)
        self.assertIn("[FAIL] p50 <= 0.300 ms and p99 <= 0.600 ms", md)  # p99 0.7 ms
        drifted = bench.stamp.mapping_check({"offset_ns": 0, "bound_ns": 4000, "at_ns": 0},
                                            {"offset_ns": 1_800_000, "bound_ns": 6000, "at_ns": 180 * 10**9})
        md = self.report(drifted)
        self.assertIn("offset drift over the run 1800.0 us (+10.00 ppm), corrected", md)
        self.assertIn("| 0.250 / 0.700 |", md)  # corrected: not flagged
        self.assertNotIn("FLAGGED", md)
        bad = bench.stamp.mapping_check({"offset_ns": 0, "bound_ns": 4000}, None)
        self.assertIn("0.250 / 0.700 (!)", self.report(bad))
        self.assertIn("FLAGGED: no end calibration", self.report(bad))


class HostPathReport(unittest.TestCase):
    """The table of where the time went: only where the server marked its requests."""

    def report(self, **extra):
        row = dict(busy_share=0.3, ttft_p50_ms=10, ttft_p99_ms=20, ttft_max_ms=30, tpot_p50_ms=1, tpot_p99_ms=2,
                   preemptions_per_request=None, offline_vs_alone=None, harvested=None, **extra)
        res = {"server": "graph-raw", "device": "test", "loads": [
            {"load": 0.3, "rate_per_s": 1.0, "rows": {"alone": row}, "checks": {}, "tails": {}}]}
        return bench.report_md(res, {})

    def test_no_marks_leave_the_report_as_it_was(self):
        md = self.report()
        self.assertNotIn("Where the time went", md)
        self.assertNotIn("host launch", md)

    def test_marks_add_the_table_and_the_gpu_column_only_with_stamps(self):
        marks = dict(send_to_recv_p50_ms=0.04, send_to_recv_p99_ms=0.09, recv_to_launch_p50_ms=0.02,
                     recv_to_launch_p99_ms=0.03)
        md = self.report(**marks)
        self.assertIn("| online alone | 0.040 / 0.090 | 0.020 / 0.030 |", md)
        self.assertNotIn("host launch -> GPU start", md)
        md = self.report(**marks, launch_to_gpu_start_p50_ms=0.015, launch_to_gpu_start_p99_ms=0.025)
        self.assertIn("| send -> server got it | got it -> host launch | host launch -> GPU start |", md)
        self.assertIn("| online alone | 0.040 / 0.090 | 0.020 / 0.030 | 0.015 / 0.025 |", md)

    def test_the_disable_split_table_only_where_a_configuration_has_it(self):
        self.assertNotIn("after the gate's disable", self.report())
        split = [{"bucket_us": "200-400", "n": 3, "p50_us": 452.0, "p99_us": 610.0}]
        md = self.report(disable_split=split)
        self.assertIn("| online alone | 200-400 | 3 | 452 / 610 |", md)

    def test_config_stats_adds_the_marks_only_where_records_have_them(self):
        rec = {"send_ns": 0, "first_ns": 10**6, "end_ns": 2 * 10**6, "tokens": 2, "error": None, "idle_at_send": True}
        plain = bench.config_stats([{"records": [dict(rec)], "progress": []}], None)
        self.assertNotIn("send_to_recv_p50_ms", plain)
        marked = bench.config_stats([{"records": [dict(rec, recv_ns=50_000, launch_ns=70_000)], "progress": []}], None)
        self.assertAlmostEqual(marked["recv_to_launch_p50_ms"], 0.02)


if __name__ == "__main__":
    unittest.main()


class TraceArrivals(unittest.TestCase):
    def test_a_window_keeps_the_trace_s_gaps_in_proportion_at_the_rate(self):
        import loadgen
        trace = [0.0, 0.01, 0.02, 1.0, 1.01, 3.0]
        got = loadgen.arrivals(0.5, 5, 0, trace)  # 5 arrivals over 3 s, replayed over 10 s
        self.assertEqual(len(got), 5)
        for want, have in zip([0.01, 0.02, 1.0, 1.01, 3.0], got):
            self.assertAlmostEqual(have, want * 10 / 3.0)
        # Another seed starts elsewhere and wraps around the end with the trace shifted by its span.
        wrapped = loadgen.arrivals(0.5, 3, 4, trace)  # 3 arrivals over 2.01 s, replayed over 6 s
        for want, have in zip([3.0 - 1.01, 3.01 - 1.01, 3.02 - 1.01], wrapped):
            self.assertAlmostEqual(have, want * 6 / 2.01)
        self.assertTrue(all(b > a for a, b in zip(wrapped, wrapped[1:])))
        with self.assertRaises(ValueError):
            loadgen.arrivals(1.0, 3, 0, [5.0])
        with self.assertRaises(ValueError):
            loadgen.arrivals(1.0, 1, 0, [1.0, 1.0, 2.0])

    def test_every_window_of_the_code_trace_ends_when_the_rate_says(self):
        import loadgen
        trace = loadgen.load_trace(bench.trace_path("azure-code"))
        for seed in (10, 30, 1010, 2010):
            got = loadgen.arrivals(0.283, 57, seed, trace)
            self.assertAlmostEqual(got[-1], 57 / 0.283)

    def test_trace_windows_counts_idle_arrivals_as_a_one_at_a_time_server_meets_them(self):
        import trace_windows as tw
        self.assertEqual(tw.idle_arrivals([0.0, 0.1, 0.2, 5.0], 1.0), 2)  # a burst queues, a lull is idle
        self.assertEqual(tw.idle_arrivals([0.0, 1.0, 2.5], 1.0), 3)  # each after the last one's end
        self.assertEqual(tw.idle_arrivals([0.0, 0.5, 2.5], 1.0), 2)  # the queue ends at 2.0, before 2.5
        self.assertEqual(tw.median_seeds([5, 1, 3, 3, 9]), (3, [2, 3]))
        self.assertAlmostEqual(tw.rate_at(0.1, 0.345), -math.log(0.9) / 0.345)

    def test_trace_windows_replays_the_window_the_benchmark_replays(self):
        import loadgen
        import trace_windows as tw
        trace = loadgen.load_trace(tw.trace_file("azure-code"))
        self.assertEqual(trace, loadgen.load_trace(bench.trace_path("azure-code")))
        rate, n = tw.rate_at(0.1, 0.345), 56
        counts = tw.window_counts(trace[:200], rate, n, 0.345, 10)
        self.assertEqual(counts[7], tw.idle_arrivals(loadgen.arrivals(rate, n, 7 + 10, trace[:200]), 0.345))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "w.csv")
            offsets = loadgen.arrivals(rate, n, 17, trace)
            r = tw.write_window(path, offsets)
            back = loadgen.load_trace(path)
            self.assertEqual(len(back), n)
            self.assertAlmostEqual(back[-1], offsets[-1], places=5)
            self.assertAlmostEqual(r, (n - 1) / (offsets[-1] - offsets[0]))
            with self.assertRaises(SystemExit):
                tw.main(["azure-code", "--load", "1.5", "--run-s", "200"])

    def test_the_committed_traces_load_and_differ_in_burstiness(self):
        import loadgen

        def cv(path):
            t = loadgen.load_trace(path)
            gaps = [b - a for a, b in zip(t, t[1:])]
            mean = sum(gaps) / len(gaps)
            return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

        self.assertGreater(cv(bench.trace_path("azure-code")), 5)
        self.assertLess(cv(bench.trace_path("azure-conv")), 1.5)
