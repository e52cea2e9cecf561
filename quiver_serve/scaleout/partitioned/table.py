"""The exact table across partitions (docs/architecture.md, "The exact table across
partitions"; decision 0065).

Each partition server holds every layer's exact output (fp32) of the nodes its partition owns, so
an exact request for them is a gather, as on one machine. A row of layer ``i`` is computed on its
one-hop in-neighbourhood (``graph/neighbourhood.py`` over the partition's lists and overlay) by
layer ``i`` of the served model (``models/layerwise.py``), from layer ``i - 1``'s rows: its own
rows here, the other partitions' rows by one call per partition (``table_rows``), the features
for the first layer (``PartitionFeatures.gather``).

Every row has a stale bit per layer. A row is served, or given to a peer as input, only while its
bit is clear; a row is computed only from inputs whose bits are clear, else it stays stale. So
no coordination between servers is needed: a server starts with every row stale, and the
refresh loop computes, layer after layer, the rows whose inputs are clean; rows waiting on a
peer's layer are computed on a later pass (with a back-off). The same loop keeps the table fresh:
an update's marks (``mark``, called by the update's primary on every server before it answers
the update, layer by layer along out-edges across partitions: ``table_marks.py``) set the bits, and
a bit set while its row was being computed stays set (``remarked``), so a row computed from an
input older than a mark is never served.

Out-edges come from :class:`OutEdges`: the base's in-lists transposed once per base, plus the
edges the log added since (removed edges stay: a superset, and marking more is safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import ExactConfig
from quiver_serve.graph.neighbourhood import (
    ALL_NODES_FRACTION,
    CurrentGraph,
    segment_positions,
    split_by_edges,
)
from quiver_serve.models.layerwise import LayerwiseModel
from quiver_serve.scaleout.partitioned.peers import PartitionUnavailable
from quiver_serve.scaleout.partitioned.sampling import LocalGraph, as_tensor

log = logging.getLogger(__name__)

#: (partition, layer, global ids it owns) -> (float32 rows, uint8 stale flags)
RemoteTableRows = Callable[[int, int, np.ndarray], Awaitable[tuple[np.ndarray, np.ndarray]]]
#: the first pause of a pass that computed nothing (waiting on peers' layers), doubled up to
#: ``MAX_BACKOFF_S``
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
#: rows per chunk at most (each chunk is one call per peer)
MAX_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class OutEdges:
    """Out-neighbours, as own local rows, of global ids: the base's in-edges sorted by source
    (``of_base``, beside the loop), and the edges added since (given to :meth:`reach`)."""

    src_sorted: Tensor  # int64 [E]: the base's sources, ascending
    dst_rows: Tensor  # int64 [E]: the local row each of them points to

    @classmethod
    def of_base(cls, indptr: Tensor, indices: Tensor) -> OutEdges:
        counts = indptr[1:] - indptr[:-1]
        dst = torch.repeat_interleave(torch.arange(counts.numel()), counts,
                                      output_size=int(indices.numel()))
        order = torch.argsort(indices.to(torch.int64), stable=True)
        return cls(indices.to(torch.int64).index_select(0, order), dst.index_select(0, order))

    def reach(self, ids: Tensor, added: np.ndarray) -> Tensor:
        """Local rows with an in-edge from a global id in ``ids`` (int64, sorted), from the
        base or from ``added`` (int64 [a, 2]: global source, local row)."""
        lo = torch.searchsorted(self.src_sorted, ids)
        hi = torch.searchsorted(self.src_sorted, ids, right=True)
        total = int((hi - lo).sum())
        found = [self.dst_rows.index_select(0, segment_positions(lo, hi - lo, total)[0])] \
            if total else []
        if added.size:
            pairs = torch.from_numpy(added)
            found.append(pairs[torch.isin(pairs[:, 0], ids), 1])
        return torch.unique(torch.cat(found)) if found else ids.new_empty(0)


@dataclass
class TableCounts:
    """What ``GET /v1/graph`` and ``/metrics`` show of a server's table."""

    computed_rows: int = 0
    passes: int = 0
    marks: int = 0
    from_table: int = 0
    inductive: int = 0  # a request's own new nodes answered from the tables
    restarted: int = 0  # servers restarted by this primary's marks (``table_marks.py``)
    #: this primary's updates' marks across the deployment (each update's wait for its group's
    #: marking): how many, seconds in all, longest
    markings: int = 0
    marking_s: float = 0.0
    marking_max_s: float = 0.0
    built_s: float | None = None  # seconds from start until the table was first fresh
    started_s: float = field(default_factory=time.monotonic)

    def observe_marking(self, seconds: float) -> None:
        self.markings += 1
        self.marking_s += seconds
        self.marking_max_s = max(self.marking_max_s, seconds)


