"""The overlay: the graph's edges and nodes since its base CSC, applied version by version.

Layout (``overlay_view.py``): per node a block in one preallocated arena (override pairs, then
its tail). A node that gains edges appends to its tail (a block grows by half again when full,
so appends cost O(1) amortised). A node that loses entries of its base list keeps it and takes a
cut (``base_cut.py``: each removed place filled from the list's end, as an override pair; the
block rewritten in place when it has room, else moved), unless its pairs would outgrow half its
base list: then its surviving list is copied into a fresh tail once (its base list is then
marked replaced). A node that loses only tail entries has each removed entry's place filled from
the end of its tail, in place, costing what is removed. So a list's order is its history of
appends and removals, the same in every process. Every process that samples keeps its own
overlay and applies the same records in the same order, so all agree at each version;
:class:`Patch` carries one application's writes to a device copy
(``device_overlay.DeviceOverlay``) or to a follower in the writer's state without recomputing
them there.

Applying is all-or-nothing: the space a call needs is computed first, and a call that would not
fit raises :class:`OverlayFull` with nothing changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph import base_cut
from quiver_serve.graph.base_cut import Pairs
from quiver_serve.graph.list_ranges import (
    gather_ranges,
    interleave,
    range_positions,
    rank_within,
)
from quiver_serve.graph.overlay_view import (
    CUT_SHIFT,
    LENGTH_MASK,
    REPLACED,
    OverlayView,
    cut_of,
)
from quiver_serve.graph.records import EdgeRecord, PlannedEdgeRecord

#: smallest tail block, in entries
MIN_BLOCK = 8


class OverlayFull(Exception):
    """The overlay has no room for an update until compaction folds it into a new base."""


@dataclass
class EdgeResult:
    added: int
    removed: int
    missing: int


@dataclass
class Patch:
    """One application's writes: per-node (start, length) and arena entries. A planned patch
    (``planned``) also carries what a host overlay in the same state needs to apply it without
    planning: block capacities and the counters; the writer logs it beside its update, so the
    processes that sample apply the writer's plan instead of planning again
    (docs/architecture.md, "The living graph")."""

    nodes: np.ndarray  # int64 nodes whose (start, length) changed
    start: np.ndarray  # int64, their new starts
    length: np.ndarray  # int64, their new lengths (with REPLACED)
    tail_pos: np.ndarray  # int64 arena positions written
    tail_val: np.ndarray  # int64 values written there
    num_nodes: int  # node count after the application
    block: np.ndarray | None = None  # int64, the nodes' block capacities (planned patches)
    #: (base version, arena top before, entries allocated, live-entry change, edge change) of
    #: a planned patch: it applies only to an overlay on that base with that top
    head: tuple[int, int, int, int, int] | None = None

    @classmethod
    def empty(cls, num_nodes: int) -> Patch:
        z = np.empty(0, np.int64)
        return cls(z, z, z, z, z, num_nodes)

    @property
    def planned(self) -> bool:
        return self.block is not None and self.head is not None


def planned_patch(record: EdgeRecord, num_nodes: int) -> Patch | None:
    """The writer's plan logged with ``record`` as a patch (None for a record without one)."""
    if not isinstance(record, PlannedEdgeRecord):
        return None
    h = record.head.tolist()
    return Patch(record.nodes, record.start, record.length, record.tail_pos, record.tail_val,
                 num_nodes, block=record.block, head=(h[0], h[1], h[2], h[3], h[4]))


def plan_record(record: EdgeRecord, patch: Patch) -> PlannedEdgeRecord:
    """``record`` with ``patch`` (a planned patch) logged beside it."""
    assert patch.block is not None and patch.head is not None
    return PlannedEdgeRecord(record.version, record.accepted_s, record.add, record.remove,
                             np.asarray(patch.head, np.int64), patch.nodes, patch.start,
                             patch.length, patch.block, patch.tail_pos, patch.tail_val)


#: list entries a compaction folds per NumPy call (``Overlay.to_csc``): NumPy's fancy indexing
#: holds the interpreter lock for the whole call, so this bounds how long the writer's update
#: calls wait behind the fold (about 6 ms on a 2-core box; 1 << 20 was 45 ms there)
FOLD_CHUNK_EDGES = 1 << 17


