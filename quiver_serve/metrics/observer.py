"""Hooks a front-end implements to turn pipeline events into metrics (default: no-op)."""

from __future__ import annotations

from quiver_serve.messages import BatchStats


class PipelineObserver:
    """Called from the client's IO thread (batches, rejections, pending) and the supervisor."""

    def on_batch(self, stats: BatchStats) -> None: ...

    def on_rejected(self, reason: str) -> None: ...

    def on_late_result(self) -> None: ...

    def on_restart(self, role: str) -> None: ...

    def on_pending(self, count: int) -> None: ...

    def on_transport(self, sent_s: float, engine_received_s: float, engine_replied_s: float,
                     received_s: float) -> None:
        """One micro-batch's trip, ``time.time()`` instants: the client sent it, the engine core
        took it in, the engine core built its reply, the client read the reply."""

    def on_model_answers(self, model: str, version: str, ok: int, failed: int,
                         round_trip_s: float) -> None:
        """One micro-batch's answers: the model and version that served them (as asked, when
        none did), how many requests succeeded and failed, and its round trip."""

    def on_round_trip(self, sent_s: float, received_s: float) -> None:
        """Every micro-batch's round trip as the client saw it (``time.time()`` instants), with
        or without batch stats (only a batch's first micro-batch carries them)."""
