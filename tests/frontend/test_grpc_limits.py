"""The gRPC port's per-connection abuse limits (``frontend/grpc/limits.py``), one counter at a
time, on an ``H2Connection`` fed bytes directly with a transport that records what it is sent:
past each limit the connection answers GOAWAY ENHANCE_YOUR_CALM naming the last stream it took,
closes, and reports the reason; below it nothing happens. The attacks against the real daemon
are in test_grpc_attacks.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loadtest.h2_flood import attack_frames, infer_message, request_block
from quiver_serve.config import GrpcLimitsConfig
from quiver_serve.frontend.grpc import frames as f
from quiver_serve.frontend.grpc import server as grpc_server
from quiver_serve.frontend.grpc.connection import H2Connection
from quiver_serve.frontend.grpc.limits import FrameCounters

BLOCK = request_block("x", "/inference.GRPCInferenceService/ModelInfer")


class Transport:
    """What ``H2Connection`` uses of an asyncio transport; keeps the bytes written."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = self.aborted = self.reading_paused = False

    def write(self, data: bytes) -> None:
        self.out += data

    def writelines(self, parts: list[Any]) -> None:
        for part in parts:
            self.out += part

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 5555) if name == "peername" else None

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        out, pos, found = bytes(self.out), 0, []
        while pos + 9 <= len(out):
            head, flags, sid = f.FRAME_HEAD.unpack_from(out, pos)
            end = pos + 9 + (head >> 8)
            found.append((head & 0xFF, flags, sid, out[pos + 9:end]))
            pos = end
        return found


class Call:
    """A call that never answers; counts what it is told."""

    def __init__(self, log: dict[str, int]) -> None:
        self.log = log

    def message(self, stream: Any, payload: bytes) -> None:
        stream.return_window(len(payload) + 5)

    def end(self, stream: Any) -> None:
        self.log["ended"] += 1

    def cancel(self, stream: Any) -> None:
        self.log["cancelled"] += 1


class Harness:
    """A connection over a :class:`Transport`, its calls and its cut-offs."""

    def __init__(self, **limits: Any) -> None:
        self.calls = {"opened": 0, "ended": 0, "cancelled": 0}
        self.cut_off: list[tuple[str, str]] = []
        self.transport = Transport()
        self.conn = H2Connection(self._on_request, 4096, GrpcLimitsConfig(**limits), None,
                                 lambda reason, peer, _: self.cut_off.append((reason, peer)))
        self.conn.connection_made(self.transport)
        self.conn.data_received(f.PREFACE + f.settings_frame(()))

    def _on_request(self, stream: Any) -> Call:
        self.calls["opened"] += 1
        return Call(self.calls)

    def send(self, data: bytes) -> None:
        self.conn.data_received(data)

    def goaway(self) -> tuple[int, int] | None:
        for ftype, _, _, payload in self.transport.frames():
            if ftype == f.GOAWAY:
                last_sid, code, _ = f.decode_goaway(payload)
                return code, last_sid
        return None

    def is_cut_off(self, reason: str) -> bool:
        closed = self.transport.closed or self.transport.aborted
        return closed and self.cut_off == [(reason, "ipv4:127.0.0.1:5555")] and \
            self.goaway() is not None and self.goaway()[0] == f.ENHANCE_YOUR_CALM


def run(test: Any) -> None:
    async def main() -> None:
        test()

    asyncio.run(main())


@pytest.mark.parametrize(("kind", "limits", "allowed", "reason"), [
    ("settings_flood", {"max_settings": 20}, 19, "settings_flood"),  # + the preface's
    ("ping_flood", {"max_pings": 30}, 30, "ping_flood"),
    ("window_update_flood", {"max_window_updates": 40}, 40, "window_update_flood"),
    ("priority_flood", {"max_priority_frames": 25}, 25, "priority_flood"),
    ("empty_frame_flood", {"max_empty_frames": 10}, 10, "empty_frame_flood"),
    ("continuation_flood", {"max_continuations": 16}, 16, "continuation_flood"),
])
def test_each_flood_is_cut_off_past_its_limit_and_not_before(
        kind: str, limits: dict[str, int], allowed: int, reason: str) -> None:
    def test() -> None:
        within = Harness(**limits)
        within.send(attack_frames(kind, allowed))
        assert within.goaway() is None and not within.cut_off
        assert not within.transport.closed and not within.transport.aborted
        past = Harness(**limits)
        past.send(attack_frames(kind, allowed + 1))
        assert past.is_cut_off(reason), past.transport.frames()[-1:]
        if kind == "ping_flood":  # every PING within the limit was answered, none after
            acks = [fr for fr in past.transport.frames() if fr[0] == f.PING]
            assert len(acks) == allowed and all(fr[1] & f.ACK for fr in acks)

    run(test)


def test_rapid_reset_is_cut_off_and_no_reset_call_starts() -> None:
    """Each call's request ends and is reset in the same read: the call is cancelled before it
    is told its request ended (``connection._end_calls``), so none is parsed or submitted."""
    def test() -> None:
        h = Harness(max_resets=50, reset_ratio=0.5)
        h.send(attack_frames("rapid_reset", 1000))
        assert h.is_cut_off("rapid_reset")
        assert h.goaway() == (f.ENHANCE_YOUR_CALM, 2 * 51 - 1)  # the 51st call's stream
        assert h.calls == {"opened": 51, "ended": 0, "cancelled": 51}
        assert not h.conn.streams  # nothing left that could still be computed
        split = Harness(max_resets=50)  # the reset in the read after the request's end
        split.send(f.frame(f.HEADERS, f.END_HEADERS, 1, BLOCK)
                   + f.frame(f.DATA, f.END_STREAM, 1, infer_message([1])))
        split.send(f.rst_stream(1, f.CANCEL))
        assert split.calls == {"opened": 1, "ended": 1, "cancelled": 1}

    run(test)


