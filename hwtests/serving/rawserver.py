"""The graph decoder (decoder.py) behind plain TCP, for `bench.py --server graph-raw`: the thread that
decodes also accepts and reads each request, so its first kernel follows the request's bytes closely.

Protocol (one request per connection: the client connects, writes, reads until the server closes):
  request   a 12-byte header, struct "<4sii": b"VRQ1", max_tokens, n_ids; then n_ids int32
            little-endian token ids (any values: the prefill graph takes them modulo the
            vocabulary). For a person with nc, one line of JSON also works:
            {"ids": [1, 2, 3], "max_tokens": 4}
  control   one line of JSON: {"calibrate": true} maps the GPU clock again and answers
            {"mapping": {...}} (an {"error": ...} without --stamp-first-kernel, as the HTTP
            server's /v1/valve/calibrate); {"health": true} answers {"status": "ok"}.
  answer    one line per token, its id in decimal ("123\\n"), then one line of JSON, {"done": true,
            "tokens": N, "recv_ns": .., "launch_ns": ..} plus, with the stamp, "gpu_start_ns",
            "gpu_start_globaltimer_ns" and "mapping_offset_ns" (as the HTTP graph engine's final
            chunk); or a line {"error": "..."}. Then the server closes. Times: CLOCK_MONOTONIC ns.

The prompt is padded with zeros or truncated to --prompt-tokens, the length the prefill graph was
captured at (on CUDA, at start-up, like the decode step; on CPU both run eagerly, for the tests).
Per request: recv returns (the bytes land straight in a pinned host buffer) -> recv_ns -> one async
copy of the ids into the graph's static input -> launch_ns -> the stamp (if on) -> prefill replay
-> decode (one graph replay and host sync per token, as the HTTP graph engine). One request at a time: requests
that arrive meanwhile wait in the listen backlog, their bytes in the kernel's socket buffers.

What to expect on a GPU host (not measured yet): send -> recv a few tens of us (loopback and one
thread wake-up), recv -> host launch 10-30 us (no HTTP, JSON, tokenizer, thread hand-off or host
copy: a header unpack and one torch call), host launch -> GPU start 10-20 us (the stamp's driver call and
the 2 KiB copy ahead of it): send -> first kernel running about 0.1 ms alone, against 1.4 ms for
the HTTP graph engine on the H200. Where send -> recv dominates, the thread's wake-up from a deep
idle state is the next thing to look at.

    python3 rawserver.py --size 3b --device cuda --port 8000 --prompt-tokens 512 \\
        [--stamp-first-kernel OUTDIR/stamp.ptx]

Prints `READY <port>` once it serves.
"""

import argparse
import ctypes
import gc
import json
import socket
import struct
import sys
import time

from stamp import stamp_file

HEADER = struct.Struct("<4sii")  # magic, max_tokens, n_ids
MAGIC = b"VRQ1"
MAX_IDS = 1 << 16
IO_TIMEOUT_S = 30.0  # a client that connects and sends nothing holds the server this long
DRAIN_S = 0.2  # after an error: how long to read what the client still sends, so close sends no RST


NO_STAMP = "the first-kernel stamp is off: start rawserver.py --device cuda --stamp-first-kernel stamp.ptx"


class RequestError(ValueError):
    """A request or control message the server cannot serve: answered with an error line."""


def encode_request(ids, max_tokens):
    """A request's bytes: the header and the ids as int32."""
    return HEADER.pack(MAGIC, max_tokens, len(ids)) + struct.pack(f"<{len(ids)}i", *ids)


def log(*a):
    print("rawserver:", *a, file=sys.stderr, flush=True)


