"""The eviction cells' shared arithmetic: the policies, sizes and rates a cell is made of, the
base line a run's losses are read against, and the target verdict per cell (episodes.py uses it).

A cell is one reclaimed size (% of offline's memory) x one reclamation rate; its loss is offline's
throughput lost against no reclaims, per handle choice. Pure functions: tested in test_eviction.py.
"""

from __future__ import annotations

POLICIES = ("alg1", "fifo", "random")
SIZES = (5.0, 10.0, 25.0, 50.0)  # % of offline's memory (its handles when the reclaim comes)
RATES = (2.0, 6.0, 20.0)  # reclaims per minute
TARGET = dict(small_size_pct=25.0, alg1_below_fifo=0.20)


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


def cell_key(size_pct: float, rate: float) -> str:
    return f"{size_pct:g}%@{rate:g}/min"


def target_check(cells: dict, small: float = TARGET["small_size_pct"], better: float = TARGET["alg1_below_fifo"]) -> dict:
    """The target per cell: where one reclaim takes at most `small`% of offline's memory,
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


def fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def pct_s(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"
