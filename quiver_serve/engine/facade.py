"""What an HTTP front-end needs from the serving path, over one :class:`EngineClient`.

Two classes implement it: :class:`~quiver_serve.engine.pipeline.Pipeline` (the engine cores are
this process's children; one front-end in the main process) and
:class:`~quiver_serve.http.frontend_proc.RemotePipeline` (a front-end process of several, whose
client reaches the main process's engine cores). Admission, drain and the per-request submit are
here, once.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.engine.client import EngineClient
from quiver_serve.sampling.base import MAX_SEED


class ClientFacade:
    """Admission (``ready``), drain, and ``submit_ids_async`` over ``self.client``."""

    cfg: ServeConfig
    client: EngineClient | None

    def _init_facade(self, id_prefix: str) -> None:
        self._rids = itertools.count()
        self._rid_prefix = id_prefix
        self._accepting = False
        self._draining = False
        self._stopping = threading.Event()

    @property
    def ready(self) -> bool:
        """Admitting requests: started, not draining, not stopped."""
        return self._accepting and not self._stopping.is_set()

    @property
    def draining(self) -> bool:
        return self._draining

    def refusal(self) -> errors.ServeError:
        """The 503 to answer while not accepting: starting up, or shutting down."""
        if self._draining:
            return errors.unavailable("shutting_down", "the server is shutting down")
        return errors.unavailable("not_ready", "the server is starting up")

    @property
    def pending_count(self) -> int:
        return self.client.pending_count if self.client is not None else 0

    def begin_drain(self) -> None:
        """Readiness turns false and new requests get 503; admitted ones go on."""
        self._accepting = False
        self._draining = True

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait (bounded) until no admitted request is left; True if none is."""
        end = time.monotonic() + timeout_s
        while self.pending_count and time.monotonic() < end:
            time.sleep(0.01)
        return not self.pending_count

    def submit_ids_async(self, ids: np.ndarray, exact: bool, seed: int | None,
                         timeout_s: float | None) -> tuple[str, Any]:
        """The hot path of a front-end: ids already checked (int64, in range, not too many).
        Returns the request id (to cancel it) and an asyncio future of its EmbedResult."""
        if not self.ready or self.client is None:
            raise self.refusal()
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise errors.ServeError("invalid_seed", f"seed must be in [0, {MAX_SEED}], got {seed}", 400)
        limit = self.cfg.server.request_timeout_s
        deadline_s = time.time() + (limit if timeout_s is None else min(timeout_s, limit))
        rid = f"{self._rid_prefix}{next(self._rids)}"
        return rid, self.client.submit_async(ids, exact, seed, deadline_s, rid)

    def cancel(self, request_id: str, reason: str = "client_disconnected") -> bool:
        """Forget a request nobody waits for; not computed if it has not been sent yet."""
        return self.client.cancel(request_id) if self.client is not None else False
