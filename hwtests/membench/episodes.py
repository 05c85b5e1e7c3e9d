"""The eviction cells measured as episodes: the same fixed offline workload run again and again
from an empty cache, with or without reclaims, timed to a fixed number of generated tokens.

Why episodes: windows of an endless backlog differ in their request mix from one window to the next;
at 10% of offline's memory that noise (2-5% a window) was as large as FIFO's whole loss, after 42
repeats (membench-16). Here every episode runs the same
requests in the same order (a list that does not change, `--episode-backlog` of them in the system at
once, a finished one replaced by the next of the list), so two episodes differ only by the reclaims and
the GPU's own jitter. An episode's figure is the time offline takes to generate `tokens` tokens (counted
at every step, a requeued request's tokens once), which the warm-up episode fixes at the start of the
run; what is left in the system then is cancelled, and the next episode starts from an empty cache.

- `base`: no reclaim. One before every group of policy episodes and one after the last, so each policy
  episode lies between two, and is compared with their line at its start (offline's rate may drift
  through a run; the line follows it).
- `iso` (one per size and policy): one reclaim, `lead` seconds in, when the episode's batch has reached
  its steady size. It answers every rate too slow for a second reclaim before the `tail`: their
  recoveries do not overlap, so the loss is the rate times one reclaim's lost seconds.
- `direct` (faster rates): reclaims at the rate's own spacing from `lead` on, while the episode still
  has `tail` seconds to count their recomputation; overlapping recoveries are in the figure.

Loss of a cell = rate/60 x (seconds lost per reclaim), where seconds lost per reclaim = (episode's
count - the base line's count) / reclaims: the share of offline's time that reclaims at that rate cost.
The count is of continuous-batching steps (turned into seconds at the base episodes' mean step), or of
seconds. Offline runs without CUDA graphs, so a step's length is the host's Python: on the first GPU run
identical base episodes took 5-36% different times, moved by the host alike for every policy, and the
steps do not move with it. Both are reported; the target is judged on steps.
Each repeat gives one loss per policy; a cell's figure is their mean, and its spread twice their
standard error (FIFO's, or the base episodes' own jitter carried through, whichever is larger).
Pure functions over JSON, tested in test_episodes.py; run.py's `episodes` command drives the GPU.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import eviction

KINDS = ("warm", "base", "iso", "direct")


@dataclass
class Episode:
    """One run of the fixed workload."""

    kind: str  # see KINDS; `warm` episodes fill the cache and fix the token count, and are not measured
    policy: str = "alg1"  # the shim's handle choice during the episode
    size_pct: float | None = None  # share of offline's handles each reclaim takes
    rates: list[float] = field(default_factory=list)  # the cells' rates this episode answers
    reclaims_at: list[float] = field(default_factory=list)  # seconds after the episode starts
    seed: int = 0  # the random policy's seed (the same for a group's policies)
    rep: int = 0  # which repeat of its cell


def plan(sizes, rates, policies, lead: float, measure_s: float, tail: float = 6.0, repeat: int = 1,
         seed: int = 30, warm: int = 2) -> list[Episode]:
    """The episodes in the order they run: `warm` warm-ups, then per repeat, size and kind a group of
    the policies (their order rotated with the group, the repeat and the seed, so no policy always runs
    first), a base episode before every group and one after the last."""
    if repeat < 1 or warm < 1:
        raise ValueError("--repeat and --warm must be at least 1")
    for p in policies:
        if p not in eviction.POLICIES:
            raise ValueError(f"unknown policy {p!r}: choose from {', '.join(eviction.POLICIES)}")
    if not (sizes and rates and policies):
        raise ValueError("episodes need sizes, rates and policies")
    if not 0 < lead <= measure_s - tail:
        raise ValueError(f"--lead {lead:g} must be above 0 and leave --tail {tail:g} s before the "
                         f"measured {measure_s:g} s: the recomputation must fall inside the episode")
    room = measure_s - tail - lead  # where reclaims may fall; a rate spaced wider has one reclaim there
    slow = sorted(r for r in rates if 60.0 / r > room)
    fast = sorted(r for r in rates if 60.0 / r <= room)
    out = [Episode("warm") for _ in range(warm)]
    for rep in range(repeat):
        for i, size in enumerate(sizes):
            kinds = [("iso", slow, [lead])] if slow else []
            for r in fast:
                gap = 60.0 / r
                at = [lead + k * gap for k in range(int((measure_s - tail - lead) / gap) + 1)]
                kinds.append(("direct", [r], at))
            for j, (kind, rs, at) in enumerate(kinds):
                turn = (i + j + seed + rep) % len(policies)
                order = list(policies[turn:]) + list(policies[:turn])
                out.append(Episode("base"))
                out += [Episode(kind, p, size, list(rs), list(at), seed + 100 * i + j + 1000 * rep, rep)
                        for p in order]
    out.append(Episode("base"))
    return out


def time_to_tokens(timeline: list, t0: float, tokens: int) -> float | None:
    """Seconds from `t0` until offline's count (timeline: [time, tokens generated since t0] at every
    step, in time order) first reached `tokens`; None if it never did."""
    counts = [n for _, n in timeline]
    i = bisect.bisect_left(counts, tokens)
    return timeline[i][0] - t0 if i < len(timeline) else None


def tokens_by(timeline: list, t0: float, seconds: float) -> int:
    """Tokens offline had generated `seconds` after `t0` (the last count at or before that time)."""
    times = [t for t, _ in timeline]
    i = bisect.bisect_right(times, t0 + seconds)
    return timeline[i - 1][1] if i else 0


def base_jitter(base: list[tuple[float, float]]) -> float | None:
    """One base episode's own jitter, as a share of its time: each inner base episode's distance from
    its two neighbours' line, relative to that line, as a root mean square; the line's own jitter
    (half the variance of one episode) is taken out. None with fewer than three base episodes."""
    if len(base) < 3:
        return None
    rel = []
    for i in range(1, len(base) - 1):
        expected = eviction.line(base[i - 1], base[i + 1], base[i][0])
        rel.append((base[i][1] - expected) / expected)
    return math.sqrt(sum(x * x for x in rel) / len(rel) / 1.5)


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (None for the error with fewer than two values)."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


MEASURES = ("steps", "seconds")


def episode_losses(episodes: list[dict], measure: str = "steps") -> tuple[dict, list[tuple[dict, float, float]]]:
    """The base episodes' line and jitter, and each measured policy episode with its seconds lost per
    reclaim against the line and the line's seconds at its start.

    `measure`: `steps` (default), the continuous-batching steps an episode took to its count, turned
    into seconds at the base episodes' mean step; or `seconds`, its time. Without CUDA graphs a step's
    length is set by the host's Python, which moved episodes of identical work by 5-36% on 4-GPU H100
    hosts (2026-11-26), the same for every policy, while a step count moves only with the work."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}: {' or '.join(MEASURES)}")
    measured = [e for e in episodes if e["kind"] != "warm"]
    base = sorted((e["t0"], e[measure]) for e in measured if e["kind"] == "base" and e.get(measure))
    if len(base) < 2:
        return dict(error=f"fewer than two base episodes with a {measure} count"), []
    bases = [e for e in measured if e["kind"] == "base" and e.get(measure)]
    seconds_per_unit = 1.0 if measure == "seconds" else (
        sum(e["seconds"] for e in bases) / sum(e["steps"] for e in bases))
    out = []
    for e in measured:
        if e["kind"] == "base" or e.get(measure) is None:
            continue
        ref = eviction.trend_at(base, e["t0"])
        n = e.get("reclaims", len(e.get("reclaims_at", [])))
        if n:
            out.append((e, (e[measure] - ref) / n * seconds_per_unit, ref * seconds_per_unit))
    mean_base = sum(x for _, x in base) / len(base)
    head = dict(measure=measure, base_seconds=mean_base * seconds_per_unit, base_episodes=len(base),
                jitter=base_jitter(base), drift=(base[-1][1] - base[0][1]) / base[0][1])
    if measure == "steps":
        head["base_steps"] = mean_base
    return head, out


