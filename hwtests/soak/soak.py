"""Valve's soak on a GPU host, through the daemon's control socket as an operator's tools use it.

Phases (`--phases`, in this order):
  cycles    N preempt/resume cycles of a PyTorch training job beside an unpreempted twin with
            the same seed: every freeze's check (the daemon's `freeze` field), long holds checked
            against the job's own progress, weights compared at every --hash-every iteration;
  restarts  a GPU-bound online server killed and restarted on the same port under a running
            gate: the new server's first request must find offline frozen;
  kills     the daemon SIGKILLed while it holds the job frozen, restarted: the job must run again
            within 1 s of the restart.
Writes OUT/soak.json and prints one line per phase. Run as root by hwtests/soak/soak.sh.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINING = os.path.join(HERE, "..", "serving", "training.py")
sys.path.insert(0, os.path.join(HERE, "..", "membench"))
from common import daemon_request  # noqa: E402  (the control socket's one request, shared)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def call(sock_path, req, timeout=10.0):
    """One control-socket request: the reply's data, or raises with the daemon's error."""
    reply = daemon_request(req, sock_path, timeout)
    if not reply:
        raise RuntimeError(f"{req['op']}: the daemon closed the connection without a reply")
    if reply.get("error"):
        raise RuntimeError(f"{req['op']}: {reply['error']}")
    return reply.get("data")


class Daemon:
    """`valvectl daemon` on a private socket and state directory (kept across restarts)."""

    def __init__(self, valvectl, work):
        self.valvectl, self.work = valvectl, work
        self.sock = os.path.join(work, "valve.sock")
        self.state = os.path.join(work, "state")
        self.proc = None
        self.starts = 0

    def start(self, timeout=20.0):
        """Starts it; returns seconds until its socket answered."""
        t0 = time.monotonic()
        logf = open(os.path.join(self.work, f"daemon-{self.starts}.log"), "w")
        self.starts += 1
        self.proc = subprocess.Popen(
            [self.valvectl, "daemon", "--socket", self.sock, "--state-dir", self.state],
            stdout=subprocess.DEVNULL, stderr=logf)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited {self.proc.returncode}: see {logf.name}")
            try:
                call(self.sock, {"op": "status"}, timeout=1.0)
                return time.monotonic() - t0
            except (OSError, ValueError, RuntimeError):
                time.sleep(0.01)
        raise RuntimeError("the daemon's socket never answered")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Job:
    """training.py with a progress file (`<monotonic_ns> <iteration>` lines) and HASH lines."""

    def __init__(self, work, name, size, hash_every, label):
        self.progress = os.path.join(work, f"{name}.progress")
        self.out = open(os.path.join(work, f"{name}.out"), "w+")
        env = dict(os.environ, VALVE_LABEL=label, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        self.proc = subprocess.Popen(
            [sys.executable, TRAINING, "--progress", self.progress, "--size", size,
             "--device", "cuda", "--hash-every", str(hash_every), "--attn", "eager"],
            stdout=self.out, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    def wait_ready(self, timeout=300.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"training exited {self.proc.returncode}: {self.text()[-2000:]}")
            if self.iterations():
                return
            time.sleep(0.1)
        raise RuntimeError("training never iterated")

    def text(self):
        self.out.flush()
        with open(self.out.name) as f:
            return f.read()

    def stamps(self):
        """[(monotonic_ns, iteration)] so far."""
        try:
            with open(self.progress) as f:
                return [tuple(map(int, ln.split())) for ln in f if ln.count(" ") == 1 and ln.endswith("\n")]
        except FileNotFoundError:
            return []

    def iterations(self):
        s = self.stamps()
        return s[-1][1] if s else 0

    def hashes(self):
        """{iteration: sha256} from the HASH lines."""
        return {int(f[1]): f[2] for f in (ln.split() for ln in self.text().splitlines())
                if len(f) == 3 and f[0] == "HASH"}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def inside(stamps, t0_ns, t1_ns):
    """Iterations the job completed strictly between two monotonic times."""
    return sum(1 for t, _ in stamps if t0_ns < t < t1_ns)


def wait_known(daemon, pid, timeout=30.0):
    """Waits until the daemon's registry lists pid with channels."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in call(daemon.sock, {"op": "ps"}).get("processes", []):
            if p.get("pid") == pid and any(g.get("channels") for g in p.get("gpus", [])):
                return
        time.sleep(0.1)
    raise RuntimeError(f"the daemon never listed pid {pid} with channels")


