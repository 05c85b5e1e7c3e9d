"""A CPU stand-in for the offline training job in run.sh --dry-run: a loop of small matrix
products (torch where it is installed, pure Python otherwise) that appends `<monotonic_ns>
<iteration>` to the progress file, as hwtests/serving/training.py does. It measures nothing about
a GPU; it only gives the dry run's "timeslice" configuration a competing process.

    VALVE_LABEL=batch python3 cpu_train.py --progress FILE [--size 64]
"""

import argparse
import signal
import sys
import time


def step_fn(size):
    """One iteration's work: torch matmuls if torch is there, else a pure-Python product."""
    try:
        import torch

        torch.set_num_threads(1)
        w = torch.randn(size, size)

        def step():
            nonlocal w
            w = torch.tanh(w @ w / size)
        return step
    except ImportError:
        m = [[(i * j) % 7 / 7 for j in range(size)] for i in range(size)]

        def step():
            col = [row[0] for row in m]
            sum(a * b for row in m for a, b in zip(row, col))
        return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--size", type=int, default=64)
    a = ap.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    step = step_fn(a.size)
    it = 0
    with open(a.progress, "a", buffering=1) as prog:
        print("READY cpu stand-in", flush=True)
        while not stop:
            step()
            it += 1
            prog.write(f"{time.monotonic_ns()} {it}\n")
    print(f"DONE {it}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
