"""lib.sh's daemon and gate helpers against a stand-in valvectl (a Python script keeping its state
in files): start_daemon refuses a running daemon, gate_wait, gate_trace's paging, and that
stop_daemon stops the gate and resumes everything before it ends the daemon."""

import os
import subprocess
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

FAKE = textwrap.dedent('''\
    #!/usr/bin/env python3
    import json, os, signal, sys, time
    d = os.environ["FAKE_VALVE_DIR"]
    args = [a for a in sys.argv[1:] if a != "--json"]
    with open(os.path.join(d, "calls"), "a") as f:
        f.write(" ".join(args) + "\\n")
    running = os.path.join(d, "running")
    if args[0] == "daemon":
        open(running, "w").close()
        signal.signal(signal.SIGTERM, lambda *_: (os.remove(running), sys.exit(0)))
        while True:
            time.sleep(0.1)
    if not os.path.exists(running):
        sys.exit(7)
    if args[:2] == ["gate", "status"]:
        print(json.dumps({"online_probes_attached": True, "offline_pids": [11, 12]}))
    elif args[:2] == ["gate", "trace"]:
        after = int(args[args.index("--after") + 1])
        for seq in range(after + 1, min(after + 3, 5) + 1):
            print(json.dumps({"seq": seq, "t_ns": seq, "event": "busy"}))
    ''')


def bash(script, fake_dir, vc):
    env = dict(os.environ, FAKE_VALVE_DIR=fake_dir)
    pre = f'set -euo pipefail; work="{fake_dir}/work"; out="{fake_dir}"; mkdir -p "$work"; here="{HERE}"; ' \
          f'root="{HERE}/../.."; valvectl="{vc}"; . "{HERE}/lib.sh"; '
    return subprocess.run(["bash", "-c", pre + script], capture_output=True, text=True, env=env, timeout=60)


class Lib(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.vc = os.path.join(self.dir, "valvectl")
        with open(self.vc, "w") as f:
            f.write(FAKE)
        os.chmod(self.vc, 0o755)

    def calls(self):
        with open(os.path.join(self.dir, "calls")) as f:
            return f.read().splitlines()

    def test_daemon_gate_trace_and_release(self):
        r = bash('start_daemon "$out/daemon.log"; gate_wait 2; gate_trace "$out/trace.jsonl"; '
                 'wc -l < "$out/trace.jsonl"; stop_daemon; "$valvectl" status || echo "gone $?"', self.dir, self.vc)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split()[0], "5")  # 5 records over pages of 3 and 2
        self.assertIn("gone 7", r.stdout)
        calls = self.calls()
        stop, resume = calls.index("gate stop"), calls.index("resume --all")
        self.assertLess(stop, resume)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "running")))

    def test_a_running_daemon_is_refused(self):
        open(os.path.join(self.dir, "running"), "w").close()
        r = bash('start_daemon "$out/daemon.log"', self.dir, self.vc)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("a Valve daemon already runs", r.stderr)

    def test_gate_wait_gives_up_on_too_few_offline_processes(self):
        r = bash('start_daemon "$out/daemon.log"; sed() { :; }; seq() { echo 1; }; '
                 'if gate_wait 3; then echo waited; else echo refused; fi; stop_daemon', self.dir, self.vc)
        self.assertIn("refused", r.stdout)
        self.assertIn("gate 3 offline processes", r.stderr)

    def test_stop_bg_ends_a_group_that_ignores_sigterm(self):
        r = bash('stop_grace_s=1; start_bg stubborn "$out/s.log" bash -c "trap \\"\\" TERM; sleep 300 & wait"; sleep 0.5; '
                 'p=$pid_stubborn; group_alive $p && echo running; stop_bg stubborn; sleep 0.5; '
                 'group_alive $p && echo alive || echo ended',
                 self.dir, self.vc)
        self.assertIn("running", r.stdout, r.stderr)
        self.assertIn("ended", r.stdout, r.stderr)


if __name__ == "__main__":
    unittest.main()