def freeze_of(reply):
    """The daemon's check of one freeze: (outcome, microseconds after the disable returned)."""
    f = (reply or {}).get("freeze") or {}
    return f.get("outcome", "absent"), f.get("after_us")


def cycle(daemon, job, hold_s):
    """One preempt/resume of the job: (freeze outcome, check us, iterations inside the hold)."""
    reply = call(daemon.sock, {"op": "preempt", "pid": job.pid, "max_hold_ms": 5000, "confirm": True})
    t_frozen = time.monotonic_ns()
    time.sleep(hold_s)
    t_resume = time.monotonic_ns()
    call(daemon.sock, {"op": "resume", "pid": job.pid})
    outcome, after_us = freeze_of(reply)
    return outcome, after_us, (t_frozen, t_resume)


def phase_cycles(a, daemon, work):
    """N cycles of the job beside its twin; weights compared at every common HASH iteration."""
    job = Job(work, "soaked", a.size, a.hash_every, "soak")
    twins = [Job(work, f"twin{i}", a.size, a.hash_every, "twin") for i in range(a.twins)]
    job.wait_ready()
    for t in twins:
        t.wait_ready()
    wait_known(daemon, job.pid)
    outcomes, checks_us, long_holds = {}, [], []
    t0 = time.monotonic()
    for i in range(a.cycles):
        long = a.long_every and i % a.long_every == a.long_every - 1
        outcome, after_us, window = cycle(daemon, job, a.long_hold_s if long else a.hold_s)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if after_us is not None:
            checks_us.append(after_us)
        if long:
            long_holds.append(window)
        time.sleep(a.run_s)
        if i % 1000 == 999:
            log(f"cycles: {i + 1} done, outcomes {outcomes}")
    secs = time.monotonic() - t0
    # The job's progress decides the long holds: no iteration may end 5 ms after the freeze
    # returned and before the resume was sent.
    stamps = job.stamps()
    moved = [inside(stamps, t0n + 5_000_000, t1n) for t0n, t1n in long_holds]
    time.sleep(2.0)
    for j in [job] + twins:
        j.stop()
    hj, ht = job.hashes(), twins[0].hashes()
    common = sorted(set(hj) & set(ht))
    differ = [it for it in common if hj[it] != ht[it]]
    # Twins against each other: what the job's own nondeterminism would look like.
    twin_differ = [it for t in twins[1:] for it in sorted(set(ht) & set(t.hashes())) if ht[it] != t.hashes()[it]]
    return {
        "cycles": a.cycles, "secs": secs, "freeze_outcomes": outcomes,
        "check_us": summary(checks_us),
        "long_holds": len(long_holds), "long_hold_s": a.long_hold_s,
        "long_holds_with_progress": sum(1 for m in moved if m), "max_iterations_in_a_long_hold": max(moved or [0]),
        "iterations_soaked": job.iterations(), "iterations_twins": [t.iterations() for t in twins],
        "twin_mismatches": twin_differ,
        "hash_iterations_compared": len(common), "hash_mismatches": differ,
        "last_compared": common[-1] if common else None,
    }


def summary(xs):
    if not xs:
        return None
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return {"n": len(s), "p50": pick(0.5), "p99": pick(0.99), "max": s[-1]}


