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


if __name__ == "__main__":
    unittest.main()
