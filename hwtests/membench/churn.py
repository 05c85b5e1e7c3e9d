"""valve-churn's admin churn: while online plays its trace, a thread restarts
Valve's gate again and again (`valvectl gate stop`, then `gate start` with run.py's arguments)
and others flood the daemon's control socket with bad input, so that online's grows, which
reclaim from offline through the daemon's loop, meet the slow admin work they were once seen to wait
behind. Standard library only; tested in test_churn.py against a fake valvectl and a fake socket.

Every thread is bounded: a gate command by `COMMAND_TIMEOUT_S`, a flooder's socket calls by
`SOCKET_TIMEOUT_S`. Errors are counted and the first few kept, never raised. `Churn.finish()`
stops and joins them and leaves the gate started (the cycler only stops between two cycles), so
run.py's end of a configuration (`gate status`, `gate stop`) works as for the others.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import subprocess
import threading
import time
from typing import Callable

import common
from common import now, pct

COMMAND_TIMEOUT_S = 30.0  # one valvectl call (its own reply timeout is 10 s)
SOCKET_TIMEOUT_S = 0.5  # each flooder's connect, send and receive
CYCLE_MARGIN_S = 5.0  # no gate restart this close to online's last arrival: it may exit after it
HOLD_MAX = 8  # connections a flooder keeps open without a request line
OVERSIZED = 70 * 1024  # over the daemon's 64 KiB request limit, no newline
FIRST_ERRORS = 5
LOG_MAX_BYTES = 64 << 20

# What a flooder sends, in turn, one connection each. None of it is a request the daemon acts on.
FLOOD = (("line", b'{"op": "status", \n'),  # malformed JSON
         ("line", b'{"op": "no_such_op", "pid": 1}\n'),  # unknown op
         ("line", b"\x00\xff\xfe not a request {{{\n"),  # garbage
         ("line", b"[1, 2, 3]\n"),  # JSON, but not an object
         ("oversized", b"x" * OVERSIZED),
         ("close", b""),  # connect and close at once
         ("hold", b""),  # connect and send nothing
         ("hold", b'{"op": '))  # half a line, then nothing


class Errors:
    """A count of errors and the text of the first few."""

    def __init__(self) -> None:
        self.n, self.first = 0, []

    def add(self, what: str) -> None:
        self.n += 1
        if len(self.first) < FIRST_ERRORS:
            self.first.append(what[:300])


class Flooder(threading.Thread):
    """Floods the control socket at `path` with `FLOOD`'s bad input until `halt`."""

    def __init__(self, path: str, halt: threading.Event, name: str = "churn-flooder") -> None:
        super().__init__(daemon=True, name=name)
        self.path, self.halt = path, halt
        self.counts = dict(connections=0, messages=0, replies=0, held=0)
        self.errors = Errors()
        self.held: collections.deque = collections.deque()

    def run(self) -> None:
        i = 0
        try:
            while not self.halt.is_set():
                self.once(*FLOOD[i % len(FLOOD)])
                i += 1
        except Exception as e:  # noqa: BLE001 - recorded, never raised into the benchmark
            self.errors.add(f"flooder stopped: {type(e).__name__}: {e}")
        finally:
            while self.held:
                self.held.popleft().close()

    def once(self, kind: str, payload: bytes) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(SOCKET_TIMEOUT_S)
        keep = False
        try:
            s.connect(self.path)
            self.counts["connections"] += 1
            if payload:
                s.sendall(payload)
                self.counts["messages"] += 1
            if kind == "hold":
                keep = self.hold(s)
            elif kind != "close" and s.recv(4096):
                self.counts["replies"] += 1
        except OSError as e:
            self.errors.add(f"{kind}: {type(e).__name__}: {e}")
            self.halt.wait(0.01)  # no hot loop while the daemon is away
        finally:
            if not keep:
                s.close()

    def hold(self, s: socket.socket) -> bool:
        self.held.append(s)
        self.counts["held"] += 1
        while len(self.held) > HOLD_MAX:
            self.held.popleft().close()
        return True


