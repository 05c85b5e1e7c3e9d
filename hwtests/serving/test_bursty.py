"""CPU tests of the bursty-traffic harness: the hold's seeded history (hold_seed.py), the peers'
environments (peers.py), the comparison (bursty_report.py), bench.py's new options and
bursty.sh --dry-run. gate_hold is faked unless built (then the real one is used too)."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import bursty_report  # noqa: E402
import hold_seed  # noqa: E402
import loadgen  # noqa: E402
import analysis  # noqa: E402
import bursty_ab  # noqa: E402
import bursty_pool  # noqa: E402
import peers  # noqa: E402

# A stand-in for gate_hold: prints its table and, with --history-out, writes a history file of
# as many gaps as the CSV has arrivals; logs its argv.
FAKE_GATE_HOLD = r'''#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
open(sys.argv[0] + ".argv", "a").write(json.dumps(args) + "\n")
n = sum(1 for _ in open(args[0])) - 1
val = lambda f: args[args.index(f) + 1] if f in args else None
caught = 60.0 if "--history-in" in args else 10.0
print("| gate | idle arrivals | caught | harvest | preemptions | x |")
print(f"| hold budget {val('--budgets')}% | {n // 2} | {caught}% | 91.5% | 7 | 1 / 2 ms |")
if val("--history-out"):
    hist = {"gaps": list(range(1, n)), "last_activity_ns": None}
    json.dump({"version": 1, "services": {val("--history-service"): {"saved_unix_s": 1, "boot_id": "", "history": hist}}},
              open(val("--history-out"), "w"))
'''

REAL_GATE_HOLD = os.path.join(HERE, "..", "..", "target", "release", "examples", "gate_hold")


def fake_bin(d, name, text):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(text)
    os.chmod(p, os.stat(p).st_mode | stat.S_IEXEC)
    return p


def seed_args(out, gate_hold, **kw):
    a = ["azure-code", "--load", "0.1", "--run-s", "90", "--service-s", "0.3", "--port", "18080",
         "--gate-hold", gate_hold, "--out", out]
    for k, v in kw.items():
        a += [f"--{k.replace('_', '-')}", str(v)]
    return a


class HoldSeedTest(unittest.TestCase):
    def test_the_window_seed_is_bench_s_round_seed(self):
        # bench.py's measure() seed for round r at load L: arrival seed + 100 L + 1000 r.
        self.assertEqual(hold_seed.window_seed(5, 0.1), 15)
        self.assertEqual(hold_seed.window_seed(0, 0.3, rnd=2), 2030)

    def test_the_history_is_on_the_window_s_timeline_and_never_wraps_into_it(self):
        trace = [0.0, 1.0, 3.0, 4.0, 10.0, 11.0, 12.0, 20.0]  # 7 gaps, span 20
        # Window of 2 from seed 4: arrivals 5, 6 (11, 12) after arrival 4 (10); 2 trace-s -> 2 / rate.
        rate = 0.5
        scale = 2 / rate / 2.0
        hist = hold_seed.preceding(trace, 4, 2, rate, history_s=6.5 * scale)
        # Back from arrival 4 (t 10) for 6.5 trace-s: 10 and 4, not 3 (7 before).
        self.assertEqual([round(t / scale, 6) for t in hist], [0.0, 6.0])
        # Never more than the trace less the window (5 arrivals here), however long the history.
        self.assertEqual(len(hold_seed.preceding(trace, 4, 2, rate, history_s=1e9)), len(trace) - 1 - 2)

    def test_the_history_ends_where_the_window_starts(self):
        trace = loadgen.load_trace(loadgen.trace_path("azure-code"))
        rate, n, seed = 0.3, 27, 10
        window = loadgen.arrivals(rate, n, seed, trace)
        hist = hold_seed.preceding(trace, seed, n, rate, 3600)
        first = seed % (len(trace) - 1)
        scale = window[-1] / (trace[first + n] - trace[first])
        # The history's last arrival is the one the window's times count from.
        self.assertAlmostEqual(hist[-1] - hist[-2], (trace[first] - trace[first - 1]) * scale, places=6)
        self.assertLessEqual(hist[-1], 3600)

    def test_builds_the_history_then_predicts_with_and_without_it(self):
        with tempfile.TemporaryDirectory() as d:
            gh = fake_bin(d, "gate_hold", FAKE_GATE_HOLD)
            out = os.path.join(d, "seed")
            self.assertEqual(hold_seed.main(seed_args(out, gh)), 0)
            calls = [json.loads(x) for x in open(gh + ".argv")]
            self.assertEqual(len(calls), 3)
            self.assertIn("--history-out", calls[0])
            self.assertTrue(calls[0][0].endswith("history-arrivals.csv"))
            self.assertIn("--history-in", calls[1])
            self.assertNotIn("--history-in", calls[2])
            info = json.load(open(os.path.join(out, "hold-seed.json")))
            self.assertEqual(info["service"], "ports=18080 label= pids=")
            self.assertEqual(info["predicted_seeded"]["caught_pct"], 60.0)
            self.assertEqual(info["predicted_fresh"]["caught_pct"], 10.0)
            self.assertEqual(info["history_gaps"], info["history_requests"] - 1)
            self.assertEqual(info["window_requests"], round(loadgen.rate_at(0.1, 0.3) * 90))
            self.assertIsNone(bench.check_hold_history(info["history_file"], 18080))
            self.assertIn("no history for", bench.check_hold_history(info["history_file"], 18081))

    def test_bad_input_is_refused_with_the_fix(self):
        with tempfile.TemporaryDirectory() as d, self.assertRaises(SystemExit):
            hold_seed.main(seed_args(d, os.path.join(d, "absent")))

    def test_a_window_s_stretches_replay_it_whole_and_each_is_seeded_by_what_came_before(self):
        trace = loadgen.load_trace(loadgen.trace_path("azure-code"))
        rate, n, seed, parts = 0.35, 420, 1690, 3
        window = loadgen.arrivals(rate, n, seed, trace)
        span = n / rate
        stretches = [loadgen.arrivals(rate, n, seed, trace, part=(k, parts)) for k in range(parts)]
        self.assertEqual(sum(len(p) for p in stretches), len(window))
        rebuilt = [t + span * k / parts for k, p in enumerate(stretches) for t in p]
        self.assertEqual([round(t, 9) for t in rebuilt], [round(t, 9) for t in window])
        history = hold_seed.preceding(trace, seed, n, rate, 3600)
        for k in range(parts):
            hist, stretch = hold_seed.part_history(history, window, span, (k, parts), 3600)
            self.assertEqual(stretch, stretches[k])
            self.assertLessEqual(hist[-1], 3600)
            # It ends with the window's arrivals before the stretch, their gaps kept; the first
            # stretch's history is the hour before the window, as `preceding` gives it.
            before = [t for t in window if t < span * k / parts]
            if k == 0:
                self.assertEqual(hist, history)
            else:
                self.assertGreater(len(before), 2)
                self.assertAlmostEqual(hist[-1] - hist[-2], before[-1] - before[-2], places=6)
                self.assertAlmostEqual(hist[-1] - hist[-3], before[-1] - before[-3], places=6)

    def test_a_window_part_is_k_of_n(self):
        self.assertEqual(loadgen.parse_part("1/3"), (1, 3))
        self.assertIsNone(loadgen.parse_part(""))
        for bad in ("3/3", "x", "1-3", "-1/2", "2-1/3", "1-3/3"):
            with self.assertRaises(ValueError):
                loadgen.parse_part(bad)

    def test_a_range_of_stretches_replays_them_as_one(self):
        self.assertEqual(loadgen.parse_part("1-2/3"), (1, 3, 2))
        self.assertEqual(loadgen.part_stretches(loadgen.parse_part("2-4/8")), 3)
        offsets = [0.0, 10.0, 35.0, 50.0, 80.0, 90.0]
        together = loadgen.window_part(offsets, 90.0, 1, 3, 2)
        apart = loadgen.window_part(offsets, 90.0, 1, 3) + [t + 30.0 for t in loadgen.window_part(offsets, 90.0, 2, 3)]
        self.assertEqual(together, apart)
        self.assertEqual(together, [5.0, 20.0, 50.0, 60.0])

    @unittest.skipUnless(os.access(REAL_GATE_HOLD, os.X_OK), "gate_hold not built")
    def test_the_real_gate_hold_writes_a_history_the_daemon_reads_back(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "seed")
            self.assertEqual(hold_seed.main(seed_args(out, REAL_GATE_HOLD, history_s=1800)), 0)
            info = json.load(open(os.path.join(out, "hold-seed.json")))
            self.assertGreater(info["history_gaps"], 8)  # the hold chooses nothing before 8 gaps
            self.assertIsNotNone(info["predicted_seeded"])
            self.assertIsNotNone(info["predicted_fresh"])


class PeersTest(unittest.TestCase):
    def test_mps_clients_share_its_directories_and_training_is_low(self):
        m = peers.Mps("/tmp/base")
        on, off = m.online_env({"A": "1"}), m.offline_env({"A": "1"})
        self.assertEqual(on["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/base/pipe")
        self.assertEqual(off["CUDA_MPS_PIPE_DIRECTORY"], "/tmp/base/pipe")
        self.assertNotIn("CUDA_MPS_CLIENT_PRIORITY", on)
        self.assertEqual(off["CUDA_MPS_CLIENT_PRIORITY"], peers.MPS_LOW_PRIORITY)

    def test_an_mps_base_it_made_itself_is_gone_when_it_exits(self):
        code = ("import sys; sys.path.insert(0, %r); import peers; b = peers.own_mps_dir(); "
                "import os; os.makedirs(os.path.join(b, 'log')); print(b)") % HERE
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        base = r.stdout.strip()
        self.assertTrue(os.path.basename(base).startswith("valve-mps-"))
        self.assertFalse(os.path.exists(base))

    def test_mps_starts_and_quits_its_own_daemon(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "calls")
            fake_bin(d, "nvidia-cuda-mps-control",
                     f'#!/bin/sh\necho "$* $CUDA_MPS_PIPE_DIRECTORY $(cat)" >> {log}\n'
                     'if [ "$1" = -d ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; fi\n')
            path = os.environ["PATH"]
            os.environ["PATH"] = d + ":" + path
            try:
                m = peers.Mps(os.path.join(d, "mps"))
                m.start()
                m.stop()
                m.stop()  # once only
            finally:
                os.environ["PATH"] = path
            lines = open(log).read().splitlines()
            self.assertEqual(len(lines), 2)
            self.assertTrue(lines[0].startswith("-d " + os.path.join(d, "mps", "pipe")))
            self.assertTrue(lines[1].endswith("quit"))

    def test_the_smoke_runs_both_roles_under_the_peer_and_says_which_failed(self):
        class Peer:
            started = stopped = 0

            def start(self):
                Peer.started += 1

            def stop(self):
                Peer.stopped += 1

            def online_env(self, env):
                return dict(env, ROLE="online")

            def offline_env(self, env):
                return dict(env, ROLE="training")

        with tempfile.TemporaryDirectory() as d:
            py = fake_bin(d, "py", '#!/bin/sh\n[ "$ROLE" = "$GOOD" ] && echo SMOKE-OK && exit 0; echo broken; exit 3\n')
            os.environ["GOOD"] = "online"
            try:
                failed = peers.smoke(Peer(), python=py)
            finally:
                del os.environ["GOOD"]
        self.assertEqual(len(failed), 1)
        self.assertTrue(failed[0].startswith("training: exit 3"), failed)
        self.assertEqual((Peer.started, Peer.stopped), (1, 1))

    def test_xsched_online_high_training_low_and_missing_builds_refused(self):
        x = peers.XSched("/opt/xs", "/tmp", 50000)
        x.libcuda = "/usr/lib/libcuda.so.1"
        on, off = x.online_env({"LD_LIBRARY_PATH": "/a"}), x.offline_env({})
        self.assertGreater(int(on["XSCHED_AUTO_XQUEUE_PRIORITY"]), int(off["XSCHED_AUTO_XQUEUE_PRIORITY"]))
        self.assertEqual(on["LD_LIBRARY_PATH"], "/opt/xs/lib:/a")
        self.assertEqual(off["LD_LIBRARY_PATH"], "/opt/xs/lib")
        self.assertEqual(on["XSCHED_CUDA_LIB"], "/usr/lib/libcuda.so.1")
        self.assertEqual(on["XSCHED_SCHEDULER"], "GLB")
        with tempfile.TemporaryDirectory() as d, self.assertRaisesRegex(peers.PeerError, "xsched_build.sh"):
            peers.XSched(d, d, 1).start()


def run(config, idle_sends, stops=(), stamps=None, gated=True, ttfts=None):
    """A report.json run: idle requests sent at `idle_sends` (ms), offline stopped over `stops`,
    each streaming its first token `ttfts[i]` ms after it was sent (none streamed without)."""
    recs = []
    for i, t in enumerate(idle_sends):
        s = int(t * 1e6)
        recs.append({"i": i, "send_ns": s, "end_ns": s + 300_000_000, "idle_at_send": True, "error": None,
                     "gpu_start_ns": s + int((stamps or {}).get(t, 0.3) * 1e6)})
        if ttfts:
            recs[-1].update(first_ns=s + int(ttfts[i] * 1e6), tokens=64)
    r = {"config": config, "load": 0.1, "records": recs}
    if gated:
        trace = []
        for a, b in stops:
            trace += [{"event": "disable", "t_ns": int(a * 1e6), "end_ns": int(a * 1e6), "pid": 0, "seq": 0},
                      {"event": "enable", "t_ns": int(b * 1e6), "pid": 0, "seq": 0}]
        r.update(trace=trace, online_pids=[])
    return r


def stats(ttft, tpot, harvested, ppr=None):
    return {"ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "tpot_p99_ms": tpot, "harvested": harvested,
            "preemptions_per_request": ppr}


class BurstyReportTest(unittest.TestCase):
    def report(self, hold_stats, stamps):
        rows = {"alone": stats(10, 5, None), "gate-hold": hold_stats, "timeslice": stats(12, 6, 0.99)}
        runs = [run("alone", [0, 1000], gated=False),
                # The first arrival finds offline stopped since before it (caught), the second not.
                run("gate-hold", [0, 1000], stops=[(-50, 5), (1000.1, 1010)], stamps=stamps),
                run("timeslice", [0, 1000], stamps={0: 0.7, 1000: 0.7}, gated=False)]
        return {"loads": [{"load": 0.1, "rows": rows}], "runs": runs}

    def test_caught_and_uncaught_first_kernels_and_ratios_to_alone(self):
        t = bursty_report.compare([self.report(stats(10.1, 5.05, 0.95, 0.5), {0: 0.31, 1000: 0.65})])
        g = t[0.1]["gate-hold"]
        self.assertEqual(g["idle_arrivals"], 2)
        self.assertEqual(g["caught_share"], 0.5)
        self.assertAlmostEqual(g["caught_first_kernel_p50_ms"], 0.31, places=6)
        self.assertAlmostEqual(g["uncaught_first_kernel_p50_ms"], 0.65, places=6)
        self.assertAlmostEqual(g["ttft_p50_ratio"], 1.01)
        self.assertAlmostEqual(g["tpot_p99_ratio"], 1.01)
        self.assertIsNone(t[0.1]["timeslice"]["caught_share"])
        # Lower latency than the only peer, but less harvest: ahead on latency only.
        self.assertIn("ttft_p50_ratio", g["ahead"])
        self.assertIn("first_kernel_p50_ms", g["ahead"])
        self.assertNotIn("harvested", g["ahead"])

    def test_nothing_is_ahead_without_peers_or_where_a_peer_is_better(self):
        self.assertEqual(bursty_report.ahead({"ttft_p50_ratio": 1.0}, []), [])
        got = bursty_report.ahead({"ttft_p50_ratio": 1.0, "harvested": 0.9},
                                  [{"ttft_p50_ratio": 1.1, "harvested": 0.95}, {"ttft_p50_ratio": 0.99, "harvested": 0.5}])
        self.assertEqual(got, [])

    def test_ahead_overall_needs_lower_latency_at_no_lower_harvest(self):
        gate = {"ttft_p99_ratio": 1.02, "tpot_p99_ratio": 0.99, "harvested": 0.84}
        slicing = {"ttft_p99_ratio": 6.9, "tpot_p99_ratio": 2.3, "harvested": 1.14}
        self.assertIs(bursty_report.ahead_overall(gate, [slicing]), False)
        self.assertIs(bursty_report.ahead_overall(dict(gate, harvested=1.2), [slicing]), True)
        self.assertIsNone(bursty_report.ahead_overall(gate, []))

    def test_ttft_is_also_paired_request_by_request_with_alone(self):
        # Two clusters, as on a bursty stretch: the p50 of four is the second-lowest request
        # (here an idle one in alone, a queued one under the gate: 11x), each request only 1.01x.
        alone = run("alone", [0, 1000, 2000, 3000], gated=False, ttfts=[9, 9, 100, 400])
        gated = run("gate-hold", [0, 1000, 2000, 3000], ttfts=[9.09, 101, 101, 404])
        gated["records"][1]["i"] = 9  # a request alone did not serve: no pair
        rows = {"alone": stats(9, 5, None), "gate-hold": stats(101, 5, 0.5)}
        t = bursty_report.compare([{"loads": [{"load": 0.1, "rows": rows}], "runs": [alone, gated]}])
        self.assertAlmostEqual(t[0.1]["gate-hold"]["ttft_p50_ratio"], 101 / 9)
        self.assertAlmostEqual(t[0.1]["gate-hold"]["ttft_paired_ratio"], 1.01, places=6)
        self.assertAlmostEqual(t[0.1]["alone"]["ttft_paired_ratio"], 1.0)
        # Without alone in the run there is nothing to pair with.
        t = bursty_report.compare([{"loads": [{"load": 0.1, "rows": {"gate-hold": rows["gate-hold"]}}],
                                    "runs": [gated]}])
        self.assertIsNone(t[0.1]["gate-hold"]["ttft_paired_ratio"])

    def test_markdown_and_json_are_written_and_unreadable_parts_skipped(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "plain.json")
            json.dump(self.report(stats(10.1, 5.05, 0.95, 0.5), {}), open(p, "w"))
            out = os.path.join(d, "bursty.md")
            self.assertEqual(bursty_report.main([p, os.path.join(d, "absent.json"), "--out", out]), 0)
            md = open(out).read()
            self.assertIn("| gate-hold | 2 |", md)
            self.assertIn("against every peer here (timeslice)", md)
            self.assertIn("0.1", json.load(open(os.path.join(d, "bursty.json"))))
            self.assertNotIn("the gate's own count", md, "a daemon that does not count says nothing")

    def test_the_gate_s_own_count_stands_beside_the_measured_one(self):
        r = self.report(stats(10.1, 5.05, 0.95, 0.5), {})
        r["runs"][1].update(arrivals_idle=2, arrivals_held=1)
        t = bursty_report.compare([r])
        g = t[0.1]["gate-hold"]
        self.assertEqual((g["gate_arrivals_idle"], g["gate_arrivals_held"]), (2, 1))
        self.assertIn("the gate's own count: 1 of 2 arrivals after an idle online found offline held "
                      "(measured here: 1 of 2 idle arrivals caught)", bursty_report.markdown(t, ["x"]))


class BurstyPoolTest(unittest.TestCase):
    def call(self, alone_ms, hold_ms, harvested, ttft_ratios):
        rows = {"alone": stats(10, 5, None), "gate-hold": stats(11, 5, harvested, 0.5)}
        runs = [run("alone", [0, 1000], gated=False, stamps={0: alone_ms, 1000: alone_ms}, ttfts=[10, 10]),
                run("gate-hold", [0, 1000], stops=[(-50, 5), (1000.1, 1010)],
                    stamps={0: hold_ms, 1000: 0.9}, ttfts=[10 * x for x in ttft_ratios])]
        return {"loads": [{"load": 0.1, "rows": rows}], "runs": runs}

    def test_stretches_pool_arrivals_and_pair_caught_ones_with_the_same_request_alone(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            # Two calls whose alone differs by 0.1 ms; caught arrivals are 0.02 ms over their own.
            for k, (alone_ms, hold_ms, h, ttft) in enumerate([(0.30, 0.32, 0.5, (1.01, 1.05)),
                                                              (0.40, 0.42, 0.7, (1.02, 1.04))]):
                paths.append(os.path.join(d, f"s{k}.json"))
                json.dump(self.call(alone_ms, hold_ms, h, ttft), open(paths[-1], "w"))
            out = os.path.join(d, "pool.md")
            self.assertEqual(bursty_pool.main([*paths, "--out", out]), 0)
            g = json.load(open(os.path.join(d, "pool.json")))["gate-hold"]
            self.assertEqual((g["idle_arrivals"], g["caught"]), (4, 2))
            self.assertAlmostEqual(g["caught_first_kernel_p50_vs_alone_ms"], 0.02, places=6)
            self.assertAlmostEqual(g["harvested"], 0.6)  # equal idle time in both calls
            # Every request against the same request alone in its own call, both calls pooled.
            self.assertAlmostEqual(g["ttft_paired_ratio"], 1.02, places=6)
            # A run known to be wrong is left out, the rest kept.
            bursty_pool.main([*paths, "--skip", "1:gate-hold", "--out", out])
            g = json.load(open(os.path.join(d, "pool.json")))["gate-hold"]
            self.assertEqual((g["calls"], g["idle_arrivals"]), (1, 2))
            self.assertAlmostEqual(g["ttft_paired_ratio"], 1.01, places=6)

    def pool(self, calls):
        """bursty_pool over `calls` (one report each): its figures and its markdown."""
        with tempfile.TemporaryDirectory() as d:
            paths = [os.path.join(d, f"s{k}.json") for k in range(len(calls))]
            for p, c in zip(paths, calls):
                with open(p, "w") as f:
                    json.dump(c, f)
            out = os.path.join(d, "pool.md")
            self.assertEqual(bursty_pool.main([*paths, "--out", out]), 0)
            with open(os.path.join(d, "pool.json")) as f, open(out) as md:
                return json.load(f), md.read()

    def test_ttft_is_split_by_what_each_request_found(self):
        # Per call: a caught arrival (offline stopped from before), an uncaught one, and a
        # request sent while another was in flight (queued), each against the same one alone.
        calls = [self.call(0.3, 0.32, 0.5, (1.01, 1.05)), self.call(0.4, 0.42, 0.7, (1.03, 1.04))]
        for c in calls:
            for r in c["runs"]:
                q = dict(r["records"][1], i=2, send_ns=r["records"][1]["send_ns"] + 1, idle_at_send=False)
                q["first_ns"] = q["send_ns"] + (100_000_000 if r["config"] == "alone" else 102_000_000)
                r["records"].append(q)
        pooled, md = self.pool(calls)
        kinds = pooled["gate-hold"]["ttft_by_kind"]
        self.assertEqual({k: v["requests"] for k, v in kinds.items()},
                         {"caught": 2, "uncaught": 2, "queued": 2})
        # Nearest-rank medians of two: the lower one.
        self.assertAlmostEqual(kinds["caught"]["ratio_p50"], 1.01, places=6)
        self.assertAlmostEqual(kinds["caught"]["diff_p50_ms"], 0.1, places=6)
        self.assertAlmostEqual(kinds["uncaught"]["ratio_p50"], 1.04, places=6)
        self.assertAlmostEqual(kinds["queued"]["diff_p50_ms"], 2.0, places=6)
        self.assertIn("| gate-hold | uncaught | 2 | +0.400 | 1.040 |", md)

    def test_what_share_caught_the_set_s_ttft_p50_needs(self):
        # Six idle arrivals, 10 ms alone (two caught, four uncaught at +0.4 ms), and four queued
        # requests at 100 ms: the set's p50 (5th of 10) lies among the idle arrivals' slowest.
        sends = [k * 1000 for k in range(6)]
        stops = [(t - 50, t + 5) if k < 2 else (t + 0.1, t + 10) for k, t in enumerate(sends)]
        alone = run("alone", sends, gated=False, ttfts=[10] * 6)
        hold = run("gate-hold", sends, stops=stops, ttfts=[10, 10, 10.4, 10.4, 10.4, 10.4])
        for r in (alone, hold):
            for k in range(4):
                q = dict(r["records"][k], i=6 + k, send_ns=r["records"][k]["send_ns"] + 1, idle_at_send=False)
                q["first_ns"] = q["send_ns"] + 100_000_000
                r["records"].append(q)
        rows = {"alone": stats(10, 5, None), "gate-hold": stats(10.4, 5, 0.5, 0.5)}
        pooled, md = self.pool([{"loads": [{"load": 0.1, "rows": rows}], "runs": [alone, hold]}])
        got = [(round(w["caught_share"], 3), round(w["ttft_p50_ratio"], 3))
               for w in pooled["gate-hold"]["ttft_p50_if_caught"]]
        # As measured 2 of 6 caught: 1.04; with 4 of 6 the p50 is still an uncaught arrival;
        # with 5 of 6 (the one left above the p50) and all caught, alone's. One row a share.
        self.assertEqual(got, [(0.333, 1.04), (0.667, 1.04), (0.833, 1.0), (1.0, 1.0)])
        self.assertIn("| gate-hold | 33.3% | 1.040 | as measured |", md)

    def test_each_call_splits_caught_first_kernels_at_the_launch_probe(self):
        calls = [self.call(0.3, 0.32, 0.5, (1.0, 1.0)), self.call(0.4, 0.47, 0.7, (1.0, 1.0))]
        # The caught arrival's (sent at 0) first launch reaches the probe 0.29 / 0.41 ms after it.
        for c, probe_ms in zip(calls, (0.29, 0.41)):
            c["runs"][1]["trace"].append({"event": "launch", "t_ns": int(probe_ms * 1e6), "pid": 7, "seq": 1})
        rows = self.pool(calls)[0]["gate-hold"]["per_call"]
        self.assertEqual([(r["call"], r["idle_arrivals"], r["caught"]) for r in rows], [(0, 2, 1), (1, 2, 1)])
        self.assertAlmostEqual(rows[1]["caught_vs_alone_ms"], 0.07, places=6)
        self.assertAlmostEqual(rows[0]["arrival_to_probe_p50_ms"], 0.29, places=6)
        self.assertAlmostEqual(rows[0]["probe_to_gpu_p50_ms"], 0.03, places=6)
        self.assertAlmostEqual(rows[1]["probe_to_gpu_p50_ms"], 0.06, places=6)


class BurstyAbTest(unittest.TestCase):
    def report(self, d, name, caught_ms, probe_ms, caught_second=False):
        """One call's report: a hold run whose first arrival is caught (first kernel `caught_ms`,
        its launch at the probe `probe_ms` after it) and whose second is caught or not."""
        second = (950, 1010) if caught_second else (1000.1, 1010)
        r = run("gate-hold", [0, 1000], stops=[(-50, 5), second], stamps={0: caught_ms, 1000: 0.4})
        r["trace"].append({"event": "launch", "t_ns": int(probe_ms * 1e6), "pid": 7, "seq": 1})
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump({"loads": [{"load": 0.1, "rows": {"gate-hold": stats(10, 5, 0.5)}}], "runs": [r]}, f)
        return path

    def test_two_runs_of_a_stretch_are_compared_arrival_by_arrival(self):
        with tempfile.TemporaryDirectory() as d:
            a = self.report(d, "a.json", 0.35, 0.30)
            b = self.report(d, "b.json", 0.32, 0.30, caught_second=True)
            out = os.path.join(d, "ab.md")
            self.assertEqual(bursty_ab.main([a, b, "--out", out]), 0)
            with open(os.path.join(d, "ab.json")) as f, open(out) as md:
                c, text = json.load(f), md.read()
            self.assertEqual((c["a"]["caught"], c["b"]["caught"], c["same_verdict"], c["caught_by_both"]), (1, 2, 1, 1))
            self.assertAlmostEqual(c["first_kernel_diff_p50_ms"], 0.03, places=6)
            self.assertAlmostEqual(c["a"]["probe_to_gpu_p50_ms"], 0.05, places=6)
            self.assertAlmostEqual(c["probe_to_gpu_diff_p50_ms"], 0.03, places=6)
            self.assertIn("A - B: first kernel +0.030 ms", text)
            with self.assertRaisesRegex(SystemExit, "no alone run .*--config"):
                bursty_ab.main([a, b, "--config", "alone", "--out", out])


class BenchOptionsTest(unittest.TestCase):
    def main_error(self, *argv):
        with tempfile.TemporaryDirectory() as out, self.assertRaises(SystemExit), \
                unittest.mock.patch("sys.stderr") as err:
            bench.main([*argv, "--dry-run", "--out", out])
        return "".join(str(c.args[0]) for c in err.write.call_args_list)

    def test_one_peer_per_invocation_and_what_each_needs(self):
        self.assertIn("one peer per invocation", self.main_error("--configs", "mps,xsched"))
        self.assertIn("--xsched-dir", self.main_error("--configs", "xsched"))
        self.assertIn("--port", self.main_error("--configs", "alone", "--hold-history", __file__))
        self.assertIn("not a hold history", self.main_error("--configs", "alone", "--hold-history", __file__,
                                                            "--port", "80"))
        self.assertIn("--nominal-service-s", self.main_error("--configs", "alone", "--nominal-service-s", "0"))

    def test_gate_hold_has_a_budget_and_other_gates_only_when_asked(self):
        a = type("A", (), {"gate_hold_budget": None})()
        self.assertEqual(bench.hold_budget_for(a, "gate-hold"), bench.DEFAULT_HOLD_BUDGET)
        self.assertIsNone(bench.hold_budget_for(a, "gate-arrival"))
        a.gate_hold_budget = 5.0
        self.assertEqual(bench.hold_budget_for(a, "gate-hold"), 5.0)
        self.assertIsNone(bench.hold_budget_for(a, "gate-arrival"))  # the gate beside it holds nothing

    def test_the_window_starts_with_the_freeze_the_settling_requests_left(self):
        dis = {"event": "disable", "pid": 0, "t_ns": 100, "end_ns": 110, "ok": True}
        en = {"event": "enable", "pid": 0, "t_ns": 500, "ok": True}
        arr = {"event": "arrival", "t_ns": 300}
        old = {"event": "enable", "pid": 0, "t_ns": 50, "ok": True}
        kept = bench.trace_from([old, dis, arr, en], 200)
        self.assertEqual(kept, [dis, arr, en])
        self.assertEqual(analysis.disabled_intervals(kept), [(110, 500)])
        # A trace cut after the disable: the leading enable closes a freeze from before it.
        self.assertEqual(analysis.disabled_intervals([arr, en]), [(300, 500)])
        later = {"event": "disable", "pid": 0, "t_ns": 600, "end_ns": 610, "ok": True}
        self.assertEqual(analysis.disabled_intervals([en, later]), [(500, 500), (610, float("inf"))])


def fake_bins(d):
    """A bin directory under `d` with bursty.sh's two binaries faked (gate_hold's table, valvectl a no-op)."""
    bindir = os.path.join(d, "bin")
    os.makedirs(bindir)
    fake_bin(bindir, "gate_hold", FAKE_GATE_HOLD)
    fake_bin(bindir, "valvectl", "#!/bin/sh\nexit 0\n")
    return bindir


class BurstyShTest(unittest.TestCase):
    def test_dry_run_seeds_the_hold_and_plans_every_part(self):
        with tempfile.TemporaryDirectory() as d:
            bindir = fake_bins(d)
            out = os.path.join(d, "out")
            r = subprocess.run(["bash", os.path.join(HERE, "bursty.sh"), out, "--dry-run", "--window-s", "60"],
                               capture_output=True, text=True, env=dict(os.environ, VALVE_BIN=bindir), timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
            dry = [x for x in r.stdout.splitlines() if x.startswith("DRY: ")]
            self.assertEqual(len(dry), 3, r.stdout)
            self.assertIn("--run-s 60", dry[0])
            self.assertIn("--configs alone,gate-hold,timeslice", dry[0])
            self.assertIn("--hold-history " + os.path.join(out, "seed", "gate-hold-history.json"), dry[0])
            self.assertIn("--configs xsched", dry[1])
            self.assertIn("--configs mps", dry[2])
            self.assertTrue(os.path.exists(os.path.join(out, "seed", "hold-seed.json")))
            self.assertTrue(os.path.exists(os.path.join(out, "bursty-results.tar.gz")))

    def test_a_window_part_goes_to_the_seed_and_the_run_and_plans_its_stretch_only(self):
        with tempfile.TemporaryDirectory() as d:
            bindir = fake_bins(d)
            out = os.path.join(d, "out")
            # 1200 s in thirds: each call plans 400 s a configuration, so three fit 530 s' plain part.
            r = subprocess.run(["bash", os.path.join(HERE, "bursty.sh"), out, "--dry-run", "--window-s", "1200",
                                "--window-part", "2/3", "--plain", "alone", "--peers", "mps"],
                               capture_output=True, text=True, env=dict(os.environ, VALVE_BIN=bindir), timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
            dry = [x for x in r.stdout.splitlines() if x.startswith("DRY: ")]
            self.assertIn("--window-part 2/3", dry[0])
            self.assertIn("--run-s 1200", dry[0])
            info = json.load(open(os.path.join(out, "seed", "hold-seed.json")))
            self.assertEqual(info["window_part"], [2, 3])
            self.assertIn("SKIPPED", r.stdout)  # the peer's 400 s do not fit after the plain part

    def test_a_stretch_without_arrivals_is_refused_and_says_why(self):
        # The default window's middle third at load 10% falls in a 760-s lull of the trace.
        with tempfile.TemporaryDirectory() as d:
            gh = fake_bin(d, "gate_hold", FAKE_GATE_HOLD)
            args = seed_args(os.path.join(d, "seed"), gh)
            args[args.index("--run-s") + 1] = "1200"
            with self.assertRaises(SystemExit) as e:
                hold_seed.main([*args, "--window-part", "1/3"])
            self.assertIn("idles through it", str(e.exception))

    def test_a_part_that_does_not_fit_the_deadline_is_skipped_and_said(self):
        with tempfile.TemporaryDirectory() as d:
            def dry(*extra):
                r = subprocess.run(["bash", os.path.join(HERE, "bursty.sh"), os.path.join(d, "o"), "--dry-run",
                                    *extra], capture_output=True, text=True, env=dict(os.environ, VALVE_BIN=d),
                                   timeout=120)
                self.assertEqual(r.returncode, 0, r.stderr)
                return r.stdout
            # 90-s windows in 530 s: the plain part and the first peer, not the second.
            out = dry()
            self.assertIn("--configs alone,gate-hold,timeslice", out)
            self.assertIn("DRY: ", out.split("--configs xsched")[0])
            self.assertIn("SKIPPED mps", out)
            self.assertIn("SKIPPED xsched", dry("--deadline-s", "400"))
            # A later call: alone again and the peer the first one left.
            later = dry("--plain", "alone", "--peers", "mps")
            self.assertIn("--configs alone --out", later)
            self.assertIn("--configs mps", later)

    def test_xsched_diag_runs_the_diagnosis_instead_of_a_part(self):
        with tempfile.TemporaryDirectory() as d:
            bindir = fake_bins(d)
            r = subprocess.run(["bash", os.path.join(HERE, "bursty.sh"), os.path.join(d, "o"), "--dry-run",
                                "--plain", "alone", "--peers", "xsched-diag"],
                               capture_output=True, text=True, env=dict(os.environ, VALVE_BIN=bindir), timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
            self.assertIn("xsched_diag.sh", r.stdout)
            self.assertNotIn("--configs xsched", r.stdout)

    def test_an_unknown_peer_is_refused(self):
        r = subprocess.run(["bash", os.path.join(HERE, "bursty.sh"), "/tmp/x", "--peers", "mig"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not mig", r.stderr)


import unittest.mock  # noqa: E402

if __name__ == "__main__":
    unittest.main()
