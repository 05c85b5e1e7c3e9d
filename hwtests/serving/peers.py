"""The sharing mechanisms the gate is compared with, as environments for the benchmark's server and
training: CUDA MPS (training at low client priority) and XSched's CUDA shim (online high, training low).

    python3 peers.py --smoke mps|xsched [--mps-dir D] [--xsched-dir D]   # a CUDA op in each role

Each peer is started before the two processes and stopped after them, on every exit path:
`Mps.stop` sends `quit` to the control daemon of its own pipe directory (bursty.sh's trap does the
same where python is killed), `XSched.stop` ends its xserver. Time-slicing needs no environment.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile

PEERS = ("mps", "xsched")

# XSched's transparent-scheduling settings (its examples/Linux/1_transparent_sched README): every
# CUDA stream an XQueue of Level-1 preemption, under the global (xserver) scheduler; the high
# priority queue keeps more commands in flight, the low one few, so it can be suspended sooner.
XSCHED_ONLINE = {"XSCHED_AUTO_XQUEUE_PRIORITY": "1", "XSCHED_AUTO_XQUEUE_THRESHOLD": "16",
                 "XSCHED_AUTO_XQUEUE_BATCH_SIZE": "8"}
XSCHED_OFFLINE = {"XSCHED_AUTO_XQUEUE_PRIORITY": "0", "XSCHED_AUTO_XQUEUE_THRESHOLD": "4",
                  "XSCHED_AUTO_XQUEUE_BATCH_SIZE": "2"}
XSCHED_COMMON = {"XSCHED_SCHEDULER": "GLB", "XSCHED_AUTO_XQUEUE": "ON", "XSCHED_AUTO_XQUEUE_LEVEL": "1",
                 "XLOG_LEVEL": "WARN"}  # its default, DEBG, logs every intercepted call

# CUDA MPS client priority (CUDA 12.4 and later): 0 normal, 1 below normal.
MPS_LOW_PRIORITY = "1"


class PeerError(RuntimeError):
    """A peer that cannot be started here, with what to do about it."""


def mps_env(base: str) -> dict:
    """The pipe and log directories of an MPS control daemon kept under `base`."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(base, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(base, "log")}


def own_mps_dir() -> str:
    """A temporary base for an MPS daemon's directories, removed when this process exits (after
    `Mps.stop`, which runs in a `finally`); a daemon left running keeps its pipe, not this one's."""
    base = tempfile.mkdtemp(prefix="valve-mps-")
    atexit.register(shutil.rmtree, base, True)
    return base


