"""Per-connection abuse limits of the gRPC port's HTTP/2
(docs/decisions/0036-http2-abuse-limits.md).

A client can make a server work without asking it anything useful: open a call and reset it at
once, thousands of times (rapid reset, CVE-2023-44487), or send frames that each cost an answer
or a look (SETTINGS, PING, WINDOW_UPDATE, PRIORITY, empty DATA, a header block cut into
CONTINUATION frames: CVE-2024-27316's class). :class:`FrameCounters` counts these per connection
over a window of ``window_s`` (``server.grpc_limits``, ``config.GrpcLimitsConfig``); past a
limit it raises :class:`Abuse`, and the connection sends GOAWAY ENHANCE_YOUR_CALM with its last
stream id and closes at once (``connection.H2Connection.cut_off``), without waiting for the peer.

The window is fixed, not sliding: counts start again once ``window_s`` has passed since the
window began (checked once per read, ``roll``). Rapid reset: the connection ends when the
client has reset more than ``max_resets`` of its streams in the window (those it reset before
their answer, and RST_STREAMs of streams already closed) and they are more than
``reset_ratio`` of the streams it opened: a client that cancels a few calls among many is no
attacker; one that cancels most is, after ``max_resets``.
"""

from __future__ import annotations

from typing import Any

from quiver_serve.frontend.grpc.frames import ENHANCE_YOUR_CALM, H2Error
from quiver_serve.metrics.prometheus import GRPC_CUT_OFF_REASONS

#: why a connection was cut off: the label values of ``grpc_connections_closed_total{reason}``
REASONS = GRPC_CUT_OFF_REASONS
#: WINDOW_UPDATEs a client may send per DATA frame it received (one for the stream, one for
#: the connection), on top of ``max_window_updates``
WINDOW_UPDATES_PER_DATA_FRAME = 2


class Abuse(H2Error):
    """A limit passed: GOAWAY ENHANCE_YOUR_CALM, then close; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(ENHANCE_YOUR_CALM, message)
        self.reason = reason


class FrameCounters:
    """One connection's counts in the current window (module docstring); ``limits`` is a
    ``config.GrpcLimitsConfig``."""

    __slots__ = ("limits", "window_start_s", "opened", "resets", "early_resets", "settings",
                 "pings", "window_updates", "data_frames_sent", "priority_frames", "empty_frames",
                 "queued_acks", "total_opened", "total_early_resets")

    def __init__(self, limits: Any, now_s: float) -> None:
        self.limits = limits
        self.total_opened = self.total_early_resets = 0
        self.queued_acks = 0  # not per window: reset when the transport drains
        self.start_window(now_s)

    def start_window(self, now_s: float) -> None:
        self.window_start_s = now_s
        self.opened = self.resets = self.early_resets = self.settings = self.pings = 0
        self.window_updates = self.data_frames_sent = self.priority_frames = 0
        self.empty_frames = 0

    def roll(self, now_s: float) -> None:
        """A new window once ``window_s`` has passed since this one began."""
        if now_s - self.window_start_s >= self.limits.window_s:
            self.start_window(now_s)

    # ---- what the client did -------------------------------------------------------------------
    def stream_opened(self) -> None:
        self.opened += 1
        self.total_opened += 1

    def reset(self, early: bool) -> None:
        """The client reset a stream it opened; ``early``: before its answer."""
        self.resets += 1
        self.early_resets += early
        self.total_early_resets += early
        lim = self.limits
        if self.resets > lim.max_resets and self.resets > lim.reset_ratio * self.opened:
            raise Abuse("rapid_reset", f"{self.resets} of {self.opened} streams reset "
                                       f"({self.early_resets} before their answer) within "
                                       f"{lim.window_s:g} s")

    def settings_frame(self) -> None:
        self.settings += 1
        if self.settings > self.limits.max_settings:
            raise Abuse("settings_flood", self._over("SETTINGS", self.limits.max_settings))

    def ping(self) -> None:
        self.pings += 1
        if self.pings > self.limits.max_pings:
            raise Abuse("ping_flood", self._over("PING", self.limits.max_pings))

    def window_update(self) -> None:
        self.window_updates += 1
        allowed = self.limits.max_window_updates \
            + WINDOW_UPDATES_PER_DATA_FRAME * self.data_frames_sent
        if self.window_updates > allowed:
            raise Abuse("window_update_flood", self._over("WINDOW_UPDATE", allowed))

    def priority(self) -> None:
        self.priority_frames += 1
        if self.priority_frames > self.limits.max_priority_frames:
            raise Abuse("priority_flood", self._over("PRIORITY", self.limits.max_priority_frames))

    def empty_frame(self) -> None:
        """A frame that carries nothing (``max_empty_frames``' description says which)."""
        self.empty_frames += 1
        if self.empty_frames > self.limits.max_empty_frames:
            raise Abuse("empty_frame_flood", self._over("empty", self.limits.max_empty_frames))

    def continuation(self, frames_in_block: int) -> None:
        """The ``frames_in_block``-th CONTINUATION of the header block being read."""
        if frames_in_block > self.limits.max_continuations:
            raise Abuse("continuation_flood", f"a header block of more than "
                        f"{self.limits.max_continuations} CONTINUATION frames")

    def ack_queued(self) -> None:
        """A control frame (an ACK, a refusal) written while the transport is full."""
        self.queued_acks += 1
        if self.queued_acks > self.limits.max_queued_acks:
            raise Abuse("control_frames_unread", f"more than {self.limits.max_queued_acks} "
                        "control frames queued to a client that does not read")

    # ---- what this side did --------------------------------------------------------------------
    def data_frame_sent(self) -> None:
        self.data_frames_sent += 1

    def transport_drained(self) -> None:
        self.queued_acks = 0

    def _over(self, what: str, limit: int) -> str:
        return f"more than {limit} {what} frames within {self.limits.window_s:g} s"

    def summary(self, now_s: float) -> str:
        """The counts, for the log line of a connection cut off."""
        return (f"in the last {now_s - self.window_start_s:.2f} s: {self.opened} streams opened, "
                f"{self.resets} reset ({self.early_resets} before their answer), "
                f"{self.settings} SETTINGS, "
                f"{self.pings} PING, {self.window_updates} WINDOW_UPDATE, "
                f"{self.priority_frames} PRIORITY, {self.empty_frames} empty frames; "
                f"{self.total_opened} streams opened and {self.total_early_resets} reset early "
                "in all")
