#!/usr/bin/env python
"""The gRPC endpoint alone: server CPU per ModelInfer call and latency, the project's own HTTP/2
(``frontend/grpc/calls.py``) against grpc.aio doing the same work, load from h2load.

Each server runs in its own process on uvloop with a stub engine that answers every submission
on the next loop turn with float32 rows [n, --dim], so the process's CPU is the endpoint's own:
HTTP/2, the request's parsing and checks (``grpc/service.infer_args``, ``fastpath.submit_ids``),
the hand-written answer (``grpc/proto.infer_response``). The baseline is a ``grpc.aio`` server
whose ``ModelInfer`` handler does that same work in a coroutine (the endpoint before decision
33). For each server and each --connections x --streams point, h2load (another process) runs
--seconds closed loop with one --ids-id request; the server's CPU comes from /proc.

    python -m bench.frontdoor.grpc_endpoint                      # about a minute
    python -m bench.frontdoor.grpc_endpoint --connections 16 64 --streams 1 4 --seconds 5

Printed: one row per server and point (calls/s, server CPU-us per call, p50 / p99 / p99.9 ms),
then the own server's CPU per call over grpc.aio's. JSON: ``grpc_endpoint_<machine>_<date>.json``
in $OUT (else bench/results/), or --out FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import clients as lc
from loadtest.cpu import CLK_TCK, read_stat
from loadtest.harness import Daemon
from loadtest.results import add_result_options, doc_parser, result_path, run_meta, write_result

SERVERS = ("own", "grpcio")


class StubPipeline:
    """An engine client that answers each submission on the next loop turn."""

    ready, num_nodes, node_capacity, num_features = True, 1 << 30, 1 << 30, 4

    def __init__(self, dim: int) -> None:
        self.dim, self.count = dim, 0

    def submit_ids_async(self, ids: np.ndarray, *args: Any) -> tuple[str, Any]:
        from quiver_serve.messages import EmbedResult

        self.count += 1
        rid = str(self.count)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        result = EmbedResult(rid, None, model="m", version=1)
        result.rows = np.ones((ids.size, self.dim), np.float32)
        loop.call_soon(resolve, fut, result)
        return rid, fut

    def cancel(self, request_id: str, reason: str = "") -> bool:
        return True


def resolve(fut: Any, result: Any) -> None:
    if not fut.done():  # a call the client cancelled cancels its future
        fut.set_result(result)


def stub_state(dim: int) -> Any:
    from quiver_serve.config import ServeConfig

    view = types.SimpleNamespace(default="m", submit_target=lambda m, v: (m, v))
    return types.SimpleNamespace(cfg=ServeConfig.default(), pipeline=StubPipeline(dim),
                                 views=types.SimpleNamespace(current=lambda **_: view))


async def grpcio_server(state: Any, port: int) -> tuple[Any, int]:
    """grpc.aio with a ``ModelInfer`` handler doing the own endpoint's work in a coroutine."""
    import grpc

    from quiver_serve.frontend.fastpath import answer_of, submit_ids
    from quiver_serve.frontend.grpc import proto as gp
    from quiver_serve.frontend.grpc.service import infer_args

    async def infer(req: Any, ctx: Any) -> bytes:
        a = infer_args(req)
        sub = submit_ids(state, a.ids, a.exact, a.seed, a.timeout_ms, a.min_version, None,
                         a.model, a.version)
        answer = answer_of(await sub.future, sub)
        return gp.infer_response(answer.model, str(answer.version), req.id, answer.rows)

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.unary_unary_rpc_method_handler(
        infer, request_deserializer=gp.message("ModelInferRequest").FromString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        gp.SERVICE, {"ModelInfer": handler}),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound  # the server stops when it is garbage


async def serve_async(kind: str, dim: int, port: int) -> None:
    state = stub_state(dim)
    if kind == "own":
        from quiver_serve.frontend.grpc import calls as grpc_calls

        server: Any = await grpc_calls.start(state, "127.0.0.1", port, None)
    else:
        server, _ = await grpcio_server(state, port)
    await asyncio.Event().wait()
    del server


