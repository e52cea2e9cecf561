"""The exact table of a typed graph, kept through updates (docs/architecture.md, "Typed graphs";
docs/decisions/0060-typed-table-refresh.md).

Every layer's output of every node, per node type, in host memory (``TypedLayerwise.run_layers``),
with a stale mark per layer and row. Layer ``i`` of a node reads layer ``i - 1`` of the node and of
its in-neighbours along every relation into its type, and the edges into it; so what a batch of
records changed (``graph/typed_living.py``, ``TypedChanges``) makes stale:

* at layer 1: the nodes whose inputs changed, their out-neighbours, and the destinations whose
  in-edges changed;
* at layer ``i + 1``: the stale rows of layer ``i``, their out-neighbours, and those
  destinations again.

``refresh`` recomputes stale rows chunk by chunk (``TypedLayerwise.layer_rows``; a chunk holds
at most ``chunk_edges`` in-edges, as the untyped table's ``exact.refresh_chunk_edges``, fewer
when the step's budget at the measured rate allows fewer, and ``chunk_nodes`` targets), the
lowest layer first and a layer only once the one below it is clean, so every row it writes is that of
the current graph; records applied between two calls only add marks. A final-layer row that is
not marked is exact; the core answers marked rows on the fly until the refresh reaches them.

Out-neighbours along a relation are the in-neighbours along its reverse when the living graph
keeps one (``add_reverse_edges``: the ``rev_`` relation, or the relation itself when it is
within one type and made undirected), read from the reverse's CSC; else every entry of the
relation is scanned once per layer.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.typed import EdgeType, TypedGraph
from quiver_serve.graph.typed_living import TypedChanges, TypedLiveGraph
from quiver_serve.graph.typed_splice import range_positions
from quiver_serve.models.typed_layerwise import TypedLayerwise

log = logging.getLogger(__name__)

#: most targets per refresh chunk (their in-edges bound it first: ``chunk_edges``)
REFRESH_CHUNK_NODES = 16384
#: fewest in-edges a chunk sized to a short budget holds (its fixed costs stay small beside)
MIN_CHUNK_EDGES = 4096


class TypedExactTable:
    """Every layer's rows per node type with stale marks; see the module docstring."""

    def __init__(self, layerwise: TypedLayerwise, chunk_edges: int = 1 << 20,
                 chunk_nodes: int = REFRESH_CHUNK_NODES) -> None:
        self.layerwise, self.chunk_edges, self.chunk_nodes = layerwise, chunk_edges, chunk_nodes
        self.graph: TypedGraph = layerwise.served.graph
        built = layerwise.run_layers()
        self._bufs = [dict(layer) for layer in built]  # storage with headroom per type
        self.counts = dict(self.graph.num_nodes)
        self._stale = [{t: torch.zeros(rows.size(0), dtype=torch.bool)
                        for t, rows in layer.items()} for layer in built]
        self.pending = [dict.fromkeys(layer, 0) for layer in built]
        #: relation -> the relation whose CSC holds its out-edges as in-edges (``follow_reverse``)
        self.reverse: dict[EdgeType, EdgeType] = {}
        self.rows_refreshed = 0
        #: in-edges refreshed per second, measured (sizes a chunk to a step's budget)
        self.edges_per_s = 1e6

    @property
    def num_layers(self) -> int:
        return len(self._bufs)

    def layer(self, i: int) -> dict[str, Tensor]:
        """Layer ``i + 1``'s rows per type (views of the first rows of the storage)."""
        return {t: buf[:self.counts[t]] for t, buf in self._bufs[i].items()}

    def types(self) -> list[str]:
        return list(self._bufs[-1])

    def stale_count(self) -> int:
        """Rows marked at any layer."""
        return sum(sum(p.values()) for p in self.pending)

    def follow_reverse(self, live: TypedLiveGraph) -> None:
        """Read out-neighbours from the reverse relations the living graph keeps."""
        self.reverse = {**live.mirror, **live.derived, **{et: et for et in live.undirected}}

    # ---- reading --------------------------------------------------------------------------------
    def clean(self, node_type: str, ids: Tensor) -> Tensor:
        """bool per id: its final row is exact (not marked)."""
        return ~self._stale[-1][node_type][ids]

    def clean_at(self, i: int, node_type: str, ids: Tensor) -> Tensor:
        """bool per id: its row of layer ``i + 1`` is exact (an id past the table's rows, or
        of a type the layer has no rows of, is not)."""
        stale = self._stale[i].get(node_type)
        if stale is None:
            return torch.zeros(ids.numel(), dtype=torch.bool)
        inside = ids < self.counts[node_type]
        out = torch.zeros(ids.numel(), dtype=torch.bool)
        out[inside] = ~stale[ids[inside]]
        return out

    def rows(self, node_type: str, ids: Tensor) -> Tensor:
        return self._bufs[-1][node_type][ids]

    # ---- marking --------------------------------------------------------------------------------
    def mark(self, changes: TypedChanges) -> int:
        """Mark what ``changes`` made stale at every layer (module docstring); rows marked."""
        self._grow()
        inputs, edges = changes.ids(changes.inputs), changes.ids(changes.in_edges)
        frontier = inputs
        marked = 0
        for i in range(self.num_layers):
            out = self.out_neighbours(frontier)
            step: dict[str, Tensor] = {}
            for t in set(frontier) | set(out) | set(edges):
                parts = [d[t] for d in (frontier, out, edges) if t in d]
                step[t] = torch.unique(torch.cat(parts))
                marked += self._mark(i, t, step[t])
            frontier = step
        return marked

    def _mark(self, i: int, node_type: str, ids: Tensor) -> int:
        stale = self._stale[i].get(node_type)
        if stale is None:
            return 0
        new = int((~stale[ids]).sum())
        stale[ids] = True
        self.pending[i][node_type] += new
        return new

    def out_neighbours(self, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per destination type, the out-neighbours of ``nodes`` (ids per type) along every
        relation (repeats allowed)."""
        out: dict[str, list[Tensor]] = {}
        for et, rel in self.graph.relations.items():
            ids = nodes.get(et[0])
            if ids is None or not ids.numel():
                continue
            rev = self.reverse.get(et)
            if rev is not None:
                r = self.graph.relations[rev]
                deg = r.indptr[ids + 1] - r.indptr[ids]
                dst = r.indices[range_positions(r.indptr[ids], deg)]
            else:
                hit = torch.zeros(self.graph.num_nodes[et[0]], dtype=torch.bool)
                hit[ids] = True
                pos = torch.nonzero(hit[rel.indices]).flatten()
                dst = torch.searchsorted(rel.indptr, pos, right=True) - 1
            out.setdefault(et[2], []).append(dst)
        return {t: torch.cat(parts) for t, parts in out.items()}

    def _grow(self) -> None:
        """Room for nodes added since (new rows are zero until refreshed: they are marked)."""
        for t, n in self.graph.num_nodes.items():
            if n == self.counts[t]:
                continue
            for i in range(self.num_layers):
                buf, stale = self._bufs[i].get(t), self._stale[i].get(t)
                if buf is None or buf.size(0) >= n:
                    continue
                size = max(n, 2 * buf.size(0))
                grown = torch.zeros((size, buf.size(1)), dtype=buf.dtype)
                grown[:buf.size(0)] = buf
                self._bufs[i][t] = grown
                more = torch.zeros(size, dtype=torch.bool)
                more[:stale.size(0)] = stale
                self._stale[i][t] = more
            self.counts[t] = n

    # ---- refreshing -----------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, budget_s: float) -> int:
        """Recompute stale rows, the lowest layer first, until none is left or ``budget_s`` has
        passed (at least one chunk, sized to the budget by the in-edges per second measured so
        far); rows recomputed."""
        t0 = time.perf_counter()
        done = 0
        for i in range(self.num_layers):
            prev = None if i == 0 else self.layer(i - 1)
            for t, count in self.pending[i].items():
                if not count:
                    continue
                stale = self._stale[i][t]
                ids = torch.nonzero(stale[:self.counts[t]]).flatten()
                ends = torch.cumsum(self.costs(t, ids), 0)
                start = 0
                while start < ids.numel():
                    left_s = budget_s - (time.perf_counter() - t0)
                    stop = self.chunk_end(ends, start, left_s)
                    chunk = ids[start:stop]
                    self._refresh_chunk(i, t, chunk, prev, int(ends[stop - 1]) - (
                        int(ends[start - 1]) if start else 0))
                    done += chunk.numel()
                    start = stop
                    if time.perf_counter() - t0 >= budget_s:
                        self.rows_refreshed += done
                        return done
        self.rows_refreshed += done
        return done

    def _refresh_chunk(self, i: int, t: str, chunk: Tensor, prev: dict[str, Tensor] | None,
                       edges: int) -> None:
        t0 = time.perf_counter()
        rows = self.layerwise.layer_rows(i, t, chunk, prev)
        if rows is None:
            raise ValueError(f"the model gave no rows for node type {t!r} at layer {i + 1} "
                             "while refreshing the typed exact table")
        self._bufs[i][t][chunk] = rows.float().cpu()
        self._stale[i][t][chunk] = False
        self.pending[i][t] -= chunk.numel()
        took_s = max(time.perf_counter() - t0, 1e-6)
        self.edges_per_s = 0.7 * self.edges_per_s + 0.3 * edges / took_s

    def costs(self, node_type: str, ids: Tensor) -> Tensor:
        """Per target, its in-edges along every relation into the type, plus one."""
        cost = torch.ones(ids.numel(), dtype=torch.int64)
        for et, rel in self.graph.relations.items():
            if et[2] == node_type:
                cost += rel.indptr[ids + 1] - rel.indptr[ids]
        return cost

    def chunk_end(self, ends: Tensor, start: int, left_s: float) -> int:
        """Where the chunk from ``start`` ends: at most ``chunk_edges`` in-edges (fewer when
        ``left_s`` at the measured rate allows fewer, ``MIN_CHUNK_EDGES`` at least) and
        ``chunk_nodes`` targets; one target at least."""
        limit = self.chunk_edges
        if left_s != float("inf"):
            limit = int(min(limit, max(MIN_CHUNK_EDGES, left_s * self.edges_per_s)))
        before = int(ends[start - 1]) if start else 0
        stop = int(torch.searchsorted(ends, before + limit, right=True))
        return min(max(stop, start + 1), start + self.chunk_nodes, ends.numel())


def rows_or_none(table: TypedExactTable | None, node_type: str, ids: Tensor,
                 ) -> tuple[np.ndarray | None, Tensor]:
    """(rows of ``ids`` read from the table, with the stale ones' rows left zero; a bool mask of
    the stale ids). (None, all) without a table for the type."""
    if table is None or node_type not in table.types():
        return None, torch.ones(ids.numel(), dtype=torch.bool)
    clean = table.clean(node_type, ids)
    rows = torch.zeros((ids.numel(), table.rows(node_type, ids[:0]).size(1)))
    rows[clean] = table.rows(node_type, ids[clean])
    return rows.numpy(), ~clean