def test_a_client_that_resets_a_few_calls_among_many_is_not_cut_off() -> None:
    """Past ``max_resets`` a connection ends only while its resets are over ``reset_ratio`` of
    the streams it opened: 60 resets among 200 calls (30%) pass; the same 60 alone do not."""
    def test() -> None:
        h = Harness(max_resets=50, reset_ratio=0.5)
        body = infer_message([1])
        for sid in range(1, 400, 2):
            h.send(f.frame(f.HEADERS, f.END_HEADERS, sid, BLOCK)
                   + f.frame(f.DATA, f.END_STREAM, sid, body)
                   + (f.rst_stream(sid, f.CANCEL) if sid % 20 < 6 else b""))
        assert h.conn.counters.resets == 60 and h.conn.counters.opened == 200
        assert h.goaway() is None and not h.cut_off
        alone = Harness(max_resets=50, reset_ratio=0.5)
        alone.send(attack_frames("rapid_reset", 60))
        assert alone.is_cut_off("rapid_reset")

    run(test)


def test_resets_of_closed_streams_count_as_resets() -> None:
    def test() -> None:
        h = Harness(max_resets=20)
        h.send(f.frame(f.HEADERS, f.END_HEADERS, 1, BLOCK) + f.rst_stream(1, f.CANCEL)
               + f.rst_stream(1, f.CANCEL) * 25)
        assert h.is_cut_off("rapid_reset") and h.conn.counters.early_resets == 1

    run(test)


def test_window_updates_are_allowed_two_per_data_frame_sent() -> None:
    def test() -> None:
        h = Harness(max_window_updates=10)
        for _ in range(30):
            h.conn.counters.data_frame_sent()
        h.send(attack_frames("window_update_flood", 70))  # 10 + 2 x 30
        assert h.goaway() is None
        h.send(f.window_update(0, 1))
        assert h.is_cut_off("window_update_flood")

    run(test)


def test_acks_queued_to_a_client_that_does_not_read_are_bounded() -> None:
    """While the transport is full (``pause_writing``), each PING answered is counted; past
    ``max_queued_acks`` the connection ends, and the count starts again once it drains."""
    def test() -> None:
        h = Harness(max_queued_acks=30, max_pings=10_000)
        h.conn.pause_writing()
        h.send(attack_frames("ping_flood", 30))
        assert h.goaway() is None and h.transport.reading_paused
        h.conn.resume_writing()
        h.conn.pause_writing()
        h.send(attack_frames("ping_flood", 30))
        assert h.goaway() is None
        h.send(attack_frames("ping_flood", 1))
        assert h.transport.aborted and h.cut_off[0][0] == "control_frames_unread"

    run(test)


def test_streams_past_max_concurrent_streams_are_refused() -> None:
    def test() -> None:
        h = Harness(max_concurrent_streams=3)
        settings = dict(f.decode_settings(h.transport.frames()[0][3]))
        assert settings[f.S_MAX_CONCURRENT_STREAMS] == 3
        h.send(b"".join(f.frame(f.HEADERS, f.END_HEADERS, sid, BLOCK) for sid in (1, 3, 5, 7)))
        refused = [(sid, f.decode_u32(p)) for t, _, sid, p in h.transport.frames()
                   if t == f.RST_STREAM]
        assert refused == [(7, f.REFUSED_STREAM)] and len(h.conn.streams) == 3

    run(test)


def test_counts_start_again_each_window() -> None:
    counters = FrameCounters(GrpcLimitsConfig(max_pings=3, window_s=10.0), now_s=100.0)
    for _ in range(3):
        counters.ping()
    counters.roll(109.9)
    assert counters.pings == 3
    counters.roll(110.0)
    for _ in range(3):
        counters.ping()
    assert counters.pings == 3 and counters.window_start_s == 110.0


def test_cut_offs_are_all_counted_and_logged_at_most_ten_a_second(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A reconnecting attacker is cut off many times a second: the metric counts every one,
    the log takes ten lines a second and then says how many it left out."""
    counted: list[str] = []
    now = [1000.2]
    monkeypatch.setattr(grpc_server.time, "monotonic", lambda: now[0])
    srv = grpc_server.H2Server(lambda s: None, 4096, GrpcLimitsConfig(), counted.append)
    with caplog.at_level("WARNING", logger=grpc_server.__name__):
        for _ in range(25):
            srv.on_cut_off("rapid_reset", "ipv4:10.0.0.9:4000", "101 of 101 streams reset")
        now[0] = 1001.1
        srv.on_cut_off("ping_flood", "ipv4:10.0.0.9:4001", "more than 500 PING frames")
    lines = [r.getMessage() for r in caplog.records]
    assert counted == ["rapid_reset"] * 25 + ["ping_flood"] and srv.cut_off_total == 26
    assert len(lines) == 11 and all("ipv4:10.0.0.9" in line for line in lines)
    assert lines[-1].endswith("(15 more cut off before this, not logged)")
    assert "cut off (ping_flood)" in lines[-1]
