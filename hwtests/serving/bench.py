"""The real serving benchmark: an online LLM service behind HTTP next to offline PyTorch training
on the same GPU, in four configurations (alone, time-slicing, gate on launch edges, gate on
arrivals) at two loads (online busy ~30% and ~70% of the time). Writes report.md and report.json
and prints the numbers with pass/fail per target. Run by scripts/serving-bench.sh.

Servers (--server):
  serve      `transformers serve` (OpenAI-compatible, continuous batching) on a local random Llama
  cb         the same continuous batching manager behind aiohttp (server.py), if serve cannot run
  graph      the GPU-bound decode loop (decoder.py: CUDA-graph replay and a host sync per token)
  graph-raw  the same decode loop behind plain TCP (rawserver.py): pre-tokenized requests read by
             the decoding thread itself, the prefill a CUDA graph of --prompt-tokens; no HTTP

Configurations (--configs): alone, timeslice, gate-old (launch edges only, no waits: the gate
without arrivals), gate-launch (launch edges and waits), gate-arrival (arrivals too; the default),
gate-offline-stopped (gate-arrival with offline SIGSTOPped: what the gate itself costs online),
gate-arrival-normal (gate-arrival with the gate's threads on the normal scheduler, not SCHED_FIFO),
gate-arrival-spin (gate-arrival with --arrival-busy-poll), alone-2 (alone again: the noise floor),
alone-offline-frozen (no gate; offline's channels disabled for the whole run by `valvectl preempt
--pid` while its host threads run: what a frozen offline process costs online from the host side).

gate-hold (gate-arrival with the hold for likely arrivals: `gate start --hold-budget`, 8% unless
--gate-hold-budget; --hold-history seeds it), and the peers: mps (no gate; server and training
clients of a CUDA MPS daemon of their own, training at low client priority) and xsched (no gate;
both under XSched's CUDA shim and xserver, online at high priority, training at low). A peer
starts the server and training under it for the whole invocation, so one invocation runs at most
one peer, and its other configurations run under it too (bursty.sh runs each peer in its own).

--dry-run: no daemon and no gate (CPU checks of the pipeline); the gate rows are skipped.

--stamp-first-kernel OUTDIR/stamp.ptx (graph and graph-raw servers, CUDA; hwtests/cuda/build.sh
builds it): the server stamps each request's first kernel's GPU start, and the report adds, per
idle arrival, the arrival -> first kernel running time, with the GPU clock's mapping (made with
offline SIGSTOPped before the first run and after the last; each stamp is mapped by the offset
interpolated linearly between the two, as the GPU clock drifts) and its error bound and drift.

The graph servers also mark when they got each request and launched its first GPU work: the
report splits each idle arrival's time into send -> recv -> host launch (-> GPU start, stamped).
"""

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import analysis  # noqa: E402
import loadgen  # noqa: E402
import peers  # noqa: E402
import stamp  # noqa: E402

# hwtests/lanes.sh gives each lane its own label (and VALVE_GPU), so no lane's gate freezes
# another lane's training.
OFFLINE_LABEL = os.environ.get("VALVE_BENCH_LABEL", "valve-bench-offline")
CONFIGS = ["alone", "timeslice", "gate-launch", "gate-arrival", "alone-2"]
CONFIG_NAMES = {
    "alone": "online alone",
    "alone-2": "online alone, a second configuration (the noise floor of every comparison with alone)",
    "timeslice": "no control (time-slicing)",
    "gate-old": "valvectl gate on launch edges only (--no-arrivals --no-waits)",
    "gate-launch": "valvectl gate, launch edges only (--no-arrivals)",
    "gate-arrival": "valvectl gate, arrivals + launch edges",
    "gate-offline-stopped": "valvectl gate, arrivals + launch edges, offline SIGSTOPped (the gate's own cost: probes and ioctls, no offline work)",
    "gate-arrival-normal": "valvectl gate, arrivals + launch edges, gate threads on the normal scheduler (--realtime-priority 0)",
    "gate-arrival-spin": "valvectl gate, arrivals + launch edges, busy-polled while offline runs (--arrival-busy-poll)",
    "alone-offline-frozen": "online alone, no gate, offline frozen throughout (valvectl preempt --pid; its host threads run)",
    "gate-hold": "valvectl gate, arrivals + launch edges, with the hold for likely arrivals (--hold-budget)",
    "mps": "CUDA MPS, training at low client priority (no gate)",
    "xsched": "XSched Level 1 (CUDA shim, xserver HPF), online high, training low (no gate)",
}

# The hold's budget (percent of idle time) of gate-hold where --gate-hold-budget is not given.
DEFAULT_HOLD_BUDGET = 8.0

# The servers that are the decoder of decoder.py (no model dir; they can stamp the first kernel).
GRAPH_SERVERS = ("graph", "graph-raw")

# The configurations whose gate preempts on request arrivals.
ARRIVAL_CONFIGS = ("gate-arrival", "gate-offline-stopped", "gate-arrival-normal", "gate-arrival-spin", "gate-hold")


def log(*a):
    print(*a, flush=True)


HOLD_HISTORY_FILE = "gate-hold-history.json"  # the daemon's name for it in its state directory


def check_hold_history(path, port):
    """Why the hold history at `path` cannot seed the gate of `--online-port port`, or None."""
    import hold_seed

    try:
        with open(path) as f:
            services = json.load(f)["services"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path}: not a hold history file ({type(e).__name__}: {e}); make one with hold_seed.py"
    key = hold_seed.service_key(port)
    if key not in services:
        return (f"{path} has no history for '{key}' (it has {sorted(services)}): give hold_seed.py the same "
                "--port as bench.py")
    return None


def hold_budget_for(a, config):
    """The hold budget (percent) a gate configuration starts with, or None: only gate-hold holds,
    so that the gates beside it in one invocation measure the gate without the hold."""
    if config == "gate-hold":
        return a.gate_hold_budget or DEFAULT_HOLD_BUDGET
    return None


def trace_from(trace, lo):
    """The gate's records from `lo` on, and the last whole-offline disable or enable before it:
    whether offline was frozen when the window began (a hold from the settling requests)."""
    before = [r for r in trace if r["t_ns"] < lo and r["event"] in ("disable", "enable") and r.get("pid", 0) == 0]
    return before[-1:] + [r for r in trace if r["t_ns"] >= lo]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_name(dry):
    """The GPU's name, driver and UUID: lent hosts of one kind differ (a probe's trap cost, for
    one), so a report says which physical GPU it ran on."""
    if dry:
        return "cpu (dry run)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,uuid", "--format=csv,noheader", "-i",
             os.environ.get("VALVE_GPU", "0")],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        return out or "unknown GPU"
    except OSError:
        return "unknown GPU (no nvidia-smi)"


