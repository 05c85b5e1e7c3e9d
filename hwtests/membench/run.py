"""The memory benchmark on a GPU host: online serving with a bursty KV demand next to
offline batch generation, with a static split and with Valve's pool; and the correctness run.

    python3 hwtests/membench/run.py --valvectl .carry/valvectl --out DIR correctness
    python3 hwtests/membench/run.py --valvectl .carry/valvectl --out DIR bench \
        --configs alone,static,valve-noreserve,valve-noreserve-fifo,valve-miad [--seconds 90] \
        [--online-cuda-graphs]
    python3 hwtests/membench/run.py --valvectl .carry/valvectl --out DIR bench \
        --configs alone,static,valve-miad,valve-miad-warm --seconds 90 [--warm-prime-seconds 450]
    python3 hwtests/membench/run.py --valvectl .carry/valvectl --out DIR bench \
        --configs valve-churn --seconds 90 --seed 12 --online-cuda-graphs \
        [--churn-gate-every 2] [--churn-flooders 2]

    python3 hwtests/membench/run.py --valvectl .carry/valvectl --out DIR episodes \
        [--sizes 10] [--rates 2,6] [--policies alg1,fifo] [--repeat 4] [--measure-s 20]
        (offline only: `valvectl pool reclaim` takes a share of offline's memory at a rate for each
        handle choice, in episodes of one fixed offline workload, each timed to a token count:
        episodes.py; report.md/report.json)

Compare online latency with `--online-cuda-graphs`: without CUDA graphs the online decode step is
bound by the host's Python (20-40 ms whatever its GPU work, +-30% between bursts), and two alone
runs differ by more than the targets; with them, by under 1% (2026-11-24-h100-membench-4.md,
archived in docs/results/README.md).

Needs root (the daemon), one GPU, PyTorch and transformers >= 5, the `valve` wheel installed and
`integrations/transformers` importable (this script puts it on the children's PYTHONPATH).
Each configuration writes `<config>.json`; `bench` also writes `report.json` and `report.md` with
the measured numbers, the device name and the targets. Configurations:

- alone: online only, a static cache as large as the pool (its peak use sizes the static split);
- alone-2: the same again, last: how far two runs of the same thing differ (the noise floor of
  every "vs alone" figure);
- static: online gets its peak, offline the rest (the minimum free memory over the alone run);
- valve-noreserve: the pool; online holds only what it uses (every burst is reclaimed);
- valve-noreserve-fifo: the same with FIFO handle choice instead of Algorithm 1;
- valve-miad: the pool with the daemon's MIAD reservation at --target-per-min, from a cold start
  (every other configuration runs with --pool-no-warm-start);
- valve-miad-warm: MIAD after a daemon restart, from a warm start. A first pass
  (valve-miad-warm-prime, --warm-prime-seconds of the same trace parameters, not in the report)
  runs valve-miad and saves MIAD's state in DIR/reservations.json at the daemon's shutdown; the
  daemon, online and offline then start again, the daemon on that file, and the measured pass
  plays the trace (docs/memory.md, "Warm start"). Its wall_s includes the first pass.
  `--warm-from FILE` starts the measured pass from a state an earlier run saved (its
  OUT/reservations.json) instead: a converged first pass (450 s) and a long measured pass do not
  fit one 10-minute device call together. Run both on the same GPU: a state is kept per GPU PCI
  address and online process (a lane's VALVE_GPU). A measured pass longer than 90 s is also judged on its
  first 90 s against static's first 90 s (the target: "over the first 90 s after a daemon restart").
  `--configs valve-miad-warm --warm-prime-only` runs the first pass alone and stops once
  DIR/reservations.json is saved: the call before the one that passes it to --warm-from.
- valve-churn: valve-noreserve while admin work churns (docs/memory.md, "How a reclaim
  reaches the daemon's loop"): a thread restarts the gate every --churn-gate-every s (`gate stop`,
  `gate start`), ending 5 s before online's last arrival, and --churn-flooders threads flood the
  daemon's control socket with bad input until online exits (churn.py). Its result has a `churn`
  object (restarts, command times, failures, flood counts, the daemon log's slow requests); the
  report judges its reclaims of up to 1 GiB while the churn ran. Each gate stop lets offline run
  ungated, so its online latency and offline throughput are not compared with alone or static.
  Its daemon keeps a stopped gate's uprobes for the next start (--churn-keep-watchers, default
  600 s; 0 measures fresh probes for every start).

Compute is shared the same way in every configuration with offline: Valve's gate, told by the
online server when requests are in flight (online_busy/online_idle), with launch edges as fallback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import churn  # noqa: E402
import common  # noqa: E402
import report  # noqa: E402
import episodes  # noqa: E402
import eviction  # noqa: E402


class Run:
    """Paths, environment and the processes of one benchmark invocation."""

    def __init__(self, a) -> None:
        self.a = a
        self.out = os.path.abspath(a.out)
        self.work = a.workdir
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.model = os.path.join(self.work, "model")
        paths = [os.path.join(REPO, "integrations", "transformers"), HERE, os.environ.get("PYTHONPATH", "")]
        self.env = dict(os.environ, PYTHONPATH=":".join(p for p in paths if p), PYTHONUNBUFFERED="1",
                        CUBLAS_WORKSPACE_CONFIG=":4096:8", TOKENIZERS_PARALLELISM="false")
        self.procs: list[subprocess.Popen] = []

    def log(self, name: str):
        return open(os.path.join(self.out, f"{name}.log"), "ab")

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=env or self.env, stdout=self.log(name), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def valvectl(self, *args: str, check: bool = True) -> str:
        r = subprocess.run([self.a.valvectl, *args], capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"valvectl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def start_daemon(self, name: str, pool_gib: int | None, target_per_min: float,
                     warm_state: str | None = None) -> subprocess.Popen:
        """The daemon, with a pool of `pool_gib` if given; its MIAD reservations start cold unless
        `warm_state` names the saved reservations file to start from and save to."""
        argv = daemon_argv(self.a, name, pool_gib, target_per_min, warm_state)
        d = self.spawn(f"{name}-daemon", argv)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if d.poll() is not None:
                raise RuntimeError(f"the daemon exited ({d.returncode}): see {name}-daemon.log")
            ready = os.path.exists(common.DAEMON_SOCKET) and (not pool_gib or os.path.exists(common.POOL_SOCKET))
            if ready:
                try:
                    common.daemon_request({"op": "status"})
                    return d
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError("the daemon did not answer within 30 s")

    def stop_all(self) -> None:
        """Stops every child (the daemon last, so it resumes whatever it froze)."""
        for p in sorted(self.procs, key=lambda p: "daemon" in " ".join(map(str, p.args))):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


def daemon_cpus_prefix(env=os.environ) -> list[str]:
    """`taskset -c CPUS` where hwtests/lanes.sh gives the lane's daemon every CPU back
    (VALVE_DAEMON_CPUS): pinned to the lane's block, its edge threads lose SCHED_DEADLINE."""
    cpus = env.get("VALVE_DAEMON_CPUS", "")
    return ["taskset", "-c", cpus] if cpus else []


