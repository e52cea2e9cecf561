"""The hot routes answered inside the HTTP protocol (``frontend/hot_protocol.py``), byte for byte.

One in-process pipeline (Cora) and one app with a bearer token; raw HTTP/1.1 bytes are fed to two
protocol instances over fake transports: uvicorn's own httptools protocol (every request through
the ASGI app) and the hot protocol. What each writes back must be the same bytes (but the Date
header), the hot protocol must have answered the hot routes without the app, and the framing
cases only a protocol sees must hold: pipelined requests answered in order, chunked bodies, a
body over the limit, ``Expect: 100-continue``, HTTP/1.0, and a client that goes away before its
answer (the request is cancelled, nothing is written).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.frontend.app import create_app
from quiver_serve.frontend.hot_protocol import HotHttpProtocol
from quiver_serve.frontend.listen import uvicorn_options
from tests.conftest import small_config

pytestmark = pytest.mark.e2e

TOKEN = "hot-protocol-token"
MAX_BODY_BYTES = 4096
INFER = "/v2/models/cora-graphsage/infer"
_DATE = re.compile(rb"date: [^\r]*\r\n")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cfg = small_config(server__max_request_nodes=256, server__max_body_bytes=MAX_BODY_BYTES,
                       server__auth_token=TOKEN, server__start_timeout_s=400.0)
    pipeline = Pipeline(cfg)
    application = create_app(cfg, pipeline)
    pipeline.start()
    try:
        yield application
    finally:
        pipeline.stop(drain_timeout_s=0.0)


class Transport:
    """Collects what a protocol writes; ``closed`` once it closes the connection."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self.wrote = asyncio.Event()

    def write(self, data: Any) -> None:
        self.data += bytes(data)
        self.wrote.set()

    def writelines(self, parts: list[Any]) -> None:
        for part in parts:
            self.data += bytes(part)
        self.wrote.set()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