def relabel(targets: Tensor, src: Tensor) -> tuple[Tensor, Tensor]:
    """Global ``n_id`` (``targets`` first, in their order, then the other sources ascending)
    and each source's position in it."""
    others = torch.unique(src[~torch.isin(src, targets)])
    n_id = torch.cat([targets, others])
    order = torch.argsort(n_id)
    col = order.index_select(0, torch.searchsorted(n_id.index_select(0, order), src))
    return n_id, col


class PartitionTable:
    """Every layer of the own rows, their stale bits, and the refresh loop (module docstring).
    Runs on the server's event loop; the layer's arithmetic goes to a thread."""

    def __init__(self, cfg: ExactConfig, model: LayerwiseModel, part: int, device: torch.device,
                 remote: RemoteTableRows) -> None:
        self.cfg, self.model, self.part, self.device = cfg, model, part, device
        self.remote = remote
        self.dims = model.out_dims()
        self.rows = 0
        self.layers = [torch.zeros((0, d), dtype=torch.float32, device=device) for d in self.dims]
        self.stale = [torch.zeros(0, dtype=torch.bool) for _ in self.dims]
        self.remarked = [torch.zeros(0, dtype=torch.bool) for _ in self.dims]
        self.own_ids = torch.zeros(0, dtype=torch.int64)  # local row -> global id
        self.owner = self.local = torch.zeros(0, dtype=torch.int64)  # the book's (follow_book)
        self.out_edges: OutEdges | None = None
        self.counts = TableCounts()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.dims)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    # ---- the partition's rows -----------------------------------------------------------------
    def follow_book(self, owner: Tensor, local: Tensor) -> None:
        """The own rows of the (grown) book: new rows are stale at every layer."""
        self.owner, self.local = owner, local
        mine = (owner == self.part).nonzero().flatten()
        rows = int(mine.numel())
        own_ids = torch.empty(rows, dtype=torch.int64)
        own_ids[local.index_select(0, mine).to(torch.int64)] = mine
        self.own_ids = own_ids
        if rows <= self.rows:
            return
        extra = rows - self.rows
        for i, d in enumerate(self.dims):
            self.layers[i] = torch.cat([self.layers[i], torch.zeros(
                (extra, d), dtype=torch.float32, device=self.device)])
            self.stale[i] = torch.cat([self.stale[i], torch.ones(extra, dtype=torch.bool)])
            self.remarked[i] = torch.cat([self.remarked[i], torch.ones(extra, dtype=torch.bool)])
        self.rows = rows
        self.counts.built_s = None
        self._poke()

    def rebase(self, out_edges: OutEdges) -> None:
        """The out-edge index of a new base (built beside the loop)."""
        self.out_edges = out_edges

    # ---- reads ----------------------------------------------------------------------------------
    def stale_of(self, rows: Tensor) -> Tensor:
        """bool: which of local ``rows`` are not fresh at the last layer."""
        return self.stale[-1].index_select(0, rows)

    def lookup(self, rows: Tensor, fresh: Tensor) -> np.ndarray:
        """float32 last-layer rows of local ``rows`` (those not ``fresh`` are to be
        overwritten by the caller)."""
        self.counts.from_table += int(fresh.sum())
        out = self.layers[-1].index_select(0, rows.to(self.device))
        return np.ascontiguousarray(out.cpu().numpy())

    def layer_rows(self, layer: int, rows: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s float32 rows of local ``rows`` and their stale flags (uint8)."""
        got = self.layers[layer].index_select(0, rows.to(self.device)).cpu().numpy()
        return np.ascontiguousarray(got), self.stale[layer].index_select(0, rows).numpy() \
            .astype(np.uint8)

    # ---- marks ----------------------------------------------------------------------------------
    def mark(self, layer: int, changed: Tensor | None, lists: Tensor, added: np.ndarray,
             num_nodes: int) -> Tensor | None:
        """Rows of ``layer`` an update can change: the own ids among ``changed`` (the global ids
        whose layer below changed; None: every node) and ``lists`` (whose in-lists changed),
        and the own out-neighbours of ``changed``. Sets their bits; the global ids marked, or
        None when every own row was (the caller then marks every node at the next layer)."""
        self.counts.marks += 1
        if changed is None or changed.numel() > ALL_NODES_FRACTION * max(num_nodes, 1):
            self._set(layer, torch.arange(self.rows))
            return None
        assert self.out_edges is not None
        keys = torch.unique(torch.cat([changed, lists]))
        rows = [self.out_edges.reach(changed, added)]
        own = self.own_rows_of(keys)
        if own.numel():
            rows.append(own)
        marked = torch.unique(torch.cat(rows)) if rows else changed.new_empty(0)
        marked = marked[marked < self.rows]
        self._set(layer, marked)
        return self.own_ids.index_select(0, marked)

    def own_rows_of(self, ids: Tensor) -> Tensor:
        """The local rows of the global ``ids`` this partition owns (others are left out)."""
        ids = ids[(ids >= 0) & (ids < self.owner.numel())]
        return self.local.index_select(0, ids[self.owner.index_select(0, ids) == self.part]) \
            .to(torch.int64)

    def _set(self, layer: int, rows: Tensor) -> None:
        self.stale[layer][rows] = True
        self.remarked[layer][rows] = True
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---- the refresh loop -----------------------------------------------------------------------
    def start(self, sources: TableSources) -> None:
        """Start the refresh loop on the running loop (again if it ended)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.ensure_future(self._run(sources))

    def stop(self) -> None:
        if self._task is not None and not self._task.get_loop().is_closed():
            self._task.cancel()

    async def _run(self, sources: TableSources) -> None:
        """Passes over the stale rows, layer by layer, until none is left; then wait for a
        mark. A pass that computed nothing (inputs stale at a peer, or a peer down) backs off."""
        backoff_s = FIRST_BACKOFF_S
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await sources.follow()
                pending, progress = await self._pass(sources)
            except Exception:  # noqa: BLE001 - logged; the next pass tries again
                log.exception("partition %d: an exact-table pass failed", self.part)
                pending, progress = True, False
            if not pending:
                if self.counts.built_s is None:
                    self.counts.built_s = time.monotonic() - self.counts.started_s
                    log.info("partition %d: exact table of %d rows fresh after %.2f s",
                             self.part, self.rows, self.counts.built_s)
                await self._wake.wait()
                # the other layers' marks of the same update come within milliseconds: one
                # pass takes them all (``exact.refresh_interval_ms``, as on one machine)
                await asyncio.sleep(self.cfg.refresh_interval_ms / 1e3)
                backoff_s = FIRST_BACKOFF_S
                continue
            if not progress:
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
            else:
                backoff_s = FIRST_BACKOFF_S
                await asyncio.sleep(0)

    async def _pass(self, sources: TableSources) -> tuple[bool, bool]:
        """One pass over every layer's stale rows: (whether any was stale, whether any was
        computed)."""
        self.counts.passes += 1
        pending = progress = False
        duty = self.cfg.refresh_duty
        for layer in range(self.num_layers):
            targets = self.stale[layer][:self.rows].nonzero().flatten()
            if not targets.numel():
                continue
            pending = True
            for chunk in self._chunks(targets, sources.current_graph()):
                t0 = time.perf_counter()
                try:
                    done = await self._compute(layer, chunk, sources)
                except PartitionUnavailable as exc:
                    log.debug("partition %d: exact table waits: %s", self.part, exc)
                    break
                progress |= done > 0
                if duty < 1.0:
                    await asyncio.sleep((time.perf_counter() - t0) * (1 - duty) / duty)
        return pending, progress

    def _chunks(self, targets: Tensor, graph: CurrentGraph) -> list[Tensor]:
        """``targets`` in chunks of about ``exact.refresh_chunk_edges`` in-edges (a node with
        more is a chunk of its own) and at most ``MAX_CHUNK_ROWS`` rows."""
        max_edges = self.cfg.refresh_chunk_edges if self.counts.built_s is not None \
            else self.cfg.chunk_edges
        return split_by_edges(targets, graph.in_degree(targets), max_edges, MAX_CHUNK_ROWS)

    async def _compute(self, layer: int, rows: Tensor, sources: TableSources) -> int:
        """Layer ``layer`` of local ``rows`` whose inputs are clean, written and their bits
        cleared unless marked meanwhile; how many were computed. The in-edges are read from
        the graph as it is now, in the same step as the bits are watched: a graph taken
        before an await may be one a move to a newer base left behind, older than marks
        already made."""
        self.remarked[layer][rows] = False
        counts, src = sources.current_graph().in_edges(rows)
        targets = self.own_ids.index_select(0, rows)
        n_id, col = relabel(targets, src)
        x, stale_in = await self._inputs(layer, n_id, sources)
        dst = torch.repeat_interleave(torch.arange(rows.numel()), counts, output_size=src.numel())
        blocked = stale_in[:rows.numel()].to(torch.int64)  # the row's own input, then its edges'
        blocked.index_add_(0, dst, stale_in.index_select(0, col).to(torch.int64))
        ok = blocked == 0
        if not bool(ok.any()):
            return 0
        edge_index = torch.stack([col, dst]).to(self.device)
        out = await asyncio.to_thread(self.model.forward_layer, layer, x.to(self.device),
                                      edge_index, int(rows.numel()), n_id.to(self.device))
        done = rows[ok]
        self.layers[layer].index_copy_(0, done.to(self.device), out[ok.to(out.device)].float())
        clear = done[~self.remarked[layer].index_select(0, done)]
        self.stale[layer][clear] = False
        self.counts.computed_rows += int(done.numel())
        return int(done.numel())

    async def _inputs(self, layer: int, n_id: Tensor,
                      sources: TableSources) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s input rows of global ``n_id`` (float32) and whether each is stale:
        the features for the first layer; else the own rows of the layer below here and the
        others' by one call per partition, all at once."""
        if layer == 0:
            return await sources.features(n_id), torch.zeros(n_id.numel(), dtype=torch.bool)
        below = layer - 1
        x = torch.empty((n_id.numel(), self.dims[below]), dtype=torch.float32, device=self.device)
        stale = torch.zeros(n_id.numel(), dtype=torch.bool)
        owners = self.owner.index_select(0, n_id).to(torch.int64)
        calls = []
        for q in torch.unique(owners).tolist():
            pos = (owners == q).nonzero().flatten()
            if q != self.part:
                calls.append((pos, asyncio.ensure_future(
                    self.remote(int(q), below, n_id.index_select(0, pos).numpy()))))
                continue
            local = self.local.index_select(0, n_id.index_select(0, pos)).to(torch.int64)
            x.index_copy_(0, pos.to(self.device), self.layers[below].index_select(
                0, local.to(self.device)))
            stale[pos] = self.stale[below].index_select(0, local)
        try:
            answers = await asyncio.gather(*(fut for _, fut in calls))
        except BaseException:
            for _, fut in calls:
                fut.cancel()
            raise
        for (pos, _), (got, flags) in zip(calls, answers, strict=True):
            x.index_copy_(0, pos.to(self.device), as_tensor(np.asarray(got, np.float32))
                          .to(self.device))
            stale[pos] = as_tensor(np.asarray(flags, np.uint8)).to(torch.bool)
        return x, stale

    async def inductive(self, x_new: Tensor, indptr: Tensor, neighbors: Tensor,
                        sources: TableSources) -> Tensor | None:
        """Exact last-layer rows of a request's own new nodes (``x_new``: their features; their
        in-neighbours as CSR ``indptr``/``neighbors``, global ids of existing nodes), decision
        0064 across partitions: a new node has no out-edges, so each layer reads only its own
        row of the layer below and its in-neighbours' rows from the tables (here and at their
        owners). None when one of those is stale (the caller computes the request on the fly)."""
        m = int(indptr.numel() - 1)
        counts = indptr[1:] - indptr[:-1]
        nbrs = torch.unique(neighbors)
        col = m + torch.searchsorted(nbrs, neighbors)
        dst = torch.repeat_interleave(torch.arange(m), counts, output_size=neighbors.numel())
        edge_index = torch.stack([col, dst]).to(self.device)
        first = int(self.owner.numel())
        n_id = torch.cat([torch.arange(first, first + m), nbrs]).to(self.device)
        h = x_new.float().to(self.device)
        for layer in range(self.num_layers):
            x_nbrs, stale = await self._inputs(layer, nbrs, sources)
            if bool(stale.any()):
                return None
            x = torch.cat([h, x_nbrs.to(self.device)])
            h = await asyncio.to_thread(self.model.forward_layer, layer, x, edge_index, m, n_id)
        self.counts.inductive += m
        return h

    def snapshot(self) -> dict[str, Any]:
        """The table's state as plain data."""
        return {"rows": self.rows, "layers": self.num_layers, "bytes": self.nbytes,
                "stale_rows": int(self.stale[-1][:self.rows].sum()) if self.rows else 0,
                "fresh": self.counts.built_s is not None, "built_s": self.counts.built_s,
                "computed_rows": self.counts.computed_rows, "passes": self.counts.passes,
                "marks": self.counts.marks, "rows_from_table": self.counts.from_table,
                "new_nodes_from_table": self.counts.inductive,
                "restarted": self.counts.restarted, "markings": self.counts.markings,
                "marking_s": round(self.counts.marking_s, 6),
                "marking_max_s": round(self.counts.marking_max_s, 6),
                "device": str(self.device)}


@dataclass(frozen=True)
class TableSources:
    """What the refresh loop reads of its server: the current graph (lists and overlay), the
    feature rows of global ids, and the follow of the log before each pass."""

    graph: Callable[[], LocalGraph]
    features: Callable[[Tensor], Awaitable[Tensor]]
    follow: Callable[[], Awaitable[None]]

    def current_graph(self) -> CurrentGraph:
        g = self.graph()
        return CurrentGraph(g.indptr, g.indices, g.overlay, g.num_nodes)
