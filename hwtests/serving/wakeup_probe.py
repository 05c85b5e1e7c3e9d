"""How long a blocked thread waits for a CPU after it is woken, beside busy CPUs, per scheduling
setting: what the gate's threads can expect on this host (docs/gate.md, "Real-time threads").

A waker process writes its CLOCK_MONOTONIC time into a pipe every 1-4 ms; a sleeper process,
blocked in read(), takes the difference when it runs. Meanwhile `--burners` processes spin on
the CPUs (`--burners 0`: idle CPUs, whose wake-up a VM may delay). The sleeper runs under each
setting in turn: the normal scheduler, nice -20, a short EEVDF slice (sched_setattr's
sched_runtime on SCHED_OTHER, Linux 6.12+), SCHED_FIFO, SCHED_DEADLINE and busy polling. A
setting the kernel refuses is reported with its errno. Also prints what decides the refusals:
the effective capabilities and the cgroup. Standard library only; needs no GPU.

    python3 hwtests/serving/wakeup_probe.py [--seconds 8] [--burners N] [--json OUT]
"""

import argparse
import ctypes
import json
import os
import random
import struct
import sys
import time

SCHED_OTHER, SCHED_FIFO, SCHED_DEADLINE = 0, 1, 6
SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(os.uname().machine)
CAP_SYS_NICE = 23


class SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64)]


def set_slice(ns):
    """SCHED_OTHER with a custom slice of `ns` for the calling thread (Linux 6.12+)."""
    set_attr(SchedAttr(size=ctypes.sizeof(SchedAttr), sched_policy=SCHED_OTHER, sched_runtime=ns))


def set_deadline(runtime_ns, period_ns):
    """SCHED_DEADLINE: `runtime_ns` of CPU every `period_ns` (deadline = period). Unlike SCHED_FIFO it is
    not refused for a cgroup without a real-time budget (RT group scheduling covers FIFO and RR only); it
    needs CAP_SYS_NICE and the admission test of the CPUs' deadline bandwidth."""
    set_attr(SchedAttr(size=ctypes.sizeof(SchedAttr), sched_policy=SCHED_DEADLINE, sched_runtime=runtime_ns,
                       sched_deadline=period_ns, sched_period=period_ns))


def set_attr(a):
    if SYS_SCHED_SETATTR is None:
        raise OSError(0, "sched_setattr: unknown syscall number on this machine")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_SCHED_SETATTR, 0, ctypes.byref(a), 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


SETTINGS = {
    "normal": lambda: None,
    "nice-20": lambda: os.setpriority(os.PRIO_PROCESS, 0, -20),
    "slice-100us": lambda: set_slice(100_000),
    "fifo-10": lambda: os.sched_setscheduler(0, SCHED_FIFO, os.sched_param(10)),
    "deadline-2of10ms": lambda: set_deadline(2_000_000, 10_000_000),
    # Never sleeps: polls the pipe without blocking. What a busy-polling watcher would get,
    # at the cost of a CPU; with --burners 0 it shows what waking an idle CPU costs.
    "spin": lambda: None,
}


def burn():
    while True:
        pass


def sleeper(setting, rfd, wfd_result):
    try:
        SETTINGS[setting]()
    except OSError as e:
        os.write(wfd_result, json.dumps({"refused": f"{e.strerror} (errno {e.errno})"}).encode())
        os._exit(0)
    waits = []
    os.set_blocking(rfd, setting != "spin")
    while True:
        try:
            data = os.read(rfd, 8)
        except BlockingIOError:
            continue
        if len(data) < 8:
            break
        waits.append((time.clock_gettime_ns(time.CLOCK_MONOTONIC) - struct.unpack("q", data)[0]) / 1e3)
    os.write(wfd_result, json.dumps({"waits_us": waits}).encode())
    os._exit(0)


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def measure(setting, seconds):
    r, w = os.pipe()
    rr, rw = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.close(rr)
        sleeper(setting, r, rw)
    os.close(r)
    os.close(rw)
    time.sleep(0.05)
    end = time.monotonic() + seconds
    rng = random.Random(1)
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.001, 0.004))
            os.write(w, struct.pack("q", time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
    except BrokenPipeError:
        pass
    os.close(w)
    out = b""
    while chunk := os.read(rr, 1 << 20):
        out += chunk
    os.waitpid(pid, 0)
    res = json.loads(out)
    if "waits_us" in res:
        ws = res.pop("waits_us")
        res.update(n=len(ws), p50_us=percentile(ws, 50), p99_us=percentile(ws, 99),
                   p999_us=percentile(ws, 99.9), max_us=max(ws), over_1ms=sum(x > 1000 for x in ws))
    return res


def host_facts():
    facts = {"kernel": os.uname().release, "cpus": os.cpu_count()}
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
            facts["cap_sys_nice"] = bool(caps >> CAP_SYS_NICE & 1)
            facts["cap_eff"] = line.split()[1]
    facts["cgroup"] = open("/proc/self/cgroup").read().strip()
    for f in ("/proc/sys/kernel/sched_rt_runtime_us", "/sys/fs/cgroup/cpu.rt_runtime_us",
              "/sys/kernel/debug/sched/base_slice_ns"):
        try:
            facts[f] = open(f).read().strip()
        except OSError as e:
            facts[f] = f"unreadable ({e.strerror})"
    return facts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per setting")
    ap.add_argument("--burners", type=int, default=os.cpu_count(), help="spinning processes beside the pair")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    facts = host_facts()
    print(json.dumps(facts, indent=1))
    burners = []
    for _ in range(a.burners):
        pid = os.fork()
        if pid == 0:
            burn()
        burners.append(pid)
    results = {}
    try:
        for s in a.settings.split(","):
            results[s] = measure(s, a.seconds)
            print(f"{s}: {json.dumps(results[s])}", flush=True)
    finally:
        for pid in burners:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"host": facts, "burners": a.burners, "seconds": a.seconds, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