class GateCycler(threading.Thread):
    """Every `every` s: `gate stop`, then `gate start` with `start_args`, each timed, until `halt`,
    until `alive()` is false or until `deadline` (common.now()) is within `margin` s. It stops
    only between two cycles, so the gate is left as the last start made it."""

    def __init__(self, valvectl: str, start_args: list[str], every: float, halt: threading.Event,
                 deadline: float, alive: Callable[[], bool], margin: float = CYCLE_MARGIN_S) -> None:
        super().__init__(daemon=True, name="churn-gate-cycler")
        self.valvectl, self.start_args, self.every, self.halt = valvectl, start_args, every, halt
        self.deadline, self.alive, self.margin = deadline, alive, margin
        self.commands: list[list] = []  # [what, t0, t1, ok] per command, common.now() seconds
        self.errors = Errors()
        self.restarts, self.preemptions = 0, 0
        self.gate_on: bool | None = True  # run.py starts the gate before the churn
        self.t_end: float | None = None

    def run(self) -> None:
        try:
            while not self.halt.wait(self.every):
                if not self.alive() or now() + self.margin > self.deadline:
                    break
                self.cycle()
        except Exception as e:  # noqa: BLE001 - recorded, never raised into the benchmark
            self.errors.add(f"cycler stopped: {type(e).__name__}: {e}")
        finally:
            self.t_end = now()

    def cycle(self) -> None:
        if self.gate_on is None:  # a command failed: ask where the gate is
            self.gate_on = gate_running(self.valvectl)
            if self.gate_on is None:
                return
        if self.gate_on:
            out = self.command("stop", ["gate", "stop", "--json"])
            if out is None:
                self.gate_on = None
                return
            self.gate_on = False
            self.preemptions += int(parse_json(out).get("preemptions") or 0)
        self.gate_on = True if self.command("start", self.start_args) is not None else None
        self.restarts += bool(self.gate_on)

    def command(self, what: str, args: list[str]) -> str | None:
        """Runs `valvectl args`, timed; its stdout, or None (counted, the error kept)."""
        t0 = now()
        out, err = run_valvectl(self.valvectl, args)
        self.commands.append([what, t0, now(), err is None])
        if err is not None:
            self.errors.add(f"gate {what}: {err}")
        return out