def mps_quit(base: str, timeout: float = 20) -> bool:
    """Asks the MPS control daemon of `base` to quit; whether it was asked (False: no daemon)."""
    env = dict(os.environ, **mps_env(base))
    if not os.path.exists(os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control")):
        return False
    try:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env,
                       capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return True


class Mps:
    """An MPS control daemon of its own directories; online a normal client, training a low one."""

    name = "mps"

    def __init__(self, base: str):
        self.base = base
        self.started = False

    def start(self):
        if not shutil.which("nvidia-cuda-mps-control"):
            raise PeerError("nvidia-cuda-mps-control is not on PATH (it comes with the NVIDIA driver's utilities)")
        env = mps_env(self.base)
        for d in env.values():
            os.makedirs(d, exist_ok=True)
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise PeerError(f"nvidia-cuda-mps-control -d: exit {r.returncode}: {r.stderr.strip()} "
                            f"(see {env['CUDA_MPS_LOG_DIRECTORY']}/control.log)")
        self.started = True

    def online_env(self, env: dict) -> dict:
        return dict(env, **mps_env(self.base))

    def offline_env(self, env: dict) -> dict:
        return dict(env, **mps_env(self.base), CUDA_MPS_CLIENT_PRIORITY=MPS_LOW_PRIORITY)

    def stop(self):
        if self.started:
            mps_quit(self.base)
            self.started = False


def real_libcuda() -> str | None:
    """The driver's libcuda.so.1 (the shim's own softlink shadows it on LD_LIBRARY_PATH)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "=>" in line:
            return line.split("=>", 1)[1].strip()
    return None


class XSched:
    """XSched's xserver (highest priority first) and its CUDA shim in both processes."""

    name = "xsched"

    def __init__(self, install: str, logdir: str, port: int):
        self.install = install
        self.logdir = logdir
        self.port = port
        self.proc = None
        self.libcuda = None

    def start(self):
        server = os.path.join(self.install, "bin", "xserver")
        shim = os.path.join(self.install, "lib", "libshimcuda.so")
        for p in (server, shim):
            if not os.path.exists(p):
                raise PeerError(f"{p} is missing: build XSched first (hwtests/serving/xsched_build.sh SRC.tar.gz "
                                f"{self.install})")
        self.libcuda = real_libcuda()
        if not self.libcuda:
            raise PeerError("no libcuda.so.1 in `ldconfig -p`: the shim needs the driver's library to forward to")
        log = open(os.path.join(self.logdir, "xserver.log"), "w")
        self.proc = subprocess.Popen([server, "HPF", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                     env=self._env(os.environ))
        # For a wrapper's trap, where this process is killed before it can stop the server.
        with open(os.path.join(self.logdir, "xserver.pid"), "w") as f:
            f.write(f"{self.proc.pid}\n")

    def _env(self, env: dict) -> dict:
        lib = os.path.join(self.install, "lib")
        path = env.get("LD_LIBRARY_PATH", "")
        return dict(env, LD_LIBRARY_PATH=lib + (":" + path if path else ""))

    def client_env(self, env: dict, prio: dict) -> dict:
        return dict(self._env(env), **XSCHED_COMMON, **prio, XSCHED_CUDA_LIB=self.libcuda or "")

    def online_env(self, env: dict) -> dict:
        return self.client_env(env, XSCHED_ONLINE)

    def offline_env(self, env: dict) -> dict:
        return self.client_env(env, XSCHED_OFFLINE)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def make(name: str | None, args, logdir: str, port: int):
    """The peer an invocation runs under (None: none)."""
    if name == "mps":
        return Mps(args.mps_dir)
    if name == "xsched":
        return XSched(args.xsched_dir, logdir, port)
    return None


# A few CUDA matrix products, run as online and as training under a peer at once.
SMOKE = ("import torch; a = torch.randn(512, 512, device='cuda')\n"
         "for _ in range(50): a = a @ a; a = a / a.norm()\n"
         "torch.cuda.synchronize(); print('SMOKE-OK', torch.version.cuda)")


def smoke(peer, python=sys.executable, timeout=90) -> list[str]:
    """Starts `peer`, runs SMOKE as online and as training at once, stops it: what failed."""
    failed = []
    try:
        peer.start()
        env = dict(os.environ)
        procs = {role: subprocess.Popen([python, "-c", SMOKE], env=make_env(env), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                 for role, make_env in (("online", peer.online_env), ("training", peer.offline_env))}
        for role, p in procs.items():
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += f"\n(killed after {timeout} s)"
            if p.returncode != 0 or "SMOKE-OK" not in out:
                failed.append(f"{role}: exit {p.returncode}: {out.strip()[-600:]}")
    except PeerError as e:
        failed.append(str(e))
    finally:
        peer.stop()
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Starts a peer, runs a CUDA op as online and as training under it, stops it.")
    ap.add_argument("--smoke", choices=PEERS, required=True)
    ap.add_argument("--mps-dir")
    ap.add_argument("--xsched-dir")
    ap.add_argument("--out", default=tempfile.gettempdir(), help="where xserver.log goes")
    a = ap.parse_args(argv)
    if a.smoke == "xsched" and not a.xsched_dir:
        ap.error("--smoke xsched needs --xsched-dir (XSched's install dir)")
    a.mps_dir = a.mps_dir or own_mps_dir()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failed = smoke(make(a.smoke, a, a.out, port))
    for f in failed:
        print(f"SMOKE FAILED {a.smoke} {f}")
    if not failed:
        print(f"SMOKE OK {a.smoke}: a CUDA op ran as online and as training")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
