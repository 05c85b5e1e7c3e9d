"""A small GPU-bound online server and its client, for the package check on a GPU host.

Server: each request line makes it run a few matrix products on the GPU and answer one line.
Client: sends requests with gaps (so each one arrives to an idle server) and prints one JSON
object with how many were answered and their latencies.
"""
import argparse
import json
import socket
import time


def serve(port: int) -> None:
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    srv = socket.create_server(("127.0.0.1", port))
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rwb") as f:
            for line in f:
                b = a
                for _ in range(8):
                    b = b @ a
                torch.cuda.synchronize()
                f.write(b"ok %d\n" % len(line))
                f.flush()


def client(port: int, requests: int, gap_ms: float) -> None:
    lat, ok = [], 0
    deadline = time.monotonic() + 60
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with sock, sock.makefile("rwb") as f:
        for i in range(requests):
            time.sleep(gap_ms / 1000)
            t = time.monotonic()
            f.write(b"request %d\n" % i)
            f.flush()
            if f.readline().startswith(b"ok"):
                ok += 1
                lat.append((time.monotonic() - t) * 1000)
    lat.sort()
    p50 = lat[len(lat) // 2] if lat else None
    print(json.dumps({"requests": requests, "ok": ok, "latency_ms_p50": p50,
                      "latency_ms_max": lat[-1] if lat else None}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--client", action="store_true", help="send requests instead of serving")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=150)
    a = ap.parse_args()
    if a.client:
        client(a.port, a.requests, a.gap_ms)
    else:
        serve(a.port)


if __name__ == "__main__":
    main()
