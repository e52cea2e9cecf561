"""KServe v2 ``ModelStreamInfer`` and the hand-encoded gRPC answers.

Unit tests (no server): the encoders parse back with the message classes, ``infer_args`` reads
and refuses requests as the unary call does, and a ``StreamSession`` driven with a stub pipeline
and context keeps its in-flight bound, answers a bad request with ``error_message`` and goes
on, cancels what is pending when cancelled, and ends a stream whose client stopped reading.
E2E (the real daemon, a bearer token, Triton's ``tritonclient.grpc``): stream rows equal the
unary call's, ids come back, a bad request mid-stream does not end the stream, a missing or
wrong token is refused, 200 pipelined requests are all answered, and a cancelled stream's
pending requests are cancelled in the pipeline while the server keeps serving. The load
generator's ``grpc-stream`` caller runs against the endpoint started in the test's own loop.
"""

from __future__ import annotations

import asyncio
import queue
import re
import time
import types
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.frontend.grpc import proto as gp
from quiver_serve.frontend.grpc import stream_infer as grpc_stream
from quiver_serve.frontend.grpc.service import infer_args
from quiver_serve.messages import EmbedResult
from tests.conftest import ServerProcess, start_server

MODEL = "cora-graphsage"
TOKEN = "stream-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
StreamResponse = gp.message("ModelStreamInferResponse")


def _request(ids: list[int], request_id: str = "", model: str = MODEL, **params: Any) -> Any:
    req = gp.message("ModelInferRequest")(model_name=model, id=request_id)
    req.inputs.add(name="node_ids", datatype="INT64", shape=[len(ids)])
    req.raw_input_contents.append(np.asarray(ids, dtype="<i8").tobytes())
    for key, value in params.items():
        setattr(req.parameters[key], "bool_param" if isinstance(value, bool) else "int64_param",
                value)
    return req


# --- encoders and request parsing -----------------------------------------------------------

@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**14, 2**32 + 5])
def test_varint_matches_protobuf(value: int) -> None:
    msg = gp.message("ModelInferResponse.InferOutputTensor")(shape=[value])
    assert gp.varint(value) in msg.SerializeToString()
    assert gp.message("ModelInferResponse.InferOutputTensor").FromString(
        b"\x1a" + gp.varint(len(gp.varint(value))) + gp.varint(value)).shape == [value]


def test_hand_encoded_answers_parse_back() -> None:
    rows = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    unary = gp.message("ModelInferResponse").FromString(gp.infer_response(MODEL, "3", "r9", rows))
    assert (unary.model_name, unary.model_version, unary.id) == (MODEL, "3", "r9")
    (out,) = unary.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("embeddings", "FP32", [5, 64])
    np.testing.assert_array_equal(np.frombuffer(unary.raw_output_contents[0], "<f4"),
                                  rows.ravel())
    stream = StreamResponse.FromString(gp.stream_response(MODEL, "1", "", rows[:1]))
    assert stream.error_message == "" and list(stream.infer_response.outputs[0].shape) == [1, 64]
    assert stream.infer_response.raw_output_contents[0] == rows[:1].tobytes()
    error = StreamResponse.FromString(gp.stream_error("node id 7 is bad", MODEL, "", "x"))
    assert error.error_message == "node id 7 is bad"
    assert (error.infer_response.model_name, error.infer_response.id) == (MODEL, "x")
    # a non-contiguous or float64 answer is written as float32 C order
    wide = np.arange(12, dtype=np.float64).reshape(3, 4).T
    again = gp.message("ModelInferResponse").FromString(gp.infer_response("m", "", "", wide))
    assert np.frombuffer(again.raw_output_contents[0], "<f4").tolist() == wide.ravel().tolist()