def daemon_argv(a, name: str, pool_gib: int | None, target_per_min: float, warm_state: str | None) -> list[str]:
    """The daemon's command line for configuration `name` (see Run.start_daemon)."""
    argv = [*daemon_cpus_prefix(), a.valvectl, "daemon"]
    if pool_gib:
        argv += ["--pool", "--pool-gpus", str(common.GPU), "--pool-max-gib", str(pool_gib), "--pool-keep-free-mib", "2048",
                 "--pool-target-reclaims-per-min", str(target_per_min)]
        argv += ["--pool-reservation-state", warm_state] if warm_state else ["--pool-no-warm-start"]
        if warm_state and getattr(a, "warm_max_age", None):
            argv += ["--pool-warm-max-age", a.warm_max_age]
    if name == "valve-churn" and getattr(a, "churn_keep_watchers", 0) > 0:
        argv += ["--gate-keep-watchers", str(a.churn_keep_watchers)]
    return argv


def wait_files(paths: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        for p in procs:
            if p.poll() is not None:
                script = os.path.basename(str(p.args[1])) if len(p.args) > 1 else p.args
                raise RuntimeError(f"{script} exited with {p.returncode} before it was ready: see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout:.0f} s: {[p for p in paths if not os.path.exists(p)]}")
        time.sleep(0.1)


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(HERE, script), *args]


# ------------------------------------------------------------------------------------ bench


