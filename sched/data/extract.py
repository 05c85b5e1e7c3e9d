#!/usr/bin/env python3
"""Rebuild the trace extracts in sched/data/ from the original public files.

Standard library only.  Two sub-commands:

  azure    Bin an Azure LLM inference trace (TIMESTAMP,ContextTokens,
           GeneratedTokens; one row per request) into per-minute sums over
           the whole trace and per-second sums over its busiest hour, and
           keep the arrival times (only) of its first minutes, to the
           microsecond, for replaying arrivals.

  alibaba  Summarise the node list and the pod mix (counts and lifetime
           quantiles per QoS and GPU class) of Alibaba's
           cluster-trace-gpu-v2023.

See sched/data/README.md for where the inputs come from and exact command
lines.  Input files may be gzip-compressed (name ending in .gz).
"""

import argparse
import csv
import gzip
import hashlib
import io
import os
import re
import sys
from collections import Counter, defaultdict
from datetime import datetime, timezone

AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
# Trailing UTC offset such as "+00:00", "-0700" or "Z" (the 2024 traces carry
# "+00:00"; the 2023 traces carry none and are taken to be UTC).
_OFFSET = re.compile(r"(Z|[+-]\d\d:?\d\d)$")


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_text(path):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, "r", encoding="utf-8", newline="")


class SecondParser:
    """Turns a trace timestamp into whole Unix seconds (fraction dropped).

    Parsing the date and hour is cached, since consecutive rows almost
    always share them; minutes and seconds are read by position.
    """

    def __init__(self):
        self._hour_cache = {}

    def __call__(self, text):
        text = text.strip()
        offset = 0
        match = _OFFSET.search(text)
        if match and len(text) > 19:
            tag = match.group(1)
            if tag != "Z":
                sign = -1 if tag[0] == "-" else 1
                digits = tag[1:].replace(":", "")
                offset = sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        key = text[:13]  # "YYYY-MM-DD HH" (or with a "T")
        base = self._hour_cache.get(key)
        if base is None:
            stamp = datetime(int(key[0:4]), int(key[5:7]), int(key[8:10]),
                             int(key[11:13]), tzinfo=timezone.utc)
            base = int(stamp.timestamp())
            self._hour_cache[key] = base
        return base + int(text[14:16]) * 60 + int(text[17:19]) - offset


def fraction_us(text):
    """The sub-second part of a trace timestamp in whole microseconds (digits past the sixth
    dropped; none: 0). Added to SecondParser's whole second, it gives the arrival to the us."""
    match = re.match(r"[^.]*\.(\d+)", text.strip())
    return int((match.group(1) + "000000")[:6]) if match else 0


