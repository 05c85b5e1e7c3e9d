"""Reads probe.sh's work folder: the two jobs' ioctl logs (channels, work submit tokens), the
holds' probe output and the jobs' progress; prints, per hold, who the resident compute
channel belonged to, the channels' enabled state and the jobs' iterations inside the hold.

    python3 hwtests/freeze/analyze.py WORK PID_A PID_B     (writes WORK/analysis.json)
"""

import json
import os
import sys

TOKEN = 0xC36F0108
TSG_INFO = 0xA06C0106


def read_log(path, pid):
    """({chid: channel handle}, {handle: class}, tokens seen, {tsg handle: tsg id}) of one job."""
    me = f"{pid:x}"
    chans, chids, tsgs = {}, {}, {}
    for line in open(path):
        f = line.split()
        if len(f) >= 6 and f[0] == "alloc" and f[1] == me and f[5].endswith("6f"):
            chans[f"{f[2]}:{f[4]}"] = f[5]
        if len(f) == 6 and f[0] == "ctrl" and f[1] == me:
            cmd, val = int(f[4], 16), int(f[5], 16)
            if cmd == TOKEN:
                chids[val & 0xFFF] = f"{f[2]}:{f[3]}"
            elif cmd == TSG_INFO:
                tsgs[f"{f[2]}:{f[3]}"] = val
    return chids, chans, tsgs


def progress(path):
    return [int(ln.split()[0]) for ln in open(path) if ln.count(" ") == 1]


def owner(key, maps):
    """'A 5c00..' / 'B ..' / 'none' / 'unknown 0x..' for a resident sample key."""
    if key.startswith("error"):
        return "none resident" if "RmStatus(33)" in key else key
    chid = int(key, 16)
    for name, (chids, _, _) in maps.items():
        if chid in chids:
            return f"{name} {chids[chid]}"
    return f"unknown {key}"


def hold_row(name, h, maps, iters):
    d = h["during"]
    t0, t1 = d["disabled_ns"], d["enable_ns"]
    inside = {j: sum(1 for t in ts if t0 + 5_000_000 < t < t1) for j, ts in iters.items()}
    res = {}
    for part in ("first_5ms", "resident"):
        for k, n in d[part]["samples"].items():
            o = owner(k, maps)
            res[o] = res.get(o, 0) + n
    states = d.get("state") or []
    enabled = sum(1 for s in states if s.get("enabled"))
    return {"hold": name, "hold_ms": (t1 - t0) / 1e6, "disable_us": d["disable_us"],
            "iterations_inside": inside, "resident_owners": res,
            "channels_enabled_during": enabled, "channels_probed": len(states),
            "state_results": sorted({s["result"] for s in states}),
            "before_resident": {owner(k, maps): n for k, n in h["before"]["resident"]["samples"].items()},
            "resident_call_us": d["resident"]["mean_call_us"], "daemon_check": d.get("daemon_check")}


def main(work, pid_a, pid_b):
    maps = {"A": read_log(os.path.join(work, "rm-a.log"), pid_a),
            "B": read_log(os.path.join(work, "rm-b.log"), pid_b)}
    iters = {j: progress(os.path.join(work, f"iters-{j.lower()}.log")) for j in ("A", "B")}
    holds = json.load(open(os.path.join(work, "holds.json")))
    first = holds["all"]
    rows = [hold_row(name, h, maps, iters) for name, h in holds.items()]
    result = {
        "per_runlist_chram": first["per_runlist_chram"],
        "allocated_chids": first["allocated"]["chids"],
        "jobs": {n: {"channels": len(m[1]), "tokens": len(m[0]),
                     "channels_without_token": sorted(set(m[1]) - set(m[0].values())),
                     "chids": sorted(m[0]), "tsg_ids": m[2]} for n, m in maps.items()},
        "holds": rows,
    }
    json.dump(result, open(os.path.join(work, "analysis.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "holds"}, indent=1))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
