"""The eviction sweep (issue 30): offline generating through the shim while `valvectl pool reclaim`
takes a share of its memory at a rate, for each handle choice (Algorithm 1, FIFO, random), and
what each cell costs offline against no reclaims. Pure functions over JSON: tested in test_sweep.py.

How the time fits one command (under ~9 minutes on an H100). One daemon and one offline process
serve the whole sweep; the shim switches its handle choice between windows (`selection` in its
policy), so the three policies share the model, the backlog and the drift of the run, and the
windows of one cell's policies run back to back. A window is `cell_seconds` of measurement:

A window's tokens are counted from its start to the next one's (its `cell_seconds` and the gap after
it, in which the next policy is set and no reclaim comes), so the tail of its recomputations counts
to it. Offline keeps a short waiting queue (run.py's --offline-backlog) so that a requeued request,
which goes to the back of it, is recomputed within seconds, inside its window; a reclaim whose
recomputation lasts longer than the window (the largest sizes) still spills into the next one.

- `base`: no reclaim. Repeated through the run (first, every `baseline_every` cell windows, last):
  their mean is the throughput without reclaims, their range the run-to-run spread.
- `iso` (one per size and policy): one reclaim, `lead` seconds in. It answers every rate whose
  spacing (60/rate s) is at least the window: at those rates a reclaim's recovery is over before the
  next, so the loss is the rate times one reclaim's lost tokens (measured here).
- `direct` (one per faster rate, size and policy): reclaims at that rate's own spacing, so
  overlapping recoveries count; its loss per reclaim is scaled to the exact rate the same way.

Loss of a cell = rate/60 x (tokens lost per reclaim) / (tokens per second without reclaims), where
tokens lost per reclaim = (base tok/s x window - tokens generated in the window) / reclaims in it.

Tokens generated, not tokens of requests finished: a requeued request goes to the back of the
waiting queue, so its finish (and all its tokens) would move seconds to minutes later, often into
another window; offline counts each request's generated tokens at every step instead, once each (a requeued
request keeps them), so a window holds the work done in it. Finishes are the fallback.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

POLICIES = ("alg1", "fifo", "random")
SIZES = (5.0, 10.0, 25.0, 50.0)  # % of offline's memory (its handles when the reclaim comes)
RATES = (2.0, 6.0, 20.0)  # reclaims per minute
TARGET = dict(small_size_pct=25.0, alg1_below_fifo=0.20)


@dataclass
class Window:
    """One measured stretch of the sweep."""

    kind: str  # "base", "iso" or "direct"
    policy: str  # the shim's selection during the window ("alg1" for base windows)
    seconds: float
    size_pct: float | None = None
    rates: list[float] = field(default_factory=list)  # the cells' rates this window answers
    reclaims_at: list[float] = field(default_factory=list)  # seconds after the window starts
    seed: int = 0  # the random policy's seed (the same for a cell's policies; new for each repeat)
    rep: int = 0  # which repeat of its cell (--repeat): each repeat is analysed as a run of its own


def plan(sizes=SIZES, rates=RATES, policies=POLICIES, cell_seconds: float = 10.0, lead: float = 1.0,
         baseline_every: int = 6, seed: int = 30, repeat: int = 1) -> list[Window]:
    """The windows in the order they run. Every cell's reclaim times are the same for each policy;
    the policies' order rotates from one group to the next so none always runs first, and with the
    seed, so that runs of consecutive seeds (as many as policies) put each policy in each place of
    every group once. A window's recomputation can spill into the next one: with one order, a policy
    that always follows the worst one is charged part of its loss (seen on the H100, 2026-11-26).

    `repeat`: every cell's group of windows runs that many times (all cells once, then again), the
    order rotating one step further each time; a small cell's cost, under one window's noise, is
    then measured as a mean of `repeat` windows."""
    if repeat < 1:
        raise ValueError("--repeat must be at least 1")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}: choose from {', '.join(POLICIES)}")
    if not (sizes and rates and policies) or cell_seconds <= lead:
        raise ValueError("a sweep needs sizes, rates, policies and --cell-seconds above the lead")
    slow = sorted(r for r in rates if 60.0 / r >= cell_seconds)
    fast = sorted(r for r in rates if 60.0 / r < cell_seconds)
    groups: list[list[Window]] = []
    for rep in range(repeat):
        for i, size in enumerate(sizes):
            kinds = [("iso", slow, [lead])] if slow else []
            for r in fast:
                gap = 60.0 / r
                kinds.append(("direct", [r], [lead + k * gap for k in range(int((cell_seconds - lead) / gap) + 1)
                                              if lead + k * gap < cell_seconds]))
            for j, (kind, rs, at) in enumerate(kinds):
                turn = (i + j + seed + rep) % len(policies)
                order = list(policies[turn:]) + list(policies[:turn])
                groups.append([Window(kind, p, cell_seconds, size, list(rs), list(at),
                                      seed + 100 * i + j + 1000 * rep, rep) for p in order])
    out = [Window("base", "alg1", cell_seconds)]
    since = 0
    for g in groups:
        if since >= baseline_every:
            out.append(Window("base", "alg1", cell_seconds))
            since = 0
        out += g
        since += len(g)
    out.append(Window("base", "alg1", cell_seconds))
    if sum(w.kind == "base" for w in out) < 3:  # the spread needs a few
        out.insert(len(out) // 2, Window("base", "alg1", cell_seconds))
    return out


def plan_seconds(windows: list[Window], gap: float, startup: float = 90.0) -> float:
    """How long the sweep takes: the windows, the settling gap before each, and the start."""
    return startup + sum(w.seconds + gap for w in windows)


def window_tokens(finishes: list, start: float, end: float) -> int:
    """Tokens of the requests that finished in [start, end) (finishes: [time, tokens] pairs)."""
    return sum(n for t, n in finishes if start <= t < end)


def generated_between(timeline: list, start: float, end: float) -> int:
    """Tokens generated in [start, end): the cumulative count (timeline: [time, total] pairs in time
    order) last seen by `end` minus the one last seen by `start`."""
    times = [t for t, _ in timeline]

    def at(t: float) -> int:
        i = bisect.bisect_left(times, t)
        return timeline[i - 1][1] if i else 0

    return at(end) - at(start)


def analyse(windows: list[dict], finishes: list, generated: list | None = None, baseline: str = "trend") -> dict:
    """Per cell and policy, the throughput loss against the base windows, and the spread.

    `windows`: the plan's windows as run, each with `t0`, `t1` (CLOCK_MONOTONIC) and `reclaims`
    (how many were made); `generated`: offline's [time, tokens generated so far] at every step;
    without it, `finishes` (offline's [time, tokens] of every finished request) are counted; with
    neither, the windows' own `tokens` (a report analysed again).

    `baseline`: what a window is compared with.
    - `trend` (default): the base windows' throughput interpolated to the window's middle. Offline's
      rate drifts through a run (on the H100 it fell 6-20%, most after the largest reclaims), so one
      mean would charge the drift to the last cells. The spread is then how far an inner base window
      lies from its two neighbours' line (the largest such, over that line), the noise that is left.
    - `mean`: the base windows' mean, and their range over it as the spread."""
    if baseline not in ("trend", "mean"):
        raise ValueError(f"unknown baseline {baseline!r}: trend or mean")
    reps = sorted({w.get("rep", 0) for w in windows if w["kind"] != "base"})
    if len(reps) > 1:
        return analyse_repeats(windows, finishes, generated, baseline, reps)
    base = []
    for w in windows:
        if generated or finishes:
            w["tokens"] = (generated_between(generated, w["t0"], w["t1"]) if generated
                           else window_tokens(finishes, w["t0"], w["t1"]))
        w.setdefault("tokens", 0)
        w["tok_s"] = w["tokens"] / (w["t1"] - w["t0"]) if w["t1"] > w["t0"] else 0.0
        if w["kind"] == "base":
            base.append(((w["t0"] + w["t1"]) / 2, w["tok_s"]))
    if not base or min(x for _, x in base) <= 0:
        return dict(base_tok_s=None, spread=None, cells={}, error="no tokens in a base window")
    base.sort()
    mean = sum(x for _, x in base) / len(base)
    spread_range = (max(x for _, x in base) - min(x for _, x in base)) / mean if len(base) >= 2 else None
    trend = baseline == "trend" and len(base) >= 3
    if trend:  # each inner base window against its neighbours' line, relative to that line
        expected = [line(base[i - 1], base[i + 1], base[i][0]) for i in range(1, len(base) - 1)]
        spread = max(abs(base[i][1] - e) / e for i, e in enumerate(expected, start=1))
    else:
        spread = spread_range
    cells: dict = {}
    for w in windows:
        if w["kind"] == "base":
            continue
        n = w.get("reclaims", len(w["reclaims_at"]))
        secs = w["t1"] - w["t0"]
        ref = trend_at(base, (w["t0"] + w["t1"]) / 2) if trend else mean
        w["base_tok_s"] = ref
        lost = (ref * secs - w["tokens"]) / n if n else None
        for r in w["rates"]:
            key = cell_key(w["size_pct"], r)
            c = cells.setdefault(key, dict(size_pct=w["size_pct"], rate=r, policies={}))
            loss = r / 60.0 * lost / ref if lost is not None else None
            # The spread of one window's throughput, carried through the same scaling.
            noise = spread * (r / 60.0 * secs) / n if spread is not None and n else None
            c["policies"][w["policy"]] = dict(loss=loss, lost_tokens_per_reclaim=lost, reclaims=n,
                                              tok_s=w["tok_s"], kind=w["kind"], requeued=w.get("requeued"),
                                              requeued_tokens=w.get("requeued_tokens"))
            c["spread"] = noise
    return dict(base_tok_s=mean, base_windows=len(base), spread=spread, spread_range=spread_range,
                baseline="trend" if trend else "mean",
                cells=cells, counted="tokens generated" if generated else
                "tokens of finished requests" if finishes else "the windows' tokens as reported")


def analyse_repeats(windows: list[dict], finishes: list, generated: list | None, baseline: str,
                    reps: list[int]) -> dict:
    """A sweep whose cells ran several times (`plan(repeat=...)`): each repeat is analysed against
    all the base windows, as a run of its own, and the repeats are merged as runs are (a cell's
    spread narrows by the square root of their number)."""
    bases = [w for w in windows if w["kind"] == "base"]
    parts = [analyse(bases + [w for w in windows if w["kind"] != "base" and w.get("rep", 0) == r],
                     finishes, generated, baseline) for r in reps]
    out = merge(parts)
    out.update(base_windows=len(bases), repeats=out.pop("runs", len(parts)))
    return out


def line(p: tuple[float, float], q: tuple[float, float], t: float) -> float:
    """The value at time `t` on the straight line through points p and q (time, value)."""
    return p[1] + (q[1] - p[1]) * (t - p[0]) / (q[0] - p[0]) if q[0] != p[0] else (p[1] + q[1]) / 2


def trend_at(base: list[tuple[float, float]], t: float) -> float:
    """The base windows' throughput at time `t`: between the two around it on their line; before the
    first or after the last, that window's own."""
    if t <= base[0][0]:
        return base[0][1]
    for p, q in zip(base, base[1:]):
        if t <= q[0]:
            return line(p, q, t)
    return base[-1][1]


def distinct_switches(switches: list[dict], within_s: float = 1.0) -> list[dict]:
    """Offline's switch notes, each once: a note with the same choice and seed as the one before it
    and within `within_s` of it is the same switch seen twice (the file read while being written;
    or the initial `alg1 0` just before the first window's), and the first note stands."""
    out: list[dict] = []
    for s in switches:
        prev = out[-1] if out else None
        if (prev and s.get("t") is not None and prev.get("t") is not None and s["t"] - prev["t"] < within_s
                and (s.get("selection"), s.get("seed")) == (prev.get("selection"), prev.get("seed"))):
            continue
        out.append(s)
    return out


def attach_requeues(windows: list[dict], switches: list[dict]) -> None:
    """Requests requeued during each window, and the tokens they had in the cache (what recomputing
    them costs at most): the shim's counters between the switch made for the window (a gap before
    it) and the next one (offline notes one per window, in order, and one after the last). A shim
    without the token counter leaves `requeued_tokens` out."""
    notes = [s["shim"] for s in distinct_switches(switches) if s.get("shim")]
    # One switch per window and a last one after them; before them, the initial `alg1 0` if offline saw it.
    if len(notes) < len(windows) + 1:
        return  # a switch was missed: the windows cannot be told apart
    notes = notes[-(len(windows) + 1):]
    for key in ("requeued", "requeued_tokens"):
        if any(key not in n for n in notes):
            continue
        for i, w in enumerate(windows):
            w[key] = notes[i + 1][key] - notes[i][key]


def attach_offline_state(windows: list[dict], timeline: dict | None) -> None:
    """What offline was doing in each window, from offline.py's --timeline (a row a second: time,
    tokens, transformers' own offloads so far, active and waiting requests, free cache blocks):
    `active` and `free_blocks` as means over the window's rows, `cb_offloads` as the requests
    transformers itself offloaded for want of cache in it. Tells a window that ran a smaller batch
    from one that lost work. A window without rows gets none."""
    if not timeline or not timeline.get("rows"):
        return
    col = {c: i for i, c in enumerate(timeline["columns"])}
    rows = sorted(timeline["rows"], key=lambda r: r[col["t"]])
    for w in windows:
        inside = [r for r in rows if w["t0"] <= r[col["t"]] < w["t1"]]
        if not inside:
            continue
        before = [r for r in rows if r[col["t"]] < w["t0"]]
        evicted_before = before[-1][col["evicted"]] if before else inside[0][col["evicted"]]
        w["active"] = sum(r[col["active"]] for r in inside) / len(inside)
        w["free_blocks"] = sum(r[col["free_blocks"]] for r in inside) / len(inside)
        w["cb_offloads"] = inside[-1][col["evicted"]] - evicted_before


def offline_state_table(windows: list[dict]) -> list[str]:
    """report.md's table of offline's state by kind of window: base windows, then each policy's
    windows with a reclaim (means over the windows). Empty where the windows carry no state."""
    groups: dict[str, list[dict]] = {}
    for w in windows:
        if w.get("active") is None:
            continue
        key = "base (no reclaim)" if w["kind"] == "base" else f"{w['policy']}, with a reclaim"
        groups.setdefault(key, []).append(w)
    if not groups:
        return []

    def mean(ws: list[dict], k: str) -> float:
        return sum(w[k] for w in ws) / len(ws)

    lines = ["## Offline's state by kind of window (means over the windows)", "",
             "| windows | n | tok/s | active requests | free cache blocks | transformers' own offloads per window |",
             "|---|---|---|---|---|---|"]
    for key, ws in groups.items():
        lines.append(f"| {key} | {len(ws)} | {fmt(mean(ws, 'tok_s'), 0)} | {fmt(mean(ws, 'active'), 1)} | "
                     f"{fmt(mean(ws, 'free_blocks'), 0)} | {fmt(mean(ws, 'cb_offloads'), 2)} |")
    return lines + [""]


def merge(analyses: list[dict]) -> dict:
    """Several sweeps' analyses (each against its own base windows) as one: per cell and policy the
    mean loss and the summed reclaims and requeues; the cell's spread is the runs' mean spread over
    sqrt(runs), as a mean of independent windows narrows. One 10-minute device call holds one
    sweep; the cells undecided within one run's spread (2026-11-25-h100-membench-12) need several."""
    runs = [a for a in analyses if a.get("cells")]
    if not runs:
        return dict(base_tok_s=None, spread=None, cells={}, runs=0, error="no sweep with cells to merge")
    cells: dict = {}
    for a in runs:
        for key, c in a["cells"].items():
            m = cells.setdefault(key, dict(size_pct=c["size_pct"], rate=c["rate"], policies={}, spreads=[]))
            if c.get("spread") is not None:
                m["spreads"].append(c["spread"])
            for pol, q in c["policies"].items():
                m["policies"].setdefault(pol, []).append(q)
    for c in cells.values():
        spreads = c.pop("spreads")
        c["spread"] = sum(spreads) / len(spreads) / len(spreads) ** 0.5 if spreads else None
        c["policies"] = {pol: pooled(qs) for pol, qs in c["policies"].items()}
    bases = [a["base_tok_s"] for a in runs if a.get("base_tok_s")]
    spreads = [a["spread"] for a in runs if a.get("spread") is not None]
    ranges = [a["spread_range"] for a in runs if a.get("spread_range") is not None]
    baselines = sorted({a.get("baseline", "mean") for a in runs})
    return dict(base_tok_s=sum(bases) / len(bases) if bases else None,
                base_windows=sum(a.get("base_windows") or 0 for a in runs),
                spread=sum(spreads) / len(spreads) if spreads else None,
                spread_range=sum(ranges) / len(ranges) if ranges else None,
                baseline=baselines[0] if len(baselines) == 1 else "+".join(baselines), cells=cells, runs=len(runs),
                counted=runs[0].get("counted"))


def pooled(qs: list[dict]) -> dict:
    """One policy's result in one cell over several runs."""
    losses = [q["loss"] for q in qs if q.get("loss") is not None]

    def total(key: str) -> int | None:
        xs = [q[key] for q in qs if q.get(key) is not None]
        return sum(xs) if len(xs) == len(qs) else None

    return dict(loss=sum(losses) / len(losses) if losses else None, losses=losses,
                reclaims=sum(q.get("reclaims") or 0 for q in qs), requeued=total("requeued"),
                requeued_tokens=total("requeued_tokens"), kind=qs[0].get("kind"))


def cell_key(size_pct: float, rate: float) -> str:
    return f"{size_pct:g}%@{rate:g}/min"


def target_check(cells: dict, small: float = TARGET["small_size_pct"], better: float = TARGET["alg1_below_fifo"]) -> dict:
    """The issue's target per cell: where one reclaim takes at most `small`% of offline's memory,
    Algorithm 1's loss at least `better` below FIFO's; elsewhere, never worse than FIFO by more than
    the spread. A cell is `undecided` where a number is missing, or (small cells) where FIFO's loss
    is within the spread, so no 20% difference can be told from noise."""
    out = {}
    for key, c in cells.items():
        p = c["policies"]
        a, f = (p.get(k, {}).get("loss") for k in ("alg1", "fifo"))
        spread = c.get("spread")
        if a is None or f is None:
            verdict, why = "undecided", "Algorithm 1 or FIFO not measured"
        elif c["size_pct"] <= small:
            if spread is not None and f <= spread:
                verdict, why = "undecided", f"FIFO's loss {f:.4f} is within the spread {spread:.4f}"
            else:
                ok = a <= (1 - better) * f
                verdict = "pass" if ok else "fail"
                why = f"Algorithm 1 {a:.4f} vs FIFO {f:.4f}: needs <= {(1 - better) * f:.4f}"
        elif spread is None:
            verdict, why = "undecided", "no spread measured (fewer than two base windows)"
        else:
            verdict = "pass" if a - f <= spread else "fail"
            why = f"Algorithm 1 {a:.4f} vs FIFO {f:.4f}, spread {spread:.4f}"
        out[key] = dict(verdict=verdict, why=why)
    verdicts = [v["verdict"] for v in out.values()]
    overall = "fail" if "fail" in verdicts else "undecided" if "undecided" in verdicts or not verdicts else "pass"
    return dict(cells=out, overall=overall)


def markdown(rep: dict) -> str:
    """report.md: a table per policy (loss per size x rate), the spread, the target per cell."""
    a = rep["analysis"]
    runs, repeats = a.get("runs"), a.get("repeats")
    lines = ["# Eviction sweep (issue 30)" + (f", {runs} runs merged" if runs else "")
             + (f", every cell {repeats} times (each cell's figures are means; spreads narrowed by the root)"
                if repeats else ""), "",
             f"Device: {rep.get('device')}. Block placement: "
             f"{rep['args'].get('placement', 'default')}. Offline without reclaims: "
             f"{fmt(a.get('base_tok_s'), 1)} tok/s over {a.get('base_windows')} base windows; {baseline_words(a)}; "
             f"counted: {a.get('counted')}. Windows of {rep['args'].get('cell_seconds')} s; "
             "loss = rate x tokens lost per reclaim / tokens per second without reclaims (sweep.py).", ""]
    if a.get("error"):
        lines += [f"**No result: {a['error']}**", ""]
    sizes = sorted({c["size_pct"] for c in a["cells"].values()})
    rates = sorted({c["rate"] for c in a["cells"].values()})
    for pol in rep["args"].get("policies", POLICIES):
        lines += [f"## {pol}: offline throughput loss", "", "| size \\ rate | " + " | ".join(f"{r:g}/min" for r in rates)
                  + " |", "|---|" + "---|" * len(rates)]
        for s in sizes:
            row = [pct_s(a["cells"].get(cell_key(s, r), {}).get("policies", {}).get(pol, {}).get("loss")) for r in rates]
            lines.append(f"| {s:g}% | " + " | ".join(row) + " |")
        lines.append("")
    lines += per_reclaim_table(a, rep["args"].get("policies", POLICIES), "requeued", "Requeued requests per reclaim", 1)
    if any(q.get("requeued_tokens") is not None for c in a["cells"].values() for q in c["policies"].values()):
        lines += [""] + per_reclaim_table(a, rep["args"].get("policies", POLICIES), "requeued_tokens",
                                          "Tokens the requeued requests had in the cache, per reclaim (what "
                                          "recomputing them costs at most; no run-to-run noise)", 0)
    state = offline_state_table(rep.get("windows", []))
    if state:
        lines += [""] + state[:-1]
    t = rep["target"]
    lines += ["", f"## Target: {t['overall']}", "",
              f"Where one reclaim takes <= {TARGET['small_size_pct']:g}% of offline's memory, Algorithm 1's loss at "
              f"least {TARGET['alg1_below_fifo']:.0%} below FIFO's; elsewhere never worse than FIFO by more than the spread.",
              "", "| cell | verdict | why |", "|---|---|---|"]
    lines += [f"| {k} | {v['verdict']} | {v['why']} |" for k, v in t["cells"].items()]
    return "\n".join(lines) + "\n"


def per_reclaim_table(a: dict, policies, key: str, title: str, digits: int) -> list[str]:
    """A table of `key` per reclaim: a row per cell, a column per policy."""
    lines = [f"## {title}", "", "| cell | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for cell, c in a["cells"].items():
        row = []
        for pol in policies:
            q = c["policies"].get(pol, {})
            row.append(fmt(q[key] / q["reclaims"], digits) if q.get(key) is not None and q.get("reclaims") else "-")
        lines.append(f"| {cell} | " + " | ".join(row) + " |")
    return lines


def baseline_words(a: dict) -> str:
    """What each window was compared with, and the spread, in words."""
    runs = " (the runs' mean)" if a.get("runs") else ""
    if a.get("baseline") == "trend":
        return (f"each window against the base windows' line at its time; spread{runs} (an inner base window off "
                f"its neighbours' line, the largest) {pct_s(a.get('spread'))}, range / mean of the base windows "
                f"{pct_s(a.get('spread_range'))}")
    return f"run-to-run spread{runs} (range / mean of those windows) {pct_s(a.get('spread'))}"


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def pct_s(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def reanalyse(rep: dict, offline_json: str, baseline: str) -> None:
    """A run's report analysed again from its windows' tokens against `baseline`, its requeues
    attached again from offline's switch notes if `offline_json` exists, and its target checked."""
    import json
    import os

    if os.path.exists(offline_json):
        with open(offline_json) as f:
            switches = json.load(f).get("switches", [])
        for w in rep["windows"]:
            w.pop("requeued", None)
            w.pop("requeued_tokens", None)
        attach_requeues(rep["windows"], switches)
    rep["analysis"] = analyse(rep["windows"], [], None, baseline)
    rep["target"] = target_check(rep["analysis"]["cells"])


def main(argv: list[str] | None = None) -> int:
    """`python3 sweep.py merge OUT1/report.json OUT2/report.json ... --out DIR`: one report over
    several sweep runs (report.json and report.md in DIR)."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the report.json of several sweep runs")
    m.add_argument("reports", nargs="+")
    m.add_argument("--out", required=True, help="folder for the merged report.json and report.md")
    m.add_argument("--baseline", choices=("trend", "mean", "as-run"), default="as-run",
                   help="analyse each run again against this baseline (see analyse) before merging; as-run "
                        "keeps each report's own analysis. Requeues are attached again from the "
                        "sweep-offline.json beside a report where there is one.")
    a = ap.parse_args(argv)
    reps = []
    for path in a.reports:
        try:
            with open(path) as f:
                reps.append(json.load(f))
        except (OSError, ValueError) as e:
            ap.error(f"{path}: not a readable sweep report ({e})")
    if any("analysis" not in r for r in reps):
        ap.error("every file must be a sweep's report.json (it has an 'analysis' key)")
    if a.baseline != "as-run":
        for path, r in zip(a.reports, reps):
            reanalyse(r, os.path.join(os.path.dirname(path), "sweep-offline.json"), a.baseline)
    devices = sorted({str(r.get("device")) for r in reps})
    rep = dict(device=", ".join(devices), args=reps[0].get("args", {}), sources=a.reports,
               analysis=merge([r["analysis"] for r in reps]))
    rep["target"] = target_check(rep["analysis"]["cells"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(rep, f, indent=1)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(markdown(rep))
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