def test_infer_args_reads_and_refuses_as_unary() -> None:
    from quiver_serve import errors

    a = infer_args(_request([3, 4], exact=True, seed=7))
    assert a.ids.tolist() == [3, 4] and a.exact and a.seed == 7 and a.model == MODEL
    assert (a.timeout_ms, a.min_version, a.version) == (None, 0, 0)
    bad_output = _request([1])
    bad_output.outputs.add(name="logits")
    with pytest.raises(errors.ServeError, match="unknown output 'logits'"):
        infer_args(bad_output)
    short = _request([1, 2])
    short.raw_input_contents[0] = short.raw_input_contents[0][:8]
    with pytest.raises(errors.ServeError, match="hold 8 bytes; INT64 \\[2\\] needs 16"):
        infer_args(short)
    versioned = _request([1])
    versioned.model_version = "x"
    with pytest.raises(errors.ServeError):
        infer_args(versioned)


# --- StreamSession with a stub pipeline -------------------------------------------------------

class StubPipeline:
    """Submissions whose futures the test resolves; ``cancel`` records the ids."""

    ready, num_nodes, node_capacity, num_features = True, 100, 100, 4

    def __init__(self) -> None:
        self.submitted: list[tuple[str, Any, np.ndarray]] = []
        self.cancelled: list[str] = []

    def submit_ids_async(self, ids: np.ndarray, *args: Any) -> tuple[str, Any]:
        rid = f"p{len(self.submitted)}"
        fut = asyncio.get_running_loop().create_future()
        self.submitted.append((rid, fut, ids))
        return rid, fut

    def answer(self, k: int) -> None:
        rid, fut, ids = self.submitted[k]
        fut.set_result(EmbedResult(rid, torch.full((ids.size, 2), float(k)), model=MODEL,
                                   version=1))

    def cancel(self, request_id: str, reason: str = "") -> bool:
        self.cancelled.append(request_id)
        return True


class StubContext:
    """A stream's context: writes collected (or held while ``hold`` is set)."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self.hold = False

    async def write(self, data: bytes) -> None:
        while self.hold:
            await asyncio.sleep(0.005)
        self.written.append(StreamResponse.FromString(data))

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class Requests:
    """The client's side of the stream: ``put`` a request, ``put(None)`` to half-close."""

    def __init__(self) -> None:
        self.q: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> Any:
        item = await asyncio.wait_for(self.q.get(), timeout=5)
        if item is None:
            raise StopAsyncIteration
        return item


def _session(max_inflight: int = 1024,
             write_stall_s: float = 60.0) -> tuple[Any, StubPipeline, StubContext]:
    pipeline = StubPipeline()
    view = types.SimpleNamespace(default=MODEL, submit_target=lambda m, v: (m, v))
    state = types.SimpleNamespace(cfg=ServeConfig.default(), pipeline=pipeline,
                                  views=types.SimpleNamespace(current=lambda **_: view))
    ctx = StubContext()
    session = grpc_stream.StreamSession(state, ctx, infer_args, max_inflight, write_stall_s)
    return session, pipeline, ctx


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_session_bounds_in_flight_and_answers_each_id() -> None:
    async def main() -> None:
        session, pipeline, ctx = _session(max_inflight=2)
        reqs = Requests()
        run = asyncio.ensure_future(session.run(reqs))
        for k in range(5):
            reqs.q.put_nowait(_request([k], f"id{k}"))
        await _settle()
        assert len(pipeline.submitted) == 2  # reading waits at the bound
        pipeline.answer(1)
        await _settle()
        assert len(pipeline.submitted) == 3 and [w.infer_response.id for w in ctx.written] == ["id1"]
        reqs.q.put_nowait(None)  # half-close: the requests read are still answered
        for k in (0, 2, 3, 4):
            while len(pipeline.submitted) <= k:
                await asyncio.sleep(0.001)
            pipeline.answer(k)
        await asyncio.wait_for(run, timeout=5)
        assert sorted(w.infer_response.id for w in ctx.written) == [f"id{k}" for k in range(5)]
        third = next(w for w in ctx.written if w.infer_response.id == "id3")
        assert np.frombuffer(third.infer_response.raw_output_contents[0], "<f4").tolist() == [3, 3]
        assert pipeline.cancelled == [] and session.in_flight == 0

    asyncio.run(main())


