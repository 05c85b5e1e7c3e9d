"""Unit tests of bench.py's per-configuration control of offline (stdlib only; run by selftest.sh).

aiohttp (the load generator's) is not needed: no request is sent."""

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
        def load(*_a):
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


if __name__ == "__main__":
    unittest.main()