def run_config(r: Run, name: str, trace_path: str, sizes: dict, warm_state: str | None = None,
               seconds: float | None = None) -> dict:
    """One configuration: daemon and gate where offline runs, online plays the trace, offline runs
    until online is done. Returns what both sides and the daemon reported. `warm_state`: the
    daemon's saved reservations file (None: MIAD starts cold); `seconds`: the trace's length
    (default --seconds)."""
    a = r.a
    mode = "alone" if name.startswith("alone") else {"static": "static"}.get(name, "valve")
    files = {k: os.path.join(r.work, f"{name}.{k}") for k in ("on-ready", "off-ready", "go", "stop")}
    for f in files.values():
        if os.path.exists(f):
            os.remove(f)
    on_out, off_out = (os.path.join(r.out, f"{name}-{s}.json") for s in ("online", "offline"))
    mem_before = common.gpu_used_mib()
    result: dict = dict(config=name, gpu_used_mib_before=mem_before)
    try:
        with_offline = mode != "alone"
        if with_offline:
            r.start_daemon(name, a.pool_gib if mode == "valve" else None, a.target_per_min, warm_state)
            off_args = ["--model", r.model, "--mode", "static" if mode == "static" else "valve", "--out", off_out,
                        "--ready", files["off-ready"], "--go", files["go"], "--stop", files["stop"], *offline_shape(a)]
            if mode == "static":
                off_args += ["--num-blocks", str(sizes["offline_blocks"])]
            if name.endswith("-fifo"):
                off_args.append("--fifo")
            off_env = dict(r.env, VALVE_LABEL=common.OFFLINE_LABEL, CUDA_MODULE_LOADING="EAGER")
            off = r.spawn(f"{name}-offline", python("offline.py", *off_args), off_env)
            wait_files([files["off-ready"]], [off], 300)
        on_args = ["--model", r.model, "--mode", mode, "--trace", trace_path, "--out", on_out,
                   "--ready", files["on-ready"], "--go", files["go"], "--max-batch-tokens",
                   str(a.online_batch_tokens), "--attention", a.attention]
        if mode != "valve":
            on_args += ["--num-blocks", str(sizes["pool_blocks"] if mode == "alone" else sizes["online_blocks"])]
        else:
            on_args += ["--reservation", "on" if name.startswith("valve-miad") else "off"]
        if with_offline:
            on_args.append("--gate-signals")
        if a.online_cuda_graphs:
            on_args.append("--cuda-graphs")
        on = r.spawn(f"{name}-online", python("online.py", *on_args))
        wait_files([files["on-ready"]], [on], 300)
        if with_offline:
            r.valvectl(*gate_start_args(on.pid))
            result["pool_before"] = pool_status(r) if mode == "valve" else None
        open(files["go"], "w").close()
        miad = MiadSampler(r) if name.startswith("valve-miad") else None
        admin = new_churn(r, name, on, trace_path, common.now()) if name == "valve-churn" else None
        try:
            if admin:
                admin.start()
            result["online_exit"] = on.wait(timeout=(seconds or a.seconds) + 240)
        finally:
            if miad:
                result["miad"] = miad.finish()
            if admin:  # stopped and joined, the gate left started: the end below is the same for all
                result["churn"] = admin.finish()
        if with_offline:
            dump_stacks(r, name, off)
            # The gate stops first: offline must not be frozen while it winds down.
            result["gate"] = json.loads(r.valvectl("gate", "status", "--json"))
            result["pool"] = pool_status(r) if mode == "valve" else None
            r.valvectl("gate", "stop")
            open(files["stop"], "w").close()
            result["offline_exit"] = off.wait(timeout=120)
    except Exception as e:  # noqa: BLE001 - the report says what went wrong, the next config still runs
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        r.stop_all()
        time.sleep(2)
        result["gpu_used_mib_after"] = common.gpu_used_mib()
    for side, path in (("online", on_out), ("offline", off_out)):
        if os.path.exists(path):
            result[side] = common.read_json(path)
    return result


def gate_start_args(online_pid: int) -> list[str]:
    """`valvectl gate start` as every configuration with offline runs it (valve-churn again and again)."""
    return ["gate", "start", "--online", str(online_pid), "--offline-label", common.OFFLINE_LABEL]


def new_churn(r: Run, name: str, on: subprocess.Popen, trace_path: str, go_t: float) -> churn.Churn:
    """valve-churn's gate cycler and socket flooders (churn.py), not started yet. Gate restarts end
    churn.CYCLE_MARGIN_S before online's last arrival (`go_t` + its `at`): online may exit any time
    after it, and a gate cannot start for an online pid that has gone. The flooders go on until
    online has exited."""
    last = max((q["at"] for q in common.read_json(trace_path)), default=0.0)
    return churn.Churn(r.a.valvectl, gate_start_args(on.pid), r.a.churn_gate_every, r.a.churn_flooders,
                       go_t + last, lambda: on.poll() is None, os.path.join(r.out, f"{name}-daemon.log"))


def dump_stacks(r: Run, name: str, off: subprocess.Popen) -> None:
    """Where offline's threads are at the end (native and Python stacks with py-spy where it is
    installed; it reads them from outside, unlike faulthandler's SIGUSR1 dump, which crashed an
    offline job mid-step on the H100), and the gate's decision trace: to explain an offline job
    that stopped making progress."""
    if off.poll() is None:
        spy = subprocess.run(["py-spy", "dump", "--native", "--pid", str(off.pid)], capture_output=True,
                             text=True, timeout=60) if shutil.which("py-spy") else None
        if spy is not None:
            with r.log(f"{name}-offline-pyspy") as f:
                f.write((spy.stdout + spy.stderr).encode())
    trace = subprocess.run([r.a.valvectl, "gate", "trace", "--json"], capture_output=True, text=True, timeout=60)
    with r.log(f"{name}-gate-trace") as f:
        f.write((trace.stdout + trace.stderr).encode())


class MiadSampler(threading.Thread):
    """Every second while online plays the trace: the MIAD state the pool reports for the online
    client (`valvectl pool status --json`): target handles, headroom, interval T, balance, events."""

    def __init__(self, r: Run) -> None:
        super().__init__(daemon=True)
        self.r, self.samples, self.stop = r, [], threading.Event()
        self.began: dict | None = None  # whether the reservation started warm, and from what
        self.start()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            st = pool_status(self.r) or {}
            for c in st.get("clients", []):
                m = c.get("reservation")
                if m:
                    self.began = self.began or m.get("start")
                    self.samples.append([common.now(), m["target_handles"], m["headroom_handles"], m["interval_ms"],
                                         round(m["balance_events"], 2), m["events"]])

    def finish(self) -> dict:
        self.stop.set()
        self.join(timeout=60)
        return dict(fields=["t", "target_handles", "headroom_handles", "interval_ms", "balance_events", "events"],
                    samples=self.samples, start=self.began)


def pool_status(r: Run) -> dict | None:
    try:
        return json.loads(r.valvectl("pool", "status", "--json"))
    except (RuntimeError, ValueError) as e:
        return {"error": str(e)}