def test_session_error_mid_stream_goes_on() -> None:
    async def main() -> None:
        session, pipeline, ctx = _session()
        reqs = Requests()
        run = asyncio.ensure_future(session.run(reqs))
        reqs.q.put_nowait(_request([1], "good"))
        reqs.q.put_nowait(_request([1, 500], "bad"))  # out of range: refused at the door
        reqs.q.put_nowait(_request(list(range(5000)), "big"))  # too many ids
        reqs.q.put_nowait(_request([2], "after"))
        reqs.q.put_nowait(None)
        await _settle()
        for k in range(len(pipeline.submitted)):
            pipeline.answer(k)
        await asyncio.wait_for(run, timeout=5)
        by_id = {w.infer_response.id: w for w in ctx.written}
        assert set(by_id) == {"good", "bad", "big", "after"}
        assert by_id["big"].error_message.startswith("5000 node ids in one request")
        assert re.match("node id 500 is out of range", by_id["bad"].error_message)
        assert by_id["bad"].infer_response.model_name == MODEL
        assert by_id["good"].error_message == "" and by_id["after"].error_message == ""

    asyncio.run(main())


def test_session_cancelled_cancels_pending_in_the_pipeline() -> None:
    async def main() -> None:
        session, pipeline, ctx = _session()
        reqs = Requests()
        run = asyncio.ensure_future(session.run(reqs))
        for k in range(3):
            reqs.q.put_nowait(_request([k], f"id{k}"))
        await _settle()
        pipeline.answer(0)
        await _settle()
        run.cancel()  # what grpc.aio does when the client cancels
        with pytest.raises(asyncio.CancelledError):
            await run
        assert sorted(pipeline.cancelled) == ["p1", "p2"]
        pipeline.answer(1)  # a late answer after the end is dropped, not written
        await _settle()
        assert [w.infer_response.id for w in ctx.written] == ["id0"]

    asyncio.run(main())


def test_session_ends_when_the_client_stops_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_stream, "STALL_CHECK_S", 0.01)

    async def main() -> None:
        session, pipeline, ctx = _session(write_stall_s=0.05)
        ctx.hold = True
        reqs = Requests()
        run = asyncio.ensure_future(session.run(reqs))
        reqs.q.put_nowait(_request([1], "a"))
        reqs.q.put_nowait(_request([2], "b"))
        await _settle()
        pipeline.answer(0)
        t0 = time.perf_counter()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, timeout=5)
        assert time.perf_counter() - t0 < 2 and pipeline.cancelled == ["p1"]

    asyncio.run(main())


# --- the real daemon with tritonclient --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The daemon with its gRPC endpoint and a bearer token."""
    from tests.conftest import free_port

    srv, cfg = start_server(tmp_path_factory.mktemp("grpc-stream"),
                            server__grpc_port=free_port(), server__auth_token=TOKEN)
    srv.grpc_port = cfg.server.grpc_port  # type: ignore[attr-defined]
    try:
        srv.wait_ready(headers=AUTH)
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def client(server: ServerProcess):  # noqa: ANN201
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url=f"127.0.0.1:{server.grpc_port}")
    yield c
    c.close()


def _input(ids: list[int]) -> Any:
    import tritonclient.grpc as grpcclient

    node_ids = grpcclient.InferInput("node_ids", [len(ids)], "INT64")
    node_ids.set_data_from_numpy(np.asarray(ids, dtype=np.int64))
    return node_ids


def _stream(client: Any, headers: dict[str, str] | None = AUTH) -> queue.Queue:
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)),
                        headers=headers)
    return answers


def _collect(answers: queue.Queue, n: int, timeout_s: float = 30.0) -> list[tuple[Any, Any]]:
    return [answers.get(timeout=timeout_s) for _ in range(n)]


