"""One async caller per protocol: ``await caller.call(i) -> status`` sends request ``i`` of the
process's list and reads the whole answer.

Bodies are encoded once before the run, so the generator's CPU goes to sending and receiving.
Statuses: ``loadtest/status.py``. The gRPC callers are in ``loadtest/grpc_callers.py``.

HTTP with ``target["retry_cut"] = N``: a request whose connection was cut (``conn:...``, e.g. its
front-end process killed) is sent again, up to N times, as a client behind a balancer would;
``retried`` counts those sends (the fault drill reports them).

``exact=True`` (the workload spec's ``"exact"``, default false) asks for exact embeddings: HTTP
bodies carry ``"exact": true`` (KServe: the request parameter ``exact``), gRPC the parameter
``exact``, the queue API ``submit_async(ids, exact=True)``. Without it the bodies are unchanged.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from loadtest.grpc_callers import GrpcCaller, GrpcH2Caller, GrpcH2StreamCaller, GrpcStreamCaller
from loadtest.status import OK

__all__ = ["HTTP_CLIENTS", "OK", "PROTOCOLS", "HttpCaller", "QueueCaller", "encode_http",
           "http_path", "make_caller"]

PROTOCOLS = ("http-json", "http-npy", "kserve-json", "kserve-binary", "grpc", "grpc-h2",
             "grpc-stream", "grpc-stream-h2", "queue")
HTTP_CLIENTS = ("aiohttp", "httpx")


def encode_http(protocol: str, ids: np.ndarray,
                exact: bool = False) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of one request of an HTTP protocol (``exact``: exact embeddings asked)."""
    if protocol in ("http-json", "http-npy"):
        headers = {"Content-Type": "application/json"}
        if protocol == "http-npy":
            headers["Accept"] = "application/x-npy"
        body: dict[str, Any] = {"node_ids": ids.tolist(), **({"exact": True} if exact else {})}
        return json.dumps(body).encode(), headers
    inp: dict[str, Any] = {"name": "node_ids", "datatype": "INT64", "shape": [int(ids.size)]}
    params = {"parameters": {"exact": True}} if exact else {}
    if protocol == "kserve-json":
        inp["data"] = ids.tolist()
        return (json.dumps({"inputs": [inp], **params}).encode(),
                {"Content-Type": "application/json"})
    raw = np.ascontiguousarray(ids, dtype="<i8").tobytes()
    inp["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps({"inputs": [inp], "outputs": [
        {"name": "embeddings", "parameters": {"binary_data": True}}], **params}).encode()
    return head + raw, {"Content-Type": "application/octet-stream",
                        "Inference-Header-Content-Length": str(len(head))}


def http_path(protocol: str, model: str) -> str:
    return "/v1/embed" if protocol.startswith("http-") else f"/v2/models/{model}/infer"


class HttpCaller:
    """aiohttp (default) or httpx; one connection pool per load process, ``limit`` connections."""

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 exact: bool = False) -> None:
        self.url = target["url"].rstrip("/") + http_path(target["protocol"], target.get("model", ""))
        self.timeout_s = target["timeout_s"]
        self.bodies = [encode_http(target["protocol"], r, exact) for r in reqs]
        self.kind, self.limit = target.get("http_client", "aiohttp"), limit
        self.retry_cut = int(target.get("retry_cut", 0))
        self.retried = 0 if self.retry_cut else None
        self.session: Any = None

    async def __aenter__(self) -> HttpCaller:
        if self.kind == "httpx":
            import httpx

            self.session = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(
                max_connections=self.limit, max_keepalive_connections=self.limit))
        else:
            import aiohttp

            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, force_close=False),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.kind == "httpx":
            await self.session.aclose()
        else:
            await self.session.close()

    async def call(self, i: int) -> str:
        status = await self.send(i)
        for _ in range(self.retry_cut):
            if not status.startswith("conn:"):
                break
            self.retried += 1  # type: ignore[operator]
            status = await self.send(i)
        return status

    async def send(self, i: int) -> str:
        body, headers = self.bodies[i]
        try:
            if self.kind == "httpx":
                r = await self.session.post(self.url, content=body, headers=headers)
                return str(r.status_code)
            async with self.session.post(self.url, data=body, headers=headers) as r:
                await r.read()
                return str(r.status)
        except asyncio.TimeoutError:
            return "timeout"
        except Exception as exc:  # noqa: BLE001 - every client failure is counted, by kind
            if type(exc).__name__ in ("ReadTimeout", "ConnectTimeout", "PoolTimeout"):
                return "timeout"
            return f"conn:{type(exc).__name__}"


class QueueCaller:
    """The queue API: ``connect_async(endpoints).submit_async(ids)`` (one client per load
    process and event loop, driven by that loop)."""

    clients: dict[str, Any] = {}  # the current engine client of this process

    def __init__(self, target: dict, reqs: list[np.ndarray], limit: int,
                 observer: Any = None, exact: bool = False) -> None:
        from quiver_serve.engine.client.pipeline import connect_async

        key = f"{target['endpoints']!r}@{id(asyncio.get_running_loop())}@{id(observer)}"
        if key not in self.clients:
            for old in self.clients.values():
                old.stop()
            self.clients.clear()
            self.clients[key] = connect_async(target["endpoints"], observer)
        self.client, self.reqs, self.exact = self.clients[key], reqs, exact

    async def __aenter__(self) -> QueueCaller:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def call(self, i: int) -> str:
        from quiver_serve.errors import ServeError

        try:
            res = await self.client.submit_async(self.reqs[i], self.exact)
        except ServeError as exc:  # refused at admission (pending full, shutting down)
            return str(exc.info.status)
        return OK if res.ok else str(res.error.status)

    @classmethod
    def close_all(cls) -> None:
        for c in cls.clients.values():
            c.stop()
        cls.clients.clear()


def make_caller(target: dict, reqs: list[np.ndarray], limit: int, observer: Any = None,
                exact: bool = False) -> Any:
    """The caller of ``target['protocol']`` for this process's requests; ``observer``: a
    ``PipelineObserver`` for the queue API's client (a probe's, ``loadtest/driver.py``);
    ``exact``: every request asks for exact embeddings."""
    protocol = target["protocol"]
    if protocol == "grpc":
        return GrpcCaller(target, reqs, limit, exact)
    if protocol == "grpc-h2":
        return GrpcH2Caller(target, reqs, limit, exact)
    if protocol == "grpc-stream":
        return GrpcStreamCaller(target, reqs, limit, exact)
    if protocol == "grpc-stream-h2":
        return GrpcH2StreamCaller(target, reqs, limit, exact)
    if protocol == "queue":
        return QueueCaller(target, reqs, limit, observer, exact)
    if protocol in PROTOCOLS:
        return HttpCaller(target, reqs, limit, exact)
    raise ValueError(f"unknown protocol {protocol!r}; one of {PROTOCOLS}")