def analyse(episodes: list[dict], measure: str = "steps") -> dict:
    """Per cell and policy, the loss of each repeat and their mean; the cell's spread; the paired
    difference FIFO - Algorithm 1 within each repeat; and the target's margin (0.8 x FIFO - Algorithm
    1, per repeat). Several runs' episodes are analysed apart and merged (`merge`)."""
    head, lost = episode_losses(episodes, measure)
    if head.get("error"):
        return dict(head, cells={})
    cells: dict = {}
    for e, lost_s, base_s in lost:
        for r in e["rates"]:
            key = eviction.cell_key(e["size_pct"], r)
            c = cells.setdefault(key, dict(size_pct=e["size_pct"], rate=r, kind=e["kind"], reps={},
                                           jitter_s=[], reclaims_per_episode=len(e["reclaims_at"])))
            c["reps"].setdefault(e.get("rep", 0), {})[e["policy"]] = dict(
                loss=r / 60.0 * lost_s, reclaims=e.get("reclaims", 0),
                requeued=e.get("requeued"), requeued_tokens=e.get("requeued_tokens"))
            if head["jitter"] is not None:
                # one episode against the line of two: sqrt(1 + 1/2) episodes' jitter
                c["jitter_s"].append(r / 60.0 * head["jitter"] * math.sqrt(1.5) * base_s
                                     / max(1, e.get("reclaims", 1)))
    return dict(head, cells={k: summarise(c) for k, c in cells.items()}, runs=1)


