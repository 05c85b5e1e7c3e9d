"""The cluster scheduler's prediction check on a GPU host: does the model's predicted
offline throughput (T_alone x (idle fraction - interruptions) x memory factor, from the node's
own harvest document) match what the offline job measured next to a real online server?

    python3 hwtests/cluster/predict.py --valvectl V --scheduler S --out DIR [--offline cb,train]

One run, on one GPU, as root:
1. the daemon with its pool and the harvest profile (windows of --window seconds);
2. profiles: the continuous-batching offline job (membench/offline.py through the pool) at
   several pool caps (`valve-scheduler profile-job`), and the training job (serving/training.py)
   alone; then each job preempted every --preempt-every, and continuous batching reclaimed
   from every --reclaim-every, to measure what an interruption costs it;
3. per offline job: the online server (membench/online.py, through the pool, telling the gate
   when it is busy) replays phases of the Azure conversation trace's arrivals (sched/data) at
   --loads requests per second, each with a steady and a bursty memory pattern (bursts of long
   prompts that take memory back from offline), while the gate runs offline in online's idle
   time. At the end of each phase the daemon's document covers exactly that phase's last
   --window seconds: the prediction (`valve-scheduler predict` on that document) is compared
   with the job's own rate over the same window, in the same document.
Writes DIR/report.json and DIR/report.md (device, per phase: load, pattern, measured busy and
memory, predicted and measured throughput, error) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MEMBENCH = os.path.join(REPO, "hwtests", "membench")
sys.path.insert(0, MEMBENCH)
import common  # noqa: E402
from run import Run, daemon_cpus_prefix, python, wait_files  # noqa: E402

AZURE = os.path.join(REPO, "sched", "data", "azure-llm-2023-conv-per-second-hour0.csv")
TARGET_ERROR = 0.10


def azure_counts(path: str = AZURE) -> list[int]:
    """Requests per second of the Azure conversation trace."""
    with open(path) as f:
        return [int(r["requests"]) for r in csv.DictReader(f)]


def phase_trace(counts: list[int], start: float, seconds: float, rps: float, bursty: bool,
                seed: int, burst_every: float = 20.0, burst_size: int = 6,
                burst_prompt: tuple[int, int] = (6000, 10000)) -> list[common.OnlineRequest]:
    """One phase's requests: the trace's per-second arrival counts from a seeded offset, scaled to
    `rps` on average (stochastic rounding), spread uniformly inside each second; short prompts.
    A bursty phase adds `burst_size` long prompts at once every `burst_every` seconds."""
    rng = random.Random(seed)
    off = rng.randrange(len(counts))
    window = [counts[(off + s) % len(counts)] for s in range(int(seconds))]
    mean = sum(window) / max(len(window), 1) or 1.0
    out: list[common.OnlineRequest] = []
    for s, c in enumerate(window):
        x = c * rps / mean
        n = int(x) + (1 if rng.random() < x - int(x) else 0)
        for _ in range(n):
            out.append(common.OnlineRequest(start + s + rng.random(), rng.randint(128, 512), 48, False))
    if bursty:
        t = start + rng.uniform(2.0, burst_every / 2)
        while t < start + seconds - 5:
            for i in range(burst_size):
                out.append(common.OnlineRequest(t + 0.01 * i, rng.randint(*burst_prompt), 16, True))
            t += burst_every
    return sorted(out, key=lambda r: r.at)


def phases(loads: list[float], patterns: list[str]) -> list[tuple[float, str]]:
    """Every (load, pattern), steady before bursty at each load."""
    return [(load, p) for load in loads for p in patterns]


def trace_for(plan: list[tuple[float, str]], phase_s: float, lead_s: float, seed: int) -> list[common.OnlineRequest]:
    counts = azure_counts()
    out: list[common.OnlineRequest] = []
    for i, (load, pattern) in enumerate(plan):
        out += phase_trace(counts, lead_s + i * phase_s, phase_s, load, pattern == "bursty", seed + i)
    return out


class GpuClocks:
    """Samples the GPU's SM clock and power once a second (`nvidia-smi -lms`, read-only) with the
    time each line arrived, so that each comparison can say what clock the GPU ran at: a job
    measured alone at full power may run at a lower clock than beside an online server."""

    FIELDS = "clocks.sm,power.draw,temperature.gpu"

    def __init__(self, path: str) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        self.f = open(path, "w")
        self.f.write("unix_s,sm_mhz,power_w,temp_c\n")
        try:
            self.p = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                       "-i", str(common.GPU), "-lms", "1000"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.p = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                sm, pw, tc = (float(x) for x in line.split(","))
            except ValueError:
                continue
            t = time.time()
            self.samples.append((t, sm, pw, tc))
            self.f.write(f"{t:.3f},{sm:.0f},{pw:.1f},{tc:.0f}\n")
            self.f.flush()

    def mean(self, since: float, until: float) -> dict:
        xs = [x for x in self.samples if since <= x[0] <= until]
        if not xs:
            return {}
        return dict(sm_mhz=sum(x[1] for x in xs) / len(xs), power_w=sum(x[2] for x in xs) / len(xs))

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            self.p.wait(timeout=10)


def gpu_entry(doc: dict) -> dict:
    """This run's GPU (common.GPU) in a harvest document."""
    return next(g for g in doc["gpus"] if g["index"] == common.GPU)