CONFIGS = ("alone", "static", "valve-noreserve", "valve-noreserve-fifo", "valve-miad", "valve-miad-warm", "valve-churn",
           "alone-2")


def warm_from_problem(path: str | None, prime_seconds: float, names: list[str]) -> str | None:
    """Why --warm-from cannot be used as given (None: it can, or it is not given)."""
    if not path:
        return None
    if "valve-miad-warm" not in names:
        return "--warm-from is for valve-miad-warm: add it to --configs"
    if prime_seconds:
        return "--warm-from replaces the first pass: drop --warm-prime-seconds"
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"--warm-from {path}: not a readable saved reservations file ({e})"
    return None


def warm_max_age_problem(age: str) -> str | None:
    """Why --warm-max-age would make the daemon refuse to start (None: it will not), checked before
    anything runs: the daemon takes 0 to 7 days, in ms, s, m, min or h."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|min|h)", age.strip())
    if not m:
        return f"--warm-max-age {age}: give a duration such as 24h, 90m or 600s"
    seconds = float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    if seconds > 7 * 24 * 3600:
        return f"--warm-max-age {age}: the daemon takes at most 7 days (168h)"
    return None


def prime_only_problem(prime_only: bool, warm_from: str | None, names: list[str]) -> str | None:
    """Why --warm-prime-only cannot be used as given (None: it can, or it is not given)."""
    if not prime_only:
        return None
    if names != ["valve-miad-warm"]:
        return "--warm-prime-only runs valve-miad-warm's first pass alone: pass --configs valve-miad-warm"
    if warm_from:
        return "--warm-prime-only saves a state and --warm-from reads one: pass one of them"
    return None


def config_problem(names: list[str], have_sizes: bool) -> str | None:
    """Why `--configs` cannot run as given (None: it can), checked before anything starts: a
    misspelt name would otherwise run as some Valve configuration and be left out of the report,
    and a static split without its alone run would stop the benchmark halfway."""
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        return f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(CONFIGS)}"
    if "static" in names and not have_sizes and "alone" not in names[: names.index("static")]:
        return ("static needs online's peak from an alone run: list alone before static, or reuse an "
                "--out folder that holds sizes.json from one")
    return None


def bench(r: Run) -> int:
    a = r.a
    common.build_model(r.model)
    trace = common.online_trace(a.seconds, a.seed, base_rate=a.base_rate, burst_every=a.burst_every,
                                burst_size=a.burst_size, burst_prompt=(a.burst_prompt[0], a.burst_prompt[1]),
                                base_new=a.base_new_tokens, burst_new=a.burst_new_tokens)
    trace_path = os.path.join(r.out, "trace.json")
    common.write_json(trace_path, trace)
    pool_blocks = a.pool_gib * 1024 // 32  # one block of every layer's K and V: 256 tokens x 128 KiB = 32 MiB
    sizes = dict(pool_blocks=pool_blocks)
    if a.warm_prime_only:
        state = prime_warm_start(r, sizes)
        print(f"valve-miad-warm: first pass only; the measured pass: --warm-from {state}" if os.path.exists(state)
              else "valve-miad-warm: the first pass saved nothing (see valve-miad-warm-prime.json)", flush=True)
        return 0 if os.path.exists(state) else 1
    results = {}
    prev = os.path.join(r.out, "sizes.json")
    if os.path.exists(prev):
        sizes.update(common.read_json(prev))
    for name in a.configs.split(","):
        t = time.monotonic()
        warm_state = warm_start(r, sizes) if name == "valve-miad-warm" else None
        res = run_config(r, name, trace_path, sizes, warm_state)
        res["wall_s"] = time.monotonic() - t
        results[name] = res
        common.write_json(os.path.join(r.out, f"{name}.json"), res)
        if name == "alone" and "online" in res:
            peak = max((k[1] for k in res["online"]["kv"]), default=0)
            online_blocks = min(pool_blocks, peak + 2)  # one handle of slack
            sizes.update(online_peak_blocks=peak, online_blocks=online_blocks,
                         offline_blocks=pool_blocks - online_blocks)
            common.write_json(prev, sizes)
        print(report.one_line(name, res), flush=True)
    all_results = {}
    for name in CONFIGS:
        path = os.path.join(r.out, f"{name}.json")
        if os.path.exists(path):
            all_results[name] = common.read_json(path)
    rep = report.build(all_results, sizes, vars(a))
    common.write_json(os.path.join(r.out, "report.json"), rep)
    with open(os.path.join(r.out, "report.md"), "w") as f:
        f.write(report.markdown(rep))
    print(report.markdown(rep))
    return 0


def warm_start(r: Run, sizes: dict) -> str:
    """The saved reservations valve-miad-warm's measured pass starts from: a copy of --warm-from (a
    file an earlier run saved: its first pass can run in an earlier device call), else the state its
    own first pass saves."""
    if not r.a.warm_from:
        return prime_warm_start(r, sizes)
    state = os.path.join(r.out, "reservations.json")
    if os.path.abspath(r.a.warm_from) != os.path.abspath(state):
        shutil.copyfile(r.a.warm_from, state)
    print(f"valve-miad-warm: starts from {r.a.warm_from} (no first pass)", flush=True)
    return state


def prime_warm_start(r: Run, sizes: dict) -> str:
    """valve-miad-warm's first pass: valve-miad from a cold start on a trace of
    --warm-prime-seconds, whose daemon saves MIAD's state at its shutdown. Returns the file the
    measured pass starts warm from."""
    a = r.a
    state = os.path.join(r.out, "reservations.json")
    for f in (state, state + ".bad"):
        if os.path.exists(f):
            os.remove(f)
    seconds = a.warm_prime_seconds or a.seconds
    trace = common.online_trace(seconds, a.seed, base_rate=a.base_rate,
                                burst_every=a.burst_every, burst_size=a.burst_size,
                                burst_prompt=(a.burst_prompt[0], a.burst_prompt[1]),
                                base_new=a.base_new_tokens, burst_new=a.burst_new_tokens)
    prime_path = os.path.join(r.out, "trace-prime.json")
    common.write_json(prime_path, trace)
    res = run_config(r, "valve-miad-warm-prime", prime_path, sizes, state, seconds)
    common.write_json(os.path.join(r.out, "valve-miad-warm-prime.json"), res)
    print(report.one_line("valve-miad-warm-prime", res), flush=True)
    if not os.path.exists(state):
        print(f"valve-miad-warm: the first pass saved no {state}: the measured pass starts cold", flush=True)
    return state


# ------------------------------------------------------------------------------ episodes


@contextlib.contextmanager
def measuring(r: Run, rep: dict):
    """The measured part of an episode run: an exception ends it as `rep["error"]` (the
    report says what went wrong, with what was measured), and every process is stopped after it,
    then NVML's used memory is read."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported, not raised: the measurements so far stand
        rep["error"] = f"{type(e).__name__}: {e}"
    finally:
        r.stop_all()
        time.sleep(2)
        rep["gpu_used_mib_after"] = common.gpu_used_mib()


