"""What an idle online server costs an offline job on the same GPU, with no online request at all:
the offline job's rate alone, next to an idle online server, and next to it under the gate.

    python3 hwtests/cluster/coresidence.py --valvectl V --scheduler S --out DIR [--offline train]

The prediction check (predict.py) found offline slower than T_alone x idle fraction even at low
load; this separates the part that has nothing to do with online's requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import predict  # noqa: E402
from predict import common, python, wait_files  # noqa: E402


def rate(path: str, seconds: float) -> float:
    """The job's rate over the last `seconds` of its progress file."""
    pts = [tuple(map(float, line.split())) for line in open(path) if line.strip()]
    end = pts[-1][0]
    old = [p for p in pts if p[0] <= end - seconds * 1000]
    a = old[-1] if old else pts[0]
    return (pts[-1][1] - a[1]) / ((end - a[0]) / 1000) if end > a[0] else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--valvectl", required=True)
    ap.add_argument("--scheduler", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/cluster-bench")
    ap.add_argument("--offline", default="train")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--pool-gib", type=int, default=12)
    ap.add_argument("--train-size", default="1b")
    ap.add_argument("--offline-batch-tokens", type=int, default=512)
    ap.add_argument("--attention", default="varlen")
    ap.add_argument("--caps", default="")
    a = ap.parse_args()
    b = predict.Bench(a)
    r = b.r
    common.build_model(r.model)
    res: dict = dict(device=common.device_name(), offline=a.offline)
    try:
        b.start_daemon()
        kind = a.offline
        off_env = dict(r.env, VALVE_LABEL=common.OFFLINE_LABEL, CUDA_MODULE_LOADING="EAGER", VALVE_PROGRESS_DIR=b.progress,
                       SLURM_JOB_ID=kind)
        r.spawn(f"{kind}-offline", b.offline_argv(kind, os.path.join(r.out, f"{kind}-offline.json")), off_env)
        prog = os.path.join(b.progress, kind)
        while not os.path.exists(prog):
            time.sleep(0.5)
        time.sleep(a.warmup + a.seconds)
        res["alone"] = rate(prog, a.seconds)
        trace = os.path.join(r.out, "trace.json")
        common.write_json(trace, [common.OnlineRequest(100000.0, 200, 8, False)])
        ready, go = os.path.join(r.work, "co.ready"), os.path.join(r.work, "co.go")
        for f in (ready, go):
            if os.path.exists(f):
                os.remove(f)
        on = r.spawn("online", python("online.py", "--model", r.model, "--mode", "valve", "--trace", trace, "--out",
                                      os.path.join(r.out, "online.json"), "--ready", ready, "--go", go,
                                      "--max-batch-tokens", "4096", "--attention", a.attention, "--gate-signals",
                                      "--reservation", "off", "--cuda-graphs"))
        wait_files([ready], [on], 400)
        open(go, "w").close()
        time.sleep(a.seconds + 2)
        res["next_to_idle_online"] = rate(prog, a.seconds)
        r.valvectl("gate", "start", "--online", str(on.pid), "--offline-label", common.OFFLINE_LABEL)
        time.sleep(a.seconds + 2)
        res["next_to_idle_online_gated"] = rate(prog, a.seconds)
        res["gate"] = json.loads(r.valvectl("gate", "status", "--json"))
        r.valvectl("gate", "stop")
        on.terminate()
        on.wait(timeout=60)
        time.sleep(a.seconds + 2)
        res["after_online_exited"] = rate(prog, a.seconds)
    finally:
        r.stop_all()
    common.write_json(os.path.join(r.out, "coresidence.json"), res)
    print(json.dumps({k: v for k, v in res.items() if k != "gate"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