def error(pred: float, meas: float) -> float | None:
    return abs(pred - meas) / meas if meas > 0 else None


class Bench:
    def __init__(self, a) -> None:
        self.a, self.r = a, Run(a)
        self.clocks = GpuClocks(os.path.join(self.r.out, "gpu-clocks.csv"))
        self.progress = os.path.join(self.r.out, "progress")
        os.makedirs(self.progress, mode=0o1777, exist_ok=True)

    def sched(self, *args: str, check: bool = True, env: dict | None = None) -> str:
        p = subprocess.run([self.a.scheduler, *args], capture_output=True, text=True, timeout=900, env=env)
        if check and p.returncode != 0:
            raise RuntimeError(f"valve-scheduler {args[0]}: exit {p.returncode}: {p.stderr.strip()[-2000:]}")
        if args[0] == "profile-job":
            print(p.stderr.strip()[-2000:], flush=True)
        return p.stdout

    def start_daemon(self) -> None:
        a = self.a
        argv = [*daemon_cpus_prefix(), a.valvectl, "daemon", "--pool", "--pool-gpus", str(common.GPU),
                "--pool-max-gib", str(a.pool_gib), "--pool-keep-free-mib", "2048", "--metrics-addr", f"127.0.0.1:{9401 + common.GPU}",
                "--node-name", "bench", "--progress-dir", self.progress,
                "--harvest-windows", f"{a.window}s,{2 * a.window}s,600s"]
        self.r.spawn("daemon", argv)
        deadline = time.monotonic() + 30
        while not (os.path.exists(common.POOL_SOCKET) and os.path.exists(common.DAEMON_SOCKET)):
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not start: see daemon.log")
            time.sleep(0.2)
        time.sleep(1.0)

    def offline_argv(self, kind: str, out: str) -> list[str]:
        a = self.a
        if kind == "cb":
            return python("offline.py", "--model", self.r.model, "--mode", "valve", "--out", out,
                          "--max-batch-tokens", str(a.offline_batch_tokens), "--max-requests", "96",
                          "--new-tokens", "128", "--prompt", *a.cb_prompt.split(","), "--attention", a.attention,
                          "--safety-margin", str(a.cb_safety_margin),
                          *(["--cuda-graphs"] if a.cb_cuda_graphs else []),
                          "--max-seconds", "3000")
        return [sys.executable, os.path.join(REPO, "hwtests", "serving", "training.py"), "--progress",
                out + ".iters", "--size", a.train_size, "--device", "cuda", "--batch", "8", "--seq", "512"]

    def profile(self, kind: str) -> str:
        a, path = self.a, os.path.join(self.r.out, f"profile-{kind}.json")
        caps = a.caps if kind == "cb" else ""
        args = ["profile-job", "--name", f"bench-{kind}", "--units", "tokens", "--valvectl", a.valvectl,
                "--gpu", str(common.GPU), "--warmup", f"{a.profile_warmup}s", "--settle", f"{a.profile_settle}s",
                "--seconds", f"{a.profile_seconds}s",
                "--alone-seconds", f"{a.profile_alone_seconds or 2 * a.profile_seconds}s", "--out", path]
        if caps:
            args += ["--caps", caps]
            if a.profile_fresh_alone:
                args += ["--fresh-alone", "true"]
        if a.preempt_every:
            args += ["--preempt-every", a.preempt_every, "--preempt-for", a.preempt_for]
        if kind == "cb" and a.reclaim_every:
            args += ["--reclaim-every", a.reclaim_every, "--reclaim-mib", str(a.reclaim_mib)]
        # The job runs exactly as it will next to online: the same environment (cuBLAS's
        # deterministic workspace included: without it training ran 20% faster alone).
        env = dict(self.r.env, VALVE_LABEL=common.OFFLINE_LABEL, CUDA_MODULE_LOADING="EAGER")
        t = time.monotonic()
        self.sched(*args, "--", *self.offline_argv(kind, os.path.join(self.r.out, f"profile-{kind}-run.json")),
                   env=env)
        print(f"profile {kind}: {time.monotonic() - t:.0f} s: {open(path).read()}", flush=True)
        common.write_json(os.path.join(self.r.out, f"profile-{kind}-clocks.json"),
                          self.clocks.mean(time.time() - (time.monotonic() - t), time.time()))
        return path

    def document_after(self, unix_ms: float, timeout: float = 30.0) -> dict:
        """The daemon's harvest document once it was made at or after `unix_ms`."""
        deadline = time.monotonic() + timeout
        while True:
            doc = json.loads(self.r.valvectl("--json", "profile"))
            if doc["generated_unix_ms"] >= unix_ms:
                return doc
            if time.monotonic() > deadline:
                raise RuntimeError("no fresh harvest document")
            time.sleep(0.5)

    def run_kind(self, kind: str, profile: str, plan: list[tuple[float, str]]) -> list[dict]:
        """Offline `kind` next to online playing every phase; one row per phase."""
        a, r = self.a, self.r
        files = {k: os.path.join(r.work, f"{kind}.{k}") for k in ("on-ready", "go")}
        for f in files.values():
            if os.path.exists(f):
                os.remove(f)
        trace = trace_for(plan, a.phase_s, a.lead_s, a.seed)
        trace_path = os.path.join(r.out, f"trace-{kind}.json")
        common.write_json(trace_path, trace)
        off_env = dict(r.env, VALVE_LABEL=common.OFFLINE_LABEL, CUDA_MODULE_LOADING="EAGER",
                       VALVE_PROGRESS_DIR=self.progress, SLURM_JOB_ID=kind)
        off = r.spawn(f"{kind}-offline", self.offline_argv(kind, os.path.join(r.out, f"{kind}-offline.json")), off_env)
        on = r.spawn(f"{kind}-online", python("online.py", "--model", r.model, "--mode", "valve", "--trace", trace_path,
                                              "--out", os.path.join(r.out, f"{kind}-online.json"), "--ready",
                                              files["on-ready"], "--go", files["go"], "--max-batch-tokens", "4096",
                                              "--attention", a.attention, "--gate-signals", "--reservation", "off",
                                              "--cuda-graphs"))
        wait_files([files["on-ready"]], [on, off], 400)
        r.valvectl("gate", "start", "--online", str(on.pid), "--offline-label", common.OFFLINE_LABEL)
        t0 = time.time()
        open(files["go"], "w").close()
        rows = []
        for i, (load, pattern) in enumerate(plan):
            end_ms = (t0 + a.lead_s + (i + 1) * a.phase_s) * 1000
            while time.time() * 1000 < end_ms - 3000:
                if off.poll() is not None:
                    raise RuntimeError(f"{kind}: the offline job exited during phase {i}: see {kind}-offline.log")
                time.sleep(0.5)
            doc = self.document_after(end_ms - 3000)
            path = os.path.join(r.out, f"harvest-{kind}-{i}.json")
            common.write_json(path, doc)
            rows.append(self.compare(kind, profile, path, doc, load, pattern))
            print(json.dumps(rows[-1]), flush=True)
        r.valvectl("gate", "stop")
        return rows

    def compare(self, kind: str, profile: str, path: str, doc: dict, load: float, pattern: str) -> dict:
        w = self.a.window
        pred = json.loads(self.sched("--json", "predict", "--profile", profile, "--harvest", path,
                                     "--gpus", str(common.GPU), "--model-window", f"{w}s"))["prediction"]
        job = next((j for j in doc.get("jobs", []) if j["job"] == kind), None)
        rate = next((x for x in (job or {}).get("rates", []) if x["window_s"] == w), None)
        gw = next(x for x in gpu_entry(doc)["windows"] if x["window_s"] == w)
        meas = rate["per_s"] if rate else 0.0
        made = doc["generated_unix_ms"] / 1000
        return dict(**{f"gpu_{k}": v for k, v in self.clocks.mean(made - w, made).items()},
                    offline=kind, load_rps=load, pattern=pattern, window_s=w, covered_s=gw["covered_s"],
                    busy=gw["busy_fraction"], memory_mean_gib=gw["offline_memory"]["mean_bytes"] / 2**30,
                    memory_p5_gib=gw["offline_memory"]["quantiles_bytes"][1] / 2**30,
                    preemptions_per_s=gw.get("preemptions", 0) / max(gw["covered_s"], 1.0),
                    reclaimed_gib_per_s=gw.get("reclaimed_bytes", 0) / 2**30 / max(gw["covered_s"], 1.0),
                    reclaim_episodes_per_s=gw.get("reclaim_episodes", 0) / max(gw["covered_s"], 1.0),
                    episode_gib=gw.get("reclaimed_bytes", 0) / 2**30 / max(gw.get("reclaim_episodes", 0), 1),
                    idle=pred["idle"], interrupted=pred.get("interrupted", 0.0), overlap=pred.get("overlap", 0.0),
                    memory_factor=pred["memory"],
                    predicted=pred["per_s"], measured=meas,
                    rate_covered_s=rate["covered_s"] if rate else 0.0, error=error(pred["per_s"], meas))