def run_valvectl(valvectl: str, args: list[str]) -> tuple[str | None, str | None]:
    """(stdout, None) if `valvectl args` succeeded within COMMAND_TIMEOUT_S, else (None, why)."""
    try:
        r = subprocess.run([valvectl, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    if r.returncode != 0:
        return None, f"exit {r.returncode}: {(r.stderr or r.stdout).strip()}"
    return r.stdout, None


def parse_json(text: str | None) -> dict:
    try:
        v = json.loads(text or "")
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def gate_status(valvectl: str) -> dict | None:
    out, _ = run_valvectl(valvectl, ["gate", "status", "--json"])
    return None if out is None else parse_json(out)


def gate_running(valvectl: str) -> bool | None:
    """Whether a gate runs (None: unknown, or still starting)."""
    st = gate_status(valvectl)
    if st is None or st.get("starting"):
        return None
    return bool(st.get("running"))


def ensure_gate(valvectl: str, start_args: list[str], tries: int = 5) -> dict:
    """Leaves a gate running: started with `start_args` if none runs. What was done, and whether
    it worked. A running gate is kept whatever its online set (online may have exited by now)."""
    err = None
    for _ in range(tries):
        st = gate_status(valvectl)
        if st is not None and st.get("running"):
            return dict(ok=True, action="kept" if err is None else "started", error=err)
        if st is not None and st.get("starting"):
            time.sleep(0.5)
            continue
        _, err = run_valvectl(valvectl, start_args)
        if err is None:
            return dict(ok=True, action="started", error=None)
    return dict(ok=False, action="none", error=err or "the gate did not leave `starting`")


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FIELD = re.compile(r"(\w+)=(\d+)\b")


def log_events(text: str, message: str) -> list[dict]:
    """The numeric fields of each daemon log line with `message`: the text format (ANSI colours
    stripped) or JSON lines (`--log-format json`)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            fields = parse_json(line).get("fields") or {}
            if fields.get("message") == message:
                out.append({k: v for k, v in fields.items() if isinstance(v, (int, float))})
            continue
        plain = ANSI.sub("", line)
        at = plain.find(f" {message}")
        if at >= 0:
            out.append({k: int(v) for k, v in FIELD.findall(plain[at:])})
    return out


def read_log(path: str, offset: int) -> str:
    """What the log at `path` gained after `offset` (at most LOG_MAX_BYTES)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(LOG_MAX_BYTES).decode("utf-8", "replace")


def log_summary(text: str) -> dict:
    """The daemon's slow-request lines (ctl/daemon/src/server.rs: a request or lane call that took
    20 ms or more from its arrival to its reply) and its reclaims (memory/server.rs)."""
    slow = log_events(text, "slow request")
    rec = log_events(text, "reclaimed for online")
    small = [r for r in rec if 1 <= r.get("handles", 0) <= 16]

    def ms_max(rows, key):
        v = [r[key] / 1e3 for r in rows if key in r]
        return max(v) if v else None

    return dict(slow_requests=len(slow), slow_handled_ms_max=ms_max(slow, "handled_us"),
                slow_waited_ms_max=ms_max(slow, "waited_us"), reclaims=len(rec), reclaims_le_1gib=len(small),
                reclaim_le_1gib_total_ms_p99=pct([r["total_us"] / 1e3 for r in small if "total_us" in r], 99),
                reclaim_queued_ms_max=ms_max(rec, "queued_us"),
                reclaim_outside_daemon_ms_max=ms_max(rec, "outside_daemon_us"))


def durations(commands: list[list], what: str) -> dict:
    """Count, successes, p50 and max (ms) of the `what` commands."""
    ms = [(t1 - t0) * 1e3 for w, t0, t1, _ in commands if w == what]
    return dict(n=len(ms), ok=sum(1 for c in commands if c[0] == what and c[3]), p50_ms=pct(ms, 50),
                max_ms=max(ms) if ms else None)


class Churn:
    """The gate cycler and `flooders` flooder threads against the daemon at `sock`, and the daemon
    log's lines from `start()` to `finish()`."""

    def __init__(self, valvectl: str, start_args: list[str], every: float, flooders: int, deadline: float,
                 alive: Callable[[], bool], log_path: str, sock: str = common.DAEMON_SOCKET,
                 margin: float = CYCLE_MARGIN_S) -> None:
        self.halt = threading.Event()
        self.valvectl, self.start_args, self.log_path = valvectl, start_args, log_path
        self.every, self.log_from, self.t_start = every, 0, None
        self.cycler = GateCycler(valvectl, start_args, every, self.halt, deadline, alive, margin)
        self.flooders = [Flooder(sock, self.halt, f"churn-flooder-{i}") for i in range(flooders)]

    def start(self) -> None:
        self.t_start = now()
        try:
            self.log_from = os.path.getsize(self.log_path)
        except OSError:
            self.log_from = 0
        for t in [self.cycler, *self.flooders]:
            t.start()

    def finish(self) -> dict:
        """Stops and joins every thread (bounded), leaves the gate started, and sums up. Never raises."""
        try:
            return self._finish()
        except Exception as e:  # noqa: BLE001 - the config's result says what went wrong
            self.halt.set()
            return dict(error=f"finishing the churn: {type(e).__name__}: {e}")

    def _finish(self) -> dict:
        self.halt.set()
        t_end = now()
        if self.cycler.ident is not None:  # started (start() may have failed part way)
            self.cycler.join(timeout=2 * COMMAND_TIMEOUT_S + 10)  # a stop and a start under way at most
        for f in self.flooders:
            if f.ident is not None:
                f.join(timeout=4 * SOCKET_TIMEOUT_S + 2)
        alive = [t.name for t in [self.cycler, *self.flooders] if t.is_alive()]
        if self.cycler.is_alive():
            final = dict(ok=False, action="none", error="the gate cycler did not stop")
        else:  # also where it never started: the gate is as run.py left it, or as a failed cycle did
            final = ensure_gate(self.valvectl, self.start_args)
        return self.summary(t_end, alive, final)

    def summary(self, t_end: float, alive: list[str], final: dict | None) -> dict:
        c = self.cycler
        flood = collections.Counter(dict.fromkeys(("connections", "messages", "replies", "held"), 0))
        for f in self.flooders:
            flood.update(f.counts)
        flood_errors = [e for f in self.flooders for e in f.errors.first][:FIRST_ERRORS]
        try:
            log = log_summary(read_log(self.log_path, self.log_from))
        except OSError as e:
            log = dict(error=f"{type(e).__name__}: {e}")
        return dict(gate_every_s=self.every, flooders=len(self.flooders), t_start=self.t_start,
                    t_cycler_end=c.t_end, t_end=t_end, restarts=c.restarts, stop=durations(c.commands, "stop"),
                    start=durations(c.commands, "start"), failures=c.errors.n, first_errors=c.errors.first,
                    gate_preemptions_at_stops=c.preemptions, commands=c.commands,
                    flood=dict(flood, errors=sum(f.errors.n for f in self.flooders), first_errors=flood_errors),
                    threads_left_running=alive, final_gate=final, daemon_log=log)
