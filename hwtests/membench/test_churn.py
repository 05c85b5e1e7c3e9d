"""Tests of valve-churn's admin churn (churn.py) against a fake control socket and a fake valvectl:
no daemon, no GPU, standard library only. About 5 s.

    python3 -m unittest test_churn
"""

import os
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import churn  # noqa: E402
from common import now  # noqa: E402


class FakeSocket(threading.Thread):
    """A control socket that answers every line (or 64 KiB without one) with an error and closes,
    as the daemon refuses bad input; counts the connections and lines it saw."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path, self.stop, self.accepted, self.lines = path, threading.Event(), 0, 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(512)
        self.listener.setblocking(False)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        while not self.stop.is_set():
            for key, _ in sel.select(timeout=0.05):
                if key.data is None:
                    self.accept(sel)
                else:
                    self.read(sel, key.fileobj, key.data)
        for key in list(sel.get_map().values()):
            key.fileobj.close()

    def accept(self, sel) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self.accepted += 1
        sel.register(conn, selectors.EVENT_READ, bytearray())

    def read(self, sel, conn, buf: bytearray) -> None:
        try:
            chunk = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buf += chunk
        if chunk and b"\n" not in buf and len(buf) <= 64 * 1024:
            return
        if buf:
            self.lines += 1
            try:
                conn.send(b'{"error": {"code": 2, "message": "bad request"}}\n')
            except OSError:
                pass
        sel.unregister(conn)
        conn.close()


FAKE_VALVECTL = """#!/bin/sh
# A fake valvectl for the gate cycler: `gate start|stop|status [--json]`, state in a file.
dir={dir}
echo "$*" >> "$dir/calls"
state=$(cat "$dir/state" 2>/dev/null)
case "$2" in
start)
    if [ -f "$dir/fail-start" ]; then rm -f "$dir/fail-start"; echo "starting the gate: boom" >&2; exit 5; fi
    [ "$state" = on ] && {{ echo "a gate is already running" >&2; exit 1; }}
    echo on > "$dir/state"; echo '{{"running": true}}';;
stop)
    [ "$state" = on ] || {{ echo "no gate is running" >&2; exit 1; }}
    echo off > "$dir/state"; echo '{{"running": false, "preemptions": 3}}';;
status)
    if [ "$state" = on ]; then echo '{{"running": true, "online_pids": [42]}}'; else echo '{{"running": false}}'; fi;;