def phase_kills(a, daemon, work):
    """SIGKILLs of the daemon while it holds the job frozen; the restart must resume it."""
    job = Job(work, "killed", a.size, 0, "soak")
    job.wait_ready()
    wait_known(daemon, job.pid)
    rounds = []
    for i in range(a.kills):
        reply = call(daemon.sock, {"op": "preempt", "pid": job.pid, "confirm": True})
        outcome, _ = freeze_of(reply)
        time.sleep(0.15)
        before = job.iterations()
        time.sleep(0.1)
        stalled = job.iterations() == before
        daemon.kill()
        t_kill = time.monotonic_ns()
        time.sleep(0.05)
        frozen_dead = job.iterations() == before
        t_start = time.monotonic_ns()
        answer_s = daemon.start()
        resumed_ns = wait_progress(job, before, t_start, 5.0)
        rounds.append({"freeze": outcome, "stalled_before_kill": stalled, "frozen_while_dead": frozen_dead,
                       "socket_s": answer_s,
                       "resume_after_restart_s": (resumed_ns - t_start) / 1e9 if resumed_ns else None,
                       "resume_after_kill_s": (resumed_ns - t_kill) / 1e9 if resumed_ns else None})
        wait_known(daemon, job.pid)
        if i % 10 == 9:
            log(f"kills: {i + 1} done, last {rounds[-1]}")
    job.stop()
    ok = [r for r in rounds if r["resume_after_restart_s"] is not None and r["resume_after_restart_s"] <= 1.0]
    late = [r["resume_after_restart_s"] for r in rounds]
    return {"kills": a.kills, "resumed_within_1s_of_restart": len(ok),
            "stalled_before_kill": sum(r["stalled_before_kill"] for r in rounds),
            "resume_after_restart_s": summary([x for x in late if x is not None]),
            "not_resumed": sum(1 for x in late if x is None), "rounds": rounds}