def markdown(rep: dict) -> str:
    lines = [f"# Cluster scheduler: predicted against measured offline throughput ({rep['device']})", "",
             f"Date {rep['date']}; window {rep['window_s']} s per phase; target |predicted - measured| / measured "
             f"<= {TARGET_ERROR:.0%} in every run. {common.lane_note()}".rstrip(), "",
             "| offline | load (req/s) | memory | online busy | preemptions/s | reclaimed GiB/s (GiB per episode) "
             "| offline memory mean / p5 (GiB) | (idle + held not lost - interrupted) x memory | predicted | measured | error "
             "| measured per idle second | SM MHz |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in rep["rows"]:
        err = "n/a" if x["error"] is None else f"{x['error']:.1%}"
        share = (x["idle"] + x.get("overlap", 0.0) - x["interrupted"]) * x["memory_factor"]
        per_idle = f"{x['measured'] / share:.0f}" if share > 0 else "n/a"
        lines.append(f"| {x['offline']} | {x['load_rps']} | {x['pattern']} | {x['busy']:.3f} | "
                     f"{x['preemptions_per_s']:.2f} | {x['reclaimed_gib_per_s']:.3f} ({x.get('episode_gib', 0):.1f}) | "
                     f"{x['memory_mean_gib']:.1f} / {x['memory_p5_gib']:.1f} | "
                     f"({x['idle']:.3f} + {x.get('overlap', 0.0):.3f} - {x['interrupted']:.3f}) x {x['memory_factor']:.3f} | "
                     f"{x['predicted']:.0f} | {x['measured']:.0f} | {err} | {per_idle} | {x.get('gpu_sm_mhz', 0):.0f} |")
    for kind, prof in rep.get("profiles", {}).items():
        m = prof.get("measured") or {}
        rates = m.get("uninterrupted_per_s") or [prof.get("alone_per_s", 0)]
        lines += ["", f"Profile {kind}: T_alone {prof.get('alone_per_s', 0):.0f}; uninterrupted rates "
                  f"{', '.join(f'{r:.0f}' for r in rates)}" + (
                      f" (moved {(max(rates) - min(rates)) / (sum(rates) / len(rates)):.1%} while profiled)"
                      if len(rates) > 1 and sum(rates) > 0 else "") + "."]
    worst = max((x["error"] for x in rep["rows"] if x["error"] is not None), default=None)
    lines += ["", f"Worst error {worst:.1%}: target {'met' if rep['met'] else 'MISSED'}." if worst is not None
              else "No run measured throughput: target MISSED."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--valvectl", required=True)
    ap.add_argument("--scheduler", required=True, help="the valve-scheduler binary")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default=f"/tmp/cluster-bench-gpu{common.GPU}")
    ap.add_argument("--offline", default="cb,train")
    ap.add_argument("--loads", default="0.5,1.5,3", help="online requests per second, one phase each")
    ap.add_argument("--patterns", default="steady,bursty")
    ap.add_argument("--window", type=int, default=30, help="seconds each comparison covers")
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--lead-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--pool-gib", type=int, default=12)
    ap.add_argument("--caps", default="1GiB,2GiB,4GiB,8GiB")
    ap.add_argument("--profile-warmup", type=int, default=15)
    ap.add_argument("--profile-seconds", type=int, default=15)
    ap.add_argument("--profile-settle", type=int, default=15,
                    help="profile-job --settle: longer than one offline request takes, so that a step measures the "
                         "new memory's rate, not the ramp to it (5 s read continuous batching 10%% low)")
    ap.add_argument("--profile-alone-seconds", type=int, help="profile-job --alone-seconds (default: twice --profile-seconds)")
    ap.add_argument("--profile-fresh-alone", action="store_true",
                    help="profile-job --fresh-alone: with --caps, T_alone from a second run started uncapped (the "
                         "sixth check's run D, within 1%% at 0.5 requests/s)")
    ap.add_argument("--offline-batch-tokens", type=int, default=512)
    ap.add_argument("--cb-safety-margin", type=float, default=0.0,
                    help="continuous batching's scheduler safety margin (offline.py --safety-margin; transformers' "
                         "default is 0.2): a share of the whole pool kept free. 0 uses all the job holds. At 0.2 the "
                         "fifth check's job stayed at its starting 8 GiB (the shim grows it since f2de114); the "
                         "margin did not steady the job's rate: host-bound steps moved it (--cb-cuda-graphs)")
    ap.add_argument("--cb-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="continuous batching replays CUDA graphs (offline.py --cuda-graphs). Without them each step "
                         "is bound by the host's Python (about 30 ms on an H200): the job's rate then moved 18%% "
                         "between 30-s windows alone, and a host-bound job loses less than its GPU share (cbrate.py)")
    ap.add_argument("--cb-prompt", default="1024,2048",
                    help="continuous batching's prompt lengths, MIN,MAX tokens (e.g. 1536,1536: every request alike, "
                         "so that the job's rate does not move with the mix of prompts in flight)")
    ap.add_argument("--train-size", default="1b")
    ap.add_argument("--attention", default="varlen")
    ap.add_argument("--profiles", help="reuse profile-<kind>.json files from this folder")
    ap.add_argument("--preempt-every", default="1s", help="profile-job --preempt-every ('' skips the step)")
    ap.add_argument("--preempt-for", default="500ms",
                    help="profile-job --preempt-for: half of --preempt-every measures the held time the job does not "
                         "lose (its host work goes on while held) to about 0.06; a tenth, to about 0.3")
    ap.add_argument("--reclaim-every", default="10s", help="profile-job --reclaim-every, cb only ('' skips)")
    ap.add_argument("--reclaim-mib", default="1024,6144",
                    help="profile-job --reclaim-mib: the sizes of the profiling reclaims (the loss per reclaim grows "
                         "faster than its size once it takes more than the job's cache slack)")
    a = ap.parse_args()
    if len(a.cb_prompt.split(",")) != 2 or not all(x.strip().isdigit() for x in a.cb_prompt.split(",")):
        ap.error(f"--cb-prompt {a.cb_prompt!r}: give MIN,MAX prompt tokens, e.g. 1024,2048")
    if not 0.0 <= a.cb_safety_margin < 1.0:
        ap.error(f"--cb-safety-margin {a.cb_safety_margin}: give a share of the cache in [0, 1), e.g. 0.2")
    if a.phase_s < a.window + 8:
        ap.error("--phase-s must exceed --window by at least 8 s (the document is rebuilt every 5 s)")
    b = Bench(a)
    common.build_model(b.r.model)
    plan = phases([float(x) for x in a.loads.split(",")], a.patterns.split(","))
    rows: list[dict] = []
    try:
        b.start_daemon()
        for kind in a.offline.split(","):
            prof = os.path.join(a.profiles, f"profile-{kind}.json") if a.profiles else b.profile(kind)
            try:
                rows += b.run_kind(kind, prof, plan)
            finally:
                for p in list(b.r.procs):
                    if "daemon" not in " ".join(map(str, p.args)) and p.poll() is None:
                        p.terminate()
                        p.wait(timeout=60)
                b.r.procs = [p for p in b.r.procs if p.poll() is None]
    finally:
        b.r.stop_all()
        b.clocks.stop()
    errs = [x["error"] for x in rows]
    profiles = {}
    for kind in a.offline.split(","):
        path = os.path.join(a.profiles or b.r.out, f"profile-{kind}.json")
        if os.path.exists(path):
            with open(path) as f:
                profiles[kind] = json.load(f)
    rep = dict(device=common.device_name(), date=time.strftime("%Y-%m-%d"), window_s=a.window, rows=rows,
               profiles=profiles, lane=common.lane(),
               args=vars(a), met=bool(rows) and all(e is not None and e <= TARGET_ERROR for e in errs))
    common.write_json(os.path.join(b.r.out, "report.json"), rep)
    with open(os.path.join(b.r.out, "report.md"), "w") as f:
        f.write(markdown(rep))
    print(markdown(rep))
    return 0 if rep["met"] else 4


if __name__ == "__main__":
    sys.exit(main())
