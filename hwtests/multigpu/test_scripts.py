"""run.sh and align.sh end to end on a CPU with the fake engine (no torch, no Valve): options,
the report files and tarball, and that every process they started is gone, also after a SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def sh(*argv, timeout=120):
    return subprocess.run([os.path.join(HERE, argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)


def alive(pid):
    return os.path.exists(f"/proc/{pid}")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def pids_in(path):
    with open(path) as f:
        return [int(x) for x in f.read().split()]


class Options(unittest.TestCase):
    def test_help_everywhere(self):
        for s in ("run.sh", "align.sh"):
            r = sh(s, "--help")
            self.assertEqual(r.returncode, 0, s)
            self.assertIn("Usage:", r.stdout)
        for py in ("tp_server.py", "ddp_job.py", "drive.py", "report.py", "cpu_train.py"):
            r = subprocess.run([sys.executable, os.path.join(HERE, py), "--help"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, py)

    def test_bad_options_name_the_fix(self):
        out = tempfile.mkdtemp()
        for argv, said in ((["run.sh", out, "--bogus"], "unknown option --bogus"),
                           (["run.sh", out, "--gpus"], "--gpus needs a value"),
                           (["run.sh", out, "--load", "1.5"], "between 0 and 1"),
                           (["run.sh", out, "--dry-run", "--configs", "gate"], "no Valve"),
                           (["run.sh", out, "--configs", "mps"], "--configs takes"),
                           (["run.sh", out, "--fake-engine"], "for --dry-run only"),
                           (["align.sh", out, "--pair", "1,1"], "two different GPUs"),
                           (["align.sh", out, "--phases", "sideways"], "--phases takes")):
            r = sh(*argv)
            self.assertEqual(r.returncode, 2, argv)
            self.assertIn(said, r.stderr, argv)

    @unittest.skipIf(os.path.exists("/dev/nvidiactl"), "a driver is here")
    def test_no_driver_is_a_skip(self):
        for s in ("run.sh", "align.sh"):
            r = sh(s, tempfile.mkdtemp())
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("SKIP", r.stdout)


class DryRuns(unittest.TestCase):
    def test_run_sh(self):
        out = tempfile.mkdtemp()
        r = sh("run.sh", out, "--dry-run", "--fake-engine", "--seconds", "3", "--alone-s", "1")
        self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-2000:])
        rep = read_json(os.path.join(out, "report.json"))
        self.assertEqual([x["config"] for x in rep["rows"]], ["alone", "timeslice"])
        self.assertTrue(all(x["requests"] > 0 and x["errors"] == 0 for x in rep["rows"]))
        self.assertIsNotNone(rep["rows"][1]["offline_vs_alone"])
        with tarfile.open(os.path.join(out, "multigpu-results.tar.gz")) as t:
            names = t.getnames()
        self.assertIn("./report.md", names)
        self.assertIn("./timeslice/records-0.json", names)
        for cfg in ("alone", "timeslice"):
            for pid in pids_in(os.path.join(out, cfg, "server.pids")):
                self.assertFalse(alive(pid), f"rank {pid} of {cfg} left running")

    def test_sigterm_stops_everything_and_still_packs(self):
        out = tempfile.mkdtemp()
        p = subprocess.Popen([os.path.join(HERE, "run.sh"), out, "--dry-run", "--fake-engine", "--seconds", "60",
                              "--configs", "timeslice"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        pidf = os.path.join(out, "timeslice", "server.pids")
        try:
            deadline = time.time() + 60
            while not os.path.exists(pidf) and time.time() < deadline:
                time.sleep(0.2)
            time.sleep(1)
            ranks = pids_in(pidf)
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(60), 143)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for pid in ranks:
            self.assertFalse(alive(pid), f"rank {pid} left running")
        self.assertTrue(os.path.exists(os.path.join(out, "multigpu-results.tar.gz")))

    def test_align_sh(self):
        out = tempfile.mkdtemp()
        r = sh("align.sh", out, "--dry-run", "--fake-engine", "--window-s", "2", "--alone-s", "1")
        self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-2000:])
        rep = read_json(os.path.join(out, "report.json"))
        rows = {x["phase"]: x for x in rep["rows"]}
        self.assertEqual(set(rows), {"instep", "outstep"})
        self.assertGreater(rows["instep"]["client"]["score"], rows["outstep"]["client"]["score"])
        self.assertIsNotNone(rows["instep"]["measured_per_s"])
        self.assertIsNone(rows["instep"]["predicted_per_s"])  # no daemon, no scheduler: nothing predicted
        self.assertTrue(os.path.exists(os.path.join(out, "profile.json")))
        self.assertTrue(os.path.exists(os.path.join(out, "align-results.tar.gz")))


if __name__ == "__main__":
    unittest.main()
