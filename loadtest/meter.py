"""One measured point of the front-door bench, whichever client drives it: wrk (HTTP), h2load
(gRPC unary with one body, the endpoint's ceiling) or the project's own generator
(``loadtest.gen``: gRPC unary and streaming, HTTP npy side by side, the queue API), each with the CPU time of the server's processes by role over the
same window (``loadtest/cpu.py``) and the load client's own CPU.

Every point is a dict with the keys the tables read (those of ``loadtest.stats.merge_point``):
``level`` (connections), ``requests``, ``ok``, ``req_per_s``, ``seed_nodes_per_s``, ``p50_ms`` ...
``p999_ms``, ``max_ms``, ``errors``, ``error_fraction``, plus ``cpu_ms`` (per process),
``cpu_ms_per_request`` (by role, ``client`` included), ``daemon_cores`` and ``client_cores``;
wrk and h2load points also ``net`` (``cpu.net_counters`` over the window: retransmitted TCP
segments, full-backlog drops and CPU time stolen by the hypervisor, machine-wide).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest import clients as lc
from loadtest import wrk_lua
from loadtest.cpu import TreeCpu, net_counters, net_delta, per_request
from loadtest.protocols import encode_http, http_path
from loadtest.workloads import IDS_PER_REQUEST, draw_requests

#: path -> (client, protocol of loadtest.protocols). gRPC unary goes through the generator's lean
#: HTTP/2 client (``grpc-h2``, ``loadtest/h2_client.py``), one connection per caller: h2load posts
#: one body file, so every request would carry the same ids, which the engine core merges into
#: one set of seeds per batch (a fraction of the sampling and model work of distinct requests:
#: on the 2-vCPU box about 3x the queue API's seeds/s, on the H200 workload (b) 1.36x), and grpc.aio
#: (``grpc-aio``, opt-in) spends several times the client CPU; gRPC streaming likewise
#: (``grpc-stream-h2``; grpc.aio's: ``grpc-stream-aio``, opt-in). ``grpc-one-body`` keeps h2load's
#: figure, named for what it is: the endpoint's ceiling.
PATHS = {"http-json": ("wrk", "http-json"), "http-npy": ("wrk", "http-npy"),
         "kserve-binary": ("wrk", "kserve-binary"), "grpc": ("gen", "grpc-h2"),
         "grpc-aio": ("gen", "grpc"), "grpc-one-body": ("h2load", "grpc"),
         "grpc-stream": ("gen", "grpc-stream-h2"), "grpc-stream-aio": ("gen", "grpc-stream"),
         "gen-npy": ("gen", "http-npy"), "queue": ("gen", "queue")}
TITLES = {"http-json": "HTTP JSON", "http-npy": "HTTP npy", "kserve-binary": "KServe binary",
          "grpc": "gRPC unary", "grpc-aio": "gRPC unary, grpc.aio client",
          "grpc-one-body": "gRPC unary, one body repeated",
          "grpc-stream": "gRPC stream", "grpc-stream-aio": "gRPC stream, grpc.aio client",
          "gen-npy": "HTTP npy", "queue": "queue API"}
#: paths whose requests are not the workload's distinct bodies (left out of the contract table)
ONE_BODY_PATHS = ("grpc-one-body",)
#: paths measured only when asked (``--paths``)
OPT_IN_PATHS = (*ONE_BODY_PATHS, "grpc-aio", "grpc-stream-aio")
CLIENT_NAMES = {"wrk": "wrk", "h2load": "h2load", "gen": "loadtest.gen"}
POINT_OVERHEAD_S = {"wrk": 0.7, "h2load": 0.7, "gen": 1.5}  # start, connect, report


@dataclass(frozen=True)
class Route:
    """How a path is driven here: the client, its protocol, the table's label."""

    client: str
    protocol: str
    label: str


def routes(tools: dict[str, Any]) -> dict[str, Route]:
    """Every path's route (client, protocol, the table's label)."""
    return {path: Route(client, protocol, f"{TITLES[path]} ({CLIENT_NAMES[client]})")
            for path, (client, protocol) in PATHS.items()}


@dataclass
class Target:
    """What the points load: the daemon's URLs, or the in-process daemon's queue endpoints."""

    model: str
    url: str | None = None
    grpc_target: str | None = None
    endpoints: Any = None