esac
"""

START = ["gate", "start", "--online", "42", "--offline-label", "batch"]


class Fakes(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="churn-test-")
        self.valvectl = os.path.join(self.dir, "valvectl")
        with open(self.valvectl, "w") as f:
            f.write(FAKE_VALVECTL.format(dir=self.dir))
        os.chmod(self.valvectl, 0o755)
        with open(os.path.join(self.dir, "state"), "w") as f:
            f.write("on\n")  # run.py has started the gate before the churn
        self.log = os.path.join(self.dir, "daemon.log")
        with open(self.log, "w") as f:
            f.write("2026-01-01T00:00:00Z  WARN valve_daemon::server: slow request handled_us=1 waited_us=30000\n")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def state(self) -> str:
        with open(os.path.join(self.dir, "state")) as f:
            return f.read().strip()

    def calls(self) -> list[str]:
        with open(os.path.join(self.dir, "calls")) as f:
            return f.read().splitlines()


class Cycler(Fakes):
    def cycle(self, seconds, deadline=1e9, alive=lambda: True):
        halt = threading.Event()
        c = churn.GateCycler(self.valvectl, START, 0.05, halt, now() + deadline, alive, margin=0.0)
        c.start()
        time.sleep(seconds)
        halt.set()
        c.join(timeout=10)
        self.assertFalse(c.is_alive())
        return c

    def test_it_stops_and_starts_with_the_given_arguments_times_each_and_ends_started(self):
        c = self.cycle(0.8)
        self.assertGreaterEqual(c.restarts, 3)
        stops = churn.durations(c.commands, "stop")
        self.assertEqual(stops["n"], stops["ok"])
        self.assertEqual(churn.durations(c.commands, "start")["n"], c.restarts)
        self.assertGreater(stops["max_ms"], 0.0)
        self.assertEqual(c.preemptions, 3 * stops["n"], "the preemptions each stop reported, summed")
        self.assertEqual(c.errors.n, 0)
        self.assertEqual(self.state(), "on", "it stops only between cycles")
        self.assertIn("gate start --online 42 --offline-label batch", self.calls())

    def test_a_failed_start_is_counted_and_kept_and_the_next_cycle_starts_the_gate_again(self):
        open(os.path.join(self.dir, "fail-start"), "w").close()
        c = self.cycle(0.8)
        self.assertEqual(c.errors.n, 1)
        self.assertIn("exit 5: starting the gate: boom", c.errors.first[0])
        self.assertIn("gate status --json", self.calls(), "it asked where the gate was")
        self.assertEqual(self.state(), "on")

    def test_no_restart_near_online_s_last_arrival_or_once_online_has_gone(self):
        self.assertEqual(self.cycle(0.3, deadline=0.0).commands, [])
        self.assertEqual(self.cycle(0.3, alive=lambda: False).commands, [])
        self.assertEqual(self.state(), "on")

    def test_ensure_gate_starts_a_stopped_gate_and_keeps_a_running_one(self):
        self.assertEqual(churn.ensure_gate(self.valvectl, START)["action"], "kept")
        with open(os.path.join(self.dir, "state"), "w") as f:
            f.write("off\n")
        self.assertEqual(churn.ensure_gate(self.valvectl, START), dict(ok=True, action="started", error=None))
        self.assertEqual(self.state(), "on")

    def test_a_missing_valvectl_is_an_error_not_an_exception(self):
        out, err = churn.run_valvectl(os.path.join(self.dir, "none"), ["gate", "status"])
        self.assertIsNone(out)
        self.assertIn("FileNotFoundError", err)


class Flood(Fakes):
    def test_flooders_send_every_kind_stop_at_halt_and_close_what_they_held(self):
        path = os.path.join(self.dir, "valve.sock")
        server = FakeSocket(path)
        server.start()
        halt = threading.Event()
        flooders = [churn.Flooder(path, halt, f"f{i}") for i in range(2)]
        for f in flooders:
            f.start()
        time.sleep(1.0)
        halt.set()
        for f in flooders:
            f.join(timeout=5)
            self.assertFalse(f.is_alive())
            self.assertGreater(f.counts["messages"], 20)
            self.assertGreater(f.counts["replies"], 10)
            self.assertGreater(f.counts["held"], 0)
            self.assertGreaterEqual(f.counts["connections"], f.counts["messages"])
            self.assertEqual(len(f.held), 0, "held connections are closed when it stops")
        server.stop.set()
        server.join(timeout=5)
        self.assertGreater(server.lines, 20)

    def test_a_missing_socket_is_counted_without_a_hot_loop(self):
        halt = threading.Event()
        f = churn.Flooder(os.path.join(self.dir, "nothing.sock"), halt)
        f.start()
        time.sleep(0.3)
        halt.set()
        f.join(timeout=5)
        self.assertFalse(f.is_alive())
        self.assertEqual(f.counts["connections"], 0)
        self.assertTrue(0 < f.errors.n < 100, f.errors.n)
        self.assertLessEqual(len(f.errors.first), churn.FIRST_ERRORS)


class Whole(Fakes):
    def test_churn_runs_both_stops_them_and_sums_up_with_the_log_lines_of_its_own_window(self):
        path = os.path.join(self.dir, "valve.sock")
        server = FakeSocket(path)
        server.start()
        c = churn.Churn(self.valvectl, START, 0.1, 2, now() + 1e9, lambda: True, self.log, sock=path, margin=0.0)
        c.start()
        with open(self.log, "a") as f:
            f.write("2026-01-01T00:00:01Z  WARN valve_daemon::server: slow request handled_us=25000 waited_us=5\n")
        time.sleep(1.0)
        s = c.finish()
        server.stop.set()
        server.join(timeout=5)
        self.assertEqual(s["threads_left_running"], [])
        self.assertGreaterEqual(s["restarts"], 3)
        self.assertEqual(s["failures"], 0)
        self.assertGreater(s["flood"]["messages"], 20)
        self.assertEqual(s["final_gate"]["action"], "kept")
        self.assertEqual(self.state(), "on")
        self.assertEqual(s["daemon_log"]["slow_requests"], 1, "only the line written after the churn began")
        self.assertEqual(s["daemon_log"]["slow_handled_ms_max"], 25.0)
        self.assertLessEqual(s["t_start"], s["t_cycler_end"])
        self.assertEqual(len(s["commands"]), s["stop"]["n"] + s["start"]["n"])

    def test_finish_without_start_leaves_the_gate_and_says_so(self):
        c = churn.Churn(self.valvectl, START, 0.1, 1, now() + 1e9, lambda: True, self.log, sock="/nonexistent")
        s = c.finish()
        self.assertEqual((s["restarts"], s["flood"]["messages"]), (0, 0))
        self.assertEqual(s["final_gate"]["action"], "kept")


class Log(unittest.TestCase):
    TEXT = "\n".join([
        "\x1b[2m2026-11-25T10:00:00.1Z\x1b[0m \x1b[33m WARN\x1b[0m \x1b[2mvalve_daemon::server\x1b[0m\x1b[2m:\x1b[0m "
        "slow request \x1b[3mhandled_us\x1b[0m\x1b[2m=\x1b[0m120 \x1b[3mwaited_us\x1b[0m\x1b[2m=\x1b[0m41000",
        '{"timestamp":"x","level":"WARN","fields":{"message":"slow request","handled_us":30000,"waited_us":7}}',
        "2026-11-25T10:00:01Z  INFO valve_daemon::server: gate start answered (the loop served other requests "
        "meanwhile) took_us=250000",
        "2026-11-25T10:00:02Z  INFO valve_daemon::memory::server: reclaimed for online handles=4 freeze_us=300 "
        "answer_us=500 total_us=900 from_gate=true queued_us=12 outside_daemon_us=80",
        "2026-11-25T10:00:03Z  INFO valve_daemon::memory::server: reclaimed for online handles=40 total_us=9000 "
        "queued_us=3000 outside_daemon_us=100",
    ])

    def test_slow_requests_and_reclaims_are_read_in_text_with_colours_and_json(self):
        s = churn.log_summary(self.TEXT)
        self.assertEqual(s["slow_requests"], 2, "not the gate start line, whose text says 'requests'")
        self.assertEqual(s["slow_waited_ms_max"], 41.0)
        self.assertEqual(s["slow_handled_ms_max"], 30.0)
        self.assertEqual((s["reclaims"], s["reclaims_le_1gib"]), (2, 1))
        self.assertAlmostEqual(s["reclaim_le_1gib_total_ms_p99"], 0.9)
        self.assertEqual(s["reclaim_queued_ms_max"], 3.0)
        self.assertEqual(churn.log_summary("")["slow_requests"], 0)
        self.assertIsNone(churn.log_summary("")["slow_waited_ms_max"])


if __name__ == "__main__":
    unittest.main()
