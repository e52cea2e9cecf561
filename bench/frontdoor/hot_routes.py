#!/usr/bin/env python
"""CPU per request of the hot routes' Python layers: the raw-ASGI layer against FastAPI's routes.

One process, one real :class:`~quiver_serve.engine.pipeline.Pipeline` (the config's graph and
model; its engine cores and samplers are other processes), two apps on it: ``server.fast_routes``
on and off. Single requests go to each app as raw ASGI calls (what uvicorn hands over: scope,
receive, send), in alternating blocks, and this process's CPU time per request is read with
``time.process_time``: the guards, the timing layer, routing, body parsing, the submit to the
engine client and the answer's encoding, without uvicorn's socket and HTTP parsing (the same for
both) and without the engine's work (other processes). CPU time, not wall time, so a busy shared
box moves it little.

    python -m bench.frontdoor.hot_routes [--config quiver_serve/defaults/default.yaml] [--requests 2000]

JSON: --out, else $OUT or bench/results/, hot_routes_<machine>_<date>[_<label>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np
import orjson

from loadtest.results import add_result_options, result_path


def requests(model: str) -> dict[str, tuple[str, bytes, list[tuple[bytes, bytes]]]]:
    raw = np.asarray([100], dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [1],
                                     "parameters": {"binary_data_size": 8}}],
                         "parameters": {"binary_data_output": True}})
    json_h = [(b"content-type", b"application/json")]
    return {
        "embed_json_1": ("/v1/embed", b'{"node_ids": [100]}', json_h),
        "embed_npy_1": ("/v1/embed", b'{"node_ids": [100]}',
                        [*json_h, (b"accept", b"application/x-npy")]),
        "kserve_json_1": (f"/v2/models/{model}/infer", orjson.dumps({"inputs": [
            {"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [100]}]}), json_h),
        "kserve_binary_1": (f"/v2/models/{model}/infer", head + raw,
                            [(b"content-type", b"application/octet-stream"),
                             (b"inference-header-content-length", str(len(head)).encode())]),
    }


async def one(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """One request as uvicorn hands it over; returns the status."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1:8000"),
                         (b"content-length", str(len(body)).encode()), *headers]}
    sent = asyncio.get_running_loop().create_future()
    first = True
    status = [0]

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await sent  # as uvicorn: http.disconnect only once the answer is out (or the client left)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif not message.get("more_body", False) and not sent.done():
            sent.set_result(None)

    await app(scope, receive, send)
    return status[0]