@pytest.mark.e2e
def test_stream_rows_equal_unary_and_carry_ids(client: Any) -> None:
    batches = [[4, 5, 2707, 4], [0], [17, 3, 3]]
    answers = _stream(client)
    for k, ids in enumerate(batches):
        client.async_stream_infer(MODEL, [_input(ids)], request_id=f"r{k}",
                                  parameters={"exact": True})
    got = {}
    for result, error in _collect(answers, len(batches)):
        assert error is None, error
        got[result.get_response().id] = result.as_numpy("embeddings")
    client.stop_stream()
    assert set(got) == {"r0", "r1", "r2"}
    for k, ids in enumerate(batches):
        unary = client.infer(MODEL, [_input(ids)], parameters={"exact": True}, headers=AUTH)
        assert got[f"r{k}"].shape == (len(ids), 64)
        np.testing.assert_array_equal(got[f"r{k}"], unary.as_numpy("embeddings"))


@pytest.mark.e2e
def test_stream_error_mid_stream_then_more_answers(client: Any) -> None:
    answers = _stream(client)
    client.async_stream_infer(MODEL, [_input([1, 99999])], request_id="bad")
    client.async_stream_infer("no-such-model", [_input([1])], request_id="nomodel")
    client.async_stream_infer(MODEL, [_input(list(range(5000)))], request_id="big")
    for k in range(3):
        client.async_stream_infer(MODEL, [_input([k, k + 1])], request_id=f"ok{k}")
    results = _collect(answers, 6)
    client.stop_stream()
    errors_seen = sorted(str(e) for r, e in results if e is not None)
    assert len(errors_seen) == 3
    assert any("node id 99999 is out of range" in e for e in errors_seen)
    assert any("no-such-model" in e for e in errors_seen)
    assert any("5000 node ids in one request; the limit is 4096" in e for e in errors_seen)
    ok = sorted(r.get_response().id for r, e in results if e is None)
    assert ok == ["ok0", "ok1", "ok2"]


@pytest.mark.e2e
@pytest.mark.parametrize("headers", [None, {"authorization": "Bearer wrong"}])
def test_stream_refused_without_the_token(client: Any, headers: dict[str, str] | None) -> None:
    from tritonclient.utils import InferenceServerException

    answers = _stream(client, headers)
    try:  # the server may refuse the stream before this request is queued
        client.async_stream_infer(MODEL, [_input([1])], request_id="x")
    except InferenceServerException as exc:
        assert "no longer in valid state" in str(exc)
    result, error = answers.get(timeout=10)
    client.stop_stream()
    assert result is None and "missing or wrong bearer token" in str(error)


@pytest.mark.e2e
def test_stream_answers_200_pipelined_requests(client: Any) -> None:
    answers = _stream(client)
    for k in range(200):
        client.async_stream_infer(MODEL, [_input([k % 2708, (k * 7) % 2708])], request_id=str(k))
    results = _collect(answers, 200)
    client.stop_stream()
    assert all(e is None for _, e in results)
    assert sorted(int(r.get_response().id) for r, _ in results) == list(range(200))