@dataclass
class Workloads:
    """The request lists every client cycles (``bodies`` per workload) and the generator's
    specs (``loadtest.workloads``)."""

    num_nodes: int
    hot: np.ndarray
    bodies: int = 4096
    seed: int = 0
    _requests: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def spec(self, workload: str) -> dict[str, Any]:
        return {"workload": workload, "hot": self.hot if workload == "a" else None,
                "num_nodes": self.num_nodes, "seed": self.seed}

    def requests(self, workload: str) -> list[np.ndarray]:
        if workload not in self._requests:
            rng = np.random.default_rng([self.seed, 7])
            rows = draw_requests(workload, self.bodies, IDS_PER_REQUEST[workload],
                                 self.num_nodes, self.hot, rng)
            self._requests[workload] = list(rows)
        return self._requests[workload]


class Meter:
    """Measures points against one target; ``gen``: the generator's load processes (spawned
    once for the run), ``cpu``: the server's process tree."""

    def __init__(self, args: Any, folder: Path, tools: dict[str, lc.Tool | None], gen: Any,
                 work: Workloads, cpu: TreeCpu, target: Target) -> None:
        self.args, self.folder, self.tools, self.gen = args, folder, tools, gen
        self.work, self.cpu, self.target = work, cpu, target
        self.routes = routes(tools)
        self.checks: dict[str, dict[str, Any]] = {}

    def cost_s(self, path: str, seconds: float | None = None) -> float:
        client = self.routes[path].client
        warm = self.args.gen_warmup_s if client == "gen" else self.args.warmup_s
        return warm + (seconds or self.args.seconds) + POINT_OVERHEAD_S[client]

    def measure(self, path: str, workload: str, level: int, seconds: int | None = None) -> dict:
        r = self.routes[path]
        client, protocol = r.client, r.protocol
        seconds = seconds or self.args.seconds
        if client == "wrk":
            p = self.wrk(protocol, workload, level, seconds)
        elif client == "h2load":
            p = self.h2load(workload, level, seconds)
        else:
            p = self.generator(protocol, workload, level)
        p.update(path=path, client=client, protocol=protocol, label=r.label, workload=workload,
                 level=level)
        return p

    def check(self, path: str, workload: str) -> dict[str, Any]:
        """One request of the path's first body with a plain client, before its sweep (raises
        when it is not answered well): the bodies and the endpoint agree."""
        key = f"{workload}/{path}"
        if key not in self.checks:
            client, protocol = self.routes[path].client, self.routes[path].protocol
            ids = self.work.requests(workload)[0]
            if client == "h2load":
                self.checks[key] = lc.grpc_check(self.target.grpc_target or "",
                                                 lc.model_infer_request(self.target.model, ids))
            elif client == "wrk":
                self.checks[key] = http_check(self.target.url or "", protocol, self.target.model,
                                              ids)
            else:
                self.checks[key] = {}
        return self.checks[key]

    def wrk(self, protocol: str, workload: str, connections: int, seconds: int) -> dict:
        tool = self.tools["wrk"]
        assert tool is not None
        script = self.folder / f"wrk_{workload}_{protocol}.lua"
        if not script.exists():
            script.write_text(wrk_lua.script(protocol, self.target.model,
                                             self.work.requests(workload), self.args.lua_statuses))
        threads = self.args.client_threads or lc.threads_for(connections)
        threads = min(threads, connections)
        url = self.target.url or ""
        if self.args.warmup_s > 0:
            lc.run_client(lc.wrk_argv(url, script, connections, self.args.warmup_s, threads), tool,
                          self.args.warmup_s + lc.RUN_SLACK_S)
        before, net = self.cpu.snap(), net_counters()
        out, client_s = lc.run_client(lc.wrk_argv(url, script, connections, seconds, threads),
                                      tool, seconds + lc.RUN_SLACK_S)
        usage = self.cpu.usage(before, self.cpu.snap())
        p = wrk_lua.point_of(wrk_lua.parse_output(out), IDS_PER_REQUEST[workload])
        p.update(per_request(usage, p["ok"], client_s * 1e3, p["seconds"]), threads=threads,
                 net=net_delta(net, net_counters()))
        return p

    def h2load(self, workload: str, connections: int, seconds: int) -> dict:
        tool = self.tools["h2load"]
        assert tool is not None
        expected = self.check("grpc-one-body", workload)["answer_bytes"]
        body = self.folder / f"grpc_{workload}.bin"
        if not body.exists():
            ids = self.work.requests(workload)[0]
            body.write_bytes(lc.grpc_frame(lc.model_infer_request(self.target.model, ids)))
        threads = min(self.args.client_threads or lc.threads_for(connections), connections)
        url = f"http://{self.target.grpc_target}"
        log = self.folder / "h2load.log"
        if self.args.warmup_s > 0:
            lc.run_client(lc.h2load_argv(url, body, connections, self.args.warmup_s, threads,
                                         None), tool, self.args.warmup_s + lc.RUN_SLACK_S)
        log.unlink(missing_ok=True)  # h2load appends: an earlier point's requests would stay
        before, net = self.cpu.snap(), net_counters()
        out, client_s = lc.run_client(lc.h2load_argv(url, body, connections, seconds, threads,
                                                     log), tool, seconds + lc.RUN_SLACK_S)
        usage = self.cpu.usage(before, self.cpu.snap())
        status, dur_us = lc.read_h2load_log(log)
        p = lc.h2load_point(lc.parse_h2load(out), status, dur_us, float(seconds),
                            IDS_PER_REQUEST[workload])
        short_answers(p, expected)
        p.update(per_request(usage, p["ok"], client_s * 1e3, p["seconds"]), threads=threads,
                 net=net_delta(net, net_counters()))
        return p

    def generator(self, protocol: str, workload: str, callers: int) -> dict:
        t = self.target
        target = {"protocol": protocol, "url": t.url or "", "grpc_target": t.grpc_target or "",
                  "model": t.model, "timeout_s": float(lc.CLIENT_TIMEOUT_S),
                  "http_client": "aiohttp", "endpoints": t.endpoints}
        snaps: list[Any] = []
        watch: list[threading.Thread] = []

        def on_start(t_start: float) -> None:  # snapshots at both ends of the window
            def window() -> None:
                for at in (t_start + self.gen.warm_s, t_start + self.gen.warm_s + self.gen.seconds):
                    time.sleep(max(0.0, at - time.time()))
                    snaps.append(self.cpu.snap())
            watch.append(threading.Thread(target=window, daemon=True))
            watch[0].start()

        p = self.gen.point(target, self.work.spec(workload), "closed", callers, None, on_start)
        for th in watch:
            th.join(timeout=30)
        lat = p.pop("latencies_ms", np.zeros(0))
        p["max_ms"] = float(lat.max()) if len(lat) else None
        client_ms = sum(p["load_cpu_cores"]) * p["seconds"] * 1e3
        usage = self.cpu.usage(snaps[0], snaps[1]) if len(snaps) == 2 else {}
        p.update(per_request(usage, p["ok"], client_ms, p["seconds"]), threads=len(p[
            "load_cpu_cores"]))
        return p