def request(path: str, body: bytes, *headers: str, method: str = "POST",
            version: str = "1.1", auth: bool = True, chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: test"]
    if auth:
        lines.append(f"authorization: Bearer {TOKEN}")
    lines += headers
    if chunked:
        lines.append("transfer-encoding: chunked")
        half = len(body) // 2
        payload = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n"
                           for p in (body[:half], body[half:]) if p) + b"0\r\n\r\n"
    else:
        lines.append(f"content-length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def embed(ids: list[int], *headers: str, **kw: Any) -> bytes:
    return request("/v1/embed", orjson.dumps({"node_ids": ids, "exact": True}),
                   "content-type: application/json", *headers, **kw)


def binary_infer(ids: list[int]) -> bytes:
    raw = np.asarray(ids, dtype="<i8").tobytes()
    head = orjson.dumps({"inputs": [{"name": "node_ids", "datatype": "INT64", "shape": [len(ids)],
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": {"binary_data_output": True, "exact": True}})
    return request(INFER, head + raw, "content-type: application/octet-stream",
                   f"inference-header-content-length: {len(head)}")


async def exchange(protocol_class: type, app: Any, wire: bytes, answers: int,
                   close_after_s: float | None = None) -> tuple[bytes, Transport]:
    """Feed ``wire`` to a fresh protocol; wait until ``answers`` responses are written."""
    config = uvicorn.Config(app, **({} if protocol_class is HttpToolsProtocol
                                    else uvicorn_options(app)))
    config.load()
    cls = protocol_class if protocol_class is HttpToolsProtocol else config.http_protocol_class
    transport = Transport()
    proto = cls(config, ServerState(), {}, asyncio.get_running_loop())
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(wire)
    if close_after_s is not None:
        await asyncio.sleep(close_after_s)
        transport.closed = True
        proto.connection_lost(None)
        return bytes(transport.data), transport
    for _ in range(600):
        if bytes(transport.data).count(b"HTTP/1.1 ") >= answers and \
                _complete(bytes(transport.data), answers):
            break
        await asyncio.sleep(0.01)
    return bytes(transport.data), transport


def _complete(data: bytes, answers: int) -> bool:
    """Every one of ``answers`` responses has its whole body (by content-length)."""
    pos = 0
    for _ in range(answers):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            return False
        length = re.search(rb"content-length: (\d+)", data[pos:end])
        pos = end + 4 + (int(length.group(1)) if length else 0)
        if pos > len(data):
            return False
    return True


def both(app: Any, wire: bytes, answers: int = 1) -> tuple[bytes, bytes]:
    async def run() -> tuple[bytes, bytes]:
        hot, _ = await exchange(HotHttpProtocol, app, wire, answers)
        plain, _ = await exchange(HttpToolsProtocol, app, wire, answers)
        return _DATE.sub(b"", hot), _DATE.sub(b"", plain)

    return asyncio.run(run())


CASES = {
    "embed json": embed([0, 1, 2707]),
    "embed npy": embed([3, 3], "accept: application/x-npy"),
    "kserve binary": binary_infer([5, 6, 7]),
    "kserve json": request(INFER, orjson.dumps({"inputs": [{"name": "node_ids", "datatype":
                                                            "INT64", "shape": [2],
                                                            "data": [8, 9]}], "id": "r1"}),
                           "content-type: application/json"),
    "no token": embed([1], auth=False),
    "declared body too large": request("/v1/embed", b"{" + b" " * MAX_BODY_BYTES + b"}",
                                       "content-type: application/json"),
    "bad JSON": request("/v1/embed", b'{"node_ids": [1,', "content-type: application/json"),
    "id out of range": embed([2708]),
    "too many ids": embed(list(range(300))),
    "unknown model": request("/v2/models/nope/infer", orjson.dumps({"inputs": [
        {"name": "node_ids", "datatype": "INT64", "shape": [1], "data": [1]}]})),
    "bad version": request("/v2/models/cora-graphsage/versions/x/infer", b"{}"),
    "chunked body": embed([4, 5], chunked=True),
    "HTTP/1.0": embed([6], version="1.0"),
    "pipelined": embed([1]) + binary_infer([2]) + embed([3], "accept: application/x-npy"),
    "pipelined, then a route of the app": embed([4]) + request("/v2", b"", method="GET"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_protocol_answers_as_the_asgi_app_byte_for_byte(app: Any, name: str) -> None:
    answers = 3 if name == "pipelined" else 2 if name.startswith("pipelined") else 1
    before = HotHttpProtocol.answered
    hot, plain = both(app, CASES[name], answers)
    assert hot.count(b"HTTP/1.1 ") == answers, hot[:300]
    assert hot == plain
    if name not in ("no token", "declared body too large"):
        assert HotHttpProtocol.answered > before  # not through the app


def test_http_1_0_closes_and_keep_alive_does_not(app: Any) -> None:
    async def run() -> tuple[Transport, Transport]:
        _, old = await exchange(HotHttpProtocol, app, embed([6], version="1.0"), 1)
        _, new = await exchange(HotHttpProtocol, app, embed([6]), 1)
        return old, new

    old, new = asyncio.run(run())
    assert old.closed and b"connection: close" in old.data
    assert not new.closed and b"connection: close" not in new.data


def test_a_chunked_body_over_the_limit_is_413_and_closes(app: Any) -> None:
    wire = request("/v1/embed", b'{"node_ids": [1], "pad": "' + b"x" * MAX_BODY_BYTES + b'"}',
                   "content-type: application/json", chunked=True)
    data, transport = asyncio.run(exchange(HotHttpProtocol, app, wire, 1))
    assert data.startswith(b"HTTP/1.1 413 ") and b"body_too_large" in data
    assert transport.closed


def test_expect_100_continue_goes_through_the_app(app: Any) -> None:
    before = HotHttpProtocol.answered
    data, _ = asyncio.run(exchange(HotHttpProtocol, app, embed([7], "expect: 100-continue"), 1))
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 ")
    assert HotHttpProtocol.answered == before


def test_a_client_gone_before_its_answer_cancels_the_request(app: Any) -> None:
    pipeline = app.state.qs.pipeline
    slow = request("/v1/embed", orjson.dumps({"node_ids": list(range(200)), "exact": True}),
                   "content-type: application/json")

    async def run() -> tuple[bytes, int]:
        _, transport = await exchange(HotHttpProtocol, app, slow, 1, close_after_s=0.0)
        await asyncio.sleep(0.5)
        return bytes(transport.data), pipeline.pending_count

    data, pending = asyncio.run(run())
    assert data == b""  # nothing written to a closed connection
    assert pending == 0  # cancelled, not left in flight
    assert ("/v1/embed", 499) in app.state.qs._durations  # counted as the ASGI path counts it


def test_a_client_gone_with_a_request_pipelined_behind_cancels_the_first(app: Any) -> None:
    pipeline = app.state.qs.pipeline
    slow = request("/v1/embed", orjson.dumps({"node_ids": list(range(200)), "exact": True}),
                   "content-type: application/json")

    async def run() -> tuple[bytes, int]:
        wire = slow + request("/v2", b"", method="GET")
        _, transport = await exchange(HotHttpProtocol, app, wire, 2, close_after_s=0.0)
        await asyncio.sleep(0.5)
        return bytes(transport.data), pipeline.pending_count

    data, pending = asyncio.run(run())
    assert data == b"", "an answer was written after the client went away"
    assert pending == 0