def wait_progress(job, before, since_ns, timeout):
    """The monotonic time of the job's first iteration past `before` that ended after since_ns."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for t, it in job.stamps():
            if it > before and t > since_ns:
                return t
        time.sleep(0.005)
    return None


def serve(port, work_ms):
    """A GPU-bound online server: each request line is answered after about work_ms of matmuls."""
    import torch

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 0.5:  # calibrate: matmuls per ms alone
        x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
        n += 1
    reps = max(1, int(n / 500.0 * work_ms))
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    print(f"LISTENING {port} {reps}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            if not conn.recv(4096):
                continue
            for _ in range(reps):
                x = (x @ x).clamp_(-1, 1)
            torch.cuda.synchronize()
            conn.sendall(b"done\n")


class Server:
    """serve() in its own process; started() waits for its LISTENING line (no probe connection,
    which the gate would see as an arrival)."""

    def __init__(self, work, port, work_ms, n):
        self.out = os.path.join(work, f"server-{n}.out")
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", "--port", str(port),
                                      "--work-ms", str(work_ms)],
                                     stdout=open(self.out, "w"), stderr=subprocess.STDOUT)

    def started(self, timeout=120.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {open(self.out).read()[-2000:]}")
            if "LISTENING" in open(self.out).read():
                return
            time.sleep(0.05)
        raise RuntimeError("the server never listened")

    def kill(self):
        self.proc.kill()
        self.proc.wait()


def request(port):
    """One request: (sent, answered) monotonic ns."""
    t0 = time.monotonic_ns()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"go\n")
        s.recv(16)
    return t0, time.monotonic_ns()


def first_request(daemon, job, port, work, n, work_ms):
    """A fresh server on the port; after 1 s idle, its first request: when the gate's disable
    came (its trace) and the offline iterations that ended inside the request after it."""
    srv = Server(work, port, work_ms, n)
    srv.started()
    time.sleep(1.0)
    t0, t1 = request(port)
    stamps = job.stamps()
    row = {"request_ms": (t1 - t0) / 1e6, "offline_iterations_inside": inside(stamps, t0 + 5_000_000, t1)}
    try:
        records = call(daemon.sock, {"op": "gate_trace", "after": 0}).get("records", [])
    except RuntimeError:
        return srv, row  # no gate running: the control round
    ours = [r for r in records if t0 - 1_000_000 <= r["t_ns"] <= t1]
    arrivals = [r for r in ours if r["event"] == "arrival"]
    disables = [r for r in ours if r["event"] == "disable" and r.get("ok")]
    if disables:
        end = disables[0]["end_ns"]
        row["disable_after_send_ms"] = (end - t0) / 1e6
        row["offline_iterations_after_disable"] = inside(stamps, end + 5_000_000, t1)
    row["arrivals_traced"] = len(arrivals)
    row["protected"] = bool(disables) and row["offline_iterations_after_disable"] == 0
    return srv, row


def phase_restarts(a, daemon, work):
    """Servers killed and restarted on one port under a running gate, first requests checked;
    one first request without the gate before, to show the check can see offline running."""
    job = Job(work, "gated", a.size, 0, "soak")
    job.wait_ready()
    wait_known(daemon, job.pid)
    port = free_port()
    srv, control = first_request(daemon, job, port, work, 0, a.work_ms)
    gate = subprocess.run([a.valvectl, "--socket", daemon.sock, "gate", "start", "--online-port",
                           str(port), "--offline-label", "soak"], capture_output=True, text=True)
    if gate.returncode:
        raise RuntimeError(f"gate start failed: {gate.stderr}")
    rounds = []
    try:
        for r in range(1, a.restarts + 1):
            srv.kill()
            srv, first = first_request(daemon, job, port, work, r, a.work_ms)
            rounds.append(first)
    finally:
        subprocess.run([a.valvectl, "--socket", daemon.sock, "gate", "stop"], capture_output=True)
        srv.kill()
        job.stop()
    late = [x["disable_after_send_ms"] for x in rounds if "disable_after_send_ms" in x]
    return {"without_gate": control, "restarts": a.restarts,
            "protected": sum(1 for x in rounds if x.get("protected")),
            "disable_after_send_ms": summary(late), "rounds": rounds}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["run", "serve"])
    ap.add_argument("--valvectl", default="valvectl")
    ap.add_argument("--out", default=".")
    ap.add_argument("--phases", default="cycles,restarts,kills")
    ap.add_argument("--size", default="small", help="training.py's model size")
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--hold-s", type=float, default=0.005)
    ap.add_argument("--run-s", type=float, default=0.005)
    ap.add_argument("--long-every", type=int, default=100, help="every Nth hold is long (0: none)")
    ap.add_argument("--long-hold-s", type=float, default=0.2)
    ap.add_argument("--hash-every", type=int, default=200)
    ap.add_argument("--twins", type=int, default=1, help="unpreempted twins (2: also twin against twin)")
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--work-ms", type=float, default=150.0, help="a request's GPU time")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        return serve(a.port, a.work_ms)
    os.makedirs(a.out, exist_ok=True)
    work = os.path.abspath(a.out)
    daemon = Daemon(a.valvectl, work)
    result = {"argv": sys.argv, "device": gpu_name(), "started_s": daemon.start()}
    phases = {"cycles": phase_cycles, "restarts": phase_restarts, "kills": phase_kills}
    try:
        for name in a.phases.split(","):
            t0 = time.monotonic()
            result[name] = phases[name](a, daemon, work)
            result[name]["phase_s"] = time.monotonic() - t0
            # The daemon's own count of every freeze it checked (the gate's on its thread too).
            result[name]["daemon_freeze_checks"] = call(daemon.sock, {"op": "status"}).get("freeze_checks")
            log(name, json.dumps({k: v for k, v in result[name].items() if k != "rounds"}))
            write(work, result)
    finally:
        daemon.stop()
        result["status_at_end"] = "stopped"
        write(work, result)


def write(work, result):
    with open(os.path.join(work, "soak.json"), "w") as f:
        json.dump(result, f, indent=1)


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
