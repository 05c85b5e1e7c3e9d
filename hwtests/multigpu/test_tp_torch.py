"""tp_server.py's torch engine on a CPU (gloo), where torch is installed: the tiny model split over
2 and 4 ranks answers with the same tokens as on one rank (the shards hold exactly the one-rank
model), and a request's per-token stamps come back. Skipped without torch."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serving"))
import rawserver  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def ask(port, ids, n):
    """The token ids and the final line of one raw request."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(rawserver.encode_request(ids, n))
        lines = s.makefile("rb").read().splitlines()
    return [int(x) for x in lines[:-1]], json.loads(lines[-1])


class Server:
    def __init__(self, ranks):
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "tp_server.py"), "--gpus", str(ranks),
                                   "--size", "tiny", "--device", "cpu", "--port", "0", "--prompt-tokens", "8",
                                   "--max-len", "64"], stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("READY"):
            self.p.kill()
            raise RuntimeError(f"tp_server with {ranks} ranks did not start: {line!r}")
        self.port = int(line.split()[1])

    def close(self):
        self.p.terminate()
        self.p.wait(30)
        self.p.stdout.close()


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class Split(unittest.TestCase):
    def test_two_and_four_ranks_give_the_one_rank_tokens(self):
        answers = {}
        for ranks in (1, 2, 4):
            srv = Server(ranks)
            try:
                answers[ranks] = [ask(srv.port, [3, 1, 4, 1, 5], 12), ask(srv.port, list(range(20)), 12)]
            finally:
                srv.close()
        for ranks in (2, 4):
            for (toks, _), (ref, _) in zip(answers[ranks], answers[1]):
                self.assertEqual(toks, ref, f"{ranks} ranks")
        toks, final = answers[2][0]
        self.assertEqual(len(toks), 12)
        self.assertEqual(final["tokens"], 12)
        self.assertEqual(len(final["server_token_ns"]), 12)


if __name__ == "__main__":
    unittest.main()
