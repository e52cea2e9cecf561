"""Transport evidence (docs/architecture.md, "Pipeline"; decision 0001): round trip of one
micro-batch message between two processes.

Compares, in one run, ``multiprocessing.Queue`` (pickle; what the old pipeline used) against ZeroMQ
IPC (DEALER/ROUTER) with a msgspec header and raw side buffers (what the engine core uses). The
echo peer is a separate spawned process; the message is a micro-batch of ``--ids`` int64 ids going
out and a [ids, dim] float32 embedding block coming back, as on the serving path.

    python -m bench.engine.transport --ids 48 --dim 64 --iters 3000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import msgspec
import numpy as np
import zmq


class Header(msgspec.Struct, array_like=True):
    batch: int
    n: int


def _mpq_peer(inq: mp.Queue, outq: mp.Queue, dim: int) -> None:
    while True:
        item = inq.get()
        if item is None:
            return
        ids, _deadlines = item
        outq.put(np.zeros((ids.size, dim), np.float32))


def _zmq_peer(addr: str, dim: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Header)
    while True:
        ident, head, ids_buf, _deadlines = sock.recv_multipart(copy=False)
        h = dec.decode(head.buffer)
        if h.n < 0:
            return
        ids = np.frombuffer(ids_buf.buffer, np.int64)
        out = np.zeros((ids.size, dim), np.float32)
        sock.send_multipart([ident, enc.encode(h), out], copy=False)


def bench_mpq(n_ids: int, dim: int, iters: int) -> list[float]:
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(64), ctx.Queue(64)
    p = ctx.Process(target=_mpq_peer, args=(inq, outq, dim), daemon=True)
    p.start()
    ids, dl = np.arange(n_ids, dtype=np.int64), np.zeros(1, np.float64)
    lat = []
    for i in range(iters + 200):
        t0 = time.perf_counter()
        inq.put((ids, dl))
        outq.get()
        if i >= 200:
            lat.append(time.perf_counter() - t0)
    inq.put(None)
    p.join(5)
    return lat


def bench_zmq(n_ids: int, dim: int, iters: int) -> list[float]:
    addr = f"ipc://{tempfile.mkdtemp()}/bench.sock"
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_zmq_peer, args=(addr, dim), daemon=True)
    p.start()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(addr)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Header)
    ids, dl = np.arange(n_ids, dtype=np.int64), np.zeros(1, np.float64)
    lat = []
    for i in range(iters + 200):
        t0 = time.perf_counter()
        sock.send_multipart([enc.encode(Header(i, n_ids)), ids, dl], copy=False)
        head, emb = sock.recv_multipart(copy=False)
        dec.decode(head.buffer)
        np.frombuffer(emb.buffer, np.float32).reshape(-1, dim)
        if i >= 200:
            lat.append(time.perf_counter() - t0)
    sock.send_multipart([enc.encode(Header(0, -1)), ids, dl])
    p.join(5)
    return lat


def summary(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {"p50_us": statistics.median(s) * 1e6, "p99_us": s[int(0.99 * (len(s) - 1))] * 1e6,
            "msgs_per_s": len(s) / sum(s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ids", type=int, nargs="+", default=[1, 48, 4096])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3000)
    args = ap.parse_args()
    rows = []
    for n in args.ids:
        for name, fn in (("mp.Queue+pickle", bench_mpq), ("zmq-ipc+msgspec", bench_zmq)):
            r = {"transport": name, "ids": n, **summary(fn(n, args.dim, args.iters))}
            rows.append(r)
            print(f"{name:18s} ids={n:5d}  round trip p50 {r['p50_us']:7.1f} us  "
                  f"p99 {r['p99_us']:7.1f} us  {r['msgs_per_s']:8.0f} msg/s", flush=True)
    print(json.dumps({"cpus": os.cpu_count(), "rows": rows}))


if __name__ == "__main__":
    main()