class Proc:
    """A child process whose output goes to a log file; `wait_line` waits for a line prefix."""

    def __init__(self, name, argv, logdir, env=None):
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, bufsize=1
        )
        self.lines = []

    def wait_line(self, prefix, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if not line:
                if self.p.poll() is not None:
                    break
                continue
            self.log.write(line)
            self.log.flush()
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()
        raise RuntimeError(f"{self.name} did not print {prefix!r} (see {self.log_path})")

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                out, _ = self.p.communicate(timeout=timeout)
                self.lines += out.splitlines()
                self.log.write(out)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def daemon_cpus_prefix(env=os.environ):
    """`taskset -c CPUS` where hwtests/lanes.sh gives the lane's daemon every CPU back
    (VALVE_DAEMON_CPUS): pinned to the lane's block, its edge threads lose SCHED_DEADLINE."""
    cpus = env.get("VALVE_DAEMON_CPUS", "")
    return ["taskset", "-c", cpus] if cpus else []


class Valve:
    """The daemon and `valvectl gate` (absent in a dry run)."""

    def __init__(self, valvectl, workdir, logdir, dry, hold_history=None):
        self.dry = dry
        self.vc = valvectl
        self.sock = os.path.join(workdir, "valve.sock")
        self.daemon = None
        if dry:
            return
        state = os.path.join(workdir, "state")
        os.makedirs(state, exist_ok=True)
        if hold_history:
            # Read by the daemon once, at its start: as a daemon restarted on a busy node has it.
            shutil.copyfile(hold_history, os.path.join(state, HOLD_HISTORY_FILE))
        self.daemon = Proc(
            "daemon", [*daemon_cpus_prefix(), valvectl, "--socket", self.sock, "daemon", "--state-dir", state],
            logdir,
        )
        deadline = time.time() + 30
        while time.time() < deadline and self.call(["status"], check=False) is None:
            time.sleep(0.2)
        if self.call(["status"], check=False) is None:
            raise RuntimeError("the daemon did not come up (see daemon.log)")

    def call(self, args, check=True):
        r = subprocess.run(
            [self.vc, "--socket", self.sock, "--json", *args], capture_output=True, text=True
        )
        if r.returncode != 0:
            if check:
                raise RuntimeError(f"valvectl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
            return None
        return r.stdout

    def gate_start(self, port, arrivals, waits=True, realtime=True, busy_poll=False, fixed_cooldown=None,
                   hold_budget=None):
        extra = ([] if arrivals else ["--no-arrivals"]) + ([] if waits else ["--no-waits"])
        extra += [] if realtime else ["--realtime-priority", "0"]
        extra += ["--arrival-busy-poll"] if busy_poll else []
        extra += ["--fixed-cooldown", fixed_cooldown] if fixed_cooldown else []
        extra += ["--hold-budget", f"{hold_budget}%"] if hold_budget else []
        self.call(["gate", "start", "--online-port", str(port), "--offline-label", OFFLINE_LABEL, *extra])

    def gate_status(self):
        return json.loads(self.call(["gate", "status"]))

    def gate_trace(self):
        """Every record the gate kept, read in pages of up to 10000."""
        records, after = [], 0
        while True:
            out = self.call(["gate", "trace", "--after", str(after)])
            page = [json.loads(line) for line in out.splitlines() if line.strip()]
            if not page:
                return records
            records += page
            after = page[-1]["seq"]

    def gate_stop(self):
        return json.loads(self.call(["gate", "stop"]))

    def freeze(self, pid):
        """Disables every channel of `pid` until `thaw` (no gate; the daemon holds them)."""
        self.call(["preempt", "--pid", str(pid), "--detach"])

    def thaw(self, pid):
        self.call(["resume", "--pid", str(pid)])

    def stop(self):
        if self.daemon:
            self.daemon.stop(signal.SIGTERM)


def stop_all(procs, valve):
    """Ends the child processes, last started first (a SIGSTOPped one is continued so that it can
    exit), then the daemon, which enables whatever a gate still held."""
    for p in reversed(procs):
        if p.p.poll() is None:
            try:
                os.kill(p.p.pid, signal.SIGCONT)
            except OSError:
                pass
        p.stop()
    if valve:
        valve.stop()


def read_progress(path):
    out = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) == 2:
                out.append((int(p[0]), int(p[1])))
    return out


def offline_rate(path, seconds):
    """Iterations per second over the next `seconds` of progress."""
    t0 = time.monotonic_ns()
    time.sleep(seconds)
    recent = [x for x in read_progress(path) if x[0] >= t0]
    for _ in range(20):  # a slow job: wait for a few iterations
        if len(recent) >= 3:
            break
        time.sleep(seconds / 2)
        recent = [x for x in read_progress(path) if x[0] >= t0]
    if len(recent) < 2:
        return None
    return (recent[-1][1] - recent[0][1]) / ((recent[-1][0] - recent[0][0]) / 1e9)


def wait_http(url, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


def server_argv(a, model_dir, port):
    """The online server's command line."""
    if a.server == "serve":
        argv = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir,
            "--continuous-batching", "--device", a.device, "--port", str(port),
            "--host", "127.0.0.1", "--cb-max-memory-percent", str(a.kv_memory),
        ]
        if a.device.startswith("cuda"):
            argv += ["--dtype", "bfloat16"]
    elif a.server == "cb":
        argv = [sys.executable, os.path.join(HERE, "server.py"), "--engine", "cb", "--model", model_dir,
                "--device", a.device, "--port", str(port), "--max-memory-percent", str(a.kv_memory),
                "--attention", a.cb_attention]
        if a.cb_cuda_graphs:
            argv.append("--cuda-graphs")
    elif a.server == "graph-raw":
        argv = [sys.executable, os.path.join(HERE, "rawserver.py"), "--size", a.model_size,
                "--device", a.device, "--port", str(port), "--prompt-tokens", str(a.prompt_tokens),
                "--max-len", str(max(1024, a.prompt_tokens + a.max_tokens))]  # graph's 1024 if it fits
        if getattr(a, "stamp_first_kernel", None):
            argv += ["--stamp-first-kernel", a.stamp_first_kernel]
    else:
        argv = [sys.executable, os.path.join(HERE, "server.py"), "--engine", "graph",
                "--size", a.model_size, "--device", a.device, "--port", str(port)]
        if getattr(a, "stamp_first_kernel", None):
            argv += ["--stamp-first-kernel", a.stamp_first_kernel]
    return argv


def start_server(a, model_dir, port, logdir, env):
    p = Proc("server", server_argv(a, model_dir, port), logdir, env=env)
    if a.server == "graph-raw":
        wait_raw(server_url(a, port), a.start_timeout)
    else:
        wait_http(server_url(a, port), a.start_timeout)
    return p


def server_url(a, port):
    """The url the load generator sends to: raw:// for rawserver.py's protocol, else http://."""
    return f"{'raw' if a.server == 'graph-raw' else 'http'}://127.0.0.1:{port}"


def wait_raw(url, timeout):
    """Waits for rawserver.py to answer its health message (it listens only once it can serve)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if loadgen.raw_control(url, {"health": True}, timeout=2).get("status") == "ok":
                return
        except (OSError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer its health message in {timeout} s")


def stamp_choice(a, ap):
    """The stamp file the graph server is to load, or None: off unless asked for, and off with a
    message in a dry run or on a device other than CUDA."""
    if not a.stamp_first_kernel:
        return None
    if a.server not in GRAPH_SERVERS:
        ap.error("--stamp-first-kernel needs --server graph or graph-raw (the stamp is in decoder.py's loop)")
    return stamp.stamp_file(a.stamp_first_kernel, "a dry run" if a.dry_run else a.device, ap,
                            lambda msg: log(f"== {msg}"))


def offline_env(a):
    """Offline's environment: its Valve label."""
    return dict(os.environ, VALVE_LABEL=OFFLINE_LABEL)


def calibrate_server(url):
    """The server's fresh mapping of the GPU clock (POST /v1/valve/calibrate, or the raw protocol's
    calibrate message), or None, said why."""
    try:
        if url.startswith("raw://"):
            answer = loadgen.raw_control(url, {"calibrate": True})
            if "error" in answer:
                raise ValueError(answer["error"])
            return answer["mapping"]
        req = urllib.request.Request(url + "/v1/valve/calibrate", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["mapping"]
    except (OSError, ValueError, KeyError) as e:
        log(f"== the stamp's clock mapping failed ({type(e).__name__}: {e}); see server.log")
        return None


def calibrate_idle(url, offline_pid, when):
    """calibrate_server with offline SIGSTOPped (and its queued GPU work drained), so the mapping's
    window is not stretched by offline's timeslices."""
    os.kill(offline_pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        m = calibrate_server(url)
    finally:
        os.kill(offline_pid, signal.SIGCONT)
    if m:
        log(f"== GPU clock mapped ({when}): offset {m['offset_ns']} ns, error bound {m['bound_ns'] / 1e3:.1f} us "
            f"(narrowest of {m['samples']} windows)")
    return m


def prompt_text(model_dir, tokens):
    """A prompt of about `tokens` tokens for the model's tokenizer (bytes for the graph decoder)."""
    words = "ba ce di fo gu ha je ki lo mu na pe ri so tu va we xi yo zu".split()
    text = " ".join(words[i % len(words)] + words[(i * 7) % len(words)] for i in range(tokens))
    if model_dir is None:
        return text[:tokens]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode(text).ids[:tokens]
    return tok.decode(ids)


MODEL_NAME = ["bench"]


TRACE_ARRIVALS = loadgen.TRACES  # --arrivals: sched/data's arrival times (Azure, 2023)
TRACE = [None]  # the arrival times replayed, when --arrivals names a trace
PART = [None]  # (K, N) or (K, N, L) with --window-part: only that stretch (or K..L) of each window


trace_path = loadgen.trace_path


def run_load(url, rate, n, seed, prompt, max_tokens, part=None):
    return asyncio.run(loadgen.run(url, rate, n, seed, prompt, max_tokens, model=MODEL_NAME[0],
                                   trace=TRACE[0], part=part))


def settle(url, prompt, max_tokens, gap_s):
    """Two unrecorded requests with idle after each, so a gate has seen a request end."""
    for _ in range(2):
        run_load(url, 1000.0, 1, 0, prompt, max_tokens)
        time.sleep(gap_s)


def measure(a, valve, url, prompt, offline_proc, rate, config, seed, n):
    """One round of one configuration at one rate (n requests): returns records and, under a gate,
    its status and trace."""
    out = {"config": config, "rate": rate}
    frozen = config == "alone-offline-frozen"
    offline_stopped = (config.startswith("alone") and not frozen) or config == "gate-offline-stopped"
    if offline_stopped:
        os.kill(offline_proc.p.pid, signal.SIGSTOP)
        time.sleep(1.0)  # what it had queued on the GPU drains
    if frozen:
        valve.freeze(offline_proc.p.pid)
    try:
        if config.startswith("gate"):
            valve.gate_start(a.port, arrivals=config in ARRIVAL_CONFIGS,
                             waits=config != "gate-old", realtime=config != "gate-arrival-normal",
                             busy_poll=config == "gate-arrival-spin", fixed_cooldown=a.gate_fixed_cooldown,
                             hold_budget=hold_budget_for(a, config))
            settle(url, prompt, a.max_tokens, 0.3)
            before = valve.gate_status()
            out["hold_gaps_at_start"] = before.get("hold_gaps")
            out["hold_us_at_start"] = before.get("hold_us")
        recs = run_load(url, rate, n, seed, prompt, a.max_tokens, part=PART[0])
        out["records"] = recs
        if config.startswith("gate"):
            st = valve.gate_status()
            out["gate_status"] = st
            out["preemptions"] = st["preemptions"] - before["preemptions"]
            # The gate's own count of the window's idle arrivals and those the hold caught
            # (daemons before arrivals_idle: None), to set beside what this run measured.
            for k in ("arrivals_idle", "arrivals_held"):
                out[k] = st[k] - before[k] if k in st and k in before else None
            out["probe_hits"] = probe_hits_between(before, st)
            lo = min(r["send_ns"] for r in recs) - 2_000_000
            out["trace"] = trace_from(valve.gate_trace(), lo)
            out["online_pids"] = st.get("online_pids", [])
            valve.gate_stop()
    finally:
        if offline_stopped:
            os.kill(offline_proc.p.pid, signal.SIGCONT)
        if frozen:
            valve.thaw(offline_proc.p.pid)
    return out


def probe_hits_between(before, after):
    """The online calls the gate's probes caught between two gate statuses (None from a daemon that
    does not count them)."""
    a, b = before.get("online_probe_hits"), after.get("online_probe_hits")
    if not a or not b:
        return None
    return {k: b[k] - a[k] for k in ("kernel_launches", "graph_launches", "syncs")}


def probe_hits_per_token(group):
    """Probed online calls per generated token over a configuration's rounds (None: not counted)."""
    counted = [r for r in group if r.get("probe_hits")]
    tokens = sum(x.get("tokens") or 0 for r in counted for x in r["records"])
    if not counted or not tokens:
        return None
    return {k: sum(r["probe_hits"][k] for r in counted) / tokens
            for k in ("kernel_launches", "graph_launches", "syncs")}


class Terminated(Exception):
    """SIGTERM (a `timeout` around the benchmark): stop measuring and report what is done."""


def on_sigterm(_sig, _frame):
    # Once: a second TERM (the script passes one on, `timeout` signals the group) must not cut
    # the report short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def round_orders(configs, rounds):
    """The order of the configurations in each round: forward, then backward, and so on, so that a
    slow drift of the host (seen as 30-60% between the first and last run of the same
    configuration) weighs on every configuration alike instead of on whichever ran first."""
    return [list(configs) if i % 2 == 0 else list(reversed(configs)) for i in range(rounds)]


def requests_per_round(a, rate, n_configs):
    """A configuration's requests at one load (--requests at most, --min-requests at least, about
    --run-s of arrivals), split over the rounds, and capped so that every run fits --budget-s."""
    total = max(a.min_requests, min(a.requests, round(rate * a.run_s)))
    n = math.ceil(total / a.rounds)
    cap = max(3, int(rate * a.budget_s / max(1, len(a.loads) * n_configs * a.rounds)))
    if PART[0] and (n > cap or total != round(rate * a.run_s)):
        raise SystemExit("bench.py: --window-part needs the whole window's requests: raise --requests and "
                         "--budget-s (a capped window is another window, and its stretches would not line up)")
    if n > cap:
        log(f"   only {cap} requests per round: more would not fit the time budget (--budget-s)")
    return min(n, cap)


def service_time(url, prompt, max_tokens, n=5):
    """Mean send -> end of sequential requests on an otherwise idle server (s)."""
    ts = []
    for i in range(n):
        r = run_load(url, 1000.0, 1, i, prompt, max_tokens)[0]
        ts.append((r["end_ns"] - r["send_ns"]) / 1e9)
        time.sleep(0.05)
    return sum(ts[1:]) / (n - 1)


def summarize(a, runs, rate_alone, device):
    """Per load: one row per configuration, its rounds pooled, and the target checks of the gates."""
    result = {"device": device, "server": a.server, "loads": []}
    if getattr(a, "stamp_first_kernel", None):
        result["stamp_mapping"] = getattr(a, "stamp_mapping", None) or stamp.mapping_check(None, None)
    for load in a.loads:
        if not any(r["load"] == load for r in runs):
            continue
        rows, tails, late = {}, {}, {}
        for cfg in dict.fromkeys(r["config"] for r in runs if r["load"] == load):
            group = [r for r in runs if r["load"] == load and r["config"] == cfg]
            rows[cfg] = config_stats(group, rate_alone, stamped=bool(getattr(a, "stamp_first_kernel", None)))
            for run in group:
                run["stats"] = rows[cfg]
        alone = rows.get("alone")
        entry = {"load": load, "rate_per_s": next(r["rate"] for r in runs if r["load"] == load),
                 "rows": rows, "checks": {}, "tails": tails, "late_arrivals": late}
        for cfg in ("gate-old", "gate-launch", "gate-arrival", "gate-arrival-normal", "gate-arrival-spin", "gate-hold"):
            if alone and cfg in rows:
                g = rows[cfg]
                entry["checks"][cfg] = analysis.check_targets(
                    alone, g, g.get("per_request", []),
                    g["preemptions_per_request"] * g["requests"]
                    if g["preemptions_per_request"] is not None else None,
                    g["harvested"],
                )
                thr = (alone["ttft_p99_ms"] or 0) * 1.2
                tails[cfg] = [t for r in runs if r["load"] == load and r["config"] == cfg
                              for t in analysis.tails(r["records"], r["trace"], thr)]
                late[cfg] = [x for r in runs if r["load"] == load and r["config"] == cfg and "trace" in r
                             for x in analysis.late_arrivals(r["records"], r["trace"],
                                                             set(r.get("online_pids") or []) or None)]
        keyed = {}
        for r in runs:
            if r["load"] == load:
                keyed.setdefault(r["config"], {}).update({(r["round"], x["i"]): x for x in r["records"]})
        if "alone" in keyed:
            entry["intervals"] = {cfg: analysis.change_intervals(keyed["alone"], recs)
                                  for cfg, recs in keyed.items() if cfg != "alone"}
        if alone and "alone-2" in rows:
            again = rows["alone-2"]
            entry["noise_pct"] = {m: analysis.pct_change(again[m], alone[m])
                                  for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")}
        result["loads"].append(entry)
    return result


def config_stats(group, rate_alone, stamped=False):
    """The numbers of one configuration at one load from its rounds: latency percentiles over every
    request of every round, offline's share summed over the rounds' windows, the gate's per-request
    reaction from each round's own trace, and (stamped) arrival -> first kernel running per idle
    arrival from the server's stamps."""
    recs = [x for r in group for x in r["records"]]
    s = analysis.request_stats(recs)
    if stamped:
        s.update(analysis.gpu_start_stats(recs))
    s.update(analysis.host_path_stats(recs))  # nothing for a server without recv_ns / launch_ns
    s.update(analysis.harvest_runs([(r["records"], r["progress"]) for r in group], rate_alone))
    s["busy_share"] = analysis.busy_share_runs([r["records"] for r in group])
    s["rounds"] = len(group)
    gated = [r for r in group if "preemptions" in r]
    s["preemptions_per_request"] = (sum(r["preemptions"] for r in gated) / len(recs)
                                    if gated and recs else None)
    s["probe_hits_per_token"] = probe_hits_per_token(group)
    if not any("trace" in r for r in group):
        return s
    per = [x for r in group if "trace" in r
           for x in analysis.per_request(r["records"], r["trace"], set(r["online_pids"]) or None)]
    s["per_request"] = per
    split = [x for r in group if "trace" in r for x in analysis.disable_split_rows(r["records"], r["trace"])]
    if split:
        s["disable_split"] = analysis.disable_split_stats(split)
    s["decode"] = analysis.decode_summary([(r["records"], r["trace"]) for r in group if "trace" in r])
    judged = [x for x in per if x["arrival_to_kernel_ms"] is not None]
    s["stopped_first_share"] = sum(x["stopped_first"] for x in judged) / len(judged) if judged else None
    # The first kernel is known exactly only where offline ran at the arrival (the gate's resume
    # armed the launch probe); where it was still stopped, the first edge can be late.
    timed = {"stopped": per, "kernel": [x for x in per if not x.get("already_stopped")]}
    for what in ("stopped", "kernel"):
        for p in (50, 99):
            s[f"arrival_to_{what}_p{p}_ms"] = analysis.percentile([x[f"arrival_to_{what}_ms"] for x in timed[what]], p)
    for hop in ("arrival_to_gate_ms", "arrival_to_watcher_ms"):
        hops = [x[hop] for x in per if x.get(hop) is not None]
        s[hop] = {f"p{p}": analysis.percentile(hops, p) for p in (50, 99, 100)}
    last = group[-1]["gate_status"]
    s["gate"] = {k: last.get(k) for k in (
        "issue", "scheduling", "cooldown_us", "arrival_hold_us", "arrival_to_disable_us",
        "edge_to_disable_us", "disable_us", "errors", "last_error")}
    return s


def fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def interval_text(iv):
    """A (low, high) change in %, or n/a."""
    return "n/a" if not iv or None in iv else f"{iv[0]:+.1f}% .. {iv[1]:+.1f}%"


GPU_START_TARGETS_MS = (0.300, 0.600)  # arrival -> first kernel running, p50 and p99 (the targets)


def gpu_start_cell(s, mapping):
    """The report table's arrival -> GPU start cell; (!) where the clock mapping is flagged."""
    cell = f"{fmt(s.get('arrival_to_gpu_start_p50_ms'), '.3f')} / {fmt(s.get('arrival_to_gpu_start_p99_ms'), '.3f')}"
    return cell + (" (!)" if mapping["flagged"] else "")


def fmt_us(v):
    """ns as us with one decimal (a sign where negative), or n/a."""
    return "n/a" if v is None else f"{v / 1e3:+.1f}" if v < 0 else f"{v / 1e3:.1f}"


def mapping_text(mapping):
    """The GPU clock mapping in words: its bound, its drift and whether the stamps were corrected for it."""
    text = f"Mapping error bound {fmt_us(mapping['bound_ns'])} us, offset drift over the run {fmt_us(mapping['drift_ns'])} us"
    if mapping.get("corrected"):
        text += (f" ({mapping['drift_ppm']:+.2f} ppm), corrected: each stamp mapped by the offset "
                 "interpolated linearly between the calibrations before and after the runs")
    if mapping["flagged"]:
        text += f"; (!) FLAGGED: {mapping['why']} (limit {mapping['limit_ns'] / 1e3:.0f} us)"
    return text


def gpu_start_lines(rows, mapping):
    """Under the table: the GPU clock's mapping, then per configuration the stamps' counts and the target."""
    lines = ["", "Arrival -> first kernel running on the GPU (the server's %globaltimer stamp mapped to CLOCK_MONOTONIC), "
                 f"idle arrivals. {mapping_text(mapping)}:", ""]
    p50_max, p99_max = GPU_START_TARGETS_MS
    for cfg, s in rows.items():
        p50, p99 = s.get("arrival_to_gpu_start_p50_ms"), s.get("arrival_to_gpu_start_p99_ms")
        ok = p50 is not None and p99 is not None and p50 <= p50_max and p99 <= p99_max
        lines.append(f"- {CONFIG_NAMES[cfg]}: {s.get('gpu_start_idle_arrivals', 0)} idle arrivals, "
                     f"{s.get('gpu_start_unknown', 0)} without a stamp, {s.get('gpu_start_before_arrival', 0)} "
                     f"stamped before the arrival; [{'PASS' if ok else 'FAIL'}] p50 <= {p50_max:.3f} ms and "
                     f"p99 <= {p99_max:.3f} ms: {fmt(p50, '.3f')} / {fmt(p99, '.3f')}")
    return lines


HOST_PATH_COLUMNS = (("send_to_recv", "send -> server got it"), ("recv_to_launch", "got it -> host launch"),
                     ("launch_to_gpu_start", "host launch -> GPU start"))


def host_path_lines(rows):
    """A table of where each configuration's idle arrivals spent the time before their first kernel,
    with the columns some row has data for; nothing where none has (servers without the marks)."""
    cols = [(k, t) for k, t in HOST_PATH_COLUMNS if any(f"{k}_p50_ms" in s for s in rows.values())]
    if not cols:
        return []
    lines = ["", "Where the time went before the first kernel, idle arrivals (ms, p50 / p99; the server's "
             "recv_ns and launch_ns marks, and its first-kernel stamp where on):", "",
             "| configuration | " + " | ".join(t for _, t in cols) + " |", "|---|" + "---|" * len(cols)]
    for cfg, s in rows.items():
        lines.append(f"| {CONFIG_NAMES[cfg]} | " + " | ".join(
            f"{fmt(s.get(f'{k}_p50_ms'), '.3f')} / {fmt(s.get(f'{k}_p99_ms'), '.3f')}" for k, _ in cols) + " |")
    return lines


def disable_split_lines(rows):
    """Per gated configuration, its idle arrivals' host launch -> GPU start by when the server launched
    after the disable's issue (the serving side of the floor experiment's table (g)); nothing where no
    configuration has both the gate's trace and the server's marks."""
    gated = {cfg: s["disable_split"] for cfg, s in rows.items() if s.get("disable_split")}
    if not gated:
        return []
    lines = ["", "Host launch -> GPU start (us, p50 / p99) of idle arrivals, by how long after the gate's disable "
             "was issued the server launched (negative: before it); the floor experiment's table (g) found a "
             "launch late in the disable waiting:", "",
             "| configuration | launch after issue (us) | idle arrivals | launch -> GPU start p50 / p99 |", "|---|---|---|---|"]
    for cfg, buckets in gated.items():
        for b in buckets:
            lines.append(f"| {CONFIG_NAMES[cfg]} | {b['bucket_us']} | {b['n']} | {fmt(b['p50_us'], '.0f')} / "
                         f"{fmt(b['p99_us'], '.0f')} |")
    return lines


def report_md(res, meta):
    mapping = res.get("stamp_mapping")
    lines = [f"# Serving benchmark: {res['server']} on {res['device']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    for e in res["loads"]:
        lines += ["", f"## Load {e['load']:.0%} busy target ({e['rate_per_s']:.2f} requests/s)", "",
                  "| configuration | busy | TTFT p50 / p99 / max (ms) | TPOT p50 / p99 (ms) | preemptions/request | offline vs alone | idle harvested | arrival -> offline stopped p50/p99 (ms) | arrival -> first kernel p50/p99 (ms) | stopped first |"
                  + (" arrival -> first kernel running (GPU) p50/p99 (ms) |" if mapping else ""),
                  "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if mapping else "")]
        for cfg, s in e["rows"].items():
            lines.append(
                f"| {CONFIG_NAMES[cfg]} | {fmt(s['busy_share'], '.0%')} | {fmt(s['ttft_p50_ms'])} / {fmt(s['ttft_p99_ms'])} / {fmt(s['ttft_max_ms'])} "
                f"| {fmt(s['tpot_p50_ms'])} / {fmt(s['tpot_p99_ms'])} | {fmt(s['preemptions_per_request'])} "
                f"| {fmt(s['offline_vs_alone'], '.0%')} | {fmt(s['harvested'], '.0%')} "
                f"| {fmt(s.get('arrival_to_stopped_p50_ms'))} / {fmt(s.get('arrival_to_stopped_p99_ms'))} "
                f"| {fmt(s.get('arrival_to_kernel_p50_ms'))} / {fmt(s.get('arrival_to_kernel_p99_ms'))} "
                f"| {fmt(s.get('stopped_first_share'), '.0%')} |"
                + (f" {gpu_start_cell(s, mapping)} |" if mapping else ""))
        if mapping:
            lines += gpu_start_lines(e["rows"], mapping)
        lines += host_path_lines(e["rows"])
        lines += disable_split_lines(e["rows"])
        decode = [(cfg, s["decode"]) for cfg, s in e["rows"].items() if s.get("decode")]
        if decode:
            lines += ["", "Offline running inside a request's decode (first token to end; 0 if the gate held it):", ""]
            lines += [f"- {CONFIG_NAMES[cfg]}: {d['with_offline_running']} of {d['requests']} requests, "
                      f"{d['offline_ran_sum_ms']:.1f} ms in all, at most {fmt(d['offline_ran_max_ms'])} ms; "
                      f"{d['edges_after_resume']} launch edges reported only because they followed a resume"
                      for cfg, d in decode]
        probed = [(cfg, s["probe_hits_per_token"]) for cfg, s in e["rows"].items() if s.get("probe_hits_per_token")]
        if probed:
            lines += ["", "Online calls caught by the gate's probes, per generated token (each a trap of about 1-2 us; a synchronising call traps twice):", ""]
            lines += [f"- {CONFIG_NAMES[cfg]}: {h['kernel_launches']:.1f} kernel launches, {h['graph_launches']:.2f} graph launches, "
                      f"{h['syncs']:.2f} synchronising calls" for cfg, h in probed]
        hops = [(cfg, s["arrival_to_gate_ms"]) for cfg, s in e["rows"].items()
                if (s.get("arrival_to_gate_ms") or {}).get("p50") is not None]
        if hops:
            lines += ["", "Arrival seen (BPF) -> the gate thread has it, idle arrivals (ms, p50 / p99 / max):", ""]
            lines += [f"- {CONFIG_NAMES[cfg]}: {fmt(h['p50'], '.3f')} / {fmt(h['p99'], '.3f')} / {fmt(h['p100'], '.3f')}"
                      + (f" (of which BPF -> watcher thread {fmt(w['p50'], '.3f')} / {fmt(w['p99'], '.3f')} / {fmt(w['p100'], '.3f')})"
                         if (w := e["rows"][cfg].get("arrival_to_watcher_ms") or {}).get("p50") is not None else "")
                      + (f"; threads {sched}" if (sched := (e["rows"][cfg].get("gate") or {}).get("scheduling")) else "")
                      for cfg, h in hops]
        if e.get("noise_pct"):
            n = e["noise_pct"]
            lines += ["", f"Noise floor: online alone measured as a second configuration, in its own rounds, differs from the first by "
                      f"{fmt(n['ttft_p50_ms'], '+.1f')}% in TTFT p50, {fmt(n['ttft_p99_ms'], '+.1f')}% in TTFT p99 "
                      f"and {fmt(n['tpot_p99_ms'], '+.1f')}% in TPOT p99: read each target against that."]
        if e.get("intervals"):
            lines += ["", "Change against alone, 90% paired bootstrap interval (requests paired by round and index, "
                      "as every configuration replays the same arrivals). It counts the sampling of requests only: "
                      "where alone-2's interval misses 0, the configurations drifted apart by more than that, and "
                      "no interval of this run settles a target.", "",
                      "| configuration | TTFT p50 | TTFT p99 | TPOT p99 |", "|---|---|---|---|"]
            lines += [f"| {CONFIG_NAMES[cfg]} | " + " | ".join(interval_text(iv.get(m)) for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")) + " |"
                      for cfg, iv in e["intervals"].items()]
        for cfg, checks in e["checks"].items():
            lines += ["", f"Targets, {CONFIG_NAMES[cfg]}:", ""]
            lines += [f"- [{'PASS' if ok else 'FAIL'}] {name}: {val}" for name, val, ok in checks]
        for cfg, ts in e["tails"].items():
            if ts:
                lines += ["", f"Slow first tokens under {CONFIG_NAMES[cfg]} (TTFT > 1.2 x alone p99), with the gate's decisions from 1 ms before the send:", ""]
                resumed = sum(t["resumed_inside"] for t in ts)
                lines.append(f"{len(ts)} slow, {resumed} of them with offline resumed while they waited for the first token.")
                lines.append("")
                for t in ts:
                    lines.append(f"- TTFT {t['ttft_ms']:.1f} ms, {t['in_flight_at_send']} in flight at send: " + "; ".join(t["decisions"]))
        for cfg, ls in (e.get("late_arrivals") or {}).items():
            if ls:
                lines += ["", f"Idle arrivals under {CONFIG_NAMES[cfg]} that offline was not stopped before, or that took over "
                          "0.5 ms to reach the gate thread, with the gate's decisions from 5 ms before the send:", ""]
                for x in ls:
                    lines.append(f"- {'stopped first' if x['stopped_first'] else 'MISSED'}, hop to the gate "
                                 f"{fmt(x['arrival_to_gate_ms'], '.2f')} ms: " + "; ".join(x["decisions"]))
    return "\n".join(lines) + "\n"


def check_peer_args(a, ap, configs):
    """The peer the configurations need (None: none), with the options it and the hold history need."""
    asked = [c for c in configs if c in peers.PEERS]
    if len(asked) > 1:
        ap.error(f"{' and '.join(asked)}: one peer per invocation (each starts the server and training under it)")
    if a.hold_history:
        if not a.port:
            ap.error("--hold-history needs --port: the history is kept by the gate's port")
        why = check_hold_history(a.hold_history, a.port)
        if why:
            ap.error(why)
    if a.nominal_service_s is not None and a.nominal_service_s <= 0:
        ap.error("--nominal-service-s must be above 0 (seconds per request alone)")
    if not 0 <= a.port < 65536:
        ap.error("--port must be 1-65535 (or 0: a free one)")
    peer = asked[0] if asked else None
    if peer == "mps":
        a.mps_dir = a.mps_dir or peers.own_mps_dir()
    if peer == "xsched" and not a.xsched_dir:
        ap.error("xsched needs --xsched-dir: XSched's install dir (hwtests/serving/xsched_build.sh makes it)")
    return peer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="serving-"))
    ap.add_argument("--server", choices=["serve", "cb", *GRAPH_SERVERS], default="serve")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-size", default="3b")
    ap.add_argument("--offline-size", default="1b")
    ap.add_argument("--valvectl", default="valvectl")
    ap.add_argument("--loads", default="0.3,0.7")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated, run in this order each round: " + ", ".join(CONFIG_NAMES))
    ap.add_argument("--requests", type=int, default=80, help="most requests per configuration and load")
    ap.add_argument("--min-requests", type=int, default=25, help="fewest requests per configuration and load")
    ap.add_argument("--run-s", type=float, default=40, help="aim for this many seconds of arrivals per configuration and load")
    ap.add_argument("--gate-fixed-cooldown", metavar="DURATION",
                    help="every gate configuration keeps offline frozen this long after online's last launch "
                         "(`gate start --fixed-cooldown`, e.g. 200ms) instead of learning it: a trade "
                         "of harvest for idle arrivals that find offline already off the GPU")
    ap.add_argument("--gate-hold-budget", type=float, metavar="PCT",
                    help="every gate configuration holds offline frozen past the cooldown for arrivals likely "
                         "soon, giving up at most this share of online's idle time (`gate start --hold-budget`)")
    ap.add_argument("--arrivals", choices=["poisson", *TRACE_ARRIVALS], default="poisson",
                    help="request arrival times: Poisson (default), or replayed from Azure's 2023 LLM inference "
                         "traces at the same mean rate: azure-code (bursty), azure-conv (nearly Poisson); each "
                         "round replays its own stretch of the trace, every configuration the same ones")
    ap.add_argument("--arrival-seed", type=int, default=0, metavar="N",
                    help="with --arrivals from a trace: round r at load L replays the window starting after "
                         "arrival N + 100 L + 1000 r (default N 0). trace_windows.py says how many requests "
                         "each window has that find the server idle, and which N gives the median window")
    ap.add_argument("--window-part", default="", metavar="K/N",
                    help="replay only the K-th (from 0) of N equal stretches of the --run-s window (K-L/N: "
                         "stretches K to L as one), timed from "
                         "its start: a window too long for one call, a stretch a call (needs --arrivals from a "
                         "trace and --rounds 1; --requests and --budget-s must not cap the window)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="split each configuration's requests into this many rounds, the configurations "
                         "taking turns (forward, then backward): host drift then weighs on all alike")
    ap.add_argument("--deadline-s", type=float, default=420,
                    help="start no run after this many seconds (the report covers the runs done)")
    ap.add_argument("--budget-s", type=float, default=240,
                    help="seconds for all measured runs together (the command must end in 8 min)")
    ap.add_argument("--prompt-tokens", type=int, default=512,
                    help="prompt length (about, in the model's tokens; graph-raw: the prefill graph's fixed length)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-memory", type=float, default=0.2, help="KV cache share of GPU memory")
    ap.add_argument("--cb-attention", choices=["sdpa", "varlen"], default="varlen",
                    help="cb server: paged|sdpa, or PyTorch's varlen flash kernel (the memory benchmark's)")
    ap.add_argument("--cb-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="cb server: replay CUDA graphs, as production servers do (without them a decode "
                         "step is bound by the host's Python, and two alone runs differ by 8-16%% in TTFT p50)")
    ap.add_argument("--start-timeout", type=float, default=240)
    ap.add_argument("--alone-s", type=float, default=5.0, help="seconds to measure offline alone")
    ap.add_argument("--port", type=int, default=0,
                    help="the online server's port (default: a free one); the hold history's key names it")
    ap.add_argument("--nominal-service-s", type=float, metavar="S",
                    help="take each load's rate from this service time instead of the one measured, so that "
                         "the replayed windows are known before the run (hold_seed.py --service-s)")
    ap.add_argument("--hold-history", metavar="FILE",
                    help="gate-hold-history.json (hold_seed.py) put in the daemon's state directory before the "
                         "daemon starts: the hold starts from it; needs --port")
    ap.add_argument("--mps-dir", default=None, help="mps: the MPS daemon's pipe/log directories go under this")
    ap.add_argument("--xsched-dir", default=None, help="xsched: XSched's install dir (bin/xserver, lib/libshimcuda.so)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--check-args", action="store_true",
                    help="check the options (the hold history's key, the peer's needs), print the plan, start nothing")
    ap.add_argument("--keep-model", help="reuse/keep the model dir here")
    ap.add_argument("--stamp-first-kernel", metavar="PTX",
                    help="graph and graph-raw servers: report arrival -> first kernel running on the GPU per idle arrival "
                         "(stamp.ptx from hwtests/cuda/build.sh OUTDIR)")
    a = ap.parse_args(argv)
    a.stamp_first_kernel = stamp_choice(a, ap)
    if a.gate_hold_budget is not None and not 0 < a.gate_hold_budget <= 50:
        ap.error("--gate-hold-budget must be more than 0 and at most 50 (percent of online's idle time)")
    if a.arrival_seed < 0:
        ap.error("--arrival-seed must be 0 or more (it picks where in the trace the replayed windows start)")
    if a.arrival_seed and a.arrivals == "poisson":
        ap.error("--arrival-seed picks a trace's window: give --arrivals azure-code or azure-conv too")
    if a.gate_hold_budget is not None and a.gate_fixed_cooldown:
        ap.error("--gate-hold-budget adds to the learned cooldown, which --gate-fixed-cooldown replaces: drop one")
    TRACE[0] = loadgen.load_trace(trace_path(a.arrivals)) if a.arrivals != "poisson" else None
    try:
        PART[0] = loadgen.parse_part(a.window_part)
    except ValueError as e:
        ap.error(f"--window-part: {e}")
    if PART[0] and (a.arrivals == "poisson" or a.rounds != 1):
        ap.error("--window-part replays a stretch of one trace window: give --arrivals azure-code or "
                 "azure-conv and --rounds 1")
    a.loads = [float(x) for x in a.loads.split(",")]
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIG_NAMES]
    if unknown:
        ap.error(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(CONFIG_NAMES)}")
    peer = check_peer_args(a, ap, configs)
    if a.check_args:
        log(f"== options checked: configurations {','.join(configs)}, peer {peer or 'none'}, loads {a.loads}, "
            f"hold history {a.hold_history or 'none'}")
        return 0
    if a.dry_run:
        configs = [c for c in configs if not c.startswith("gate") and c != "alone-offline-frozen"
                   and c not in peers.PEERS]
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="valve-serving-")
    t_start = time.time()
    device = device_name(a.dry_run)
    log(f"== device: {device}; server: {a.server}; out: {a.out}")
    procs, valve, peer_env = [], None, None
    try:
        model_dir = None
        if a.server not in GRAPH_SERVERS:
            model_dir = a.keep_model or os.path.join(work, "model")
            if not os.path.exists(os.path.join(model_dir, "config.json")):
                log(f"== building the random-weight model ({a.model_size}) and its tokenizer")
                import make_model

                info = make_model.build(model_dir, a.model_size, 0, device=a.device)
                log(f"   {info}")
        valve = Valve(a.valvectl, work, a.out, a.dry_run, a.hold_history)
        a.port = a.port or free_port()
        progress = os.path.join(work, "offline.progress")
        env = offline_env(a)
        if peer and not a.dry_run:
            peer_env = peers.make(peer, a, a.out, free_port())
            log(f"== starting the peer: {CONFIG_NAMES[peer]}")
            peer_env.start()
            env = peer_env.offline_env(env)
        off = Proc("offline", [sys.executable, os.path.join(HERE, "training.py"), "--progress", progress,
                               "--size", a.offline_size, "--device", a.device], a.out, env=env)
        procs.append(off)
        off.wait_line("READY", 300)
        senv = {k: v for k, v in os.environ.items() if k != "VALVE_LABEL"}
        senv.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if peer_env:
            senv = peer_env.online_env(senv)
        log("== starting the online server")
        srv = start_server(a, model_dir, a.port, a.out, senv)
        procs.append(srv)
        url = server_url(a, a.port)
        prompt = prompt_text(model_dir, a.prompt_tokens)
        MODEL_NAME[0] = model_dir or a.model_size
        for _ in range(3):  # warm-up
            w = run_load(url, 1000.0, 1, 0, prompt, a.max_tokens)[0]
        if w["error"] or w["tokens"] != a.max_tokens:
            raise RuntimeError(f"warm-up request failed: {w} (see server.log)")
        # Then batches of 2-4 at once: the first measured run (alone) waited about 1 s for the
        # first token of its first overlapping requests on the H100, which later runs did not.
        for n in (2, 4, 4):
            run_load(url, 1000.0, n, n, prompt, a.max_tokens)
        rate_alone = offline_rate(progress, a.alone_s)
        log(f"== offline alone: {fmt(rate_alone)} iterations/s")
        os.kill(off.p.pid, signal.SIGSTOP)
        time.sleep(1.0)
        s = service_time(url, prompt, a.max_tokens)
        os.kill(off.p.pid, signal.SIGCONT)
        log(f"== service time alone: {s * 1e3:.1f} ms per request")
        # Offline runs from before the server starts, so the server's own mapping at start may be
        # stretched by it: map again now and after the last run, offline stopped both times.
        cal_start = calibrate_idle(url, off.p.pid, "before the first run") if a.stamp_first_kernel else None
        runs, run_s, stopped = [], [], False
        signal.signal(signal.SIGTERM, on_sigterm)
        for load in a.loads:
            if stopped:
                break
            rate = loadgen.rate_at(load, a.nominal_service_s or s)
            # An unrecorded run at this load first: the first measured run was slower than the same
            # configuration run again last, whatever it was (alone TPOT p99 105 ms, again 47 ms).
            log(f"== load {load:.0%} ({rate:.2f}/s): warm-up run, not recorded")
            run_load(url, rate, 10, 999, prompt, a.max_tokens)
            n = requests_per_round(a, rate, len(configs))
            for rnd, order in enumerate(round_orders(configs, a.rounds)):
                if stopped:
                    break
                for cfg in order:
                    if not analysis.fits_deadline(time.time() - t_start, run_s, a.deadline_s):
                        log(f"== SKIPPED load {load:.0%} round {rnd + 1} {CONFIG_NAMES[cfg]}: it would end past --deadline-s")
                        continue
                    log(f"== load {load:.0%} ({rate:.2f}/s) round {rnd + 1}/{a.rounds}: {CONFIG_NAMES[cfg]}, {n} requests")
                    t_run = time.time()
                    try:
                        r = measure(a, valve, url, prompt, off, rate, cfg, a.arrival_seed + int(load * 100) + 1000 * rnd, n)
                    except Terminated:
                        log("== SIGTERM: reporting the runs done so far")
                        stopped = True
                        break
                    run_s.append(time.time() - t_run)
                    r.update(load=load, round=rnd, progress=read_progress(progress))
                    runs.append(r)
                    st = analysis.request_stats(r["records"])
                    log(f"   TTFT p50/p99 {fmt(st['ttft_p50_ms'])}/{fmt(st['ttft_p99_ms'])} ms, "
                        f"TPOT p50/p99 {fmt(st['tpot_p50_ms'])}/{fmt(st['tpot_p99_ms'])} ms, errors {st['errors']}")
                    hp = analysis.host_path_stats(r["records"])
                    if hp:
                        log("   idle arrivals p50/p99 (ms): " + ", ".join(
                            f"{t} {fmt(hp[f'{k}_p50_ms'], '.3f')}/{fmt(hp[f'{k}_p99_ms'], '.3f')}"
                            for k, t in HOST_PATH_COLUMNS if f"{k}_p50_ms" in hp))
                    if a.stamp_first_kernel:
                        g = analysis.gpu_start_stats(r["records"])
                        log(f"   arrival -> first kernel running p50/p99 {fmt(g['arrival_to_gpu_start_p50_ms'], '.3f')}/"
                            f"{fmt(g['arrival_to_gpu_start_p99_ms'], '.3f')} ms over {g['gpu_start_idle_arrivals']} idle "
                            f"arrivals, {g['gpu_start_unknown']} without a stamp (by the start offset; the report "
                            "corrects for the clock's drift)")
        # Offline alone again, online idle: one 5-s reading read 15.3 it/s on one H200 and 18.0 on
        # another, so a harvest against one reading says as much about the reading as the gate.
        rate_start = rate_alone
        if not stopped:
            try:
                rate_end = offline_rate(progress, a.alone_s)
            except Terminated:
                rate_end = None
            rate_alone, moved = analysis.bracket_alone(rate_start, rate_end)
            log(f"== offline alone after the runs: {fmt(rate_end)} iterations/s; the harvest's reference is "
                f"{fmt(rate_alone)} (moved {fmt(None if moved is None else 100 * moved)}% between the two)")
        else:
            rate_end = moved = None
        if a.stamp_first_kernel:
            try:
                cal_end = calibrate_idle(url, off.p.pid, "after the last run")
            except Terminated:  # the report of the runs done matters more
                cal_end = None
            a.stamp_mapping = stamp.mapping_check(cal_start, cal_end)
            # The server mapped every stamp by the offset it had at the start; the GPU clock drifts
            # (9.6 ppm on the H200): map each again, interpolated between the two calibrations.
            n = sum(stamp.remap_records(r["records"], cal_start, cal_end) for r in runs)
            m = a.stamp_mapping
            log(f"== stamps mapped again: {n}; offset drift {fmt_us(m['drift_ns'])} us"
                + (f" ({m['drift_ppm']:+.2f} ppm), corrected linearly" if m["corrected"] else ", not corrected"))
        res = summarize(a, runs, rate_alone, device)
        meta = {
            "requests per configuration (rounds)": ", ".join(
                f"{cfg}@{e['load']:.0%}: {st['requests']} ({st['rounds']})" for e in res["loads"]
                for cfg, st in e["rows"].items()),
            "prompt tokens (about)": a.prompt_tokens,
            "tokens per request": a.max_tokens,
            "cb server": (f"attention {a.cb_attention}, CUDA graphs {'asked for (transformers drops them without CUDA)' if a.cb_cuda_graphs else 'off'}"
                          if a.server == "cb" else "not used"),
            "offline": f"training.py --size {a.offline_size} (PyTorch Llama training, AdamW), {fmt(rate_alone)} it/s alone"
                       + (f" (mean of {fmt(rate_start)} before the runs and {fmt(rate_end)} after: moved {100 * moved:.1f}%)"
                          if moved is not None else ""),
            "service time alone (s)": f"{s:.4f}" + (f" (rates from {a.nominal_service_s:g} s, --nominal-service-s)"
                                                    if a.nominal_service_s else ""),
            "peer": CONFIG_NAMES[peer] if peer else "none",
            "hold history": (f"seeded from {a.hold_history} (hold_seed.py: the trace before the window, replayed "
                             "through the gate's policy on the CPU)" if a.hold_history else "none (as the daemon had it)"),
            "gate cooldown": (f"fixed at {a.gate_fixed_cooldown}" if a.gate_fixed_cooldown else "learned (the default)")
                             + (f", hold budget {a.gate_hold_budget:g}% of idle time" if a.gate_hold_budget else ""),
            "arrivals": ("Poisson" if a.arrivals == "poisson" else
                         f"{a.arrivals} ({TRACE_ARRIVALS[a.arrivals]}, scaled to each load's rate"
                         + (f"; windows from arrival seed {a.arrival_seed}" if a.arrival_seed else "") + ")"),
            "duration (s)": f"{time.time() - t_start:.0f}",
        }
        res["meta"] = meta
        res["runs"] = [{k: v for k, v in r.items() if k not in ("progress",)} for r in runs]
        with open(os.path.join(a.out, "report.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        md = report_md(res, meta)
        with open(os.path.join(a.out, "report.md"), "w") as f:
            f.write(md)
        print(md)
        failed = [n for e in res["loads"] for c, ch in e["checks"].items() if c == "gate-arrival"
                  for n, _, ok in ch if not ok]
        planned = len(a.loads) * len(configs) * a.rounds
        log(f"== report: {a.out}/report.md; runs done: {len(runs)} of {planned}; "
            f"arrival-gate targets failed: {len(failed)}")
        return 0 if not failed and len(runs) == planned else 1
    finally:
        stop_all(procs, valve)
        if peer_env:
            peer_env.stop()
        for p in procs:
            if p.name == "offline":
                done = [x for x in p.lines if x.startswith("DONE")]
                if done:
                    log(f"== offline: {done[-1]}")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
