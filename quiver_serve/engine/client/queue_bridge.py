"""QueueBridge: a stream of requests on a queue, answered on another queue, through one client.

One implementation serves both queue APIs: ``Pipeline.request_queue()`` / ``result_queue()`` and
the seed's ``InferenceServer`` (``seed_api.py``). A thread reads the request queue (items:
:class:`EmbedRequest`, or a LongTensor of node ids whose request id is its arrival number),
submits each through ``submit`` (which validates and hands it to an :class:`EngineClient`), and
puts exactly one :class:`EmbedResult` per request on the result queue: the embeddings, or the
error (a refused request's 400/413/409 at once; 504/503 from the client).

Backpressure: requests in flight plus results not yet read never exceed ``capacity``; while they
would, the thread stops reading requests, so a caller that does not read results holds back its
own stream instead of growing any queue. That room is why a result put never waits.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from quiver_serve import errors
from quiver_serve.engine.procs.process import get_or_none
from quiver_serve.messages import EmbedRequest, EmbedResult

log = logging.getLogger(__name__)

#: how long the thread waits before looking again while the caller is not reading results
BACKPRESSURE_WAIT_S = 0.005
#: a result put waits at most this long (room is reserved, so it should not wait at all)
PUT_TIMEOUT_S = 1.0

Submit = Callable[[EmbedRequest], "Future[EmbedResult]"]


def as_request(item: Any, seq: int) -> EmbedRequest | None:
    """Accept an EmbedRequest, or a bare LongTensor of node ids (request_id = its arrival number)."""
    if isinstance(item, EmbedRequest):
        return item
    if isinstance(item, Tensor):
        return EmbedRequest(request_id=str(seq), node_ids=item)
    return None


class QueueBridge:
    """Reads ``requests``, answers on ``results``; ``start()`` / ``stop()`` its thread.

    ``ordered``: results leave in the order their requests arrived (a stream's order; a result
    that is ready waits for the ones before it, each of which is answered by its deadline at the
    latest). Unordered, each leaves as soon as it is ready.
    """

    def __init__(self, requests: Any, results: Any, submit: Submit, capacity: int,
                 ordered: bool = False, name: str = "quiver-queue-bridge") -> None:
        self.requests, self.results = requests, results
        self.capacity = capacity
        self.ordered = ordered
        self.ignored_items = 0  # neither an EmbedRequest nor a tensor: logged and skipped
        self._submit = submit
        self._in_flight = 0  # taken, and their result not yet put on ``results``
        #: re-entrant: ordered delivery puts (and counts) while it holds the lock
        self._lock = threading.RLock()
        #: futures of unanswered requests in arrival order (``ordered`` only)
        self._order: deque[Future[EmbedResult]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop reading requests (any time, any number of times). Requests already submitted
        still get their result when their future resolves (a stopped client answers 503)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        seq = itertools.count()
        while not self._stop.is_set():
            if self._in_flight + _qsize(self.results) >= self.capacity:
                self._stop.wait(BACKPRESSURE_WAIT_S)  # the caller is not reading results
                continue
            item = get_or_none(self.requests)
            if item is None:
                continue
            request = as_request(item, next(seq))
            if request is None:
                self.ignored_items += 1
                log.error("request queue: ignoring %s (expected EmbedRequest or LongTensor)",
                          type(item))
                continue
            self._take(request)

    def _take(self, request: EmbedRequest) -> None:
        with self._lock:
            self._in_flight += 1
        try:
            fut = self._submit(request)
        except errors.ServeError as exc:  # refused before submitting: answered at once
            fut = Future()
            fut.set_result(EmbedResult(request.request_id, error=exc.info))
        if self.ordered:
            with self._lock:
                self._order.append(fut)
        fut.add_done_callback(self._on_done)

    def _on_done(self, fut: Future[EmbedResult]) -> None:
        """Runs on the client's thread (or this one): deliver what is ready, in order if asked."""
        if not self.ordered:
            self._put(fut.result())
            return
        with self._lock:  # one deliverer at a time keeps the arrival order on the queue
            while self._order and self._order[0].done():
                self._put(self._order.popleft().result())

    def _put(self, result: EmbedResult) -> None:
        try:
            self.results.put(result, timeout=PUT_TIMEOUT_S)
        except (queue.Full, ValueError, OSError):  # full despite the reserved room, or closed
            log.error("result queue: result of %s dropped", result.request_id)
        finally:
            with self._lock:
                self._in_flight -= 1


def _qsize(q: Any) -> int:
    try:
        return int(q.qsize())
    except (NotImplementedError, OSError):  # macOS has no sem_getvalue: assume room
        return 0
