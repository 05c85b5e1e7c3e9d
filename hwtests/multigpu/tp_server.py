"""A tensor-parallel online server across the GPUs of one host: one process per GPU, a random-weight
Llama-shaped decoder split Megatron-style (QKV and gate/up column-parallel, O and down row-parallel
with an all-reduce after each, the LM head split over the vocabulary), rank 0 serving
rawserver.py's plain-TCP protocol (hwtests/serving/rawserver.py; loadgen.py's raw://HOST:PORT).

    python3 tp_server.py --gpus 4 --size 8b --device cuda --port 8000      # NCCL, one rank per GPU
    python3 tp_server.py --gpus 2 --size tiny --device cpu --port 0        # gloo on a CPU
    python3 tp_server.py --gpus 2 --engine fake --port 0                   # no torch: sleeps per token

The launcher (this script without --worker; it imports no torch and opens no GPU) starts one worker
process per rank with its own environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
VALVE_LABEL (--label, default online: Valve's gate sees one online process per GPU),
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off). Under torchrun
(RANK set) the script is a worker directly. If a worker exits, the launcher ends the others; SIGTERM
or SIGINT to the launcher ends them all.

Per request: rank 0 reads it, sends (n_ids, max_tokens, the padded prompt) to every other rank over
a plain TCP control channel (no GPU work while idle: an NCCL broadcast would spin a kernel on every
follower's GPU between requests), then every rank runs the prefill (fixed --prompt-tokens, padded
or cut) and the decode steps, one host sync per token. The answer's final line carries rawserver's
recv_ns and launch_ns and `server_token_ns`: CLOCK_MONOTONIC ns at which rank 0 had each token.
On CUDA the prefill and the decode step are CUDA graphs (all-reduces inside) unless --no-graphs.
Prints `READY <port> ranks <N>` once every rank has warmed up (--pid-file: the ranks' pids).
"""

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serving"))
import rawserver  # noqa: E402

SIZES = {
    # name: (vocab, hidden, layers, heads, kv_heads, intermediate)
    "tiny": (1024, 64, 2, 8, 8, 128),
    "3b": (32000, 3072, 28, 24, 8, 8192),  # hwtests/serving/decoder.py's 3b
    "8b": (128256, 4096, 32, 32, 8, 14336),  # Llama-3-8B's shape
    "70b": (128256, 8192, 80, 64, 8, 28672),  # Llama-3-70B's shape (140 GB bf16: 2+ H200s)
}
CTRL = struct.Struct("<iii")  # command, n_ids, max_tokens; then prompt_tokens int32 ids
CMD_GENERATE, CMD_STOP = 1, 2
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def log(*a):
    print(f"tp_server[{os.environ.get('RANK', 'launcher')}]:", *a, file=sys.stderr, flush=True)


def check_split(size, world):
    """None if `size` splits over `world` ranks, else what is wrong and the fix."""
    vocab, hidden, _, heads, kv, inter = SIZES[size]
    bad = [f"{name} {v}" for name, v in (("heads", heads), ("kv_heads", kv), ("intermediate", inter),
                                         ("vocab", vocab)) if v % world]
    if bad:
        return (f"size {size} does not split over {world} ranks ({', '.join(bad)} not divisible): "
                f"use --gpus that divides {kv} (kv heads)")
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base, rank, world, device, master_port, ctrl_port, label):
    """The environment of worker `rank`: torchrun's variables, the label, multicast off."""
    env = dict(base)
    env.update(MULTICAST_OFF)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master_port), VALVE_TP_CTRL_PORT=str(ctrl_port), VALVE_TP_DEVICE=str(device),
               VALVE_LABEL=label)
    return env


def devices_of(a):
    """The device index of each rank: --devices, else 0 .. --gpus - 1."""
    if a.devices:
        devs = [int(x) for x in a.devices.split(",")]
        if len(devs) != a.gpus:
            raise SystemExit(f"tp_server: --devices names {len(devs)} devices, --gpus {a.gpus}: give as many")
        return devs
    return list(range(a.gpus))