class TorchEngine:
    """The model side: GraphDecoder with its decode step and a prefill of fixed length captured.
    Requests are read into `buf`, the bytes of a host tensor (pinned on CUDA): the header, then the
    int32 ids, which the prefill's input is copied from as they are."""

    def __init__(self, size, device, max_len, prompt_len, stamp_path=None):
        import torch
        from decoder import GraphDecoder

        self.dec = GraphDecoder(size=size, device=device, max_len=max_len)
        self.dec.capture()
        self.dec.capture_prefill(prompt_len)
        self.plen, self.max_tokens = prompt_len, max_len - prompt_len
        size = HEADER.size + 4 * MAX_IDS
        self.req = torch.zeros(size, dtype=torch.uint8, pin_memory=self.dec.device.type == "cuda")
        self.buf = memoryview((ctypes.c_ubyte * size).from_address(self.req.data_ptr())).cast("B")
        self.ids_ptr = self.req.data_ptr() + HEADER.size
        self.prompt = self.req[HEADER.size:].view(torch.int32)[:prompt_len]
        self.static_ids = self.dec.p_ids.view(-1)
        self.stamper, self.mapping = None, None
        if stamp_path:
            from stamp import start_stamper

            self.stamper, self.mapping = start_stamper(stamp_path, torch, self.dec.device)
            log(f"STAMP mapping at start: {json.dumps(self.mapping)}")
        for _ in range(3):  # warm-up: allocator, kernels, the stamp
            for _ in self.generate(16, 4, {}):
                pass

    def generate(self, n_ids, n, marks):
        """Yields n tokens for the n_ids ids in `buf`; sets marks["launch_ns"] just before the first
        kernel and, after the last token, the stamp's fields."""
        if n_ids < self.plen:  # padded with zeros (longer prompts are cut: the rest is not copied)
            ctypes.memset(self.ids_ptr + 4 * n_ids, 0, 4 * (self.plen - n_ids))
        # The buffer is read into again only after this request's host syncs: the copy is done.
        self.static_ids.copy_(self.prompt, non_blocking=True)
        marks["launch_ns"] = time.monotonic_ns()
        slot = self.stamper.begin() if self.stamper else None
        self.dec.prefill_static()
        yield from self.dec.decode(self.dec.p_out.item(), self.plen, n)
        if slot is not None:  # the request's work is done: reading the slot waits for nothing
            from stamp import stamp_fields

            marks.update(stamp_fields(self.stamper.read(slot), self.mapping))

    def calibrate(self):
        """A fresh mapping of the GPU clock (the bench asks with the GPU otherwise idle)."""
        if self.stamper is None:
            raise RequestError(NO_STAMP)
        self.mapping = self.stamper.calibrate()
        log(f"STAMP mapping: {json.dumps(self.mapping)}")
        return self.mapping


def send_line(conn, msg):
    conn.sendall(json.dumps(msg).encode() + b"\n")


