"""tp_server.py without torch: the split check, each rank's environment, the control channel, rank
0's engine behind rawserver's front end, and the launcher with the fake engine (a real process per
rank: their /proc environ carries the label and multicast off; SIGTERM ends them all)."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import tp_server
from tp_server import CMD_GENERATE, CMD_STOP, Control, FakeModel, Rank0Engine

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serving"))
import loadgen  # noqa: E402
import rawserver  # noqa: E402


class Split(unittest.TestCase):
    def test_sizes_split_over_one_to_eight(self):
        for size in ("3b", "8b", "70b"):
            for world in (1, 2, 4, 8):
                self.assertIsNone(tp_server.check_split(size, world), (size, world))
        self.assertIsNone(tp_server.check_split("tiny", 2))

    def test_a_bad_split_names_the_fix(self):
        why = tp_server.check_split("8b", 3)
        self.assertIn("kv_heads 8", why)
        self.assertIn("--gpus that divides 8", why)


class Env(unittest.TestCase):
    def test_rank_env(self):
        env = tp_server.rank_env({"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"}, 1, 4, 5, 100, 101, "online")
        self.assertEqual(env["NCCL_NVLS_ENABLE"], "0")
        self.assertEqual(env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], "1")
        self.assertEqual((env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]), ("1", "4", "1"))
        self.assertEqual((env["MASTER_PORT"], env["VALVE_TP_CTRL_PORT"], env["VALVE_TP_DEVICE"]), ("100", "101", "5"))
        self.assertEqual((env["VALVE_LABEL"], env["PATH"]), ("online", "/bin"))

    def test_pad_ids(self):
        self.assertEqual(tp_server.pad_ids(b"\x01\x00\x00\x00", 2), b"\x01\x00\x00\x00" + bytes(4))
        self.assertEqual(len(tp_server.pad_ids(bytes(40), 3)), 12)


def controls(world, plen):
    """A Control per rank, connected (rank 0 accepts on a free port while the others connect)."""
    port = tp_server.free_port()
    out = [None] * world

    def make(r):
        out[r] = Control(r, world, port, plen, timeout_s=10)
    ts = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    return out


class Channel(unittest.TestCase):
    def test_broadcast_and_stop(self):
        c = controls(3, 4)
        for f in c[1:]:
            f.barrier()
        c[0].barrier()
        ids = c[0].send(CMD_GENERATE, b"\x07\x00\x00\x00", 1, 5)
        self.assertEqual(ids, b"\x07\x00\x00\x00" + bytes(12))
        for f in c[1:]:
            self.assertEqual(f.recv(), (CMD_GENERATE, 1, 5, ids))
        for p in c[0].peers:
            p.close()
        self.assertEqual(c[1].recv()[0], CMD_STOP)  # rank 0 gone: the followers stop
        close(c)

    def test_follower_runs_what_rank0_sends(self):
        c = controls(2, 2)
        model = FakeModel(0, 0)
        t = threading.Thread(target=tp_server.follow, args=(model, c[1]))
        t.start()
        c[0].send(CMD_GENERATE, b"", 0, 3)
        c[0].send(CMD_STOP)
        t.join(5)
        self.assertFalse(t.is_alive())
        close(c)


class Served(unittest.TestCase):
    def test_tokens_and_server_stamps_over_the_raw_protocol(self):
        c = controls(1, 4)[0]
        server = rawserver.RawServer(Rank0Engine(FakeModel(1, 1), c, 32), 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            recs = asyncio.run(loadgen.run(f"raw://127.0.0.1:{server.port}", 50, 3, 1, [1, 2, 3], 5))
        finally:
            server.stop()
        for r in recs:
            self.assertIsNone(r["error"])
            self.assertEqual(r["tokens"], 5)
            self.assertEqual(len(r["server_token_ns"]), 5)
            self.assertLessEqual(r["recv_ns"], r["launch_ns"])
            self.assertLessEqual(r["launch_ns"], r["server_token_ns"][0])
            self.assertEqual(r["server_token_ns"], sorted(r["server_token_ns"]))


def read_pids(path):
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def close(ctrls):
    for c in ctrls:
        for s in [*c.peers, c.sock]:
            if s is not None:
                s.close()


def environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


class LauncherProcess(unittest.TestCase):
    def test_one_process_per_rank_labelled_and_all_ended_by_sigterm(self):
        pidf = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tp-test-{os.getpid()}.pids")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "VALVE_LABEL")}
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "tp_server.py"), "--gpus", "3", "--engine", "fake",
                              "--port", "0", "--prompt-tokens", "4", "--pid-file", pidf],
                             stdout=subprocess.PIPE, text=True, env=env)
        try:
            line = p.stdout.readline()
            self.assertTrue(line.startswith("READY "), line)
            self.assertIn("ranks 3", line)
            pids = read_pids(pidf)
            self.assertEqual(len(pids), 3)
            for r, pid in enumerate(pids):
                e = environ(pid)
                self.assertEqual(e[b"VALVE_LABEL"], b"online")
                self.assertEqual(e[b"NCCL_NVLS_ENABLE"], b"0")
                self.assertEqual(e[b"TORCH_SYMM_MEM_DISABLE_MULTICAST"], b"1")
                self.assertEqual(e[b"RANK"], str(r).encode())
            self.assertNotIn(b"VALVE_LABEL", environ(p.pid))  # the launcher opens no GPU: not online
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(20), 0)
            time.sleep(0.2)
            for pid in pids:
                self.assertFalse(os.path.exists(f"/proc/{pid}"), f"rank pid {pid} still there")
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
            os.remove(pidf)

    def test_a_worker_that_dies_ends_the_others(self):
        pidf = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tp-test2-{os.getpid()}.pids")
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "tp_server.py"), "--gpus", "2", "--engine", "fake",
                              "--port", "0", "--prompt-tokens", "4", "--pid-file", pidf], stdout=subprocess.PIPE, text=True)
        try:
            self.assertTrue(p.stdout.readline().startswith("READY "))
            pids = read_pids(pidf)
            os.kill(pids[1], signal.SIGKILL)
            self.assertNotEqual(p.wait(20), 0)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
            os.remove(pidf)

    def test_arguments_are_checked(self):
        r = subprocess.run([sys.executable, os.path.join(HERE, "tp_server.py"), "--gpus", "3", "--size", "8b"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("does not split over 3 ranks", r.stderr)


if __name__ == "__main__":
    unittest.main()