class Launcher:
    """One worker process per rank; ends them all when one ends or on SIGTERM/SIGINT."""

    def __init__(self, a, argv):
        self.procs, self.stopping = [], False
        mport, cport = a.master_port or free_port(), a.ctrl_port or free_port()
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker"]
        for r, dev in enumerate(devices_of(a)):
            env = rank_env(os.environ, r, a.gpus, dev, mport, cport, a.label)
            self.procs.append(subprocess.Popen(cmd, env=env))
        if a.pid_file:
            with open(a.pid_file, "w") as f:
                f.write("".join(f"{p.pid}\n" for p in self.procs))

    def stop(self, *_):
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()

    def wait(self, grace_s=15.0):
        """Waits for any worker to end, then ends the rest; the first non-zero exit code."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        while not self.stopping and all(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        self.stop()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        codes = [p.returncode for p in self.procs]
        return 0 if self.stopping and not any(c not in (0, -signal.SIGTERM) for c in codes) else \
            next((c for c in codes if c), 0)


class Control:
    """Rank 0's plain-TCP channel to the other ranks: one connection per follower."""

    def __init__(self, rank, world, port, prompt_tokens, timeout_s=300.0):
        self.rank, self.world, self.plen = rank, world, prompt_tokens
        self.size = CTRL.size + 4 * prompt_tokens
        self.peers, self.sock = [], None
        if world == 1:
            return
        if rank == 0:
            lsock = socket.create_server(("127.0.0.1", port), backlog=world)
            lsock.settimeout(timeout_s)
            for _ in range(world - 1):
                conn, _ = lsock.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.peers.append(conn)
            lsock.close()
        else:
            self.sock = connect_retry(port, timeout_s)

    def send(self, cmd, ids_bytes=b"", n_ids=0, n=0):
        """Rank 0: the command and the prompt (padded with zeros or cut to prompt_tokens)."""
        msg = CTRL.pack(cmd, n_ids, n) + pad_ids(ids_bytes, self.plen)
        for c in self.peers:
            c.sendall(msg)
        return msg[CTRL.size:]

    def recv(self):
        """A follower: (cmd, n_ids, n, ids_bytes); CMD_STOP when rank 0 has gone."""
        buf = recv_exact(self.sock, self.size)
        if buf is None:
            return CMD_STOP, 0, 0, b""
        cmd, n_ids, n = CTRL.unpack_from(buf)
        return cmd, n_ids, n, buf[CTRL.size:]

    def barrier(self):
        """Every follower says it is ready; rank 0 waits for all of them."""
        if self.rank == 0:
            for c in self.peers:
                if recv_exact(c, 1) is None:
                    raise RuntimeError("a rank exited before it was ready: see its log above")
        elif self.sock is not None:
            self.sock.sendall(b"R")


def pad_ids(ids_bytes, plen):
    """The first plen int32 ids of ids_bytes, zero-padded to plen."""
    b = bytes(ids_bytes[: 4 * plen])
    return b + bytes(4 * plen - len(b))


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        k = sock.recv(n - len(buf))
        if not k:
            return None
        buf += k
    return bytes(buf)


def connect_retry(port, timeout_s):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0's control port {port} did not open in {timeout_s:.0f} s") from None
            time.sleep(0.1)


class FakeModel:
    """No torch: a prefill and each token take a fixed time (the harness's tests)."""

    def __init__(self, prefill_ms, token_ms):
        self.prefill_s, self.token_s = prefill_ms / 1e3, token_ms / 1e3

    def generate(self, ids_bytes, n):
        time.sleep(self.prefill_s)
        tok = sum(ids_bytes) % 1000
        for i in range(n):
            if i:
                time.sleep(self.token_s)
            yield (tok + i) % 1000


