"""The load generator's lean gRPC client (``loadtest/h2_client.py``, protocol ``grpc-h2``) against
the daemon's gRPC endpoint and against grpc.aio's server (the reference implementation): answers
larger than HTTP/2's default windows, errors as gRPC statuses, deadlines, a server that goes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from bench.frontdoor.grpc_endpoint import grpcio_server, stub_state
from loadtest.protocols import OK, make_caller


class Silent:
    """An engine client that never answers (the deadline test); cancels are counted."""

    ready, num_nodes, node_capacity, num_features = True, 1000, 1000, 4

    def __init__(self) -> None:
        self.cancelled = 0

    def submit_ids_async(self, ids: np.ndarray, *args: Any) -> tuple[str, Any]:
        return "r", asyncio.get_running_loop().create_future()

    def cancel(self, request_id: str, reason: str = "") -> bool:
        self.cancelled += 1
        return True


async def _own(state: Any) -> tuple[Any, int]:
    from quiver_serve.frontend.grpc import calls as grpc_calls

    server = await grpc_calls.start(state, "127.0.0.1", 0, None)
    return server, server.port


def _target(port: int, **kw: Any) -> dict[str, Any]:
    return {"protocol": "grpc-h2", "grpc_target": f"127.0.0.1:{port}", "model": "m",
            "timeout_s": 5.0, **kw}


@pytest.mark.parametrize("server", ["own", "grpcio"])
def test_calls_answer_over_several_connections_and_past_the_default_windows(server: str) -> None:
    """1,024-wide float32 rows of 48 ids: 196 KiB answers, three times the default 64 KiB window
    of a connection; 300 calls on 4 connections, every one answered."""
    async def main() -> None:
        state = stub_state(1024)
        srv, port = await (_own(state) if server == "own" else grpcio_server(state, 0))
        reqs = [np.arange(k, k + 48) for k in range(300)]
        try:
            async with make_caller(_target(port), reqs, limit=4) as caller:
                assert len(caller.conns) == 4
                statuses = await asyncio.gather(*[caller.call(i) for i in range(len(reqs))])
        finally:
            await srv.stop(None)
        assert statuses == [OK] * len(reqs)
        assert state.pipeline.count == len(reqs)

    asyncio.run(main())


def test_errors_deadlines_and_a_server_that_goes() -> None:
    async def main() -> None:
        import types

        state = stub_state(8)
        srv, port = await _own(state)
        reqs = [np.array([1, 2]), np.array([], dtype=np.int64)]  # the second: no ids
        async with make_caller(_target(port), reqs, limit=2) as caller:
            assert await caller.call(0) == OK
            assert await caller.call(1) == "grpc:INVALID_ARGUMENT"
            await srv.stop(None)  # the server goes: its connections close
            statuses = {await caller.call(0) for _ in range(3)}
            assert all(s.startswith("conn:") for s in statuses), statuses
        silent = types.SimpleNamespace(**{**vars(state), "pipeline": Silent()})
        srv, port = await _own(silent)
        try:
            async with make_caller(_target(port, timeout_s=0.3), reqs, limit=1) as caller:
                t0 = asyncio.get_running_loop().time()
                assert await caller.call(0) == "timeout"
                assert asyncio.get_running_loop().time() - t0 < 1.0
                for _ in range(50):  # the RST_STREAM the client sent cancels it in the engine
                    if silent.pipeline.cancelled:
                        break
                    await asyncio.sleep(0.02)
                assert silent.pipeline.cancelled == 1
        finally:
            await srv.stop(None)

    asyncio.run(main())


def test_stream_calls_pipeline_past_the_windows_and_go_on_after_an_error() -> None:
    """300 requests over 3 ModelStreamInfer streams, 196 KiB answers (59 MB through windows of
    16 MiB: the stream's window is returned as answers are read); a request without ids is
    answered with an error message and the stream goes on; a silent engine times out."""
    async def main() -> None:
        import types

        state = stub_state(1024)
        srv, port = await _own(state)
        reqs = [np.arange(k, k + 48) for k in range(300)] + [np.array([], dtype=np.int64)]
        try:
            async with make_caller(_target(port, protocol="grpc-stream-h2", grpc_streams=3),
                                   reqs, limit=16) as caller:
                assert len(caller.conns) == 3
                statuses = await asyncio.gather(*[caller.call(i) for i in range(300)])
                assert await caller.call(300) == "stream:error"
                assert await caller.call(0) == OK  # the stream goes on
        finally:
            await srv.stop(None)
        assert statuses == [OK] * 300

        silent = types.SimpleNamespace(**{**vars(state), "pipeline": Silent()})
        srv, port = await _own(silent)
        try:
            async with make_caller(_target(port, protocol="grpc-stream-h2", timeout_s=0.3),
                                   reqs, limit=1) as caller:
                assert await caller.call(0) == "timeout"
        finally:
            await srv.stop(None)

    asyncio.run(main())


def test_a_server_that_never_speaks_http2_is_refused_and_its_connection_closed() -> None:
    async def main() -> None:
        from loadtest.h2_client import connect

        closed = asyncio.Event()

        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # the preface, then nothing in answer; returns at the close
            closed.set()

        srv = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            with pytest.raises(ConnectionError, match="not reachable"):
                await connect("127.0.0.1", port, "/x", timeout_s=0.2)
            await asyncio.wait_for(closed.wait(), 2.0)  # the client closed its side
        finally:
            srv.close()

    asyncio.run(main())
