"""One typed batch drawn by the kernels of ``csrc/typed_hop.cu`` (docs/architecture.md, "Typed
graphs"; decision 0062), for ``TypedGpuSampler``.

A hop of every relation at once is a fixed handful of launches (count, scan, draw, mark, scan,
assign, relabel) and one host synchronisation, which reads the hop's sizes: edges per relation
and new nodes per type. The seeds are de-duplicated the same way (hop 0). Duplicates are found
through ``state``, an int32 per node of every type that is empty between batches (the
homogeneous GPU sampler's scheme, ``csrc/gpu_sampler.cu``); the batch puts back the entries it
touched, and on an error the whole array is emptied again. The output is the reference's bit
for bit (``sampling/typed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from quiver_serve.graph.typed import EdgeType, TypedGraph
from quiver_serve.sampling.base import relation_base, seed_base
from quiver_serve.sampling.reference import unique_first

#: an empty state entry (``STATE_EMPTY`` of the kernels)
STATE_EMPTY = 0x7FFFFFFF
#: hop positions are int32 in the state: a hop's output must stay under this
MAX_HOP_POSITIONS = 0x7FFFFFFF - 1
DESC_FIELDS, TYPE_FIELDS = 11, 4


@dataclass
class HopPlan:
    """The relations a hop expands (those whose destination type has a frontier), ordered by
    source type then edge-type position, with their frontier entries' first index."""

    rels: list[int]  # positions in the graph's edge types
    desc: list[int]  # DESC_FIELDS per relation
    types: list[int]  # TYPE_FIELDS per node type
    entries: int  # frontier entries of all relations
    cap: int  # output positions the buffers hold (-1: unknown, every fanout -1 somewhere)


@dataclass
class BatchState:
    """What a batch has drawn so far."""

    frontier: dict[str, Tensor]  # per type: the global ids of the nodes added last hop
    before: dict[str, int]  # per type: nodes with a local id
    pieces: dict[str, list[Tensor]]  # per type: ids in local-id order, by hop
    rows: dict[EdgeType, list[Tensor]] = field(default_factory=dict)
    cols: dict[EdgeType, list[Tensor]] = field(default_factory=dict)
    eids: dict[EdgeType, list[Tensor]] = field(default_factory=dict)
    resets: list[tuple[Tensor, Tensor, int]] = field(default_factory=list)  # (total, keys, cap)