def iso(unix_seconds):
    return datetime.fromtimestamp(unix_seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_rows(path, header, rows):
    with open(path, "w", encoding="utf-8", newline="") as fh:
        out = csv.writer(fh, lineterminator="\n")
        out.writerow(header)
        out.writerows(rows)
    print(f"  wrote {path} ({os.path.getsize(path)} bytes)")


def cmd_azure(args):
    parse = SecondParser()
    # Sums keyed by absolute Unix second: [requests, context, generated].
    per_sec = defaultdict(lambda: [0, 0, 0])
    arrivals_us = []
    n_rows = 0
    with open_text(args.trace) as fh:
        reader = csv.reader(fh)
        header = [h.strip().lstrip("\ufeff") for h in next(reader)]
        if header != AZURE_HEADER:
            sys.exit(f"unexpected header {header!r} in {args.trace}")
        for row in reader:
            if not row:
                continue
            second = parse(row[0])
            arrivals_us.append(second * 1_000_000 + fraction_us(row[0]))
            cell = per_sec[second]
            cell[0] += 1
            cell[1] += int(row[1])
            cell[2] += int(row[2])
            n_rows += 1
    if not per_sec:
        sys.exit("trace has no rows")

    t0 = min(per_sec)   # first request, rounded down to the whole second
    t_last = max(per_sec)
    span = t_last - t0 + 1

    # Per-minute sums over the whole trace, minute k = [t0+60k, t0+60k+60).
    n_min = (span + 59) // 60
    minutes = [[0, 0, 0] for _ in range(n_min)]
    for sec, (req, ctx, gen) in per_sec.items():
        m = minutes[(sec - t0) // 60]
        m[0] += req
        m[1] += ctx
        m[2] += gen

    # Busiest hour: the hour window [t0+3600h, t0+3600h+3600) with the most
    # requests among windows lying wholly inside the trace; a trace shorter
    # than an hour gives window 0, i.e. the whole trace.
    n_full_hours = max(1, span // 3600)
    hour_req = [0] * n_full_hours
    for sec, cell in per_sec.items():
        h = (sec - t0) // 3600
        if h < n_full_hours:
            hour_req[h] += cell[0]
    if args.hour is not None:
        busy = args.hour
    else:
        busy = max(range(n_full_hours), key=lambda h: (hour_req[h], -h))
    h_start = t0 + 3600 * busy
    h_len = min(3600, t_last - h_start + 1)

    stem = f"azure-llm-{args.name}"
    os.makedirs(args.outdir, exist_ok=True)
    print(f"{args.trace}: {n_rows} requests, sha256 {sha256_of(args.trace)}")
    print(f"  first second {iso(t0)}, last second {iso(t_last)}, span {span} s")
    write_rows(os.path.join(args.outdir, f"{stem}-per-minute.csv"),
               ["minute", "requests", "context_tokens", "generated_tokens"],
               ([k] + minutes[k] for k in range(n_min)))
    zero = (0, 0, 0)
    write_rows(os.path.join(args.outdir, f"{stem}-per-second-hour{busy}.csv"),
               ["second", "requests", "context_tokens", "generated_tokens"],
               ([s] + list(per_sec.get(h_start + s, zero)) for s in range(h_len)))
    print(f"  per-second window: hour {busy} from {iso(h_start)}, {h_len} s, "
          f"{sum(per_sec.get(h_start + s, zero)[0] for s in range(h_len))} requests")
    # Arrival times alone (no token counts) over the first minutes, from the first request.
    arrivals_us.sort()
    first, until = arrivals_us[0], arrivals_us[0] + args.arrival_minutes * 60_000_000
    write_rows(os.path.join(args.outdir, f"{stem}-arrivals-first{args.arrival_minutes}min.csv"),
               ["offset_us"], ([t - first] for t in arrivals_us if t < until))


def cmd_alibaba(args):
    os.makedirs(args.outdir, exist_ok=True)

    with open_text(args.nodes) as fh:
        nodes = list(csv.DictReader(fh))
    shapes = Counter((int(n["gpu"]), n["model"]) for n in nodes if int(n["gpu"]) > 0)
    print(f"{args.nodes}: {len(nodes)} nodes, sha256 {sha256_of(args.nodes)}")
    write_rows(os.path.join(args.outdir, "alibaba-gpu-v2023-nodes.csv"),
               ["gpus", "gpu_model", "count"],
               ([g, m, c] for (g, m), c in sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))))

    with open_text(args.pods) as fh:
        pods = list(csv.DictReader(fh))
    print(f"{args.pods}: {len(pods)} pods, sha256 {sha256_of(args.pods)}")
    # Only aggregates are kept: the v2023 folder carries no licence (README.md).
    lifetimes = defaultdict(list)
    for p in pods:
        lifetimes[(p["qos"], gpu_class(p))].append(int(p["deletion_time"]) - int(p["creation_time"]))
    rows = []
    for (qos, gpus), v in sorted(lifetimes.items()):
        v.sort()
        q = lambda f: v[min(len(v) - 1, int(f * len(v)))]
        rows.append([qos, gpus, len(v), q(0.1), q(0.5), q(0.9), q(0.99)])
    write_rows(os.path.join(args.outdir, "alibaba-gpu-v2023-pod-mix.csv"),
               ["qos", "gpus", "pods", "lifetime_p10_s", "lifetime_p50_s",
                "lifetime_p90_s", "lifetime_p99_s"], rows)


def gpu_class(pod):
    """'0' (CPU only), 'frac' (a share of one GPU), or the whole GPUs requested."""
    n, milli = int(pod["num_gpu"]), int(pod["gpu_milli"])
    if n == 0:
        return "0"
    if n == 1 and milli < 1000:
        return "frac"
    return str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    az = sub.add_parser("azure", help="bin an Azure LLM inference trace")
    az.add_argument("--trace", required=True, help="AzureLLMInferenceTrace_*.csv[.gz]")
    az.add_argument("--name", required=True,
                    help="label used in output names, e.g. 2023-code or 2024-conv-1week")
    az.add_argument("--hour", type=int, default=None,
                    help="hour index (from trace start) for the per-second file; "
                         "default: the busiest whole hour")
    az.add_argument("--arrival-minutes", type=int, default=20,
                    help="minutes of arrival times (from the first request) to keep, to the us")
    az.add_argument("--outdir", default=os.path.dirname(os.path.abspath(__file__)))
    az.set_defaults(func=cmd_azure)

    al = sub.add_parser("alibaba", help="summarise cluster-trace-gpu-v2023")
    al.add_argument("--nodes", required=True, help="openb_node_list_gpu_node.csv")
    al.add_argument("--pods", required=True, help="openb_pod_list_default.csv")
    al.add_argument("--outdir", default=os.path.dirname(os.path.abspath(__file__)))
    al.set_defaults(func=cmd_alibaba)

    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