async def measure(apps: dict[str, Any], reqs: dict, n: int, block: int) -> dict[str, dict]:
    cpu = {(a, r): 0.0 for a in apps for r in reqs}
    wall: dict[tuple[str, str], list[float]] = {(a, r): [] for a in apps for r in reqs}
    for app in apps.values():  # warm-up (first calls build the middleware stacks)
        for path, body, headers in reqs.values():
            for _ in range(20):
                assert await one(app, path, body, headers) == 200
    for _ in range(max(1, n // block)):
        for r, (path, body, headers) in reqs.items():
            for a, app in apps.items():
                c0 = time.process_time()
                for _ in range(block):
                    t0 = time.perf_counter()
                    status = await one(app, path, body, headers)
                    wall[(a, r)].append(time.perf_counter() - t0)
                    if status != 200:
                        raise RuntimeError(f"{a} {r}: status {status}")
                cpu[(a, r)] += time.process_time() - c0
    done = max(1, n // block) * block
    return {f"{a}/{r}": {"cpu_us_per_request": cpu[(a, r)] / done * 1e6,
                         "p50_ms": float(np.percentile(wall[(a, r)], 50) * 1e3)}
            for a in apps for r in reqs}


class _Transport:
    """What the protocol writes to: counts answers, and feeds the connection its next request
    (a closed loop with no network in the way)."""

    def __init__(self, loop: Any, wire: bytes, left: list[int], done: Any) -> None:
        self.loop, self.wire, self.left, self.done = loop, wire, left, done
        self.protocol: Any = None
        self.statuses: dict[bytes, int] = {}

    def writelines(self, parts: list[Any]) -> None:
        status = bytes(parts[0][9:12])
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.left[0] -= 1
        if self.left[0] > 0:
            self.loop.call_soon(self.protocol.data_received, self.wire)
        elif not self.done.done():
            self.done.set_result(None)

    def write(self, data: bytes) -> None:
        self.writelines([data])

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None

    def set_protocol(self, protocol: Any) -> None:
        return None


def wire_request(path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"host: 127.0.0.1:8000",
            b"content-length: " + str(len(body)).encode()]
    head += [k + b": " + v for k, v in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def protocol_loop(app: Any, reqs: dict, n: int, connections: int) -> dict[str, dict]:
    """The hot routes through the HTTP protocol itself (``frontend/hot_protocol.py``), with
    ``connections`` closed-loop connections on fake transports: CPU per request of parsing,
    admission, the hand-off to the engine client, the reply and the answer's write."""
    import uvicorn
    from uvicorn.server import ServerState

    from quiver_serve.frontend.listen import uvicorn_options

    loop = asyncio.get_running_loop()
    config = uvicorn.Config(app, **uvicorn_options(app))
    config.load()
    rows = {}
    for r, (path, body, headers) in reqs.items():
        wire = wire_request(path, body, headers)
        for rounds, count in ((0, max(20, connections)), (1, n)):
            left, done = [count], loop.create_future()
            statuses: dict[bytes, int] = {}
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(connections):
                transport = _Transport(loop, wire, left, done)
                proto = config.http_protocol_class(config, ServerState(), {}, loop)
                transport.protocol = proto
                proto.connection_made(transport)
                transport.statuses = statuses
                proto.data_received(wire)
            await asyncio.wait_for(done, 120)
            if rounds:
                answered = count + connections - 1
                rows[f"protocol/{r}/c{connections}"] = {
                    "cpu_us_per_request": (time.process_time() - c0) / answered * 1e6,
                    "requests_per_s": answered / (time.perf_counter() - t0),
                    "statuses": {k.decode(): v for k, v in statuses.items()}}
            await asyncio.sleep(0.2)  # the last connections' answers
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    p.add_argument("--requests", type=int, default=2000, help="requests per app and route")
    p.add_argument("--block", type=int, default=100, help="requests per block (apps alternate)")
    p.add_argument("--connections", type=int, nargs="*", default=[1, 16, 64],
                   help="closed-loop connections of the protocol path (fake transports)")
    p.add_argument("--label", default="run", help="the run's name (in the JSON and, unless "
                   "'run', the file name)")
    p.add_argument("--out", help="JSON file (default $OUT or bench/results/, "
                   "hot_routes_<machine>_<date>[_<label>].json)")
    add_result_options(p)
    args = p.parse_args()
    import uvloop

    from quiver_serve.config import ServeConfig, resolve_path
    from quiver_serve.engine.client.pipeline import Pipeline
    from quiver_serve.frontend.app import create_app

    cfg = ServeConfig.from_yaml(resolve_path(args.config)) if args.config else ServeConfig.default()
    slow_cfg = cfg.model_copy(deep=True)
    cfg.server.fast_routes, slow_cfg.server.fast_routes = True, False
    pipeline = Pipeline(cfg)
    apps = {"fastapi": create_app(slow_cfg, pipeline), "fast_layer": create_app(cfg, pipeline)}
    pipeline.start()
    try:
        reqs = requests(cfg.model.name)
        rows = uvloop.run(measure(apps, reqs, args.requests, args.block))
        for c in args.connections:
            rows.update(uvloop.run(protocol_loop(apps["fast_layer"], reqs, args.requests, c)))
    finally:
        pipeline.stop(drain_timeout_s=0.0)
    out = {"label": args.label, "requests": args.requests, "rows": rows}
    path = result_path("hot_routes", args, None if args.label == "run" else args.label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"{'app/route':38s} {'CPU us/req':>10s} {'p50 ms':>8s} {'req/s':>8s}")
    for name, r in rows.items():
        print(f"{name:38s} {r['cpu_us_per_request']:10.0f} {r.get('p50_ms', float('nan')):8.3f} "
              f"{r.get('requests_per_s', float('nan')):8.0f} {r.get('statuses', '')}")
    print(f"written {path}")


if __name__ == "__main__":
    main()