def summarise(c: dict) -> dict:
    """One cell from its repeats: per policy the mean loss and its standard error, the summed reclaims
    and requeues; the paired differences; the spread (twice the larger of FIFO's standard error and
    the base jitter carried through)."""
    reps = c["reps"]
    policies: dict = {}
    for q in reps.values():
        for pol, x in q.items():
            policies.setdefault(pol, []).append(x)
    out_pol = {}
    for pol, xs in policies.items():
        m, se = mean_se([x["loss"] for x in xs])
        out_pol[pol] = dict(loss=m, se=se, losses=[x["loss"] for x in xs],
                            reclaims=sum(x["reclaims"] or 0 for x in xs),
                            requeued=total(xs, "requeued"), requeued_tokens=total(xs, "requeued_tokens"),
                            kind=c["kind"])
    paired = [q["fifo"]["loss"] - q["alg1"]["loss"] for q in reps.values() if "fifo" in q and "alg1" in q]
    keep = 1 - eviction.TARGET["alg1_below_fifo"]  # the target: Algorithm 1 at most this share of FIFO's loss
    margin = [keep * q["fifo"]["loss"] - q["alg1"]["loss"] for q in reps.values() if "fifo" in q and "alg1" in q]
    n = len(policies.get("fifo", []))
    carried = (sum(c["jitter_s"]) / len(c["jitter_s"]) / math.sqrt(max(1, n))) if c["jitter_s"] else None
    fifo_se = out_pol.get("fifo", {}).get("se")
    parts = [x for x in (fifo_se, carried) if x is not None]
    return dict(size_pct=c["size_pct"], rate=c["rate"], kind=c["kind"], repeats=len(reps),
                reclaims_per_episode=c["reclaims_per_episode"], policies=out_pol,
                spread=2 * max(parts) if parts else None, jitter_carried=carried, jitter_s=c["jitter_s"],
                paired=list(mean_se(paired)), paired_values=paired, margin=list(mean_se(margin)),
                margin_values=margin, reps=reps)


def total(xs: list[dict], key: str) -> int | None:
    vals = [x.get(key) for x in xs]
    return sum(vals) if vals and all(v is not None for v in vals) else None


def merge(analyses: list[dict]) -> dict:
    """Several runs (lanes, calls) as one: each run's repeats were measured against its own base line,
    so their per-repeat losses pool directly; the spread is recomputed over all of them."""
    runs = [a for a in analyses if a.get("cells")]
    if not runs:
        return dict(cells={}, runs=0, error="no run with cells to merge")
    cells: dict = {}
    for k, a in enumerate(runs):
        for key, c in a["cells"].items():
            m = cells.setdefault(key, dict(size_pct=c["size_pct"], rate=c["rate"], kind=c["kind"], reps={},
                                           jitter_s=[], reclaims_per_episode=c["reclaims_per_episode"]))
            for rep, q in c["reps"].items():
                m["reps"][f"{k}.{rep}"] = q
            m["jitter_s"] += c.get("jitter_s", [])
    jit = [a["jitter"] for a in runs if a.get("jitter") is not None]
    steps = [a["base_steps"] for a in runs if a.get("base_steps")]
    return dict(measure=runs[0].get("measure"), base_seconds=sum(a["base_seconds"] for a in runs) / len(runs),
                base_steps=sum(steps) / len(steps) if steps else None,
                base_episodes=sum(a["base_episodes"] for a in runs),
                jitter=sum(jit) / len(jit) if jit else None,
                drift=[a.get("drift") for a in runs], cells={k: summarise(c) for k, c in cells.items()},
                runs=len(runs))


