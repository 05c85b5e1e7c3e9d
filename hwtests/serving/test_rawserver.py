"""Tests of rawserver.py's TCP front end with loadgen's raw protocol, on CPU (run by selftest.sh).

The protocol tests serve a pure-Python engine, so they need only the standard library; the tests
with the tiny decoder (and server.py's graph engine marks) run where torch is installed."""

import asyncio
import importlib.util
import json
import socket
import struct
import sys
import threading
import time
import types
import unittest

import loadgen
import rawserver

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def stub_aiohttp():
    """bench.py and server.py import aiohttp; these tests send no HTTP (as test_stamp.py does)."""
    m = sys.modules.setdefault("aiohttp", types.ModuleType("aiohttp"))
    if not hasattr(m, "web"):
        m.web = None


class FakeEngine:
    """rawserver's engine interface without torch: token i of a request is (sum of its ids + i) % 1000."""

    max_tokens = 64

    def __init__(self, mapping=None, step_s=0.0, fail=False):
        self.buf = bytearray(rawserver.HEADER.size + 4 * rawserver.MAX_IDS)
        self.mapping, self.step_s, self.fail = mapping, step_s, fail

    def generate(self, n_ids, n, marks):
        ids = struct.unpack_from(f"<{n_ids}i", self.buf, rawserver.HEADER.size)
        marks["launch_ns"] = time.monotonic_ns()
        if self.fail:
            raise RuntimeError("the device fell over")
        for i in range(n):
            time.sleep(self.step_s)
            yield (sum(ids) + i) % 1000

    def calibrate(self):
        if self.mapping is None:
            raise rawserver.RequestError(rawserver.NO_STAMP)
        return self.mapping


class Served:
    """A RawServer on a free port, serving on a thread until the block ends."""

    def __init__(self, engine):
        self.server = rawserver.RawServer(engine, 0)
        self.url = f"raw://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()
        self.thread.join(5)
        assert not self.thread.is_alive(), "serve_forever did not end"


def ask(url, data, shut=False):
    """Sends raw bytes on a fresh connection and returns the answer's lines (decoded)."""
    with socket.create_connection(loadgen.raw_address(url), timeout=10) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        return s.makefile("rb").read().decode().splitlines()


def load(url, n=1, prompt="hello world", max_tokens=8, rate=1000.0):
    return asyncio.run(loadgen.run(url, rate, n, 0, prompt, max_tokens))


