"""The ingress of a partitioned deployment: the daemon's HTTP contract on Ray Serve's proxy.

``POST /v1/embed`` and KServe v2 ``POST /v2/models/{name}/infer`` take the daemon's bodies and
answer its bodies and errors (``frontend/responses.py``, ``frontend/kserve.py``). Ids go to the
partition that owns them, one call per partition, all at once, and the rows are merged in request
order. A seeded request goes whole to one partition server (the owner of its first id), which
draws its subgraph across partitions: a seeded answer is a function of the whole request's
subgraph, as on one machine. ``GET /v1/graph`` lists the partitions, ``GET /v2/health/ready``
asks every one, ``GET /metrics`` gathers their counts (``metrics/partitioned.py``).
``POST /v1/graph/edges`` and ``PUT /v1/graph/features`` (admin) go to the partitions owning what
they change and answer a version token that ``min_version`` takes (``live_routes.py``).
``POST /v1/graph/nodes`` (admin) hands out the next global ids, enters them in the book at their
owner (with their rows), then at every other partition (decision 0052); the ingress learns the
book's growth from the partitions when it starts and completes an entry a failed call left.

A partition that fails a call (gone, restarting, past its timeout) is refused for
``partitioned.down_s``: requests needing it are answered 503 with Retry-After at once, never with
a partial answer; the others go on (docs/architecture.md, "Partitioned serving").
"""


import asyncio
import os
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve

from quiver_serve import errors
from quiver_serve.config import ServeConfig
from quiver_serve.frontend import kserve
from quiver_serve.frontend.bodies import validation_message
from quiver_serve.frontend.guards import Plane, Tokens, authorize
from quiver_serve.frontend.responses import embed_answer, error_response, serve_error_response
from quiver_serve.frontend.schemas import GraphEdgesBody, GraphFeaturesBody, GraphNodesBody
from quiver_serve.metrics.partitioned import IngressCounts, exposition
from quiver_serve.partition.book import PartitionBook
from quiver_serve.scaleout.partitioned.links import LinkError, WireLink
from quiver_serve.scaleout.partitioned.live_routes import (
    PartitionedEmbedBody,
    adopt,
    choose_owner,
    inductive_server,
    largest_in_neighbor,
    merge_answers,
    merge_growth,
    new_nodes_of,
    parse_token,
    split_edges,
    split_rows,
)
from quiver_serve.scaleout.partitioned.peers import CALL_BUCKETS_S, Replicas
from quiver_serve.wire import InductiveNodes

#: how long a readiness or status probe waits for a partition server
PROBE_S = 2.0
#: beyond the request's own deadline, how long the ingress waits for a partition server
MARGIN_S = 1.0
#: how long ``POST /v1/graph/compact`` waits for a partition's compaction (a fold and a base
#: written, then the move to it)
COMPACT_TIMEOUT_S = 600.0

APP = FastAPI(title="quiver-serve, partitioned, on Ray Serve",
              description="the daemon's /v1/embed and KServe v2 infer over partition servers")


@APP.exception_handler(RequestValidationError)
async def _malformed(request: Any, exc: RequestValidationError) -> JSONResponse:
    """A body the schema refuses: 422 ``invalid_request``, worded as the daemon words it."""
    return error_response(422, "invalid_request", validation_message(list(exc.errors())),
                          path=request.url.path)


def book_arrays(book: PartitionBook) -> dict[str, Any]:
    """The book as plain data (what goes into the object store for the ingress)."""
    return {"owner": book.owner, "local": book.local, "num_parts": book.num_parts,
            "method": book.method}


class Unavailable(errors.ServeError):
    """A partition the request needs is refused or lost: 503 with the server's Retry-After."""

    def __init__(self, part: int, reason: str) -> None:
        super().__init__("partition_unavailable",
                         f"partition {part} is unavailable ({reason}); retry later", 503)
        self.part = part