def short_answers(p: dict, answer_bytes: int) -> None:
    """h2load cannot read gRPC trailers: answers far shorter than a real one (bytes received
    per request under half of it) are errors (a gRPC status other than OK)."""
    p["answer_bytes"] = answer_bytes
    if p["requests"] and p["bytes_per_request"] < 0.5 * answer_bytes:
        p["errors"]["short_answers"] = p["ok"]
        p["ok"], p["error_fraction"] = 0, 1.0
        p["req_per_s"] = p["seed_nodes_per_s"] = 0.0


def http_check(url: str, protocol: str, model: str, ids: np.ndarray,
               timeout_s: float = 10.0) -> dict[str, Any]:
    """POST one body of ``protocol`` with urllib: status 200 and an answer of the right kind,
    else RuntimeError naming what came back."""
    body, headers = encode_http(protocol, ids)
    req = urllib.request.Request(url + http_path(protocol, model), data=body, headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
            status, answer, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{protocol}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc
    if protocol == "http-npy" and not answer.startswith(b"\x93NUMPY"):
        raise RuntimeError(f"{protocol}: not an .npy answer ({ctype}): {answer[:100]!r}")
    if protocol == "http-json":
        rows = len(json.loads(answer)["embeddings"])
        if rows != ids.size:
            raise RuntimeError(f"{protocol}: {rows} rows for {ids.size} ids")
    return {"status": status, "content_type": ctype, "answer_bytes": len(answer)}
