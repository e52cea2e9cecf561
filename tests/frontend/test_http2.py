"""The gRPC endpoint's HTTP/2 (``frontend/grpc/``: ``frames.py``, ``connection.py``, ``calls.py``)
driven frame by frame: flow control both ways, frame sizes, CONTINUATION and padding, PING,
protocol errors, every refusal as a gRPC status, cancellation, draining, and the HPACK block
cache against a plain decoder. Real clients (tritonclient, grpc.aio) are in
test_kserve_clients.py and test_grpc_stream.py."""

from __future__ import annotations

import asyncio
import random
import struct
import types
from typing import Any

import hpack
import numpy as np
import pytest

from quiver_serve.config import ServeConfig
from quiver_serve.frontend.grpc import calls as grpc_calls
from quiver_serve.frontend.grpc import connection
from quiver_serve.frontend.grpc import frames as h
from quiver_serve.frontend.grpc import proto as gp
from quiver_serve.messages import EmbedResult

MODEL, DIM, TOKEN = "m", 64, "s3cret"
PATH = "/inference.GRPCInferenceService/ModelInfer"
Response = gp.message("ModelInferResponse")


class Pipeline:
    """Answers each submission with rows ``ids * 1.0`` repeated over DIM columns, at once or
    when ``hold`` is off; records cancellations."""

    ready, num_nodes, node_capacity, num_features = True, 10_000, 10_000, 4

    def __init__(self, hold: bool = False) -> None:
        self.hold, self.cancelled, self.futures = hold, [], {}
        self.timeouts_s: list[float | None] = []

    def submit_ids_async(self, ids: np.ndarray, exact: bool, seed: Any, timeout_s: Any,
                         *args: Any) -> tuple[str, Any]:
        self.timeouts_s.append(timeout_s)
        rid = f"r{len(self.futures)}"
        fut = asyncio.get_running_loop().create_future()
        self.futures[rid] = (fut, ids)
        if not self.hold:
            self.answer(rid)
        return rid, fut

    def answer(self, rid: str) -> None:
        fut, ids = self.futures[rid]
        rows = np.repeat(ids.astype(np.float32)[:, None], DIM, axis=1)
        result = EmbedResult(rid, None, model=MODEL, version=1)
        result.rows = rows
        fut.set_result(result)

    def cancel(self, request_id: str, reason: str = "") -> bool:
        self.cancelled.append(request_id)
        return True


def _state(pipeline: Pipeline) -> Any:
    view = types.SimpleNamespace(default=MODEL, submit_target=lambda m, v: (m, v))
    cfg = ServeConfig.default()
    cfg.server.max_body_bytes = 4096
    return types.SimpleNamespace(cfg=cfg, pipeline=pipeline,
                                 views=types.SimpleNamespace(current=lambda **_: view))


def infer_message(ids: list[int], request_id: str = "q") -> bytes:
    req = gp.message("ModelInferRequest")(model_name=MODEL, id=request_id)
    req.inputs.add(name="node_ids", datatype="INT64", shape=[len(ids)])
    req.raw_input_contents.append(np.asarray(ids, "<i8").tobytes())
    body = req.SerializeToString()
    return struct.pack(">BI", 0, len(body)) + body


