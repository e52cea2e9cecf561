#!/usr/bin/env python
"""What uvicorn's event loop and HTTP parser cost per request, with nothing else in the way.

uvicorn serves a trivial raw-ASGI app (read the body, answer 11 bytes of JSON) on each of
uvloop + httptools, asyncio + httptools and asyncio + h11 in turn, ``--rounds`` times; one
keep-alive ``http.client`` connection sends ``--requests`` small POSTs to it. Prints the server
process's CPU per request (from /proc) and the client's p50.

    python -m bench.frontdoor.uvicorn_loop [--requests 4000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import subprocess
import sys
import time
from typing import Any

from loadtest.results import ROOT

COMBOS = (("uvloop", "httptools"), ("asyncio", "httptools"), ("asyncio", "h11"))
BODY = b'{"node_ids": [1]}'


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await receive()
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def serve(port: int, loop: str, http_impl: str) -> None:
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, loop=loop, http=http_impl, log_level="warning",
                access_log=False, lifespan="off")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connect(port: int, proc: subprocess.Popen) -> http.client.HTTPConnection:
    for _ in range(100):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/x", BODY)
            conn.getresponse().read()
            return conn
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("server did not answer")


def measure(loop: str, http_impl: str, n: int) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "bench.frontdoor.uvicorn_loop", "--serve",
                             str(port), loop, http_impl], cwd=ROOT)
    try:
        conn = connect(port, proc)
        headers = {"content-type": "application/json"}
        for _ in range(300):
            conn.request("POST", "/x", BODY, headers)
            conn.getresponse().read()
        lat = []
        c0 = cpu_s(proc.pid)
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("POST", "/x", BODY, headers)
            conn.getresponse().read()
            lat.append(time.perf_counter() - t0)
        cpu_us = (cpu_s(proc.pid) - c0) / n * 1e6
        lat.sort()
        return cpu_us, lat[n // 2] * 1e3
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for _ in range(args.rounds):
        for loop, http_impl in COMBOS:
            cpu_us, p50_ms = measure(loop, http_impl, args.requests)
            print(f"{loop:8s} {http_impl:9s} server CPU {cpu_us:5.0f} us/request, p50 {p50_ms:.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