@serve.ingress(APP)
class PartitionedIngress:
    """See the module docstring. ``servers[p][r]``: partition ``p``'s replica ``r`` (Ray actor
    handles, valid across restarts)."""

    def __init__(self, servers: list[list[Any]], book: dict[str, Any], cfg_dict: dict[str, Any],
                 dim: int, num_features: int) -> None:
        import ray

        self.servers = servers
        arrays = ray.get(book["ref"])
        self.book = PartitionBook(arrays["owner"], arrays["local"], arrays["num_parts"],
                                  arrays["method"])
        self.cfg = ServeConfig.model_validate(cfg_dict)
        self.dim, self.num_features = dim, num_features
        self.down_until = [0.0] * len(servers)
        self.counts = IngressCounts()
        self.replicas = Replicas(max(len(r) for r in servers), self.cfg.partitioned.down_s)
        self.tokens = Tokens.from_config(self.cfg.server)
        #: whether ``book`` holds the growth the partitions logged (learned at the first request)
        self.synced = False
        self.grow_lock = asyncio.Lock()
        self._learning: asyncio.Future[None] | None = None  # the reads' shared ``_sync_book``
        #: embeds go to the servers over the wire when it is the transport (decision 0054)
        self.link = WireLink(self._address) if self.cfg.partitioned.transport == "wire" else None

    # ---- routes --------------------------------------------------------------------------------
    @APP.post("/v1/embed", summary="Embeddings for node ids (the daemon's /v1/embed)")
    async def embed(self, body: PartitionedEmbedBody, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            ids = await self._check(np.asarray(body.node_ids, dtype=np.int64), 0, body.seed,
                                    bool(body.new_nodes), largest_in_neighbor(body))
            new = new_nodes_of(body, ids, self.num_features, self.book,
                               self.cfg.server.max_request_nodes)
            timeout_s = None if body.timeout_ms is None else body.timeout_ms / 1000.0
            await self._wait_versions(parse_token(body.min_version, self.book.num_parts),
                                      timeout_s)
            rows = await self.rows(ids, body.exact, body.seed, timeout_s, new)
        except errors.ServeError as exc:
            return self._refuse(exc, t0)
        content, media_type = embed_answer(self.cfg.model.name, rows,
                                           request.headers.get("accept"))
        self.counts.observe(200, time.perf_counter() - t0)
        return Response(content, media_type=media_type)

    @APP.post("/v2/models/{name}/infer", summary="KServe v2 inference: node_ids -> embeddings")
    async def infer(self, name: str, request: Request) -> Response:
        t0 = time.perf_counter()
        path = request.url.path
        try:
            if name != self.cfg.model.name:
                raise errors.ServeError("model_not_found", f"unknown model {name!r}; this "
                                        f"deployment serves {self.cfg.model.name!r}", 404)
            req = kserve.parse_infer(await request.body(),
                                     request.headers.get(kserve.HEADER_LENGTH))
            ids = await self._check(req.node_ids, req.min_version, req.seed)
            timeout_s = None if req.timeout_ms is None else req.timeout_ms / 1000.0
            rows = await self.rows(ids, req.exact, req.seed, timeout_s)
        except errors.ServeError as exc:
            return self._refuse(exc, t0, path)
        content, headers = kserve.infer_response(name, 1, req, rows)
        self.counts.observe(200, time.perf_counter() - t0)
        return Response(content, headers=headers)

    @APP.post("/v1/graph/edges", summary="Add or remove edges, each at its destination's owner "
              "(admin); answers the version token")
    async def edges(self, body: GraphEdgesBody, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._admin(request)
            named = [v for pair in (*body.add, *body.remove) for v in pair]
            await self._learn_book(force=max(named, default=-1) >= self.book.num_nodes)
            split = split_edges(self.book, body.add, body.remove)
            answer = await self._update("edges", {p: (a, r) for p, (a, r) in split.items()})
        except errors.ServeError as exc:
            return self._refuse(exc, t0, request.url.path)
        self.counts.observe(200, time.perf_counter() - t0)
        return JSONResponse(answer)

    @APP.put("/v1/graph/features", summary="Overwrite feature rows at their owners (admin); "
             "replicated copies are dropped first")
    async def features(self, body: GraphFeaturesBody, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._admin(request)
            await self._learn_book(force=max(body.node_ids) >= self.book.num_nodes)
            split = split_rows(self.book, body.node_ids, body.features)
            await self._drop_copies(np.asarray(body.node_ids, np.int64), set(split))
            answer = await self._update("features", split)
        except errors.ServeError as exc:
            return self._refuse(exc, t0, request.url.path)
        self.counts.observe(200, time.perf_counter() - t0)
        return JSONResponse(answer)

    @APP.post("/v1/graph/nodes", summary="Append nodes with their feature rows (admin): the "
              "next global ids, at the least-loaded partition; answers them and the token")
    async def nodes(self, body: GraphNodesBody, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._admin(request)
            async with self.grow_lock:
                await self._sync_book(complete=True)
                answer = await self._add_nodes(body.features)
        except errors.ServeError as exc:
            return self._refuse(exc, t0, request.url.path)
        self.counts.observe(200, time.perf_counter() - t0)
        return JSONResponse(answer)

    @APP.post("/v1/graph/compact", summary="Fold every partition's updates into a new base of "
              "its log now (admin; each also compacts by itself at graph.compact_at_fill)")
    async def compact(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._admin(request)
            answers = await asyncio.gather(*(self._compact_one(p)
                                             for p in range(self.book.num_parts)))
        except errors.ServeError as exc:
            return self._refuse(exc, t0, request.url.path)
        self.counts.observe(200, time.perf_counter() - t0)
        return JSONResponse({"partitions": {str(p): a for p, a in enumerate(answers)}})

    async def _compact_one(self, part: int) -> dict[str, Any]:
        from ray.exceptions import RayError

        self._check_up(part)
        try:
            out: dict[str, Any] = await asyncio.wait_for(
                self.servers[part][0].compact.remote(), COMPACT_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as exc:
            raise Unavailable(part, type(exc).__name__) from None
        if "code" in out:
            self._refused(out)
        return out

    @APP.get("/v2/health/live", summary="Liveness")
    async def live(self) -> dict[str, bool]:
        return {"live": True}

    @APP.get("/v2/health/ready", summary="Readiness: every partition has a server answering")
    async def ready(self) -> Response:
        infos = await self._infos()
        missing = sorted({s["partition"] for s in infos if s.get("down")} -
                         {s["partition"] for s in infos if not s.get("down")})
        if missing:
            return serve_error_response(errors.unavailable(
                "not_ready", f"partitions {missing} have no server answering"),
                self.cfg.server.retry_after_s, "/v2/health/ready")
        return JSONResponse({"ready": True})

    @APP.get("/v1/graph", summary="The partitioned graph: partitions, their servers, sizes")
    async def graph(self) -> JSONResponse:
        infos = await self._infos()
        shown = ("replica", "pid", "nodes", "graph_nodes", "edges", "device", "transport", "requests",
                 "hot_hit_rate", "version", "base_version", "compaction", "table")
        parts = [{"partition": p, "servers": [
            {"down": bool(s.get("down")), **{k: s.get(k) for k in shown}}
            for s in infos if s["partition"] == p]} for p in range(self.book.num_parts)]
        await self._learn_book()
        return JSONResponse({"num_nodes": self.book.num_nodes, "num_parts": self.book.num_parts,
                             "method": self.book.method, "dim": self.dim,
                             "ingress_pid": os.getpid(), "partitions": parts})

    @APP.get("/metrics", summary="Prometheus metrics of the ingress and every partition server")
    async def metrics(self) -> Response:
        text = exposition(await self._infos(), self.counts, CALL_BUCKETS_S)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- the work ------------------------------------------------------------------------------
    async def _check(self, ids: np.ndarray, min_version: int, seed: int | None,
                     new_nodes: bool = False, named: int = -1) -> np.ndarray:
        """The daemon's checks of one request (``errors.check_node_ids``, none when only
        ``new_nodes`` are asked, the seed's range, after learning the book's growth when an id
        or ``named``, the largest in-neighbour of its new nodes, is past it); a plain
        ``min_version`` is refused (KServe's parameter: /v1/embed takes the version token
        instead, ``live_routes.py``)."""
        if min_version:
            raise errors.ServeError("unsupported_on_ray", "a numeric min_version is not "
                                    "supported on a partitioned graph; /v1/embed takes the "
                                    "version token an update answered as min_version", 400)
        largest = max(int(ids.max()) if ids.size else -1, named)
        if not self.synced or largest >= self.book.num_nodes:
            await self._learn_book(force=True)
        if ids.size or not new_nodes:
            errors.check_node_ids(ids, self.book.num_nodes, self.cfg.server.max_request_nodes)
        errors.check_seed(seed)
        return ids

    async def rows(self, ids: np.ndarray, exact: bool, seed: int | None,
                   timeout_s: float | None, new: InductiveNodes | None = None) -> np.ndarray:
        """float32 [len(ids), dim] in request order (then a row per new node);
        :class:`errors.ServeError` otherwise."""
        if new is not None:  # one server holds the new nodes for the request
            return await self._call(inductive_server(self.book, new, ids), ids, exact, seed,
                                    timeout_s, new)
        if seed is not None and not exact:  # one server draws the whole request's subgraph
            owner = int(self.book.owners(ids[:1])[0])
            return await self._call(owner, ids, exact, seed, timeout_s)
        out = np.empty((ids.size, self.dim), dtype=np.float32)
        split = [(p, pos) for p, pos in enumerate(self.book.split(ids)) if pos.size]
        for p, _ in split:
            self._check_up(p)
        got = await asyncio.gather(*(self._call(p, ids[pos], exact, seed, timeout_s)
                                     for p, pos in split), return_exceptions=True)
        for (_, pos), rows in zip(split, got, strict=True):
            if isinstance(rows, BaseException):
                raise rows
            out[pos] = rows
        return out

    def _admin(self, request: Request) -> None:
        refused = authorize(Plane.ADMIN, request.headers.get("authorization", "").encode(),
                            request.client, self.tokens)
        if refused is not None:
            raise errors.ServeError(refused.code, refused.message, refused.status)

    async def _update(self, kind: str, split: dict[int, tuple[Any, Any]]) -> dict[str, Any]:
        """One call per partition touched (replica 0: the one holding the log), all at once;
        the merged answer, or the first refusal (the partitions that answered keep their
        update: each is durable in its own log, and its version shows in /v1/graph)."""
        from ray.exceptions import RayError

        async def one(p: int, first: Any, second: Any) -> dict[str, Any]:
            self._check_up(p)
            try:
                out: dict[str, Any] = await asyncio.wait_for(
                    self.servers[p][0].update.remote(kind, first, second),
                    self.cfg.server.request_timeout_s + MARGIN_S)
            except (RayError, asyncio.TimeoutError) as exc:
                self.down_until[p] = time.monotonic() + self.cfg.partitioned.down_s
                raise Unavailable(p, type(exc).__name__) from None
            if "code" in out:
                self._refused(out)
            return out

        got = await asyncio.gather(*(one(p, a, b) for p, (a, b) in split.items()),
                                   return_exceptions=True)
        for answer in got:
            if isinstance(answer, BaseException):
                raise answer
        return merge_answers(dict(zip(split, got, strict=True)))  # type: ignore[arg-type]

    async def _add_nodes(self, features: list[list[float]]) -> dict[str, Any]:
        """``features``' nodes at the next global ids: entered at their owner with their rows
        (durable there), then at every other partition; the book grows when all have them.
        A call that fails leaves the book to be learned and completed by the next one."""
        owner, first, count = choose_owner(self.book), self.book.num_nodes, len(features)
        entry = [first, count, owner]
        try:
            at_owner = await self._update("nodes", {owner: (entry, features)})
            others = await self._update("nodes", {q: (entry, None)
                                                  for q in range(self.book.num_parts) if q != owner})
        except errors.ServeError:
            self.synced = False
            raise
        adopt(self.book, [entry])  # a read's ``_sync_book`` meanwhile may have entered it
        versions = {**at_owner["versions"], **others.get("versions", {})}
        return {"versions": dict(sorted(versions.items(), key=lambda kv: int(kv[0]))),
                "node_ids": list(range(first, first + count))}

    async def _learn_book(self, force: bool = False) -> None:
        """``_sync_book`` for reads and edge or row updates, once until it succeeds (again with
        ``force``: a request names an id past the book, which another ingress replica may have
        added), one call shared by every request that waits meanwhile (a restarted ingress under
        load asks the partitions once, not once per request)."""
        if self.synced and not force:
            return
        if self._learning is None or self._learning.done():
            self._learning = asyncio.ensure_future(self._sync_book())
        await asyncio.shield(self._learning)

    async def _sync_book(self, complete: bool = False) -> None:
        """Learn the book's growth from every partition server that answers (an acknowledged
        entry is at every partition); with ``complete``, every partition's replica 0 must
        answer (503 naming one that does not) and is given the entries it lacks, in order."""
        from ray.exceptions import RayError

        async def ask(server: Any) -> list[list[int]]:
            got: list[list[int]] = await asyncio.wait_for(server.growth.remote(), PROBE_S)
            return got

        asked = [(p, r) for p, reps in enumerate(self.servers) for r in range(len(reps))]
        got = await asyncio.gather(*(ask(self.servers[p][r]) for p, r in asked),
                                   return_exceptions=True)
        lists = {pr: g for pr, g in zip(asked, got, strict=True) if not isinstance(g, BaseException)}
        for (p, r), g in zip(asked, got, strict=True):
            if complete and r == 0 and isinstance(g, BaseException):
                if not isinstance(g, RayError | asyncio.TimeoutError):
                    raise g
                raise Unavailable(p, "new nodes need every partition answering")
        if not lists:
            return
        entries = merge_growth(list(lists.values()))
        adopt(self.book, entries)
        if complete:
            for p in range(self.book.num_parts):
                for entry in entries[len(lists[(p, 0)]):]:
                    await self._update("nodes", {p: (entry, None)})
        self.synced = True

    async def _drop_copies(self, ids: np.ndarray, owners: set[int]) -> None:
        """Every server of every partition but the owners drops its replicated copies of
        ``ids`` before the owners write them (decision 0047); one that cannot be reached
        fails the write with nothing written."""
        from ray.exceptions import RayError

        calls = [(p, s.drop_hot.remote(ids)) for p, reps in enumerate(self.servers)
                 for s in reps]
        for p, ref in calls:
            try:
                await asyncio.wait_for(ref, self.cfg.partitioned.remote_timeout_s + MARGIN_S)
            except (RayError, asyncio.TimeoutError) as exc:
                raise Unavailable(p, f"its replicated rows could not be dropped: "
                                  f"{type(exc).__name__}") from None

    async def _wait_versions(self, wanted: dict[int, int], timeout_s: float | None) -> None:
        """Until every partition in ``wanted`` applied its version; 504 past the deadline."""
        if not wanted:
            return
        wait_s = timeout_s or self.cfg.server.request_timeout_s
        got = await asyncio.gather(*(self._wait_version(p, v, wait_s)
                                     for p, v in wanted.items()), return_exceptions=True)
        for answer in got:
            if isinstance(answer, BaseException):
                raise answer

    async def _wait_version(self, part: int, version: int, wait_s: float) -> None:
        """Until a replica of ``part`` applied ``version``: it is then in the partition's log,
        which every replica reads up to before it answers (decision 0053). Another replica
        when one is lost; 504 naming the partition past ``wait_s``, 503 when none answers."""
        from ray.exceptions import RayError

        end = time.monotonic() + wait_s
        for replica in self.replicas.order(part):
            left = end - time.monotonic()
            try:
                got = await asyncio.wait_for(
                    self.servers[part][replica].wait_version.remote(version, max(left, 0.0)),
                    max(left, 0.0) + MARGIN_S)
            except (RayError, asyncio.TimeoutError):
                self.replicas.failed(part, replica)
                continue
            if got >= 0:
                return
            raise errors.ServeError("deadline_exceeded", f"partition {part} did not reach "
                                    f"version {version} within the deadline", 504)
        if time.monotonic() < end:
            raise Unavailable(part, f"no replica answered while waiting for version {version}")
        raise errors.ServeError("deadline_exceeded", f"partition {part} did not reach version "
                                f"{version} within the deadline (no replica answered)", 504)

    def _check_up(self, part: int) -> None:
        if time.monotonic() < self.down_until[part]:
            raise Unavailable(part, "it failed moments ago")

    async def _call(self, part: int, ids: np.ndarray, exact: bool, seed: int | None,
                    timeout_s: float | None, new: InductiveNodes | None = None) -> np.ndarray:
        """Partition ``part``'s answer for ``ids`` (and ``new`` nodes, through Ray): the next
        replica, then (if that one is lost) another; a refusal naming a partition marks that
        partition down."""
        from ray.exceptions import RayError

        self._check_up(part)
        replicas = self.servers[part]
        wait_s = (timeout_s or self.cfg.server.request_timeout_s) + MARGIN_S
        reason = "no replica"
        for replica in self.replicas.order(part)[:2]:
            try:
                call = replicas[replica].embed_new.remote(ids, exact, seed, timeout_s,
                                                          *new.frames()) if new else \
                    replicas[replica].embed.remote(ids, exact, seed, timeout_s) \
                    if self.link is None else \
                    self.link.call(part, replica, "embed", ids, exact, seed, timeout_s)
                out = await asyncio.wait_for(call, wait_s)
            except (RayError, LinkError, asyncio.TimeoutError) as exc:
                reason = type(exc).__name__
                self.replicas.failed(part, replica)
                if self.link is not None:
                    asyncio.ensure_future(self._relink(part, replica))
                continue
            if isinstance(out, dict):
                self._refused(out)
            return np.asarray(out, dtype=np.float32)
        self.down_until[part] = time.monotonic() + self.cfg.partitioned.down_s
        raise Unavailable(part, reason)

    async def _address(self, part: int, replica: int) -> str:
        """Partition ``part`` replica ``replica``'s wire address, asked of its actor."""
        address: str = await asyncio.wait_for(
            self.servers[part][replica].wire_address.remote(), PROBE_S)
        return address

    async def _relink(self, part: int, replica: int) -> None:
        """After a failed wire call: drop the socket if the server moved (restarted on a new
        port) or is gone; a slow answer alone keeps it (other calls are on it)."""
        from ray.exceptions import RayError

        if self.link is None:
            return
        try:
            address: str | None = await self._address(part, replica)
        except (RayError, asyncio.TimeoutError):
            address = None
        self.link.moved(part, replica, address)

    def _refused(self, out: dict[str, Any]) -> None:
        if "partition" in out:
            self.down_until[int(out["partition"])] = \
                time.monotonic() + self.cfg.partitioned.down_s
        raise errors.ServeError(out["code"], out["message"], int(out["status"]))

    def _refuse(self, exc: errors.ServeError, t0: float, path: str = "") -> JSONResponse:
        self.counts.observe(exc.info.status, time.perf_counter() - t0)
        return serve_error_response(exc, self.cfg.server.retry_after_s, path)

    async def _infos(self) -> list[dict[str, Any]]:
        """Every server's ``info()`` (``{"partition", "replica", "down": True}`` for one that
        does not answer within ``PROBE_S``)."""
        async def one(p: int, r: int, server: Any) -> dict[str, Any]:
            try:
                info: dict[str, Any] = await asyncio.wait_for(server.info.remote(), PROBE_S)
                return info
            except Exception:  # noqa: BLE001 - any failure: shown as down
                return {"partition": p, "replica": r, "down": True}

        return list(await asyncio.gather(*(one(p, r, s) for p, reps in enumerate(self.servers)
                                           for r, s in enumerate(reps))))