def serve(kind: str, dim: int, port: int) -> None:
    """The server process: serves on ``port`` until killed."""
    import uvloop

    uvloop.install()
    asyncio.run(serve_async(kind, dim, port))


def point(tool: lc.Tool, port: int, pid: int, body: Path, connections: int, streams: int,
          seconds: int, ids: int) -> dict[str, Any]:
    """One h2load run: calls/s, latency percentiles and the server's CPU per call."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "h2load.log"
        argv = lc.h2load_argv(f"http://127.0.0.1:{port}", body, connections, seconds, 1, log)
        argv[argv.index("-m") + 1] = str(streams)
        before = read_stat(pid)
        out, client_cpu_s = lc.run_client(argv, tool, seconds + lc.RUN_SLACK_S)
        after = read_stat(pid)
        status, dur_us = lc.read_h2load_log(log)
    res = lc.h2load_point(lc.parse_h2load(out), status, dur_us, float(seconds), ids)
    ticks = (after[1] - before[1]) if before and after else 0
    res.update({"connections": connections, "streams": streams,
                "server_cpu_us_per_call": ticks / CLK_TCK * 1e6 / max(res["ok"], 1),
                "client_cpu_us_per_call": client_cpu_s * 1e6 / max(res["ok"], 1)})
    return res


def run(args: Any) -> dict[str, Any]:
    tool = lc.find_tool("h2load")
    if tool is None:
        raise SystemExit("h2load not found (bench/README.md: filling .tools/)")
    rows: list[dict[str, Any]] = []
    request = lc.grpc_frame(lc.model_infer_request("m", np.arange(args.ids, dtype=np.int64)))
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(request)
        body.flush()
        for kind in args.servers:
            with Daemon(command=("-m", "bench.frontdoor.grpc_endpoint", "--serve", kind),
                        args=["--dim", str(args.dim)], name=f"{kind} gRPC endpoint",
                        ready_path=None, ready_timeout_s=60.0, grace_s=2.0) as srv:
                check = lc.grpc_check(f"127.0.0.1:{srv.port}", request[5:])
                for c in args.connections:
                    for m in args.streams:
                        row = point(tool, srv.port, srv.pid, Path(body.name), c, m, args.seconds,
                                    args.ids)
                        row.update(server=kind, check=check)
                        rows.append(row)
                        print(f"| {kind} | {c} x {m} | {row['req_per_s']:,.0f} | "
                              f"{row['server_cpu_us_per_call']:.1f} | {row['p50_ms']:.2f} / "
                              f"{row['p99_ms']:.2f} / {row['p999_ms']:.2f} | {row['errors']} |",
                              flush=True)
    return {"meta": run_meta(args, h2load=tool.version()), "rows": rows, "ratios": ratios(rows)}


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: own CPU per call / grpc.aio's, own calls/s / grpc.aio's."""
    by = {(r["server"], r["connections"], r["streams"]): r for r in rows}
    out = []
    for (kind, c, m), own in by.items():
        base = by.get(("grpcio", c, m))
        if kind == "own" and base is not None:
            out.append({"connections": c, "streams": m,
                        "cpu_per_call": own["server_cpu_us_per_call"]
                        / max(base["server_cpu_us_per_call"], 1e-9),
                        "calls_per_s": own["req_per_s"] / max(base["req_per_s"], 1e-9)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = doc_parser("python -m bench.frontdoor.grpc_endpoint", __doc__)
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="h2load -m")
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--ids", type=int, default=48, help="ids per request")
    ap.add_argument("--dim", type=int, default=64, help="columns of the stub's answer rows")
    ap.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    ap.add_argument("--out-dir")
    add_result_options(ap)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.dim, args.port)
        return
    print("| server | connections x streams | calls/s | server CPU-us per call | "
          "p50 / p99 / p99.9 ms | errors |\n|---|---|---|---|---|---|", flush=True)
    result = run(args)
    for r in result["ratios"]:
        print(f"own / grpc.aio at {r['connections']} x {r['streams']}: CPU per call "
              f"{r['cpu_per_call']:.2f}, calls/s {r['calls_per_s']:.2f}")
    write_result(result_path("grpc_endpoint", args), result)


if __name__ == "__main__":
    main()
