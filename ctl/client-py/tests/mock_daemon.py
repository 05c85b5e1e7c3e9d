"""A stand-in for `valvectl daemon --pool` for the Python package's tests: the pool protocol
(docs/memory.md, "The pool protocol") over a SOCK_SEQPACKET socket, with memfds as handles.

It serves register, attach, grow, shrink, usage and status, announces the pool to premapped online
clients, and can send an offline client a `reclaim` (`MockDaemon.reclaim`). Pair it with
`valve.Client(..., _fake=True)`, which maps nothing, so no GPU is needed.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import tempfile
import threading

MIB = 1 << 20
MAX_MESSAGE = 1 << 20


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _recv(sock: socket.socket):
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 250)
    if not data:
        return None, fds
    return json.loads(data), fds


class MockDaemon:
    def __init__(self, handles: int = 8, handle_bytes: int = 8 * MIB, usage_target: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="valve-mock-")
        self.path = os.path.join(self.dir, "pool.sock")
        self.handle_bytes = handle_bytes
        self.usage_target = usage_target
        self.owner: list[int | None] = [None] * handles
        self.fds = [os.memfd_create(f"handle-{h}") for h in range(handles)]
        self.clients: dict[int, dict] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.rids = itertools.count(1)
        self.log: list[dict] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for fd in self.fds:
            os.close(fd)
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass

    def __enter__(self) -> "MockDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def held(self, client: int) -> list[int]:
        with self.lock:
            return [h for h, o in enumerate(self.owner) if o == client]

    def reclaim(self, client: int, count: int) -> dict:
        """The daemon's reclaim: asks the client's callback thread for `count` handles back."""
        cb = self.clients[client]["callback"]
        rid = next(self.rids)
        _send(cb, {"op": "reclaim", "rid": rid, "count": count})
        reply, _ = _recv(cb)
        assert reply["rid"] == rid, reply
        with self.lock:
            for h in reply.get("handles", []):
                assert self.owner[h] == client, (h, self.owner)
                self.owner[h] = None
        return reply

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        me = None
        while True:
            try:
                msg, _fds = _recv(conn)
            except OSError:
                break
            if msg is None:
                break
            self.log.append(msg)
            op = msg.get("op")
            if op == "attach":
                self._attach(conn, msg)
                return
            if op == "register":
                me = next(self.ids)
                premap = msg["role"] == "online" and msg.get("premap", True)
                self.clients[me] = {"role": msg["role"], "premap": premap, "callback": None}
                _send(conn, {"ok": True, "client": me, "token": f"tok-{me}", "handle_bytes": self.handle_bytes,
                             "gpu_index": 0, "pool_capacity_handles": len(self.owner)})
            elif me is None:
                _send(conn, {"ok": False, "code": 13, "error": "not registered: send `register` first"})
            elif op == "grow":
                self._grow(conn, me, msg.get("count", 0))
            elif op == "shrink":
                with self.lock:
                    bad = [h for h in msg["handles"] if self.owner[h] != me]
                    if bad:
                        _send(conn, {"ok": False, "code": 14, "error": f"handles {bad} are not this client's"})
                        continue
                    for h in msg["handles"]:
                        self.owner[h] = None
                _send(conn, {"ok": True})
            elif op == "usage":
                _send(conn, {"ok": True, "target_handles": self.usage_target})
            elif op == "status":
                with self.lock:
                    free = sum(o is None for o in self.owner)
                _send(conn, {"ok": True, "handles": len(self.owner), "free_handles": free,
                             "handle_bytes": self.handle_bytes})
            else:
                _send(conn, {"ok": False, "code": 2, "error": f"unknown op {op!r}"})
        if me is not None:
            with self.lock:
                self.owner = [None if o == me else o for o in self.owner]

    def _attach(self, conn: socket.socket, msg: dict) -> None:
        client = msg.get("client")
        if client not in self.clients or msg.get("token") != f"tok-{client}":
            _send(conn, {"ok": False, "code": 13, "error": "wrong token for this client"})
            return
        self.clients[client]["callback"] = conn
        _send(conn, {"ok": True})
        if self.clients[client]["premap"]:
            everything = list(range(len(self.owner)))
            _send(conn, {"op": "pool_handles", "handles": everything}, [self.fds[h] for h in everything])

    def _grow(self, conn: socket.socket, me: int, count: int) -> None:
        with self.lock:
            free = [h for h, o in enumerate(self.owner) if o is None]
            if count > len(self.owner):
                _send(conn, {"ok": False, "code": 11, "error": f"{count} handles is more than the pool's {len(self.owner)}"})
                return
            if len(free) < count:
                _send(conn, {"ok": False, "code": 12, "error": f"{len(free)} free handle(s), {count} asked"})
                return
            lent = free[:count]
            for h in lent:
                self.owner[h] = me
        if self.clients[me]["premap"]:
            _send(conn, {"ok": True, "handles": lent, "fds_for": []})
        else:
            _send(conn, {"ok": True, "handles": lent}, [self.fds[h] for h in lent])
