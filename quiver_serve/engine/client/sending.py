"""How an engine client's requests leave: micro-batches, spread over the engine cores.

Each tick of the client (its IO thread, or a ``LoopClient``'s event loop) takes the requests due
to leave (every new one; with ``batching.adaptive: false``, the held ones once the oldest waited
``hold_s`` or ``max_batch_nodes`` ids wait) and groups them into micro-batches: one per engine
core and kind (sampled / exact, model, version), split at ``max_batch_nodes``; a seeded or
inductive request travels alone. Each request joins the engine core with the least estimated
work: the client's own ids there plus, for a short while after that engine said so, the ids
other clients have there; ties go round-robin (decision 0019). Each header carries the ids the
client expects that engine to see from it soon (``outstanding_ids``), which the engine's
expected fill uses.

A mixin of :class:`~quiver_serve.engine.client.client.EngineClient`, which owns the state named
below; it runs on the thread that owns the sockets.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any

import zmq

from quiver_serve.engine.client.inflight import Admitted, Flight
from quiver_serve.wire import NO_SEED, MicroBatchHeader, encode, pack_requests

#: how long an engine core's report of other clients' ids counts (about a batch or two)
OTHERS_TTL_S = 0.02


class MicroBatchSender:
    """Micro-batch forming and spreading; see the module docstring."""

    endpoints: Any  # EngineEndpoints
    _inbox: Any  # deque[Admitted]
    _held: list[Admitted]
    _held_ids: int
    _deadlines: list[tuple[float, int, Admitted]]
    _tie: itertools.count
    _seq: itertools.count
    _load: list[int]
    _others: list[tuple[int, float]]
    _next_engine: int
    _pending_ids: int
    _flights: dict[int, Flight]
    _socks: list[zmq.Socket]
    sent: list[int]

    def _take_inbox(self) -> list[Admitted]:
        """Requests to send now: every new one (adaptive), or the held ones once due."""
        while self._inbox:
            req = self._inbox.popleft()
            if not req.done:
                heapq.heappush(self._deadlines, (req.deadline_s, next(self._tie), req))
                self._held.append(req)
                self._held_ids += req.rows
        if not self._held:
            return []
        hold_s = self.endpoints.hold_s
        due = hold_s <= 0 or self._held_ids >= self.endpoints.max_batch_nodes \
            or time.monotonic() - self._held[0].arrived_s >= hold_s
        if not due:
            return []
        taken, self._held, self._held_ids = self._held, [], 0
        return taken

    def _send_new(self) -> None:
        """Requests due to leave, as micro-batches to the engines: each request joins the engine
        with the least estimated work, counting what this tick already gave it (so callers that
        return together are spread over every engine core, not sent to one); one micro-batch per
        engine and kind, split at ``max_batch_nodes``; a seeded or inductive request travels
        alone."""
        cap = self.endpoints.max_batch_nodes
        planned = self._estimated_load()
        groups: dict[tuple[int, bool, str, int, str], list[Admitted]] = {}
        sizes: dict[tuple[int, bool, str, int, str], int] = {}
        for req in self._take_inbox():
            if req.done:
                continue
            engine = self._pick(planned)
            planned[engine] += req.rows
            if req.alone:
                self._send([req], req.exact, NO_SEED if req.seed is None else req.seed, engine)
                continue
            key = (engine, req.exact, req.model, req.version, req.node_type)
            group = groups.setdefault(key, [])
            if group and sizes[key] + req.rows > cap:
                self._send(group, req.exact, NO_SEED, engine)
                group = groups[key] = []
                sizes[key] = 0
            group.append(req)
            sizes[key] = sizes.get(key, 0) + req.rows
        for (engine, exact, *_), group in groups.items():
            if group:
                self._send(group, exact, NO_SEED, engine)

    def _estimated_load(self) -> list[int]:
        """Per engine core: the ids this client has there plus, for a short while after the
        engine said so, the ids other clients have there."""
        now_s = time.monotonic()
        return [mine + (others if now_s - at_s < OTHERS_TTL_S else 0)
                for mine, (others, at_s) in zip(self._load, self._others, strict=True)]

    def _pick(self, load: list[int]) -> int:
        """The engine with the least load; ties go round-robin (never always to engine 0: with
        callers in lock-step every engine is idle at once, and index order would starve the
        rest)."""
        n = len(load)
        if n == 1:
            return 0
        best, start = -1, self._next_engine
        for k in range(n):
            e = (start + k) % n
            if best < 0 or load[e] < load[best]:
                best = e
        self._next_engine = (best + 1) % n
        return best

    def _send(self, reqs: list[Admitted], exact: bool, seed: int, engine: int) -> None:
        """One micro-batch: header and its requests packed in one frame (``pack_requests``),
        then an inductive request's ``InductiveNodes`` frames; its ``min_version`` is the
        largest its requests asked."""
        seq = next(self._seq)
        body = pack_requests([r.ids for r in reqs], [r.deadline_s for r in reqs])
        if len(reqs) == 1:
            rows, min_version, inductive = reqs[0].rows, reqs[0].min_version, reqs[0].inductive
        else:  # inductive requests travel alone: a group's rows are its ids
            rows = body.size - 2 * len(reqs)
            min_version, inductive = max(r.min_version for r in reqs), None
        self._load[engine] += rows
        self.sent[engine] += 1
        head = MicroBatchHeader(seq, exact, seed, self._share(engine), min_version,
                                inductive.count if inductive is not None else 0,
                                reqs[0].model, reqs[0].version, len(reqs), reqs[0].node_type,
                                inductive.relations if inductive is not None else ())
        frames: list[Any] = [encode(head), body]
        if inductive is not None:
            frames += inductive.frames()
        self._flights[seq] = Flight(engine, reqs, frames, rows)
        self._socks[engine].send_multipart(frames, copy=False)

    def _share(self, engine: int) -> int:
        """Ids this client expects ``engine`` to see from it soon: those it has there now (a
        caller that gets its answer sends its next request to the least loaded engine, which
        is then usually the one that answered) plus an even share of those not sent yet. With
        one engine this is every pending id."""
        unsent = max(self._pending_ids - sum(self._load), 0)
        return self._load[engine] + -(-unsent // len(self._load))
