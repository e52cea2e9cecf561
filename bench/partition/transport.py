#!/usr/bin/env python
"""The data path between partition servers: a Ray actor call (NumPy arrays through Ray's object
store) against the project's ZeroMQ wire (a msgpack header and raw frames, no pickling, sent and
viewed without copies: ``quiver_serve/wire.py``), for the feature call of a batch: global ids
out, float32 rows back. Both servers gather the same rows from the same matrix; both clients are
asyncio callers in the same process, one call at a time (latency) and 16 in flight (throughput).

    python -m bench.partition.transport            # bench/results/partition_transport_<machine>_<date>.json

Writes per (path, ids per call) p50/p99 microseconds and calls/s; decision 0045 reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np

from loadtest.results import result_path, run_meta

ROWS, FEATURES = 200_000, 128
SIZES = (64, 1024, 16384)


class RowServer:
    """The feature call's work: rows of the ids asked."""

    def __init__(self) -> None:
        self.x = np.random.default_rng(0).standard_normal((ROWS, FEATURES)).astype(np.float32)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.x[ids]


def _zmq_server(address: str) -> None:
    import zmq

    server = RowServer()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        ident, head, frame = sock.recv_multipart(copy=False)
        if bytes(head) == b"stop":
            return
        ids = np.frombuffer(frame.buffer, dtype=np.int64)
        sock.send_multipart([ident, b"rows", server.rows(ids)], copy=False)


async def _time_calls(call: Any, ids: np.ndarray, calls: int, concurrency: int) -> dict[str, float]:
    lat: list[float] = []

    async def worker(n: int) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            await call(ids)
            lat.append(time.perf_counter() - t0)

    for _ in range(5):
        await call(ids)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    us = np.array(lat) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "calls_per_s": len(lat) / wall}


async def _zmq_client(address: str, sizes: tuple[int, ...], calls: int) -> dict[str, Any]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    out: dict[str, Any] = {}
    socks: list[Any] = []

    def sock() -> Any:
        s = ctx.socket(zmq.DEALER)
        s.connect(address)
        socks.append(s)
        return s

    pool: asyncio.Queue[Any] = asyncio.Queue()
    for _ in range(16):
        pool.put_nowait(sock())

    async def call(ids: np.ndarray) -> np.ndarray:
        s = await pool.get()
        try:
            await s.send_multipart([b"rows", ids], copy=False)
            _, frame = await s.recv_multipart(copy=False)
            return np.frombuffer(frame.buffer, dtype=np.float32).reshape(ids.size, FEATURES)
        finally:
            pool.put_nowait(s)

    rng = np.random.default_rng(1)
    for n in sizes:
        ids = rng.integers(0, ROWS, n)
        out[str(n)] = {"serial": await _time_calls(call, ids, calls, 1),
                       "16_in_flight": await _time_calls(call, ids, calls, 16)}
    stop = ctx.socket(zmq.DEALER)
    stop.connect(address)
    await stop.send_multipart([b"stop", b""])
    await asyncio.sleep(0.1)
    for s in [*socks, stop]:
        s.close(0)
    ctx.term()
    return out


def run_zmq(sizes: tuple[int, ...], calls: int, address: str) -> dict[str, Any]:
    proc = mp.get_context("spawn").Process(target=_zmq_server, args=(address,), daemon=True)
    proc.start()
    time.sleep(1.0)
    try:
        return asyncio.run(_zmq_client(address, sizes, calls))
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def run_ray(sizes: tuple[int, ...], calls: int) -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=300 << 20)
    try:
        server = ray.remote(RowServer).options(num_cpus=0.5).remote()
        ray.get(server.rows.remote(np.arange(4)))

        async def call(ids: np.ndarray) -> np.ndarray:
            return await server.rows.remote(ids)

        async def all_sizes() -> dict[str, Any]:
            rng = np.random.default_rng(1)
            out: dict[str, Any] = {}
            for n in sizes:
                ids = rng.integers(0, ROWS, n)
                out[str(n)] = {"serial": await _time_calls(call, ids, calls, 1),
                               "16_in_flight": await _time_calls(call, ids, calls, 16)}
            return out

        return asyncio.run(all_sizes())
    finally:
        ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", help="folder of the JSON (default $OUT, else bench/results/)")
    ap.add_argument("--out", help="the JSON file (default: in --out-dir, by name)")
    ap.add_argument("--calls", type=int, default=400, help="timed calls per size and mode")
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="quiver-transport-")
    result = {"rows": ROWS, "features": FEATURES, "cpus": os.cpu_count(),
              "zmq_ipc": run_zmq(SIZES, args.calls, f"ipc://{run_dir}/rows.sock"),
              "zmq_tcp": run_zmq(SIZES, args.calls, f"tcp://127.0.0.1:{_free_port()}"),
              "ray": run_ray(SIZES, args.calls)}
    path = result_path("partition_transport", args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": run_meta(args), **result}, indent=2) + "\n")
    for link in ("ray", "zmq_tcp", "zmq_ipc"):
        for n, modes in result[link].items():
            s, c = modes["serial"], modes["16_in_flight"]
            print(f"{link:8s} {n:>6s} ids: serial p50 {s['p50_us']:8.0f} us p99 "
                  f"{s['p99_us']:8.0f} us | 16 in flight {c['calls_per_s']:8.0f} calls/s "
                  f"p99 {c['p99_us']:8.0f} us")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