class RawClient:
    """An HTTP/2 client written frame by frame."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()

    @classmethod
    async def open(cls, port: int, settings: dict[int, int] | None = None,
                   preface: bytes = h.PREFACE) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
        writer.write(preface + h.frame(h.SETTINGS, 0, 0, payload))
        return cls(reader, writer)

    def headers_block(self, path: str = PATH, token: str | None = TOKEN,
                      content_type: str = "application/grpc", **extra: str) -> bytes:
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path),
                  (":authority", "x"), ("content-type", content_type), ("te", "trailers")]
        if token:
            fields.append(("authorization", f"Bearer {token}"))
        return self.encoder.encode(fields + [(k.replace("_", "-"), v) for k, v in extra.items()])

    def call(self, sid: int, body: bytes, **headers: Any) -> None:
        block = self.headers_block(**headers)
        self.writer.write(h.frame(h.HEADERS, h.END_HEADERS, sid, block)
                          + h.frame(h.DATA, h.END_STREAM, sid, body))

    async def frame(self, timeout_s: float = 5.0) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.reader.readexactly(9), timeout_s)
        lt, flags, sid = struct.unpack(">IBI", head)
        payload = await asyncio.wait_for(self.reader.readexactly(lt >> 8), timeout_s)
        return lt & 0xFF, flags, sid, payload

    async def answer(self, sid: int, window: bool = False) -> tuple[dict, bytes, dict]:
        """Headers, DATA bytes and trailers of stream ``sid`` (other frames skipped)."""
        heads: list[dict] = []
        data = b""
        while True:
            ftype, flags, fsid, payload = await self.frame()
            if ftype == h.HEADERS and fsid == sid:
                heads.append({k.decode(): v.decode() for k, v in
                              self.decoder.decode(payload, raw=True)})
                if flags & h.END_STREAM:
                    break
            elif ftype == h.DATA and fsid == sid:
                assert len(payload) <= h.MIN_FRAME_BYTES
                data += payload
                if window:
                    self.writer.write(h.frame(h.WINDOW_UPDATE, 0, sid,
                                              struct.pack(">I", len(payload))))
        return (heads[0] if len(heads) == 2 else {}), data, heads[-1]

    async def goaway(self) -> int:
        while True:
            ftype, _, _, payload = await self.frame()
            if ftype == h.GOAWAY:
                return struct.unpack(">II", payload[:8])[1]


def rows_of(data: bytes) -> np.ndarray:
    flag, size = struct.unpack(">BI", data[:5])
    assert flag == 0 and size == len(data) - 5
    resp = Response.FromString(data[5:])
    shape = list(resp.outputs[0].shape)
    return np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(shape)


def run(test: Any, hold: bool = False) -> Pipeline:
    """Start the endpoint with a stub pipeline, run ``test(port, pipeline, server)``, stop."""
    pipeline = Pipeline(hold)

    async def main() -> None:
        server = await grpc_calls.start(_state(pipeline), "127.0.0.1", 0, TOKEN)
        try:
            await asyncio.wait_for(test(server.port, pipeline, server), 20)
        finally:
            await server.stop(None)

    asyncio.run(main())
    return pipeline


def test_unary_answer_headers_rows_trailers() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        for sid in (1, 3, 5):  # one connection, several calls (HPACK state carried)
            c.call(sid, infer_message([sid, 7, 9], f"id{sid}"))
            head, data, trailers = await c.answer(sid)
            assert head[":status"] == "200" and head["content-type"] == "application/grpc"
            assert trailers == {"grpc-status": "0"}
            np.testing.assert_array_equal(rows_of(data)[:, 0], [sid, 7, 9])
            assert Response.FromString(data[5:]).id == f"id{sid}"

    run(test)


def test_answers_respect_the_clients_windows_and_frame_size() -> None:
    ids = list(range(100))  # 100 x 64 x 4 = 25,600 bytes of rows: two frames at least

    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port, {h.S_INITIAL_WINDOW_SIZE: 1000})
        c.call(1, infer_message(ids))
        first = b""
        while len(first) < 1000:  # the first 1,000 bytes, then nothing until the window grows
            ftype, _, sid, payload = await c.frame()
            if ftype == h.DATA:
                first += payload
        assert len(first) == 1000
        with pytest.raises(asyncio.TimeoutError):
            while True:
                ftype, *_ = await c.frame(timeout_s=0.3)
                assert ftype != h.DATA
        c.writer.write(h.frame(h.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 20)))
        _, rest, trailers = await c.answer(1)
        assert trailers["grpc-status"] == "0"
        np.testing.assert_array_equal(rows_of(first + rest)[:, 0], ids)

    run(test)


def test_continuation_padding_and_ping() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        c.writer.write(h.frame(h.PING, 0, 0, b"12345678"))
        ftype, flags, _, payload = await c.frame()
        while ftype != h.PING:
            ftype, flags, _, payload = await c.frame()
        assert flags & h.ACK and payload == b"12345678"
        block = c.headers_block()
        body = infer_message([4, 2])
        padded = bytes([3]) + body + b"\0\0\0"
        c.writer.write(h.frame(h.HEADERS, 0, 1, block[:5])
                       + h.frame(h.CONTINUATION, h.END_HEADERS, 1, block[5:])
                       + h.frame(h.DATA, h.PADDED | h.END_STREAM, 1, padded))
        _, data, trailers = await c.answer(1)
        assert trailers["grpc-status"] == "0"
        np.testing.assert_array_equal(rows_of(data)[:, 0], [4, 2])

    run(test)


@pytest.mark.parametrize(("send", "code", "words"), [
    (lambda c: c.call(1, infer_message([1]), path="/inference.GRPCInferenceService/Nope"),
     "12", "unknown method"),
    (lambda c: c.call(1, infer_message([1]), content_type="text/plain"), "3", "application/grpc"),
    (lambda c: c.call(1, infer_message([1]), token="wrong"), "16", "bearer token"),
    (lambda c: c.call(1, infer_message([1]), grpc_encoding="gzip"), "12", "gzip"),
    (lambda c: c.call(1, infer_message([1]) * 2), "3", "exactly one"),
    (lambda c: c.call(1, b"\0\0\0\0\3abc"), "3", "ModelInferRequest"),
    (lambda c: c.call(1, b"\1" + infer_message([1])[1:]), "12", "compressed"),
    (lambda c: c.call(1, struct.pack(">BI", 0, 5000) + b"x" * 100), "8", "exceeds"),
    (lambda c: c.call(1, infer_message([10_000])), "3", "10000"),
])
def test_refusals_are_grpc_statuses(send: Any, code: str, words: str) -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        send(c)
        _, data, trailers = await c.answer(1)
        assert trailers["grpc-status"] == code and not data
        assert words in trailers.get("grpc-message", "")
        c.call(3, infer_message([5]))  # the connection serves on
        assert (await c.answer(3))[2]["grpc-status"] == "0"

    run(test)


@pytest.mark.parametrize(("raw", "code"), [
    (h.frame(h.DATA, 0, 0, b"x"), h.PROTOCOL_ERROR),
    (h.frame(h.DATA, 0, 7, b"x"), h.PROTOCOL_ERROR),  # an idle stream
    (h.frame(h.PING, 0, 0, b"short"), h.FRAME_SIZE_ERROR),
    (h.frame(h.SETTINGS, 0, 0, b"12345"), h.FRAME_SIZE_ERROR),
    (h.frame(h.WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)), h.PROTOCOL_ERROR),
    (h.frame(h.HEADERS, h.END_HEADERS, 2, b"\x83"), h.PROTOCOL_ERROR),  # an even stream
    (h.frame(h.HEADERS, h.END_HEADERS, 1, b"\xff\xff\xff\xff"), h.COMPRESSION_ERROR),
    (h.frame_head(h.DATA, 0, 1, 20_000) + b"x" * 20_000, h.FRAME_SIZE_ERROR),
    (h.frame(h.HEADERS, 0, 1, b"") + h.frame(h.PING, 0, 0, b"12345678"), h.PROTOCOL_ERROR),
])
def test_protocol_errors_end_the_connection_with_goaway(raw: bytes, code: int) -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        c.writer.write(raw)
        assert await c.goaway() == code
        assert await asyncio.wait_for(c.reader.read(), 5) == b""  # then closed

    run(test)


def test_not_http2_is_refused() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port, preface=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await c.goaway() == h.PROTOCOL_ERROR

    run(test)


def test_reset_and_disconnect_cancel_the_request() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        c.call(1, infer_message([1]))
        c.call(3, infer_message([2]))
        while len(pipeline.futures) < 2:
            await asyncio.sleep(0.01)
        c.writer.write(h.frame(h.RST_STREAM, 0, 1, struct.pack(">I", h.CANCEL)))
        while "r0" not in pipeline.cancelled:
            await asyncio.sleep(0.01)
        c.writer.close()
        while "r1" not in pipeline.cancelled:
            await asyncio.sleep(0.01)

    pipeline = run(test, hold=True)
    assert pipeline.cancelled == ["r0", "r1"]


def test_grpc_timeout_shortens_the_deadline() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        c.call(1, infer_message([1]), grpc_timeout="50m")
        c.call(3, infer_message([2]))
        for sid in (1, 3):
            assert (await c.answer(sid))[2]["grpc-status"] == "0"

    assert run(test).timeouts_s == [0.05, None]
    assert grpc_calls.grpc_timeout_ms(b"250m") == 250.0
    assert grpc_calls.grpc_timeout_ms(b"2S") == 2000.0
    assert grpc_calls.grpc_timeout_ms(b"1500u") == 1.5
    for bad in (None, b"", b"m", b"12x", b"1234567890S", b"-5m"):
        assert grpc_calls.grpc_timeout_ms(bad) is None


def test_stop_drains_calls_in_flight() -> None:
    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port)
        c.call(1, infer_message([3]))
        while not pipeline.futures:
            await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(server.stop(5.0))
        assert await c.goaway() == h.NO_ERROR
        pipeline.answer("r0")
        _, data, trailers = await c.answer(1)  # answered after the GOAWAY
        assert trailers["grpc-status"] == "0" and rows_of(data)[0, 0] == 3
        await asyncio.wait_for(stopping, 5)

    run(test, hold=True)


def test_header_cache_decodes_as_a_plain_decoder() -> None:
    """Random blocks (new ones, which add to the table, and replays of old ones) give the
    cache and a plain decoder the same headers or the same error, in the same order."""
    rng = random.Random(0)
    encoder, plain = hpack.Encoder(), hpack.Decoder()
    cache = h.HeaderCache(hpack.Decoder())
    pool = [(f"x-k{i}", f"v{j}") for i in range(6) for j in range(3)]
    blocks: list[bytes] = []
    hits = 0
    for _ in range(600):
        if blocks and rng.random() < 0.6:
            block = rng.choice(blocks)
        else:
            block = encoder.encode(rng.sample(pool, rng.randint(1, 4)))
            blocks.append(block)
        try:
            want: Any = [(bytes(k), bytes(v)) for k, v in plain.decode(block, raw=True)]
        except hpack.HPACKError as exc:
            want = type(exc)
        gen = cache.generation
        try:
            hits += block in cache.blocks and cache.blocks[block][0] == gen
            got: Any = cache.decode(block)
        except hpack.HPACKError as exc:
            got = type(exc)
        assert got == want
    assert hits > 50


async def _closed(c: RawClient, within_s: float = 5.0) -> None:
    """Reads (and drops) frames until the server closes the connection."""
    async def drain() -> None:
        while await c.reader.read(65536):
            pass

    try:
        await asyncio.wait_for(drain(), within_s)
    except ConnectionResetError:
        pass


def test_a_client_that_stops_reading_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "TICK_S", 0.05)
    monkeypatch.setattr(connection, "WRITE_STALL_S", 0.3)

    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port, {h.S_INITIAL_WINDOW_SIZE: 100})
        c.call(1, infer_message(list(range(50))))  # 12.8 kB of rows, 100 bytes of window
        t0 = asyncio.get_running_loop().time()
        await _closed(c)
        assert asyncio.get_running_loop().time() - t0 >= 0.3
        assert not server.connections

    run(test)


def test_keepalive_ping_and_a_silent_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "TICK_S", 0.05)
    monkeypatch.setattr(connection, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(connection, "KEEPALIVE_TIMEOUT_S", 0.3)

    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        answered = await RawClient.open(port)  # answers the PING: stays open
        silent = await RawClient.open(port)  # reads but never answers: closed
        for _ in range(3):
            ftype, flags, _, payload = await answered.frame()
            while ftype != h.PING:
                ftype, flags, _, payload = await answered.frame()
            assert not flags & h.ACK
            answered.writer.write(h.frame(h.PING, h.ACK, 0, payload))
        await _closed(silent)
        answered.call(1, infer_message([8]))
        assert (await answered.answer(1))[2]["grpc-status"] == "0"

    run(test)


def test_random_frames_never_take_the_endpoint_down(caplog: pytest.LogCaptureFixture) -> None:
    """Frames of every type with random flags, stream ids and payloads (and a valid call mixed
    in): each connection ends in an answer, a GOAWAY or a reset, never an internal error, and
    a fresh connection is served after all of them."""
    rng = random.Random(7)

    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        for _ in range(300):
            c = await RawClient.open(port)
            raw = b""
            for _ in range(rng.randint(1, 6)):
                ftype = rng.randint(0, 11)
                sid = rng.choice([0, 0, 1, 2, 3, 5, 2 ** 31 - 1])
                payload = rng.randbytes(rng.choice([0, 1, 4, 5, 6, 8, 9, 12, 30, 300]))
                if ftype == h.HEADERS and rng.random() < 0.5:
                    payload = c.headers_block()
                raw += h.frame(ftype, rng.randint(0, 255), sid, payload)
            c.writer.write(raw)
            c.call(101, infer_message([1]))
            await c.writer.drain()
            await asyncio.sleep(0.002)
            c.writer.close()
        await asyncio.sleep(0.2)
        ok = await RawClient.open(port)
        ok.call(1, infer_message([6]))
        assert (await ok.answer(1))[2]["grpc-status"] == "0"

    run(test)
    assert "internal error" not in caplog.text


def test_answers_held_by_the_clients_windows_refuse_new_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PENDING_BYTES of answers waiting for the client's windows, a new stream is
    refused; reading goes on (the WINDOW_UPDATE gets in) and the connection serves again."""
    monkeypatch.setattr(connection, "MAX_PENDING_BYTES", 5000)

    async def test(port: int, pipeline: Pipeline, server: Any) -> None:
        c = await RawClient.open(port, {h.S_INITIAL_WINDOW_SIZE: 100})
        c.call(1, infer_message(list(range(50))))  # 12.8 kB held by a 100-byte window
        (conn,) = server.connections
        while conn.pending_bytes() <= 5000:
            await asyncio.sleep(0.01)
        c.call(3, infer_message([1]))
        ftype, _, sid, payload = await c.frame()
        while ftype != h.RST_STREAM:
            ftype, _, sid, payload = await c.frame()
        assert sid == 3 and struct.unpack(">I", payload)[0] == h.REFUSED_STREAM
        assert not conn.reading_paused
        c.writer.write(h.frame(h.WINDOW_UPDATE, 0, 1, struct.pack(">I", 1 << 20)))
        _, data, trailers = await c.answer(1)
        assert trailers["grpc-status"] == "0" and conn.pending_bytes() == 0
        c.writer.write(h.frame(h.SETTINGS, 0, 0, struct.pack(">HI", h.S_INITIAL_WINDOW_SIZE,
                                                              1 << 20)))
        c.call(5, infer_message([2]))
        assert (await c.answer(5))[2]["grpc-status"] == "0"

    run(test)
