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