class Rank0Engine:
    """rawserver's engine interface on rank 0: the request goes to every rank, then rank 0 runs its
    shard and stamps each token."""

    def __init__(self, model, ctrl, max_tokens):
        self.model, self.ctrl, self.max_tokens = model, ctrl, max_tokens
        self.buf = bytearray(rawserver.HEADER.size + 4 * rawserver.MAX_IDS)

    def generate(self, n_ids, n, marks):
        raw = memoryview(self.buf)[rawserver.HEADER.size: rawserver.HEADER.size + 4 * n_ids]
        ids = self.ctrl.send(CMD_GENERATE, raw, n_ids, n)
        marks["launch_ns"] = time.monotonic_ns()
        stamps = marks["server_token_ns"] = []
        for tok in self.model.generate(ids, n):
            stamps.append(time.monotonic_ns())
            yield tok

    def calibrate(self):
        raise rawserver.RequestError("tp_server has no first-kernel stamp")


def follow(model, ctrl):
    """A follower's loop: run every request rank 0 sends, until it says stop or goes away."""
    while True:
        cmd, _, n, ids = ctrl.recv()
        if cmd != CMD_GENERATE:
            return 0
        for _ in model.generate(ids, n):
            pass


def make_model(a, rank, world):
    if a.engine == "fake":
        return FakeModel(a.fake_prefill_ms, a.fake_token_ms)
    from tp_model import TPDecoder, init_distributed

    device = init_distributed(a.device, rank, world, int(os.environ.get("VALVE_TP_DEVICE", rank)), a.threads)
    t0 = time.time()
    m = TPDecoder(a.size, device, a.max_len, a.prompt_tokens, rank, world, graphs=a.graphs)
    log(f"{a.size} shard built and captured in {time.time() - t0:.1f} s ({m.params() / 1e9:.2f} B parameters here)")
    return m


def worker(a):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(MULTICAST_OFF)  # read at NCCL's init: in force under torchrun too
    if os.environ.get("VALVE_LABEL") != a.label:
        log(f"VALVE_LABEL is {os.environ.get('VALVE_LABEL')!r}, not {a.label!r}: the gate will not see this rank "
            "as online; start it through the launcher, or set VALVE_LABEL for torchrun")
    ctrl_port = int(os.environ.get("VALVE_TP_CTRL_PORT") or int(os.environ["MASTER_PORT"]) + 1)
    model = make_model(a, rank, world)
    zeros = bytes(4 * a.prompt_tokens)
    for _ in range(3):  # warm-up, every rank together (the collectives keep them in step)
        for _ in model.generate(zeros, 4):
            pass
    ctrl = Control(rank, world, ctrl_port, a.prompt_tokens)
    ctrl.barrier()
    if rank:
        return follow(model, ctrl)
    server = rawserver.RawServer(Rank0Engine(model, ctrl, a.max_len - a.prompt_tokens), a.port)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"READY {server.port} ranks {world}", flush=True)
    try:
        server.serve_forever()
    finally:
        for c in ctrl.peers:
            try:
                c.sendall(CTRL.pack(CMD_STOP, 0, 0) + zeros)
            except OSError:
                pass
    return 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="ranks, one process (and GPU) each")
    ap.add_argument("--devices", help="device index per rank, e.g. 4,5,6,7 (default 0 .. --gpus - 1)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL; cpu: gloo")
    ap.add_argument("--engine", default="torch", choices=["torch", "fake"],
                    help="fake: no torch, sleeps per token (tests of the harness only, not a measurement)")
    ap.add_argument("--port", type=int, default=8000, help="rank 0's serving port; 0: any free one")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the prefill's fixed length")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA graphs for prefill and decode (CUDA only)")
    ap.add_argument("--label", default="online", help="VALVE_LABEL of every rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on a CPU")
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--ctrl-port", type=int, default=0)
    ap.add_argument("--pid-file", help="the launcher writes each rank's pid here, one a line")
    ap.add_argument("--fake-prefill-ms", type=float, default=5.0)
    ap.add_argument("--fake-token-ms", type=float, default=2.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not 0 < a.prompt_tokens < a.max_len:
        ap.error(f"--prompt-tokens {a.prompt_tokens}: must be 1 .. --max-len - 1")
    if a.gpus < 1:
        ap.error("--gpus must be at least 1")
    if a.engine == "torch" and (why := check_split(a.size, a.gpus)):
        ap.error(why)
    return a


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.worker or "RANK" in os.environ:
        return worker(a)
    return Launcher(a, argv).wait()


if __name__ == "__main__":
    sys.exit(main())