class Protocol(unittest.TestCase):
    def test_loadgen_gets_every_token_and_the_marks_in_order(self):
        with Served(FakeEngine()) as srv:
            (r,) = load(srv.url, prompt="hello world", max_tokens=8)
        self.assertIsNone(r["error"])
        self.assertEqual(r["tokens"], 8)
        self.assertTrue(r["idle_at_send"])
        self.assertLessEqual(r["send_ns"], r["recv_ns"])
        self.assertLessEqual(r["recv_ns"], r["launch_ns"])
        self.assertLessEqual(r["launch_ns"], r["first_ns"])
        self.assertLessEqual(r["first_ns"], r["end_ns"])
        self.assertNotIn("done", r)

    def test_the_ids_and_token_lines_are_as_documented(self):
        ids = list(b"hello")
        with Served(FakeEngine()) as srv:
            lines = ask(srv.url, rawserver.encode_request(ids, 3))
            json_lines = ask(srv.url, b'{"ids": [104, 101, 108, 108, 111], "max_tokens": 3}\n')
        want = [str((sum(ids) + i) % 1000) for i in range(3)]
        self.assertEqual(lines[:3], want)
        final = json.loads(lines[3])
        self.assertEqual((final["done"], final["tokens"], len(lines)), (True, 3, 4))
        self.assertLessEqual(final["recv_ns"], final["launch_ns"])
        self.assertEqual(json_lines[:3], want)

    def test_concurrent_clients_are_served_one_at_a_time_and_each_completely(self):
        answers = {}

        def client(k):
            answers[k] = ask(srv.url, rawserver.encode_request([k] * 10, 5))

        with Served(FakeEngine(step_s=0.01)) as srv:
            threads = [threading.Thread(target=client, args=(k,)) for k in (1, 2, 3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            recs = load(srv.url, n=3, max_tokens=5)  # through loadgen too: overlapping sends
        for k in (1, 2, 3):
            self.assertEqual(answers[k][:5], [str((10 * k + i) % 1000) for i in range(5)])
            self.assertTrue(json.loads(answers[k][5])["done"])
        marks = sorted((json.loads(a[5])["recv_ns"], json.loads(a[5])["launch_ns"]) for a in answers.values())
        self.assertEqual([(r["error"], r["tokens"]) for r in recs], [(None, 5)] * 3)
        self.assertGreater(max(r["in_flight_at_send"] for r in recs), 0)
        for (_, launch), (recv, _) in zip(marks, marks[1:]):
            self.assertGreaterEqual(recv, launch)  # the next one was read after the last launched

    def test_malformed_requests_get_an_error_line_and_the_server_keeps_serving(self):
        cases = [
            (b"HTTP/1.1 GET /\r\n\r\n", "not a request"),
            (b"{not json\n", "not a line of JSON"),
            (b'{"ids": "abc"}\n', '"ids"'),
            (b'{"ids": [1, 2], "max_tokens": 999}\n', "max_tokens 999"),
            (b'{"ids": [4294967296], "max_tokens": 2}\n', "int32"),
            (rawserver.HEADER.pack(rawserver.MAGIC, 4, 0), "0 ids"),
            (rawserver.encode_request([1] * 10, 4)[:20], "ended after 20 of 52 bytes"),
        ]
        with Served(FakeEngine()) as srv:
            for data, why in cases:
                lines = ask(srv.url, data, shut=True)
                self.assertEqual(len(lines), 1, lines)
                self.assertIn(why, json.loads(lines[0])["error"])
            socket.create_connection(loadgen.raw_address(srv.url)).close()  # a bare connect
            (r,) = load(srv.url, max_tokens=4)
        self.assertEqual((r["error"], r["tokens"]), (None, 4))

    def test_an_engine_failure_is_an_error_line_and_a_client_gone_mid_answer_is_dropped(self):
        eng = FakeEngine(fail=True)
        with Served(eng) as srv:
            (r,) = load(srv.url)
            self.assertIn("RuntimeError: the device fell over", r["error"])
            eng.fail, eng.step_s = False, 0.005
            with socket.create_connection(loadgen.raw_address(srv.url)) as s:
                s.sendall(rawserver.encode_request([1, 2], 60))
                s.recv(4)  # the first token, then gone
            (r,) = load(srv.url, max_tokens=3)
        self.assertEqual((r["error"], r["tokens"]), (None, 3))

    def test_calibrate_without_a_stamper_says_so_and_with_one_returns_the_mapping(self):
        with Served(FakeEngine()) as srv:
            answer = loadgen.raw_control(srv.url, {"calibrate": True})
            self.assertIn("--stamp-first-kernel", answer["error"])
            self.assertEqual(loadgen.raw_control(srv.url, {"health": True}), {"status": "ok"})
        mapping = {"offset_ns": 5, "bound_ns": 3000, "samples": 50, "at_ns": 7}
        with Served(FakeEngine(mapping=mapping)) as srv:
            self.assertEqual(loadgen.raw_control(srv.url, {"calibrate": True}), {"mapping": mapping})

    def test_a_server_that_closes_before_its_final_line_is_an_error(self):
        lsock = socket.create_server(("127.0.0.1", 0))

        def serve_two_tokens():
            conn, _ = lsock.accept()
            conn.recv(65536)
            conn.sendall(b"1\n2\n")
            conn.close()

        t = threading.Thread(target=serve_two_tokens)
        t.start()
        (r,) = load(f"raw://127.0.0.1:{lsock.getsockname()[1]}")
        t.join(5)
        lsock.close()
        self.assertEqual(r["tokens"], 2)
        self.assertIn("before its final line", r["error"])

    def test_prompts_are_sent_as_their_bytes_and_urls_are_checked(self):
        self.assertEqual(loadgen.raw_ids("hé"), [104, 195, 169])
        self.assertEqual(loadgen.raw_ids([5, 6]), [5, 6])
        self.assertEqual(loadgen.raw_address("raw://127.0.0.1:8123"), ("127.0.0.1", 8123))
        with self.assertRaises(ValueError):
            loadgen.raw_address("http://127.0.0.1:8123")


class Bench(unittest.TestCase):
    """bench.py --server graph-raw: its command line, url, calibration and stamp flag."""

    def setUp(self):
        stub_aiohttp()
        import bench

        self.bench = bench

    def ns(self, **kw):
        base = dict(server="graph-raw", model_size="3b", device="cuda", prompt_tokens=512, max_tokens=64,
                    dry_run=False, stamp_first_kernel=None)
        return types.SimpleNamespace(**dict(base, **kw))

    def test_argv_url_and_stamp_flag(self):
        b = self.bench
        argv = b.server_argv(self.ns(stamp_first_kernel="/o/stamp.ptx"), None, 8000)
        self.assertEqual(argv[1:], [b.os.path.join(b.HERE, "rawserver.py"), "--size", "3b", "--device", "cuda",
                                    "--port", "8000", "--prompt-tokens", "512", "--max-len", "1024",
                                    "--stamp-first-kernel", "/o/stamp.ptx"])
        self.assertIn("1100", b.server_argv(self.ns(prompt_tokens=1000, max_tokens=100), None, 1))
        self.assertEqual(b.server_url(self.ns(), 8000), "raw://127.0.0.1:8000")
        self.assertEqual(b.server_url(self.ns(server="graph"), 8000), "http://127.0.0.1:8000")
        ap = b.argparse.ArgumentParser()
        self.assertEqual(b.stamp_choice(self.ns(stamp_first_kernel=__file__), ap), b.os.path.abspath(__file__))

    def test_calibrate_server_speaks_the_raw_protocol(self):
        mapping = {"offset_ns": 5, "bound_ns": 3000, "samples": 50, "at_ns": 7}
        with Served(FakeEngine(mapping=mapping)) as srv:
            self.assertEqual(self.bench.calibrate_server(srv.url), mapping)
            self.bench.wait_raw(srv.url, 5)
        with Served(FakeEngine()) as srv:
            self.assertIsNone(self.bench.calibrate_server(srv.url))  # logged: the stamp is off


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TinyDecoder(unittest.TestCase):
    """The real engine on CPU: the tiny decoder, prefill at a fixed length, decode eagerly."""

    @classmethod
    def setUpClass(cls):
        cls.engine = rawserver.TorchEngine("tiny", "cpu", max_len=128, prompt_len=32)

    def expected(self, ids, n):
        from decoder import GraphDecoder

        d = GraphDecoder(size="tiny", device="cpu", max_len=128)
        ids = (list(ids) + [0] * 32)[:32]  # padded with zeros or cut to the prefill's length
        return [str(t) for t in d.generate([i % d.vocab for i in ids], n)]

    def test_loadgen_over_tcp_gets_the_decoders_tokens_and_ordered_marks(self):
        with Served(self.engine) as srv:
            recs = load(srv.url, n=2, prompt="x" * 40, max_tokens=6)
            short = ask(srv.url, rawserver.encode_request([3, 1025, -7], 5))
            long = ask(srv.url, rawserver.encode_request(list(range(50)), 5))
        for r in recs:
            self.assertEqual((r["error"], r["tokens"]), (None, 6))
            self.assertLessEqual(r["send_ns"], r["recv_ns"])
            self.assertLessEqual(r["recv_ns"], r["launch_ns"])
            self.assertLessEqual(r["launch_ns"], r["first_ns"])
        self.assertEqual(short[:5], self.expected([3, 1025, -7], 5))
        self.assertEqual(long[:5], self.expected(range(50), 5))
        self.assertNotIn("gpu_start_ns", json.loads(short[5]))  # no stamp on CPU

    def test_calibrate_on_cpu_answers_that_the_stamp_is_off(self):
        with Served(self.engine) as srv:
            self.assertIn("stamp is off", loadgen.raw_control(srv.url, {"calibrate": True})["error"])


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class GraphEngineMarks(unittest.TestCase):
    """server.py's HTTP graph engine: its final chunk carries recv_ns and launch_ns."""

    def test_the_final_chunk_has_the_marks(self):
        import queue

        stub_aiohttp()
        import server

        eng = server.GraphEngine("tiny", "cpu", 128)
        loop, q = types.SimpleNamespace(call_soon_threadsafe=lambda fn, *a: fn(*a)), queue.Queue()
        recv_ns = time.monotonic_ns()
        eng.submit([1, 2, 3], 4, loop, q, recv_ns)
        out = [q.get(timeout=30) for _ in range(6)]
        self.assertEqual([done for _, done in out], [False] * 5 + [True])
        marks = out[4][0]
        self.assertEqual(marks["recv_ns"], recv_ns)
        self.assertGreaterEqual(marks["launch_ns"], recv_ns)
        self.assertNotIn("slot", marks)


if __name__ == "__main__":
    unittest.main()