def note_error(rep: dict) -> None:
    """The run's error, if any, goes first into its analysis's error."""
    if rep.get("error"):
        rep["analysis"]["error"] = rep["error"] + (f"; {rep['analysis']['error']}" if rep["analysis"].get("error") else "")


def offline_handles(r: Run) -> int:
    """Handles the offline client holds now (pool status)."""
    st = pool_status(r) or {}
    return sum(c.get("handles", 0) for c in st.get("clients", []) if c.get("role") == "offline")


def offline_shape(a) -> list[str]:
    """offline.py's workload options, as every command of this script sets them."""
    return ["--max-batch-tokens", str(a.offline_batch_tokens), "--max-requests", str(a.offline_max_requests),
            "--new-tokens", str(a.offline_new_tokens), "--prompt", *map(str, a.offline_prompt), "--attention", a.attention]


def reclaim_share(r: Run, size_pct: float) -> tuple[int | None, int]:
    """`valvectl pool reclaim` of `size_pct`% of the handles offline holds now (at least one): the MiB
    the daemon says it reclaimed, and the handles offline held before."""
    h = offline_handles(r)
    n = max(1, round(size_pct / 100 * h))
    out = r.valvectl("pool", "reclaim", "--gpu", str(common.GPU), "--mib", str(n * common.HANDLE_BYTES >> 20), "--json")
    try:
        return json.loads(out).get("reclaimed_mib"), h
    except ValueError:
        return None, h


