"""What an engine client holds: each admitted request, and each micro-batch in flight.

Both live only in the client's process; past it a request is a position in a micro-batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from quiver_serve.messages import EmbedResult, ErrorInfo
from quiver_serve.wire import InductiveNodes, MicroBatchDone, view


class Waiter:
    """The future of a caller blocked on its answer (``EngineClient.call``): one lock, taken
    when made and released to wake the caller. Cheaper than a ``concurrent.futures.Future``
    (no condition, no callbacks, no lock made per wait).

    Waiters answered together wake in turn (:func:`wake_in_turn`): each caller, once awake,
    wakes the next. Released all at once, every caller would wake to queue for the GIL and the
    lock behind it, most of them only to sleep again; one at a time, each finds the GIL about
    free (decision 28: ~20% less caller CPU per request with 64 threads on two CPU cores).
    ``wake`` may be called more than once (the IO thread wakes a stalled chain's waiters)."""

    __slots__ = ("result", "next", "returns", "_lock", "_woken")

    def __init__(self, returns: bool = False) -> None:
        self.result: EmbedResult | None = None
        #: its caller is expected to ask again as soon as it has the answer (``returns.py``)
        self.returns = returns
        self.next: Waiter | None = None  # the waiter this one wakes when it wakes
        self._lock = threading.Lock()
        self._lock.acquire()
        self._woken = False

    def done(self) -> bool:
        return self.result is not None

    @property
    def woken(self) -> bool:
        return self._woken

    def set_result(self, result: EmbedResult) -> None:
        self.result = result
        self.wake()

    def wake(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # released already, not yet taken by its caller
            pass

    def wait(self, timeout_s: float) -> EmbedResult | None:
        """The answer, or None if it did not come within ``timeout_s``; wakes the next waiter
        of its chain first."""
        if not self._woken:
            self._woken = self._lock.acquire(timeout=max(timeout_s, 0.0))
            # answered in a chain that has not reached it yet: it leaves, so it wakes the next
            if (self._woken or self.result is not None) and self.next is not None:
                self.next.wake()
        return self.result


def wake_in_turn(waiters: list[Waiter], results: list[EmbedResult]) -> None:
    """Set every answer, then wake the first waiter; each wakes the next (see :class:`Waiter`)."""
    for w, result in zip(waiters, results, strict=True):
        w.result = result
    for a, b in zip(waiters[:-1], waiters[1:], strict=True):
        a.next = b
    waiters[0].wake()


class Admitted:
    """One admitted request, alive only in this process. ``rows``: the rows its answer has
    (its ids, then its inductive nodes)."""

    __slots__ = ("request_id", "ids", "exact", "seed", "deadline_s", "future", "loop", "done",
                 "arrived_s", "min_version", "inductive", "rows", "model", "version",
                 "numpy_rows", "node_type")

    def __init__(self, request_id: str, ids: np.ndarray, exact: bool, seed: int | None,
                 deadline_s: float, future: Any, loop: asyncio.AbstractEventLoop | None,
                 min_version: int = 0, inductive: InductiveNodes | None = None,
                 model: str = "", version: int = 0, numpy_rows: bool = False) -> None:
        self.request_id, self.ids, self.exact, self.seed = request_id, ids, exact, seed
        #: answered with ``EmbedResult.rows`` (a NumPy view of the reply), not a tensor
        self.numpy_rows = numpy_rows
        self.model, self.version = model, version
        #: the node type of its ids (typed graphs; "": the graph's only type)
        self.node_type = ""
        self.deadline_s, self.future, self.loop = deadline_s, future, loop
        self.min_version, self.inductive = min_version, inductive
        self.rows = int(ids.size) + (inductive.count if inductive is not None else 0)
        self.done = False
        self.arrived_s = time.monotonic()

    @property
    def alone(self) -> bool:
        """Travels in a micro-batch of its own (a seeded sample; inductive frames)."""
        return self.seed is not None or self.inductive is not None


@dataclass
class Flight:
    """A micro-batch sent to an engine core and not yet answered."""

    engine: int
    requests: list[Admitted]
    frames: list[Any]
    num_rows: int  # answer rows: its ids and inductive nodes (the load it puts on the engine)
    attempts: int = 1
    sent_s: float = field(default_factory=time.monotonic)
    sent_wall_s: float = field(default_factory=time.time)  # the same, comparable across processes

    def answers(self, done: MicroBatchDone, frames: list[Any]) -> list[tuple[Admitted, EmbedResult]]:
        """Each request's answer from the engine core's reply, or the error the reply names
        for it. Rows are views: of the reply's own buffer (read-only, no copy) for requests
        that asked for NumPy rows (``Admitted.numpy_rows``: the front-ends), else of one
        tensor copied from it per micro-batch."""
        arr = tensor = None
        if done.dim and len(frames) > 1:
            arr = view(frames[1], np.float32).reshape(-1, done.dim)
        failed = {e.index: e for e in done.errors}
        out, start = [], 0
        for i, req in enumerate(self.requests):
            end = start + req.rows
            err = failed.get(i)
            if err is not None or arr is None:
                info = ErrorInfo(err.code, err.message, err.status) if err else ErrorInfo(
                    "internal", "engine reply carried no rows", 500)
                out.append((req, EmbedResult(req.request_id, error=info)))
            elif req.numpy_rows:
                out.append((req, EmbedResult(req.request_id, rows=arr[start:end],
                                             model=done.model, version=done.version)))
            else:
                if tensor is None:
                    tensor = torch.from_numpy(arr.copy())
                out.append((req, EmbedResult(req.request_id, embeddings=tensor[start:end],
                                             model=done.model, version=done.version)))
            start = end
        return out