def markdown(rep: dict) -> str:
    """report.md: the loss per cell and policy with its standard error, the paired difference, the
    target's margin, the requeues, and the target per cell; the same losses timed in seconds after."""
    a = rep["analysis"]
    pols = rep.get("args", {}).get("policies") or list(eviction.POLICIES)
    runs = a.get("runs") or 1
    lines = [f"# Eviction cells as episodes{f', {runs} runs merged' if runs > 1 else ''}", "",
             f"Device: {rep.get('device')}. Each episode: the same offline requests from an empty cache, "
             f"run to {rep.get('tokens')} generated tokens. Loss = rate/60 x seconds lost per reclaim against "
             "the base episodes' line (episodes.py). +- is one standard error over the repeats; spread = twice "
             "the larger of FIFO's standard error and the base jitter carried through.", ""]
    if a.get("error"):
        lines += [f"**No result: {a['error']}**", ""]
    lines += cell_table(a, pols)
    lines += [""] + eviction.per_reclaim_table(a, pols, "requeued", "Requeued requests per reclaim", 1)
    lines += [""] + eviction.per_reclaim_table(a, pols, "requeued_tokens",
                                            "Tokens the requeued requests had in the cache, per reclaim", 0)
    t = rep.get("target") or eviction.target_check(a["cells"])
    lines += ["", f"## Target ({a.get('measure', 'steps')}): {t['overall']}", "",
              f"Where one reclaim takes <= {eviction.TARGET['small_size_pct']:g}% of offline's memory, Algorithm 1's "
              f"loss at least {eviction.TARGET['alg1_below_fifo']:.0%} below FIFO's (undecided while FIFO's own loss "
              "is within the spread); elsewhere never worse than FIFO by more than the spread. The margin column "
              "says how sure: above twice its standard error, the 20% holds with about 95% confidence.",
              "", "| cell | verdict | why |", "|---|---|---|"]
    lines += [f"| {k} | {v['verdict']} | {v['why']} |" for k, v in t["cells"].items()]
    if rep.get("analysis_seconds", {}).get("cells"):
        lines += ["", "## The same episodes timed in seconds (the host's step length left in)", ""]
        lines += cell_table(rep["analysis_seconds"], pols)
    return "\n".join(lines) + "\n"


def cell_table(a: dict, pols: list[str]) -> list[str]:
    """The losses by cell, with what they were measured in and against."""
    unit = ("steps to the count, at the base episodes' mean step" if a.get("measure") == "steps"
            else "seconds to the count")
    lines = [f"Measured in {unit}: {eviction.fmt(a.get('base_seconds'), 2)} s without reclaims"
             + (f" ({eviction.fmt(a.get('base_steps'), 0)} steps)" if a.get("base_steps") else "")
             + f", mean of {a.get('base_episodes')} base episodes; one base episode's jitter "
             f"{eviction.pct_s(a.get('jitter'))}; first to last base {drift_words(a.get('drift'))}.", "",
             "| cell | repeats | " + " | ".join(pols) + " | FIFO - Alg 1 (paired) | 0.8 FIFO - Alg 1 | spread |",
             "|---|---|" + "---|" * len(pols) + "---|---|---|"]
    for key, c in sorted(a["cells"].items(), key=lambda kv: (kv[1]["size_pct"], kv[1]["rate"])):
        row = [pm(c["policies"].get(p, {}).get("loss"), c["policies"].get(p, {}).get("se")) for p in pols]
        lines.append(f"| {key} | {c['repeats']} | " + " | ".join(row)
                     + f" | {pm(*c['paired'])} | {pm(*c['margin'])} | {eviction.pct_s(c.get('spread'))} |")
    return lines


def drift_words(drift) -> str:
    if isinstance(drift, list):
        return ", ".join(eviction.pct_s(d) for d in drift)
    return eviction.pct_s(drift)


def pm(x, se) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" + (f" +- {100 * se:.2f}" if se is not None else "")


def main(argv: list[str] | None = None) -> int:
    """`python3 episodes.py merge OUT1/report.json ... --out DIR`: one report over several runs."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("reports", nargs="+")
    m.add_argument("--out", required=True, help="folder for the merged report.json and report.md")
    a = ap.parse_args(argv)
    reps = []
    for path in a.reports:
        with open(path) as f:
            reps.append(json.load(f))
    def of(r: dict, measure: str) -> dict:
        """A run's analysis in `measure`: made again from its episodes where the report has them,
        so runs written by older code merge as the newest would analyse them."""
        if r.get("episodes"):
            return analyse(r["episodes"], measure)
        return r.get("analysis" if measure == "steps" else "analysis_seconds") or {}

    devices = sorted({r.get("device") or "?" for r in reps})
    merged = dict(args=reps[0].get("args", {}), device=", ".join(devices), tokens=sorted({r.get("tokens") for r in reps}),
                  sources=a.reports, analysis=merge([of(r, "steps") for r in reps]),
                  analysis_seconds=merge([of(r, "seconds") for r in reps]))
    merged["target"] = eviction.target_check(merged["analysis"]["cells"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(merged, f, indent=1)
    text = markdown(merged)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