def episodes_run(r: Run) -> int:
    """The eviction cells as episodes (episodes.py): one daemon with a pool and one offline process
    (offline.py --episodes) that runs the same requests from an empty cache whenever asked; reclaims
    at the episode's times; each episode's time to the warm-up's token count, against the base line."""
    a = r.a
    plan = episodes.plan(a.sizes, a.rates, a.policies, a.lead, a.measure_s, a.tail, a.repeat, a.seed, a.warm)
    print(f"episodes: {len(plan)} of about {a.measure_s:g} s, about "
          f"{(90 + len(plan) * (a.measure_s + a.drain_s)) / 60:.1f} min", flush=True)
    common.build_model(r.model)
    d = os.path.join(r.work, "episodes")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    off_out = os.path.join(r.out, "episodes-offline.json")
    rep: dict = dict(args=dict(vars(a), policies=list(a.policies)), episodes=[], gpu_used_mib_before=common.gpu_used_mib())
    tokens = None
    with measuring(r, rep):
        r.start_daemon("episodes", a.pool_gib, a.target_per_min)
        off_args = ["--model", r.model, "--mode", "valve", "--out", off_out, "--ready", os.path.join(d, "ready"),
                    "--episodes", d, "--episode-requests", str(a.episode_requests), *offline_shape(a),
                    "--placement", a.placement]
        off = r.spawn("episodes-offline", python("offline.py", *off_args),
                      dict(r.env, VALVE_LABEL=common.OFFLINE_LABEL, CUDA_MODULE_LOADING="EAGER"))
        wait_files([os.path.join(d, "ready")], [off], 300)
        started, k = time.monotonic(), 0
        for i, e in enumerate(plan):
            if e.kind == "base" and i < len(plan) - 1 and out_of_budget(a, rep["episodes"], started):
                # whole groups only; the plan's last base episode still runs, for the line
                rep["budget_note"] = f"--budget-s {a.budget_s:g} reached: {len(plan) - 1 - i} episodes not run"
                print(f"episodes: {rep['budget_note']}", flush=True)
                e = plan[-1]
                del plan[i + 1:]
            k += 1
            rec = run_one_episode(r, d, k, e, tokens, off)
            tokens = rec["tokens"] if e.kind == "warm" else tokens
            rep["episodes"].append(rec)
            print(f"episodes: {i + 1}/{len(plan)} {e.kind} {e.policy} size {e.size_pct} rates {e.rates}: "
                  f"{episodes_fmt(rec.get('seconds'))} s, {rec.get('steps')} steps to {rec.get('tokens')} tokens, "
                  f"reclaims {rec['reclaims']} "
                  f"requeued {rec.get('requeued')} ({rec.get('requeued_tokens')} tokens)", flush=True)
            if rec.get("errors") or not rec.get("drained", True):
                raise RuntimeError(f"episode {k}: {rec.get('errors') or 'did not drain'}")
        open(os.path.join(d, "stop"), "w").close()
        rep["offline_exit"] = off.wait(timeout=120)
    rep.update(device=common.device_name(), lane=common.lane(), tokens=tokens)
    rep["analysis"] = episodes.analyse(rep["episodes"], "steps")
    rep["analysis_seconds"] = episodes.analyse(rep["episodes"], "seconds")
    note_error(rep)
    rep["target"] = eviction.target_check(rep["analysis"]["cells"])
    common.write_json(os.path.join(r.out, "report.json"), rep)
    text = episodes.markdown(rep)
    with open(os.path.join(r.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if not rep.get("error") else 1


def out_of_budget(a, done: list[dict], started: float) -> bool:
    """Whether a base episode, a group of the policies and the last base episode would overrun
    --budget-s, at the longest episode so far."""
    if not a.budget_s:
        return False
    longest = max((x["t_stop"] - x["t0"] for x in done), default=a.measure_s) + a.drain_s + 1
    return time.monotonic() - started + (len(a.policies) + 2) * longest > a.budget_s


def run_one_episode(r: Run, d: str, k: int, e, tokens: int | None, off: subprocess.Popen) -> dict:
    """Asks offline for episode `k`, makes its reclaims at their times, and returns what offline
    reported with the reclaims made."""
    a = r.a
    start_at = common.now() + 0.5
    spec = dict(k=k, start_at=start_at, backlog=a.offline_backlog, selection=e.policy, seed=e.seed,
                max_s=4 * a.measure_s + 30)
    spec.update(dict(measure_s=a.measure_s) if e.kind == "warm" or not tokens else dict(tokens=tokens))
    common.write_json(os.path.join(d, f"episode-{k}.json.new"), spec)
    os.replace(os.path.join(d, f"episode-{k}.json.new"), os.path.join(d, f"episode-{k}.json"))
    made, sizes_mib, held = 0, [], []
    for at in e.reclaims_at:
        time.sleep(max(0.0, start_at + at - common.now()))
        got, h = reclaim_share(r, e.size_pct)
        made, sizes_mib, held = made + 1, sizes_mib + [got], held + [h]
    done = os.path.join(d, f"episode-{k}.done.json")
    wait_files([done], [off], spec["max_s"] + 90)
    return dict(vars(e), **common.read_json(done), reclaims=made, reclaimed_mib=sizes_mib, offline_handles=held)


def episodes_fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------------------ correctness


def correctness(r: Run) -> int:
    """Reference runs (plain transformers) and reclaimed runs (the shim, with an online client
    taking memory back again and again), one token per forward pass and batched."""
    common.build_model(r.model)
    out: dict = {"device": None, "runs": {}}
    mem_before = common.gpu_used_mib()
    for mbt, keep in ((1, 0), (64, 1)):
        if mbt not in r.a.batch_tokens:
            continue
        ref = os.path.join(r.out, f"correct-plain-{mbt}.json")
        p = r.spawn(f"correct-plain-{mbt}", python("correctness.py", "generate", "--model", r.model, "--mode",
                                                   "plain", "--max-batch-tokens", str(mbt), "--out", ref))
        p.wait(timeout=600)
        got = os.path.join(r.out, f"correct-valve-{mbt}.json")
        stop, started = os.path.join(r.work, "pressure.stop"), os.path.join(r.work, "gen.started")
        for f in (stop, started):
            if os.path.exists(f):
                os.remove(f)
        try:
            r.start_daemon(f"correct-{mbt}", 1, 2.0)  # a 1 GiB pool: 16 handles, all of them offline's
            gen = r.spawn(f"correct-valve-{mbt}", python("correctness.py", "generate", "--model", r.model,
                                                         "--mode", "valve", "--max-batch-tokens", str(mbt),
                                                         "--out", got, "--started", started,
                                                         "--placement", r.a.placement),
                          dict(r.env, VALVE_LABEL=common.OFFLINE_LABEL))
            wait_files([started], [gen], 300)
            time.sleep(2.0)  # the cache is built and generation under way
            pres_out = os.path.join(r.out, f"correct-pressure-{mbt}.json")
            pres = r.spawn(f"correct-pressure-{mbt}", python("correctness.py", "pressure", "--stop", stop,
                                                             "--out", pres_out, "--cycles", "10", "--keep", str(keep)))
            gen_exit = gen.wait(timeout=600)
            open(stop, "w").close()
            pres.wait(timeout=60)
        finally:
            r.stop_all()
        out["runs"][mbt] = report.compare_outputs(ref, got, pres_out, gen_exit)
    time.sleep(2)
    if len(out["runs"]) == 2:
        refs = [common.read_json(os.path.join(r.out, f"correct-plain-{m}.json"))["outputs"] for m in (1, 64)]
        out["batch_invariant"] = refs[0] == refs[1]  # whether batching alone changes the tokens here
    out["placement"] = r.a.placement
    out["lane"] = common.lane()
    out["gpu_used_mib_before"], out["gpu_used_mib_after"] = mem_before, common.gpu_used_mib()
    out["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader",
                                    "-i", str(common.GPU)],
                                   capture_output=True, text=True).stdout.strip()
    common.write_json(os.path.join(r.out, "correctness.json"), out)
    print(report.correctness_markdown(out))
    runs = out["runs"]
    ok = bool(runs) and all(run["requeued"] > 0 and (m != 1 or run["identical"]) for m, run in runs.items())
    return 0 if ok else 1


def add_offline_only(p: argparse.ArgumentParser) -> None:
    """The pool and offline's workload, for the command that runs offline alone (episodes)."""
    p.add_argument("--pool-gib", type=int, default=12)
    p.add_argument("--target-per-min", type=float, default=6.0, help="the daemon's MIAD target (unused: no online)")
    p.add_argument("--offline-batch-tokens", type=int, default=512)
    p.add_argument("--offline-max-requests", type=int, default=96)
    p.add_argument("--offline-new-tokens", type=int, default=128)
    p.add_argument("--offline-prompt", type=int, nargs=2, default=(1024, 2048))
    p.add_argument("--attention", choices=("varlen", "sdpa"), default="varlen")
    p.add_argument("--placement", choices=("default", "compact"), default="default",
                   help="the shim's block placement (compact: a request's blocks on as few handles as possible; "
                        "docs/memory.md); run once per placement to compare")


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers (`5,10,25`)."""
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--valvectl", required=True, help="the valvectl binary")
    ap.add_argument("--out", required=True, help="where results and logs go")
    ap.add_argument("--workdir", default=f"/tmp/membench-gpu{common.GPU}", help="model and scratch files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    co = sub.add_parser("correctness")
    co.add_argument("--placement", choices=("default", "compact"), default="default",
                    help="the shim's block placement in the reclaimed runs (docs/memory.md)")
    co.add_argument("--batch-tokens", type=lambda t: [int(x) for x in t.split(",") if x], default=[1, 64],
                    help="which runs: 1 (one token per forward pass: batch-invariant, must be identical) and/or 64 "
                         "(batched; its reference differs by batching alone)")
    ep = sub.add_parser("episodes", help="the eviction cells (reclaimed size x rate x handle choice) as "
                                         "episodes of a fixed offline workload (episodes.py)")
    ep.add_argument("--sizes", type=floats, default=[10.0], help="%% of offline's memory per reclaim")
    ep.add_argument("--rates", type=floats, default=[2.0, 6.0], help="reclaims per minute")
    ep.add_argument("--policies", type=lambda x: [p for p in x.split(",") if p], default=["alg1", "fifo"],
                    help="comma-separated: " + ", ".join(eviction.POLICIES))
    ep.add_argument("--measure-s", type=float, default=20.0,
                    help="the warm-up episode's length; its token count is every later episode's goal")
    ep.add_argument("--lead", type=float, default=9.0,
                    help="seconds into an episode before its first reclaim (offline's batch fills in the first ~8 s)")
    ep.add_argument("--tail", type=float, default=6.0,
                    help="seconds an episode keeps after its last reclaim, for the recomputation to fall inside it")
    ep.add_argument("--drain-s", type=float, default=3.0, help="seconds between episodes (estimates only)")
    ep.add_argument("--budget-s", type=float, default=0,
                    help="seconds from the first warm-up: at a group's start, if the group and the plan's last base "
                         "episode would not fit at the longest episode so far, run that last base episode and stop; "
                         "0: run the whole plan")
    ep.add_argument("--repeat", type=int, default=4, help="each cell's group of episodes, this many times")
    ep.add_argument("--warm", type=int, default=2, help="warm-up episodes (the first grows the cache)")
    ep.add_argument("--seed", type=int, default=30, help="the policies' order and the random policy's seeds")
    ep.add_argument("--episode-requests", type=int, default=600,
                    help="the fixed list's length (a 30-s episode on an H100 used about 350)")
    ep.add_argument("--offline-backlog", type=int, default=80, help="offline's requests in the system at once")
    add_offline_only(ep)
    b = sub.add_parser("bench")
    b.add_argument("--configs", default="alone,static,valve-miad,valve-noreserve,valve-noreserve-fifo,alone-2",
                   help="comma-separated, run in this order: " + ", ".join(CONFIGS)
                        + " (static needs alone before it, or sizes.json in --out from an earlier alone run)")
    b.add_argument("--seconds", type=float, default=60)
    b.add_argument("--seed", type=int, default=11, help="trace seed (11: three bursts in 60 s)")
    b.add_argument("--pool-gib", type=int, default=12)
    b.add_argument("--base-rate", type=float, default=0.15, help="short requests per second")
    b.add_argument("--burst-every", type=float, default=25.0, help="mean seconds between bursts")
    b.add_argument("--burst-size", type=int, default=8)
    b.add_argument("--burst-prompt", type=int, nargs=2, default=(8000, 12000))
    b.add_argument("--base-new-tokens", type=int, default=24, help="tokens a short online request generates")
    b.add_argument("--burst-new-tokens", type=int, default=64, help="tokens a long online request generates")
    b.add_argument("--online-batch-tokens", type=int, default=4096)
    b.add_argument("--online-cuda-graphs", action="store_true",
                   help="online replays CUDA graphs, so its decode step is bound by the GPU, not by the host's "
                        "Python (without: 20-40 ms a step whatever its GPU work, +-30%% between bursts)")
    b.add_argument("--target-per-min", type=float, default=6.0, help="MIAD's target reclaims per minute")
    b.add_argument("--warm-prime-seconds", type=float, default=0,
                   help="valve-miad-warm: length of the first pass's trace, whose MIAD state the measured pass "
                        "starts from after a daemon restart (0: --seconds)")
    b.add_argument("--warm-from", metavar="FILE",
                   help="valve-miad-warm: start the measured pass from this saved reservations file (an earlier "
                        "run's OUT/reservations.json) instead of running a first pass")
    b.add_argument("--warm-max-age", metavar="DURATION", default="24h",
                   help="valve-miad-warm: the daemon's --pool-warm-max-age (a saved state older than this starts "
                        "cold; raise it, at most 168h (the daemon's limit), to start from a state a day-old call "
                        "saved: its trace parameters, not its age, decide what it learned)")
    b.add_argument("--warm-prime-only", action="store_true",
                   help="valve-miad-warm: run only the first pass (--warm-prime-seconds) and stop once it has saved "
                        "OUT/reservations.json, for a later call's --warm-from on the same GPU")
    b.add_argument("--churn-gate-every", type=float, default=2.0,
                   help="valve-churn: seconds between two gate restarts (`gate stop`, then `gate start`)")
    b.add_argument("--churn-flooders", type=int, default=2,
                   help="valve-churn: threads flooding the daemon's control socket with bad input")
    b.add_argument("--churn-keep-watchers", type=int, default=600,
                   help="valve-churn: the daemon's --gate-keep-watchers (seconds; 0: fresh uprobes for every "
                        "gate start, which took 6-12 s each beside these jobs on the H100)")
    # Offline is long-context batch generation, decode-heavy: its batch (and so its throughput) is
    # bounded by KV memory, the regime the pool is for. With short prompts (128-384 tokens, 64
    # new) offline was bounded by its token budget and compute share instead: 1.09x static
    # (2026-11-24-h100-membench.md, archived in docs/results/README.md).
    b.add_argument("--offline-batch-tokens", type=int, default=512)
    b.add_argument("--offline-max-requests", type=int, default=96)
    b.add_argument("--offline-new-tokens", type=int, default=128)
    b.add_argument("--offline-prompt", type=int, nargs=2, default=(1024, 2048))
    b.add_argument("--attention", choices=("varlen", "sdpa"), default="varlen",
                   help="both sides' attention: varlen (PyTorch's flash kernel, cost linear in the batch) or "
                        "transformers' paged|sdpa (one masked sequence: cost grows with the batch squared, so "
                        "memory does not turn into offline throughput; 1.05x static measured on the H100)")
    a = ap.parse_args()
    if a.cmd == "bench":
        names = [n for n in a.configs.split(",") if n]
        sizes = os.path.join(a.out, "sizes.json")
        try:
            have_sizes = os.path.exists(sizes) and "online_blocks" in common.read_json(sizes)
        except (OSError, ValueError, TypeError) as e:
            ap.error(f"{sizes} is not a readable sizes file ({e}): delete it and run alone again")
        problem = config_problem(names, have_sizes)
        problem = problem or warm_from_problem(a.warm_from, a.warm_prime_seconds, names)
        problem = problem or prime_only_problem(a.warm_prime_only, a.warm_from, names)
        problem = problem or warm_max_age_problem(a.warm_max_age)
        if a.churn_gate_every <= 0 or a.churn_flooders < 0:
            problem = "--churn-gate-every must be above 0 and --churn-flooders at least 0"
        if problem:
            ap.error(problem)
        a.configs = ",".join(names)
    if a.cmd == "episodes":
        try:
            episodes.plan(a.sizes, a.rates, a.policies, a.lead, a.measure_s, a.tail, a.repeat, a.seed, a.warm)
        except ValueError as e:
            ap.error(str(e))
    if os.geteuid() != 0:
        raise SystemExit("run as root: the benchmark starts the Valve daemon")
    r = Run(a)
    try:
        return {"correctness": correctness, "bench": bench, "episodes": episodes_run}[a.cmd](r)
    finally:
        r.stop_all()
        subprocess.run([a.valvectl, "resume", "--all"], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