class RawServer:
    """The socket side, all on the calling thread: accept, read one request, answer, close. Any
    engine with `buf` (a writable buffer), `max_tokens`, `generate(n_ids, n, marks)` and
    `calibrate()` serves (the tests use one without torch)."""

    def __init__(self, engine, port=0, host="127.0.0.1", backlog=128):
        self.engine = engine
        self.view = memoryview(engine.buf).cast("B")
        self.lsock = socket.create_server((host, port), backlog=backlog)
        self.port = self.lsock.getsockname()[1]
        self.stopping = False

    def serve_forever(self):
        while not self.stopping:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                if self.stopping:
                    return
                raise
            with conn:
                try:
                    self.handle(conn)
                except OSError as e:  # the client went away or stalled: on to the next one
                    log(f"connection dropped: {type(e).__name__}: {e}")

    def stop(self):
        """Ends serve_forever (from another thread): shutting the listener down wakes its accept."""
        self.stopping = True
        try:
            self.lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.lsock.close()

    def handle(self, conn):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(IO_TIMEOUT_S)
        got = conn.recv_into(self.view)
        recv_ns = time.monotonic_ns()
        if not got:
            return  # connected and closed (a port probe): nothing was asked
        try:
            req = self.read_json(conn, got) if self.view[0] == ord("{") else self.read_binary(conn, got)
        except RequestError as e:
            self.refuse(conn, str(e))
            return
        if req is not None:
            self.answer(conn, *req, recv_ns)

    def fill(self, conn, got, need):
        """Reads until `need` bytes of the request are in the buffer."""
        while got < need:
            k = conn.recv_into(self.view[got:])
            if not k:
                raise RequestError(f"the request ended after {got} of {need} bytes")
            got += k
        return got

    def check(self, n_ids, n):
        if not 0 < n_ids <= MAX_IDS:
            raise RequestError(f"{n_ids} ids: a request has 1 .. {MAX_IDS}")
        if not 0 < n <= self.engine.max_tokens:
            raise RequestError(f"max_tokens {n}: must be 1 .. {self.engine.max_tokens} "
                               "(--max-len less --prompt-tokens)")

    def read_binary(self, conn, got):
        """(n_ids, max_tokens) of a binary request, its ids read into the buffer after the header."""
        got = self.fill(conn, got, HEADER.size)
        magic, n, n_ids = HEADER.unpack_from(self.view)
        if magic != MAGIC:
            raise RequestError(f"not a request: it starts {bytes(magic)!r}, not {MAGIC!r} or a line of JSON")
        self.check(n_ids, n)
        self.fill(conn, got, HEADER.size + 4 * n_ids)
        return n_ids, n

    def read_json(self, conn, got):
        """A JSON line: a control message (answered here; None) or a request (its ids packed into
        the buffer as a binary one's would be; (n_ids, max_tokens))."""
        while self.view[:got].tobytes().find(b"\n") < 0 and got < len(self.view):
            k = conn.recv_into(self.view[got:])
            if not k:
                break
            got += k
        try:
            msg = json.loads(bytes(self.view[:got]).split(b"\n", 1)[0])
        except ValueError as e:
            raise RequestError(f"not a line of JSON: {e}") from None
        if not isinstance(msg, dict):
            raise RequestError("a JSON line must be an object")
        if msg.get("health"):
            send_line(conn, {"status": "ok"})
            return None
        if msg.get("calibrate"):
            try:
                send_line(conn, {"mapping": self.engine.calibrate()})
            except (RequestError, RuntimeError) as e:
                raise RequestError(f"calibrate: {e}") from None
            return None
        return self.json_request(msg)

    def json_request(self, msg):
        ids, n = msg.get("ids"), msg.get("max_tokens", 16)
        if not isinstance(ids, list) or not all(type(i) is int for i in ids) or type(n) is not int:
            raise RequestError('expected {"ids": [int, ...], "max_tokens": int}, {"calibrate": true} '
                               'or {"health": true}')
        self.check(len(ids), n)
        try:
            struct.pack_into(f"<{len(ids)}i", self.view, HEADER.size, *ids)
        except struct.error as e:
            raise RequestError(f"ids must be int32: {e}") from None
        return len(ids), n

    def answer(self, conn, n_ids, n, recv_ns):
        """Streams the tokens, then the final line with the marks; an engine failure is an error line."""
        marks, count = {"recv_ns": recv_ns}, 0
        try:
            for tok in self.engine.generate(n_ids, n, marks):
                conn.sendall(b"%d\n" % tok)
                count += 1
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - the client is told, and the next request served
            log(f"request failed: {type(e).__name__}: {e}")
            send_line(conn, {"error": f"{type(e).__name__}: {e}"})
            return
        send_line(conn, dict(marks, done=True, tokens=count))

    def refuse(self, conn, why):
        """The error line, then the client's remaining bytes read for a moment: closing a socket with
        unread data resets the connection, and the client could lose the line."""
        log(f"refused: {why}")
        send_line(conn, {"error": why})
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(DRAIN_S)
        try:
            while conn.recv_into(self.view):
                pass
        except OSError:
            pass


def stamp_choice(a, ap):
    """The stamp file to load, or None (stamp.stamp_file)."""
    return stamp_file(a.stamp_first_kernel, a.device, ap, log)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", help="decoder size: tiny or 3b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed with READY)")
    ap.add_argument("--max-len", type=int, default=1024, help="KV cache length (as server.py's graph engine)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the prefill's fixed length: prompts are padded or cut to it")
    ap.add_argument("--stamp-first-kernel", metavar="PTX",
                    help="stamp each request's first kernel's GPU start (stamp.ptx from hwtests/cuda/build.sh)")
    a = ap.parse_args(argv)
    if not 0 < a.prompt_tokens < a.max_len:
        ap.error(f"--prompt-tokens {a.prompt_tokens}: must be 1 .. --max-len - 1 ({a.max_len - 1})")
    stamp_path = stamp_choice(a, ap)
    t0 = time.time()
    engine = TorchEngine(a.size, a.device, a.max_len, a.prompt_tokens, stamp_path)
    server = RawServer(engine, a.port)
    gc.collect()
    gc.freeze()  # start-up's objects out of every later collection's way
    print(f"READY {server.port} ({time.time() - t0:.1f} s to start)", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
