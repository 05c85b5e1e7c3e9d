"""The k-GPU offline job of align.sh: data-parallel training of a random MLP, one process per GPU
(torch DistributedDataParallel: every step's gradients all-reduced over NCCL, so a step finishes
only when every rank's GPU has run; gloo on a CPU). Rank 0 appends `<monotonic_ns> <step>` to
--progress; with VALVE_PROGRESS_DIR and SLURM_JOB_ID set it also reports steps done there
(`UNIX_MS STEPS`, at most 4 times a second, docs/cluster.md) for the daemon's harvest document.

    VALVE_LABEL=batch python3 ddp_job.py --gpus 2 --device cuda --progress FILE
    python3 ddp_job.py --gpus 2 --device cpu --hidden 64 --batch 16 --progress FILE   # gloo
    python3 ddp_job.py --engine fake --progress FILE       # no torch: one process, a Python loop

The launcher starts the ranks with NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
ends them all when one ends or on SIGTERM. Prints `READY` once the first step is done.
"""

import argparse
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tp_server import Launcher, MULTICAST_OFF  # noqa: E402


class Progress:
    """Rank 0's progress lines, and the Valve job file where the environment names one."""

    def __init__(self, path):
        self.f = open(path, "a", buffering=1)
        d, job = os.environ.get("VALVE_PROGRESS_DIR"), os.environ.get("SLURM_JOB_ID")
        self.valve = open(os.path.join(d, job), "a", buffering=1) if d and job else None
        self.reported = 0.0

    def step(self, n):
        self.f.write(f"{time.monotonic_ns()} {n}\n")
        if self.valve and time.monotonic() - self.reported >= 0.25:
            self.reported = time.monotonic()
            self.valve.write(f"{int(time.time() * 1000)} {n}\n")


def fake_loop(a, stop):
    prog = Progress(a.progress)
    n = 0
    print("READY fake", flush=True)
    while not stop:
        t = time.perf_counter() + a.fake_step_ms / 1e3
        while time.perf_counter() < t:
            pass
        n += 1
        prog.step(n)


def torch_loop(a, stop):
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(MULTICAST_OFF)
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("VALVE_TP_DEVICE", rank)))
        dev, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    else:
        torch.set_num_threads(1)
        dev, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a.hidden, a.hidden, bias=False) for _ in range(a.layers)]
    model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.GELU())]).to(dev, dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.hidden, device=dev, dtype=dtype)
    prog = Progress(a.progress) if rank == 0 else None
    n = 0
    while not stop:
        ddp(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        n += 1
        if prog:
            prog.step(n)
            if n == 1:
                print(f"READY {world} ranks", flush=True)
    dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--devices", help="device index per rank (default 0 .. --gpus - 1)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--engine", default="torch", choices=["torch", "fake"])
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--label", default="batch", help="VALVE_LABEL of every rank")
    ap.add_argument("--fake-step-ms", type=float, default=5.0)
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--ctrl-port", type=int, default=0)
    ap.add_argument("--pid-file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    stop = []
    if a.engine == "fake":
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        fake_loop(a, stop)
        return 0
    if a.worker or "RANK" in os.environ:  # SIGTERM ends a rank at once: a rank that finished its step
        torch_loop(a, stop)               # would leave the others waiting in the all-reduce
        return 0
    return Launcher(a, argv).wait()


if __name__ == "__main__":
    sys.exit(main())