def _rejected_disconnected(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    m = re.search(r'^quiver_serve_requests_rejected_total\{reason="client_disconnected"\} (\S+)$',
                  text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.e2e
def test_cancelled_stream_cancels_pending_and_server_serves_on(client: Any,
                                                               server: ServerProcess) -> None:
    before = _rejected_disconnected(server)
    answers = _stream(client)
    big = list(range(2708)) + list(range(1388))  # 4096 ids: far more work than the window
    for k in range(150):
        client.async_stream_infer(MODEL, [_input(big)], request_id=str(k))
    time.sleep(0.3)
    client.stop_stream(cancel_requests=True)
    while not answers.empty():
        answers.get_nowait()
    t0 = time.monotonic()
    unary = client.infer(MODEL, [_input([1, 2])], headers=AUTH, client_timeout=20)
    assert unary.as_numpy("embeddings").shape == (2, 64) and time.monotonic() - t0 < 20
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pending = httpx.get(server.url + "/v1/workers", headers=AUTH).json()["pending_requests"]
        if pending == 0:
            break
        time.sleep(0.2)
    assert pending == 0
    assert _rejected_disconnected(server) > before  # some were cancelled before being computed


# --- the load generator's grpc-stream caller against the endpoint in this process -------------

class AnsweringPipeline(StubPipeline):
    """Answers every submission on the next loop turn."""

    def submit_ids_async(self, ids: np.ndarray, *args: Any) -> tuple[str, Any]:
        rid, fut = super().submit_ids_async(ids, *args)
        asyncio.get_running_loop().call_soon(self.answer, len(self.submitted) - 1)
        return rid, fut


async def _answering_endpoint() -> tuple[AnsweringPipeline, Any, int]:
    """The gRPC endpoint on this loop over an :class:`AnsweringPipeline`."""
    from quiver_serve.frontend.grpc import calls as grpc_calls
    from tests.conftest import free_port

    pipeline = AnsweringPipeline()
    view = types.SimpleNamespace(default=MODEL, submit_target=lambda m, v: (m, v))
    state = types.SimpleNamespace(cfg=ServeConfig.default(), pipeline=pipeline,
                                  views=types.SimpleNamespace(current=lambda **_: view))
    port = free_port()
    server = await grpc_calls.start(state, "127.0.0.1", port, None)  # type: ignore[arg-type]
    return pipeline, server, port


def test_loadgen_stream_caller_pipelines_and_counts_errors() -> None:
    from loadtest.protocols import OK, make_caller

    async def main() -> None:
        pipeline, server, port = await _answering_endpoint()
        target = {"protocol": "grpc-stream", "grpc_target": f"127.0.0.1:{port}",
                  "model": MODEL, "timeout_s": 5.0}
        reqs = [np.array([k % 100, 3]) for k in range(40)] + [np.array([1, 100])]  # last: bad
        try:
            async with make_caller(target, reqs, limit=3) as caller:
                assert caller.num_streams == 3
                statuses = await asyncio.gather(*[caller.call(i) for i in range(len(reqs))])
        finally:
            await server.stop(grace=None)
        assert statuses[:40] == [OK] * 40 and statuses[40] == "stream:error"
        assert len(pipeline.submitted) == 40  # the bad one was refused at the door

    asyncio.run(main())


def test_loadgen_unary_caller_holds_one_connection_per_caller() -> None:
    """As wrk and h2load do: the kernel then spreads the callers over the front-end processes
    (one shared channel loaded one front-end)."""
    from loadtest.protocols import OK, make_caller

    async def main() -> None:
        pipeline, server, port = await _answering_endpoint()
        target = {"protocol": "grpc", "grpc_target": f"127.0.0.1:{port}", "model": MODEL,
                  "timeout_s": 5.0}
        reqs = [np.array([k % 100, 3]) for k in range(24)] + [np.array([1, 100])]  # last: bad
        try:
            async with make_caller(target, reqs, limit=4) as caller:
                statuses = await asyncio.gather(*[caller.call(i) for i in range(len(reqs))])
                assert len(server.connections) == 4
            for _ in range(100):  # the closed channels' connections leave the server's set
                if not server.connections:
                    break
                await asyncio.sleep(0.02)
            async with make_caller({**target, "grpc_connections": 1}, reqs, limit=4) as caller:
                assert await caller.call(0) == OK
                assert len(server.connections) == 1
        finally:
            await server.stop(grace=None)
        assert statuses[:24] == [OK] * 24 and statuses[24] == "grpc:INVALID_ARGUMENT"
        assert len(pipeline.submitted) == 24 + 1  # the bad one refused at the door; one more

    asyncio.run(main())