class Overlay:
    """Host overlay over one base CSC; see the module docstring. Not thread-safe: one owner."""

    def __init__(self, indptr: Tensor, indices: Tensor, node_capacity: int,
                 edge_capacity: int, base_version: int = -1, cut_base: bool = True) -> None:
        self.indptr = indptr.numpy() if isinstance(indptr, Tensor) else np.asarray(indptr)
        self.indices = indices.numpy() if isinstance(indices, Tensor) else np.asarray(indices)
        self.n_base = int(self.indptr.size - 1)
        if node_capacity < self.n_base:
            raise ValueError(f"node capacity {node_capacity} is below the base's {self.n_base} nodes")
        self.node_capacity, self.edge_capacity = int(node_capacity), int(edge_capacity)
        #: the version of the base under this overlay (a planned patch names the base it was
        #: planned on; -1: unknown, so no planned patch applies)
        self.base_version = int(base_version)
        self.num_nodes = self.n_base
        self.num_edges = int(self.indices.size)
        #: logged edge records applied with the writer's plan, and planned here (``apply_record``)
        self.records_applied = {"writer": 0, "here": 0}
        self.top = 0  # arena entries handed out (live or abandoned)
        self.live_entries = 0  # entries in current tails
        self._start: np.ndarray | None = None  # allocated at the first edge update
        self._length: np.ndarray | None = None
        self._block: np.ndarray | None = None  # block capacity of each node's tail
        self._tail: np.ndarray | None = None
        self._base_sorted: bool | None = None
        #: removals from base lists take cuts (``base_cut``, decision 0069); False: every
        #: such node's list is copied whole (the old layout, kept for the benchmark). Every
        #: reader reads both layouts.
        self.cut_base = cut_base
        #: frozen copies being read (``freeze``): while any is, no plan rewrites an arena
        #: entry in place (a removal's survivors go to a new block), so their lists stay intact
        self.frozen = 0

    # ---- reading ---------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any edge changed since the base (else samplers read the base alone)."""
        return self._start is not None

    def view(self) -> OverlayView | None:
        """The sampler view over this overlay's host arrays (live: later applies show through)."""
        if self._start is None:
            return None
        assert self._length is not None and self._tail is not None
        return OverlayView(self.n_base, self.num_nodes, torch.from_numpy(self._start),
                           torch.from_numpy(self._length), torch.from_numpy(self._tail))

    def base_degree(self, nodes: np.ndarray) -> np.ndarray:
        """Base-list length of each node (0 for nodes added since the base)."""
        in_base = nodes < self.n_base
        out = np.zeros(nodes.size, np.int64)
        b = nodes[in_base]
        out[in_base] = self.indptr[b + 1] - self.indptr[b]
        return out

    def _parts(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(counted base entries, tail start, tail length) of each node."""
        base = self.base_degree(nodes)
        if self._start is None:
            return base, np.full(nodes.size, -1, np.int64), np.zeros(nodes.size, np.int64)
        assert self._length is not None
        start, raw = self._start[nodes], self._length[nodes]
        cut = np.where((nodes < self.n_base) & ((raw & REPLACED) == 0), cut_of(raw), 0)
        base = np.where((raw & REPLACED) != 0, 0, base - cut)
        return base, np.where(start >= 0, start + 2 * cut, start), raw & LENGTH_MASK

    def _pairs(self, nodes: np.ndarray) -> Pairs:
        """The override pairs of ``nodes`` (``base_cut.Pairs``, owners index ``nodes``)."""
        if self._start is None:
            z = np.empty(0, np.int64)
            return Pairs(z, z, z)
        assert self._length is not None and self._tail is not None
        return Pairs.read(self._tail, self._start[nodes], cut_of(self._length[nodes]))

    def degree(self, nodes: np.ndarray) -> np.ndarray:
        """Current in-degree of each node."""
        base, _, tail = self._parts(nodes)
        return base + tail

    def neighbour_lists(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The current in-neighbours of ``nodes``, concatenated in list order, and each node's count."""
        base, start, tail = self._parts(nodes)
        b = np.minimum(nodes, max(self.n_base - 1, 0))
        base_vals = gather_ranges(self.indices, self.indptr[b], base)
        tail_vals = gather_ranges(self._tail, start, tail) if self._tail is not None \
            else np.empty(0, np.int64)
        counts = base + tail
        out = np.empty(int(counts.sum()), np.int64)
        # Interleave per node: base part then tail part.
        owner_base = np.repeat(np.arange(nodes.size), base)
        owner_tail = np.repeat(np.arange(nodes.size), tail)
        node_off = np.cumsum(counts) - counts
        out[node_off[owner_base] + rank_within(owner_base)] = base_vals
        out[node_off[owner_tail] + base[owner_tail] + rank_within(owner_tail)] = tail_vals
        base_cut.apply_pairs(out, node_off, base, self._pairs(nodes))
        return out, counts

    def self_loops(self, nodes: np.ndarray) -> np.ndarray:
        """Number of self loops (v -> v, copies counted) of each node now."""
        values, counts = self.neighbour_lists(nodes)
        owner = np.repeat(nodes, counts)
        return np.bincount(np.repeat(np.arange(nodes.size), counts)[values == owner],
                           minlength=nodes.size).astype(np.int64)

    def freeze(self) -> Overlay:
        """A read-only copy of this overlay's lists at this version that stays valid while
        updates go on (compaction folds it outside the writer's lock): per-node arrays
        copied, the arena shared (later plans write only beyond what the copy reads, until
        ``thaw``). Not for writing."""
        frozen = copy.copy(self)
        if self._start is not None:
            assert self._length is not None
            frozen._start = self._start[:self.num_nodes].copy()
            frozen._length = self._length[:self.num_nodes].copy()
            frozen._block = None
        self.frozen += 1
        return frozen

    def thaw(self) -> None:
        """A frozen copy is no longer read (``freeze``)."""
        self.frozen = max(0, self.frozen - 1)

    def changed_nodes(self) -> np.ndarray:
        """Nodes whose lists the overlay changed (their merged lists are not sorted by id)."""
        if self._start is None:
            return np.empty(0, np.int64)
        return np.flatnonzero(self._start[:self.num_nodes] >= 0)

    def to_csc(self, edges_per_chunk: int = FOLD_CHUNK_EDGES) -> tuple[Tensor, Tensor]:
        """The current graph as a plain CSC (lists in overlay order), e.g. for compaction. Built
        over node ranges of about ``edges_per_chunk`` entries: NumPy holds the interpreter lock
        through some whole-array calls (``repeat``, fancy indexing), so a fold of the whole
        graph in one call would stall the writer's other threads for as long (decision 0041)."""
        nodes = np.arange(self.num_nodes, dtype=np.int64)
        if self._start is None:
            indptr = np.zeros(self.num_nodes + 1, np.int64)
            indptr[1:self.n_base + 1] = self.indptr[1:]
            indptr[self.n_base + 1:] = self.indptr[-1]
            return torch.from_numpy(indptr), torch.from_numpy(self.indices.copy())
        indptr = np.zeros(self.num_nodes + 1, np.int64)
        np.cumsum(self.degree(nodes), out=indptr[1:])
        values = np.empty(int(indptr[-1]), np.int64)
        lo = 0
        while lo < self.num_nodes:
            hi = int(np.searchsorted(indptr, indptr[lo] + edges_per_chunk, side="right")) - 1
            hi = min(self.num_nodes, max(lo + 1, hi))
            values[indptr[lo]:indptr[hi]] = self.neighbour_lists(nodes[lo:hi])[0]
            lo = hi
        return torch.from_numpy(indptr), torch.from_numpy(values)

    # ---- writing ---------------------------------------------------------------------------------
    def add_nodes(self, count: int) -> np.ndarray:
        """Append ``count`` nodes without edges; their ids."""
        if self.num_nodes + count > self.node_capacity:
            raise OverlayFull(f"node capacity {self.node_capacity} reached ({self.num_nodes} nodes; "
                              f"{count} more asked)")
        ids = np.arange(self.num_nodes, self.num_nodes + count, dtype=np.int64)
        self.num_nodes += count
        return ids

    def apply_edges(self, add: np.ndarray, remove: np.ndarray,
                    before_commit: Callable[[EdgeResult, Patch], None] | None = None,
                    ) -> tuple[EdgeResult, Patch]:
        """Remove every copy of each ``remove`` pair, then append each ``add`` pair (rows are
        (src, dst)); ids must be valid (the caller checked). All or nothing: ``before_commit``
        (the writer's log append, which logs the planned patch too) runs once the call is known
        to fit; if it raises, nothing changes. Returns the counts and the planned patch."""
        self._ensure_arrays()
        plan = _Plan(self)
        missing, removed = plan.remove(remove.reshape(-1, 2)) if remove.size else (0, 0)
        if add.size:
            plan.add(add.reshape(-1, 2))
        if self.top + plan.alloc > self.edge_capacity:
            raise OverlayFull(f"overlay full: {self.top + plan.alloc:,} of {self.edge_capacity:,} "
                              f"entries needed; compaction frees them")
        result = EdgeResult(int(add.size // 2), removed, missing)
        patch = plan.patch(result.added - removed)
        if before_commit is not None:
            before_commit(result, patch)
        self.apply_patch(patch)
        return result, patch

    def fits(self, patch: Patch) -> bool:
        """Whether ``patch`` was planned on an overlay in this one's state (same base, same
        arena top, same node count): then applying it equals planning its update here."""
        return (patch.planned and patch.head is not None and self.base_version >= 0
                and patch.head[0] == self.base_version and patch.head[1] == self.top
                and patch.num_nodes == self.num_nodes)

    def apply_patch(self, patch: Patch) -> None:
        """Make a planned patch's writes (``fits`` checked by the caller, or the plan is this
        overlay's own): the arena entries first (beyond what readers see), then each node's
        (start, length), so a reader between two records sees either version's list."""
        assert patch.block is not None and patch.head is not None
        self._ensure_arrays()
        assert self._start is not None and self._length is not None
        assert self._block is not None and self._tail is not None
        self._tail[patch.tail_pos] = patch.tail_val
        self._start[patch.nodes] = patch.start
        self._length[patch.nodes] = patch.length
        self._block[patch.nodes] = patch.block
        _, _, alloc, live_delta, edges_delta = patch.head
        self.top += alloc
        self.live_entries += live_delta
        self.num_edges += edges_delta

    def current_patch(self, nodes: np.ndarray, positions: np.ndarray) -> Patch:
        """The entries of ``nodes`` and arena ``positions`` as they are now: one patch that
        brings a copy that had all of them before up to this overlay (several applications'
        patches merged; the last write of each entry wins)."""
        self._ensure_arrays()
        assert self._start is not None and self._length is not None and self._tail is not None
        return Patch(nodes, self._start[nodes], self._length[nodes], positions,
                     self._tail[positions], self.num_nodes)

    def apply_record(self, record: EdgeRecord) -> Patch:
        """A logged edge update's writes here: the writer's plan when it fits this overlay (no
        planning), else planned here. Returns the patch applied."""
        planned = planned_patch(record, self.num_nodes)
        if planned is not None and self.fits(planned):
            self.apply_patch(planned)
            self.records_applied["writer"] += 1
            return planned
        self.records_applied["here"] += 1
        return self.apply_edges(record.add, record.remove)[1]

    def base_sorted(self) -> bool:
        """Whether every base list is sorted by id (the loaders and compaction sort them;
        checked once, at the first removal)."""
        if self._base_sorted is None:
            descending = self.indices[1:] < self.indices[:-1]
            starts = self.indptr[1:-1]
            starts = starts[(starts > 0) & (starts < self.indices.size)]
            descending[starts - 1] = False
            self._base_sorted = not bool(descending.any())
        return self._base_sorted

    def ensure_active(self) -> None:
        """Allocate the overlay's arrays (samplers given its view read them from now on)."""
        self._ensure_arrays()

    def _ensure_arrays(self) -> None:
        if self._start is None:
            self._start = np.full(self.node_capacity, -1, np.int64)
            self._length = np.zeros(self.node_capacity, np.int64)
            self._block = np.zeros(self.node_capacity, np.int64)
            self._tail = np.zeros(self.edge_capacity, np.int64)

    def usage(self) -> dict[str, int]:
        return {"entries_used": self.top, "entries_capacity": self.edge_capacity,
                "live_entries": self.live_entries, "nodes_added": self.num_nodes - self.n_base,
                "nodes_capacity": self.node_capacity - self.n_base}


def _matches(pairs: np.ndarray, dsts: np.ndarray, values: np.ndarray, counts: np.ndarray,
             cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Which list entries (``values``, grouped per ``dsts`` node) are a removed (src, dst)
    pair, and the pair keys (dst * cap + src) found. Hub lists hold millions of entries and a
    call a few hundred pairs: entries are first filtered by source through a table over node
    ids (linear), and only those candidates are looked up among the pair keys."""
    drop = np.zeros(values.size, dtype=bool)
    if not values.size:
        return drop, np.empty(0, np.int64)
    keys = np.unique(pairs[:, 1] * cap + pairs[:, 0])
    sources = np.unique(pairs[:, 0])
    # a table over the sources' id range is linear in the list but costs the range itself:
    # only worth it for lists longer than that range
    span = int(sources[-1] - sources[0]) + 1
    candidate = np.flatnonzero(np.isin(values, sources,
                                       kind="table" if values.size > span else "sort"))
    ck = np.repeat(dsts, counts)[candidate] * cap + values[candidate]
    pos = np.minimum(np.searchsorted(keys, ck), keys.size - 1)
    match = keys[pos] == ck
    drop[candidate[match]] = True
    return drop, np.unique(ck[match])


def _span(length: np.ndarray) -> np.ndarray:
    """Entries of a node's block in use, from its length words: its pairs, then its tail."""
    return (length & LENGTH_MASK) + 2 * cut_of(length)


def _block_for(entries: np.ndarray) -> np.ndarray:
    return np.maximum(MIN_BLOCK, entries + entries // 2)


class _Plan:
    """The writes of one ``apply_edges`` call, computed before any is made."""

    def __init__(self, ov: Overlay) -> None:
        self.ov = ov
        self.alloc = 0
        self.new_blocks: dict[str, list[np.ndarray]] = {"node": [], "start": [], "length": [],
                                                        "block": []}
        self.writes_pos: list[np.ndarray] = []
        self.writes_val: list[np.ndarray] = []
        # (nodes, start, length, block) the removals planned (sorted nodes; adds read it)
        z = np.empty(0, np.int64)
        self.state: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = (z, z, z, z)

    def _new_block(self, nodes: np.ndarray, lengths: np.ndarray, flags: np.ndarray,
                   content: np.ndarray, content_counts: np.ndarray, spare: np.ndarray) -> np.ndarray:
        """Blocks for ``nodes`` holding ``content`` (grouped per node) with room for ``spare``
        more; returns their starts."""
        caps = _block_for(content_counts + spare)
        starts = self.ov.top + self.alloc + np.cumsum(caps) - caps
        self.alloc += int(caps.sum())
        self.new_blocks["node"].append(nodes)
        self.new_blocks["start"].append(starts)
        self.new_blocks["length"].append(lengths | flags)
        self.new_blocks["block"].append(caps)
        self.writes_pos.append(range_positions(starts, content_counts))
        self.writes_val.append(content)
        return starts

    def remove(self, pairs: np.ndarray) -> tuple[int, int]:
        """Plan the removals. A node that loses entries of its counted base list takes a cut
        (``base_cut``: its block, pairs then tail, is rewritten, in place when it has room,
        costing what it removed so far, not its degree), or, once its pairs would outgrow half
        its base list, has its whole surviving list written into a new tail (its base list then
        no longer counts); a node that loses only tail entries (and has no cut) has its tail
        rewritten in place."""
        ov = self.ov
        assert ov._start is not None and ov._length is not None and ov._block is not None
        cap = ov.node_capacity
        dsts = np.unique(pairs[:, 1])
        counted, t_start, t_len = ov._parts(dsts)
        cuts = cut_of(ov._length[dsts])
        route = self._route(pairs, dsts, counted, cuts)
        whole, cutting, tails = dsts[route == 2], np.flatnonzero(route == 1), dsts[route == 0]
        values, counts = ov.neighbour_lists(whole)
        drop_w, found_w = _matches(pairs, whole, values, counts, cap)
        t_vals = gather_ranges(ov._tail, np.maximum(t_start[route == 0], 0), t_len[route == 0])
        drop_t, found_t = _matches(pairs, tails, t_vals, t_len[route == 0], cap)
        hit_c, removed_c, found_c = self._cut(pairs, dsts[cutting], counted[cutting],
                                              cuts[cutting], t_start[cutting], t_len[cutting])
        requested = pairs[:, 1] * cap + pairs[:, 0]
        missing = int((~np.isin(requested, np.concatenate([found_w, found_t, found_c]))).sum())
        removed = int(drop_w.sum() + drop_t.sum()) + removed_c
        if removed == 0:
            return missing, 0
        hit_w = self._rewrite(whole, values, counts, drop_w, whole_list=True)
        hit_t = self._rewrite(tails, t_vals, t_len[route == 0], drop_t, whole_list=False)
        hit = np.sort(np.concatenate([hit_w, hit_t, hit_c]))
        self.state = (hit, *self._planned(hit))
        return missing, removed

    def _route(self, pairs: np.ndarray, dsts: np.ndarray, counted: np.ndarray,
               cuts: np.ndarray) -> np.ndarray:
        """Per node of ``dsts``: 2 to rewrite its whole list, 1 to cut (or rewrite the block of
        a node that has a cut), 0 to remove from its tail alone. Without sorted base lists
        every node with a counted base list is rewritten whole (no binary search)."""
        ov = self.ov
        route = np.where(cuts > 0, 1, 0)
        node_of = np.searchsorted(dsts, pairs[:, 1])
        if not (counted[node_of] > 0).any():
            return route
        if not ov.base_sorted():
            route[node_of[counted[node_of] > 0]] = 2
            return route
        hits = base_cut.base_hits(ov.indptr, ov.indices, pairs, dsts, counted,
                                  ov._pairs(dsts), ov.node_capacity)
        removed = np.bincount(hits.owner, minlength=dsts.size)
        keep = base_cut.worth_cut(ov.base_degree(dsts), cuts, removed) & ov.cut_base
        route[(removed > 0) & keep] = 1
        route[(removed > 0) & ~keep] = 2
        return route

    def _cut(self, pairs: np.ndarray, nodes: np.ndarray, counted: np.ndarray, cuts: np.ndarray,
             t_start: np.ndarray, t_len: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
        """Plan the new blocks of cut nodes that lose entries (``base_cut.cut_blocks``):
        (nodes written, entries removed, pair keys found)."""
        ov = self.ov
        assert ov._tail is not None
        z = np.empty(0, np.int64)
        if nodes.size == 0:
            return z, 0, z
        overrides = ov._pairs(nodes)
        hits = base_cut.base_hits(ov.indptr, ov.indices, pairs, nodes, counted, overrides,
                                  ov.node_capacity)
        t_vals = gather_ranges(ov._tail, np.maximum(t_start, 0), t_len)
        drop, found_t = _matches(pairs, nodes, t_vals, t_len, ov.node_capacity)
        owner = np.repeat(np.arange(nodes.size), t_len)
        lost = np.bincount(hits.owner, minlength=nodes.size) \
            + np.bincount(owner[drop], minlength=nodes.size)
        hit = np.flatnonzero(lost > 0)
        if hit.size == 0:
            return z, 0, found_t
        keep_t = np.isin(owner, hit)
        hits = base_cut.Hits(np.searchsorted(hit, hits.owner), hits.pos, hits.found)
        blocks = base_cut.cut_blocks(
            ov.indptr[nodes[hit]], ov.indices, counted[hit], cuts[hit],
            overrides.select(np.isin(overrides.owner, hit)).renumbered(hit), hits,
            t_vals[keep_t], t_len[hit], drop[keep_t])
        self._write_cut(nodes[hit], blocks)
        return nodes[hit], int(lost.sum()), np.concatenate([hits.found, found_t])

    def _write_cut(self, nodes: np.ndarray, blocks: base_cut.CutBlocks) -> None:
        """Write cut blocks: in place where the node's block has room and no frozen copy reads
        the arena (only the entries that change: the pairs and the tail's first ``2m``, moved
        to its end), else into new blocks with as much room again for the next calls."""
        ov = self.ov
        assert ov._start is not None and ov._block is not None and ov._tail is not None
        start, block = ov._start[nodes], ov._block[nodes]
        length = blocks.tail_len | (blocks.cut << CUT_SHIFT)
        fits = (start >= 0) & (blocks.content_counts <= block) & (ov.frozen == 0)
        owner = np.repeat(np.arange(nodes.size), blocks.content_counts)
        here = fits[owner]
        pos = range_positions(start[fits], blocks.content_counts[fits])
        # skip only entries of the node's current span: past it, a block's spare room holds
        # whatever this process left there, which another process applying this patch may not
        old_end = np.repeat(start[fits] + _span(ov._length[nodes[fits]]),
                            blocks.content_counts[fits])
        changed = (pos >= old_end) | (ov._tail[pos] != blocks.content[here])
        self.writes_pos.append(pos[changed])
        self.writes_val.append(blocks.content[here][changed])
        self._set(nodes[fits], start[fits], length[fits], block[fits])
        moved = ~fits
        if moved.any():
            counts = blocks.content_counts[moved]
            self._new_block(nodes[moved], blocks.tail_len[moved], length[moved] & ~LENGTH_MASK,
                            blocks.content[~here], counts, counts)

    def _rewrite(self, nodes: np.ndarray, values: np.ndarray, counts: np.ndarray,
                 drop: np.ndarray, whole_list: bool) -> np.ndarray:
        """Write the surviving entries of the ``nodes`` that lost some: a whole list into a new
        block (replacing the base list), or a tail in place (the removed entries' places
        filled from its end). Returns the nodes written."""
        ov = self.ov
        assert ov._start is not None and ov._length is not None and ov._block is not None
        owner = np.repeat(np.arange(nodes.size), counts)
        hit = np.bincount(owner[drop], minlength=nodes.size) > 0
        keep_counts = np.bincount(owner[~drop], minlength=nodes.size)
        keep = ~drop & hit[owner]
        kept = values[keep]
        if whole_list or ov.frozen:  # a frozen copy reads the old block: never in place
            lengths = keep_counts[hit]
            flags = np.full(lengths.size, REPLACED, np.int64) if whole_list \
                else ov._length[nodes[hit]] & REPLACED
            self._new_block(nodes[hit], lengths, flags, kept, lengths,
                            np.zeros(lengths.size, np.int64))
            return nodes[hit]
        start, length, block = ov._start[nodes], ov._length[nodes], ov._block[nodes]
        # In place, costing what is removed: each removed entry before the new length takes
        # one surviving entry from past it (the list's order is not kept; readers see the new
        # length once it is written, after the entries)
        rank = rank_within(owner)
        beyond = rank >= keep_counts[owner]
        holes, movers = np.flatnonzero(drop & ~beyond), np.flatnonzero(~drop & beyond)
        self.writes_pos.append(start[owner[holes]] + rank[holes])  # per node as many of each,
        self.writes_val.append(values[movers])  # both in node order: paired one to one
        self._set(nodes[hit], start[hit], keep_counts[hit] | (length[hit] & REPLACED), block[hit])
        return nodes[hit]

    def _set(self, nodes: np.ndarray, start: np.ndarray, length: np.ndarray,
             block: np.ndarray) -> None:
        for key, value in (("node", nodes), ("start", start), ("length", length),
                           ("block", block)):
            self.new_blocks[key].append(value)

    def _planned(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, length, block) this plan gives ``nodes`` (each planned exactly once so far)."""
        cols = {k: np.concatenate(v) for k, v in self.new_blocks.items()}
        order = np.argsort(cols["node"], kind="stable")
        at = order[np.searchsorted(cols["node"][order], nodes)]
        return cols["start"][at], cols["length"][at], cols["block"][at]

    def _current(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ov = self.ov
        assert ov._start is not None and ov._length is not None and ov._block is not None
        start, length, block = ov._start[nodes].copy(), ov._length[nodes].copy(), ov._block[nodes].copy()
        planned_nodes = self.state[0]
        if planned_nodes.size:
            idx = np.minimum(np.searchsorted(planned_nodes, nodes), planned_nodes.size - 1)
            found = planned_nodes[idx] == nodes
            start[found] = self.state[1][idx[found]]
            length[found] = self.state[2][idx[found]]
            block[found] = self.state[3][idx[found]]
        return start, length, block

    def add(self, pairs: np.ndarray) -> None:
        order = np.argsort(pairs[:, 1], kind="stable")
        src, dst = pairs[order, 0], pairs[order, 1]
        nodes, first, counts = np.unique(dst, return_index=True, return_counts=True)
        start, length, block = self._current(nodes)
        used = length & LENGTH_MASK
        flags = length & ~LENGTH_MASK  # REPLACED and the cut
        span = _span(length)  # the block's entries in use: pairs, then the tail
        fits = (start >= 0) & (span + counts <= block)
        # In place: appended after each tail, beyond what readers see until the length moves.
        rank = np.arange(dst.size) - np.repeat(first, counts)
        node_of = np.repeat(np.arange(nodes.size), counts)
        in_place = fits[node_of]
        self.writes_pos.append(start[node_of[in_place]] + span[node_of[in_place]] + rank[in_place])
        self.writes_val.append(src[in_place])
        self.new_blocks["node"].append(nodes[fits])
        self.new_blocks["start"].append(start[fits])
        self.new_blocks["length"].append((used[fits] + counts[fits]) | flags[fits])
        self.new_blocks["block"].append(block[fits])
        # Moved: the old block (plan state or arena) and the new entries into a bigger block.
        moved = np.flatnonzero(~fits)
        if moved.size:
            old = self._old_tails(nodes[moved], start[moved], span[moved])
            new_vals = src[~in_place]
            m_span, m_counts = span[moved], counts[moved]
            content = interleave(old, m_span, new_vals, m_counts)
            self._new_block(nodes[moved], used[moved] + m_counts, flags[moved], content,
                            m_span + m_counts, m_span + m_counts)

    def _old_tails(self, nodes: np.ndarray, start: np.ndarray, used: np.ndarray) -> np.ndarray:
        """Current block contents of ``nodes``, ``used`` entries each (blocks this plan made
        are not in the arena yet)."""
        ov = self.ov
        assert ov._tail is not None
        pending = {int(p): v for pos, val in zip(self.writes_pos, self.writes_val, strict=True)
                   for p, v in zip(pos.tolist(), val.tolist(), strict=True)} \
            if np.isin(nodes, self.state[0]).any() else {}
        if not pending:
            return gather_ranges(ov._tail, np.maximum(start, 0), used)
        pos = range_positions(np.maximum(start, 0), used)
        return np.array([pending[p] if p in pending else ov._tail[p] for p in pos.tolist()],
                        np.int64)

    def patch(self, edges_delta: int) -> Patch:
        """The plan's writes as a planned patch; nothing is written (``Overlay.apply_patch``)."""
        ov = self.ov
        assert ov._length is not None
        pos = np.concatenate(self.writes_pos) if self.writes_pos else np.empty(0, np.int64)
        val = np.concatenate(self.writes_val) if self.writes_val else np.empty(0, np.int64)
        cols = {k: (np.concatenate(v) if v else np.empty(0, np.int64))
                for k, v in self.new_blocks.items()}
        # Later entries win: a node rewritten by a removal then grown by an add.
        uniq, rev_first = np.unique(cols["node"][::-1], return_index=True)
        last = cols["node"].size - 1 - rev_first
        length = cols["length"][last]
        live_delta = int(_span(length).sum()) - int(_span(ov._length[uniq]).sum())
        return Patch(uniq, cols["start"][last], length, pos, val, ov.num_nodes,
                     block=cols["block"][last],
                     head=(ov.base_version, ov.top, self.alloc, live_delta, edges_delta))