class TypedKernelBatch:
    """Draws batches of one sampler (``sample``); ``kernels`` launches the named kernels
    (``TypedHopKernels`` or a CPU build in tests); ``addrs`` are the relations' (indptr,
    indices, edge_id or 0) addresses in edge-type order. Not for concurrent use: the sampler
    holds a lock around it."""

    def __init__(self, graph: TypedGraph, device: torch.device, kernels: Any,
                 addrs: list[tuple[int, int, int]]) -> None:
        self.graph, self.device, self.kernels, self.addrs = graph, device, kernels, addrs
        self.types = list(graph.node_types)
        self.type_index = {t: i for i, t in enumerate(self.types)}
        offsets, at = {}, 0
        for t in self.types:
            offsets[t], at = at, at + int(graph.num_nodes[t])
        self.offset = offsets
        self.state = torch.full((max(at, 1),), STATE_EMPTY, dtype=torch.int32, device=device)
        self.edge_types = list(graph.edge_types)
        #: relations in the order a hop lays them out: by source type, then edge-type position
        self.order = sorted(range(len(self.edge_types)),
                            key=lambda r: (self.type_index[self.edge_types[r][0]], r))

    def upload(self, values: list[int] | Tensor) -> Tensor:
        """A small int64 table on the device (one host-to-device copy)."""
        host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def sample(self, seed_type: str, seeds: Tensor, per_rel: dict[EdgeType, list[int]],
               num_layers: int, seed: int) -> tuple[BatchState, Tensor, dict, dict]:
        """The batch's draws: its state, the seeds' rows, nodes per type and hop, edges per
        relation and hop."""
        try:
            hop0 = self.seed_hop_host if seeds.device.type == "cpu" else self.seed_hop
            st, seed_index, unique = hop0(seed_type, seeds)
            num_nodes = {t: [unique if t == seed_type else 0] for t in self.types}
            num_edges: dict[EdgeType, list[int]] = {et: [] for et in self.edge_types}
            base = seed_base(seed)
            for hop in range(1, num_layers + 1):
                added, edges = self.hop(st, per_rel, hop, base)
                for t in self.types:
                    num_nodes[t].append(added.get(t, 0))
                for et in self.edge_types:
                    num_edges[et].append(edges.get(et, 0))
            self.reset(st)
            return st, seed_index, num_nodes, num_edges
        except BaseException:
            self.state.fill_(STATE_EMPTY)  # whatever the batch left behind
            raise

    def type_table(self, firsts: dict[str, tuple[int, int]], before: dict[str, int]) -> list[int]:
        table: list[int] = []
        for t in self.types:
            first, last = firsts.get(t, (-1, 0))
            table += [self.offset[t], before.get(t, 0), first, last]
        return table

    def seed_hop(self, seed_type: str, seeds: Tensor) -> tuple[BatchState, Tensor, int]:
        """Hop 0: the unique seeds in order of first occurrence, and each seed's row."""
        k, n, dev = self.kernels, int(seeds.numel()), self.device
        t = self.type_index[seed_type]
        meta = self.upload(self.type_table({seed_type: (0, 0)}, {}) + [0] * len(self.types) + [n])
        types_at = meta.data_ptr()
        new_count = meta[len(self.types) * TYPE_FIELDS:-1]
        end = meta[-1:]
        keys = seeds + self.offset[seed_type]
        flag = torch.empty(n, dtype=torch.int64, device=dev)
        k.launch("typed_propose", n, (n, keys.data_ptr(), self.state.data_ptr()))
        k.launch("typed_mark", n, (end.data_ptr(), n, keys.data_ptr(), self.state.data_ptr(),
                                   flag.data_ptr(), 0, 0, end.data_ptr(), 0))
        csum = torch.cumsum(flag, 0)
        stype = torch.full((n,), t, dtype=torch.int32, device=dev)
        new_ids = torch.empty(n, dtype=torch.int64, device=dev)
        rows = torch.empty(n, dtype=torch.int64, device=dev)
        k.launch("typed_assign", n, (end.data_ptr(), keys.data_ptr(), stype.data_ptr(),
                                     csum.data_ptr(), types_at, end.data_ptr(),
                                     new_ids.data_ptr(), new_count.data_ptr(),
                                     self.state.data_ptr()))
        k.launch("typed_relabel", n, (end.data_ptr(), keys.data_ptr(), self.state.data_ptr(),
                                      rows.data_ptr()))
        unique = int(new_count[t])  # hop 0's host synchronisation
        st = BatchState({seed_type: new_ids[:unique]}, {seed_type: unique},
                        {seed_type: [new_ids[:unique]]},
                        resets=[(end, keys, n)])
        return st, rows, unique

    def seed_hop_host(self, seed_type: str, seeds: Tensor) -> tuple[BatchState, Tensor, int]:
        """Hop 0 of seeds in host memory: de-duplicated here (their number known without a
        synchronisation), then one upload and one launch give them their local ids."""
        uniq, seed_index = unique_first(seeds.to(torch.int64))
        n = int(uniq.numel())
        meta = self.upload(torch.cat([torch.tensor([n]), uniq + self.offset[seed_type], uniq,
                                      seed_index]))
        total, keys, ids = meta[:1], meta[1:n + 1], meta[n + 1:2 * n + 1]
        self.kernels.launch("typed_claim", n, (total.data_ptr(), keys.data_ptr(),
                                               self.state.data_ptr()))
        st = BatchState({seed_type: ids}, {seed_type: n}, {seed_type: [ids]},
                        resets=[(total, keys, n)])
        return st, meta[2 * n + 1:], n

    def plan(self, st: BatchState, per_rel: dict[EdgeType, list[int]], hop: int,
             base: int) -> HopPlan:
        rels: list[int] = []
        desc: list[int] = []
        firsts: dict[str, tuple[int, int]] = {}
        entries, cap = 0, 0
        for r in self.order:
            src, _, dst = et = self.edge_types[r]
            frontier = st.frontier.get(dst)
            n = 0 if frontier is None else int(frontier.numel())
            if n == 0:
                continue
            k = per_rel[et][hop - 1]
            indptr, indices, edge_id = self.addrs[r]
            desc += [indptr, indices, edge_id, frontier.data_ptr(), entries, n, k,
                     relation_base(base, r), self.offset[src], self.type_index[src],
                     st.before[dst] - n]
            firsts[src] = (firsts.get(src, (entries, 0))[0], entries + n - 1)
            rels.append(r)
            entries += n
            cap = -1 if k < 0 or cap < 0 else cap + n * k
        return HopPlan(rels, desc, self.type_table(firsts, st.before), entries, cap)

    def hop(self, st: BatchState, per_rel: dict[EdgeType, list[int]], hop: int,
            base: int) -> tuple[dict[str, int], dict[EdgeType, int]]:
        """One hop of every relation: nodes added per type and edges per relation."""
        p = self.plan(st, per_rel, hop, base)
        if p.entries == 0:
            st.frontier = {}
            return {}, {}
        k, dev, state = self.kernels, self.device, self.state.data_ptr()
        num_desc, num_types = len(p.rels), len(self.types)
        meta = self.upload(p.desc + p.types + [0] * (num_types + num_desc))
        desc_at = meta.data_ptr()
        types_at = desc_at + 8 * len(p.desc)
        new_count = meta[len(p.desc) + len(p.types):len(p.desc) + len(p.types) + num_types]
        rel_end = meta[len(p.desc) + len(p.types) + num_types:]
        count = torch.empty(p.entries, dtype=torch.int64, device=dev)
        k.launch("typed_count", p.entries, (desc_at, num_desc, p.entries, count.data_ptr()))
        end = torch.cumsum(count, 0)
        total = end[-1:]
        cap = p.cap if p.cap >= 0 else int(total)
        if cap > MAX_HOP_POSITIONS:
            raise ValueError(f"a hop of this batch would read up to {cap} edges, more than "
                             f"{MAX_HOP_POSITIONS}: send fewer seeds per request")
        buf = torch.empty((5, max(cap, 1)), dtype=torch.int64, device=dev)
        keys, eid, col, rows, flag = buf.unbind(0)
        stype = torch.empty(max(cap, 1), dtype=torch.int32, device=dev)
        k.launch("typed_draw", p.entries, (desc_at, num_desc, p.entries, hop,
                                            count.data_ptr(), end.data_ptr(), keys.data_ptr(),
                                            eid.data_ptr(), col.data_ptr(), stype.data_ptr(),
                                            state))
        k.launch("typed_mark", max(cap, num_desc),
                 (total.data_ptr(), cap, keys.data_ptr(), state, flag.data_ptr(), desc_at,
                  num_desc, end.data_ptr(), rel_end.data_ptr()))
        csum = torch.cumsum(flag, 0)
        new_ids = torch.empty(max(cap, 1), dtype=torch.int64, device=dev)
        k.launch("typed_assign", cap, (total.data_ptr(), keys.data_ptr(), stype.data_ptr(),
                                       csum.data_ptr(), types_at, end.data_ptr(),
                                       new_ids.data_ptr(), new_count.data_ptr(), state))
        k.launch("typed_relabel", cap, (total.data_ptr(), keys.data_ptr(), state,
                                        rows.data_ptr()))
        st.resets.append((total, keys, cap))
        sizes = meta[len(p.desc) + len(p.types):].tolist()  # the hop's host synchronisation
        return self.take(st, p, sizes[:num_types], sizes[num_types:], (rows, col, eid),
                         new_ids)

    def take(self, st: BatchState, p: HopPlan, added: list[int], rel_end: list[int],
             edges: tuple[Tensor, Tensor, Tensor], new_ids: Tensor
             ) -> tuple[dict[str, int], dict[EdgeType, int]]:
        """The hop's new nodes become the next frontier; its edges are sliced per relation."""
        frontier, at = {}, 0
        out_nodes: dict[str, int] = {}
        for t, c in zip(self.types, added, strict=True):
            if c:
                frontier[t] = new_ids[at:at + c]
                st.pieces.setdefault(t, []).append(frontier[t])
                st.before[t] = st.before.get(t, 0) + c
                out_nodes[t] = c
            at += c
        st.frontier = frontier
        out_edges: dict[EdgeType, int] = {}
        start = 0
        rows, col, eid = edges
        for r, stop in zip(p.rels, rel_end, strict=True):
            et = self.edge_types[r]
            st.rows.setdefault(et, []).append(rows[start:stop])
            st.cols.setdefault(et, []).append(col[start:stop])
            st.eids.setdefault(et, []).append(eid[start:stop])
            out_edges[et] = stop - start
            start = stop
        return out_nodes, out_edges

    def reset(self, st: BatchState) -> None:
        """Every state entry the batch touched back to empty."""
        for total, keys, cap in st.resets:
            if cap:
                self.kernels.launch("typed_reset", cap, (total.data_ptr(), keys.data_ptr(),
                                                         self.state.data_ptr()))

    def assemble(self, st: BatchState) -> tuple[dict[str, Tensor], dict[EdgeType, Tensor],
                                                dict[EdgeType, Tensor]]:
        """The batch's nodes per type, ``edge_index`` and ``e_id`` per relation, copied out of
        the hop buffers in one launch (``typed_gather_segments``) into one allocation."""
        sizes = {t: sum(int(p.numel()) for p in st.pieces.get(t, [])) for t in self.types}
        edges = {et: sum(int(p.numel()) for p in st.rows.get(et, [])) for et in self.edge_types}
        flat = torch.empty(sum(sizes.values()) + 3 * sum(edges.values()), dtype=torch.int64,
                           device=self.device)
        table: list[int] = []
        copied = 0

        def copy(pieces: list[Tensor], at: int) -> None:
            nonlocal copied
            for piece in pieces:
                n = int(piece.numel())
                if n:
                    table.extend((copied, piece.data_ptr(), flat.data_ptr() + 8 * at))
                    copied, at = copied + n, at + n

        node, edge_index, e_id, at = {}, {}, {}, 0
        for t in self.types:
            node[t] = flat[at:at + sizes[t]]
            copy(st.pieces.get(t, []), at)
            at += sizes[t]
        for et in self.edge_types:
            e = edges[et]
            edge_index[et] = flat[at:at + 2 * e].view(2, e)
            e_id[et] = flat[at + 2 * e:at + 3 * e]
            for part, pieces in enumerate((st.rows.get(et, []), st.cols.get(et, []),
                                           st.eids.get(et, []))):
                copy(pieces, at + part * e)
            at += 3 * e
        if copied:
            segments = self.upload(table)
            self.kernels.launch("typed_gather_segments", copied,
                                (segments.data_ptr(), len(table) // 3, copied))
        return node, edge_index, e_id
