"""Neighbour sampling across partitions, with the single machine's semantics.

A partition server holds the in-edge lists of the nodes it owns (rows in local order, sources as
GLOBAL ids). Hop ``l`` of a batch expands its frontier: the nodes this server owns are drawn here
by the reference sampler's hop (``sampling.reference.hop_edge_positions``) over the local rows,
hashing their global ids; the nodes owned elsewhere are drawn by their owners, one batched call
per partition per hop, all partitions at once and beside the local draws. Random numbers are a
pure function of (seed, hop, global id, draw) (``sampling/base.py``), so every node's draws are
the ones a whole-graph sampler makes, and the assembled hop, the ``n_id`` order, ``edge_index``
and the per-hop counts equal ``ReferenceSampler`` on the whole graph (docs/architecture.md,
"Partitioned serving"; decision 0044).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.sampling.base import SamplerOutput, check_seed_range, seed_base
from quiver_serve.sampling.reference import SubgraphBuilder, hop_edge_positions, read_positions

T = TypeVar("T")

#: (partition, global ids it owns, fanout, hop, seed base[, rows for partition, last hop]) ->
#: (neighbours, count per id[, row ids, rows]): with a partition to send rows to, the owner's
#: answer also carries feature rows that partition's gather will need (``RidingRows``)
RemoteHop = Callable[..., Awaitable[tuple[np.ndarray, ...]]]


class RowSink(Protocol):
    """Where a batch's hops leave the feature rows they learn about (``features.RidingRows``)."""

    @property
    def part(self) -> int: ...

    def arrived(self, ids: np.ndarray, rows: np.ndarray) -> None: ...

    def drawn(self, nbr: Tensor, answered_by: int | None) -> None: ...


def as_tensor(a: np.ndarray) -> Tensor:
    """A tensor over ``a`` without a copy, read-only arrays (memory maps, Ray's object store,
    frames off the wire) included: nothing here writes to them."""
    a = np.asarray(a)
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # torch warns that writing would be undefined
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


@dataclass
class LocalGraph:
    """The in-edge lists one partition owns, as tensors (read-only views are fine)."""

    part: int
    owner: Tensor  # int32/int64 [num_nodes]: partition of each global id
    local: Tensor  # int64 [num_nodes]: row of each global id within its owner
    indptr: Tensor  # int64 [owned + 1]
    indices: Tensor  # int64 [edges]: source GLOBAL ids
    #: the partition's living-graph overlay over these lists (``live.py``), None when unchanged
    overlay: OverlayView | None = None
    #: (indptr, indices) copied to a GPU by :meth:`place`: local hops are drawn there while
    #: no overlay is set (the same torch ops on integers: the same draws; decision 0054)
    device_csc: tuple[Tensor, Tensor] | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.owner.numel())

    def place(self, device: torch.device, budget_bytes: int) -> int:
        """Copy the in-edge lists to ``device`` (a GPU) when they fit in ``budget_bytes``; the
        bytes placed."""
        nbytes = self.indptr.numel() * self.indptr.element_size() + \
            self.indices.numel() * self.indices.element_size()
        if device.type == "cpu" or nbytes > budget_bytes:
            return 0
        self.device_csc = (self.indptr.to(device), self.indices.to(device))
        return nbytes


def local_hop(graph: LocalGraph, ids: Tensor, k: int, hop: int, base: int) -> tuple[Tensor, Tensor]:
    """Hop ``hop`` (fanout ``k``, -1: every neighbour) of global ``ids`` this partition owns:
    (their drawn neighbours' global ids in id order, how many per id). ValueError naming the
    first id it does not own."""
    ids = ids.to(torch.int64)
    if ids.numel() == 0:
        return ids.new_empty(0), ids.new_empty(0)
    if int(ids.min()) < 0 or int(ids.max()) >= graph.num_nodes:
        raise ValueError(f"node ids must be in [0, {graph.num_nodes})")
    mine = graph.owner[ids] == graph.part
    if not bool(mine.all()):
        bad = int(ids[~mine][0])
        raise ValueError(f"node {bad} is owned by partition {int(graph.owner[bad])}, not "
                         f"{graph.part}")
    rows = graph.local[ids]
    if graph.overlay is None and graph.device_csc is not None:
        indptr, indices = graph.device_csc
        dev = indptr.device
        edge_pos, count = hop_edge_positions(indptr, rows.to(dev), k, hop, base, None, ids.to(dev))
        return read_positions(indices, edge_pos, None).cpu(), count.cpu()
    edge_pos, count = hop_edge_positions(graph.indptr, rows, k, hop, base, graph.overlay, ids)
    return read_positions(graph.indices, edge_pos, graph.overlay), count


#: work on at least this many ids runs in a thread, beside the loop (which keeps answering
#: peers and sending calls meanwhile: torch releases the GIL); less runs inline, where a
#: thread's hand-over would cost more than it frees
OFF_LOOP_MIN_IDS = 2048


async def off_loop(fn: Callable[..., T], size: int, *args: Any) -> T:
    """``fn(*args)``, in a thread when ``size`` (ids of work) reaches ``OFF_LOOP_MIN_IDS``."""
    if size >= OFF_LOOP_MIN_IDS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _place(frontier_size: int, parts: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """One hop's neighbours in frontier order from per-partition answers ``(positions into the
    frontier, neighbours in position order, count per position)``; and each one's frontier
    position."""
    count = torch.zeros(frontier_size, dtype=torch.int64)
    for pos, _, cnt in parts:
        count[pos] = cnt
    start = torch.cumsum(count, 0) - count
    total = int(count.sum())
    nbr = torch.empty(total, dtype=torch.int64)
    for pos, got, cnt in parts:
        if got.numel() == 0:
            continue
        within = torch.arange(got.numel()) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt,
                                                                     cnt)
        nbr[torch.repeat_interleave(start[pos], cnt) + within] = got
    owner = torch.repeat_interleave(torch.arange(frontier_size), count)
    return nbr, owner


@dataclass(frozen=True)
class VirtualNodes:
    """A request's own new nodes (``new_nodes``, inductive): ids ``first, first + 1, ...`` past
    the graph's nodes, each with its in-neighbours (global ids of existing nodes, in the order
    given) and its feature row. Embedded as if added, nothing written; no list holds them, so
    they are drawn from only as seeds, by the server the request went to (as the daemon's
    overlay draws them: ``hop_edge_positions`` over their lists, hashing their ids)."""

    first: int
    indptr: Tensor  # int64 [m + 1]
    neighbors: Tensor  # int64 [nnz]
    features: Tensor  # float32 [m, F]

    @property
    def count(self) -> int:
        return int(self.indptr.numel() - 1)

    def hop(self, ids: Tensor, k: int, hop: int, base: int) -> tuple[Tensor, Tensor]:
        """Hop ``hop`` of virtual ``ids``: (their drawn neighbours in id order, count per id)."""
        edge_pos, count = hop_edge_positions(self.indptr, ids - self.first, k, hop, base, None,
                                             ids)
        return read_positions(self.neighbors, edge_pos, None), count


class PartitionSampler:
    """``ReferenceSampler.sample`` over a partitioned graph (see the module docstring);
    ``remote`` draws a hop of the ids another partition owns (a Ray call in a deployment, the
    owner's :func:`local_hop` in process for tests)."""

    name = "partitioned"

    def __init__(self, graph: LocalGraph, num_parts: int, remote: RemoteHop) -> None:
        self.graph, self.num_parts, self.remote = graph, num_parts, remote

    async def hop(self, frontier: Tensor, k: int, hop: int, base: int,
                  virtual: VirtualNodes | None = None, rows: RowSink | None = None,
                  last: bool = False) -> tuple[Tensor, Tensor]:
        """One hop of ``frontier`` (global ids): remote calls sent first, then the local draws,
        then the remote answers awaited (one call per other partition holding frontier nodes).
        Ids of ``virtual`` nodes are drawn here from their own lists. With ``rows``, the
        answers carry feature rows for this batch's gather, and the ``last`` hop's draws ask
        for the rows no answer brings (decision 0070)."""
        extra = () if rows is None else (rows.part, last)
        if virtual is None:
            owners = self.graph.owner[frontier].to(torch.int64)
        else:
            real = frontier < virtual.first
            owners = torch.full_like(frontier, -1)
            owners[real] = self.graph.owner[frontier[real]].to(torch.int64)
        calls: list[tuple[int, Tensor, Awaitable[tuple[np.ndarray, ...]]]] = []
        for q in range(self.num_parts):
            if q == self.graph.part:
                continue
            pos = (owners == q).nonzero().flatten()
            if pos.numel():
                ids = frontier[pos].numpy()
                calls.append((q, pos, asyncio.ensure_future(self.remote(q, ids, k, hop, base,
                                                                        *extra))))
        answers: list[tuple[Tensor, Tensor, Tensor]] = []
        if virtual is not None and (pos := (owners < 0).nonzero().flatten()).numel():
            answers.append((pos, *virtual.hop(frontier[pos], k, hop, base)))
            if rows is not None and last:
                rows.drawn(answers[-1][1], None)
        mine = (owners == self.graph.part).nonzero().flatten()
        if mine.numel():
            got, cnt = await off_loop(local_hop, int(mine.numel()), self.graph, frontier[mine],
                                      k, hop, base)
            answers.append((mine, got, cnt))
            if rows is not None and last:
                rows.drawn(got, None)
        try:
            remote = await asyncio.gather(*(fut for _, _, fut in calls))
        except BaseException:
            for _, _, fut in calls:
                fut.cancel()  # type: ignore[attr-defined]
            raise
        for (q, pos, _), answer in zip(calls, remote, strict=True):
            got, cnt = as_tensor(np.asarray(answer[0], np.int64)), \
                as_tensor(np.asarray(answer[1], np.int64))
            answers.append((pos, got, cnt))
            if rows is not None and len(answer) == 4:
                rows.arrived(answer[2], answer[3])
                if last:
                    rows.drawn(got, q)
        return _place(int(frontier.numel()), answers)

    async def sample(self, seeds: Tensor, fanouts: list[int], seed: int,
                     virtual: VirtualNodes | None = None,
                     rows: RowSink | None = None) -> SamplerOutput:
        """The ``len(fanouts)``-hop subgraph of global ``seeds`` (``virtual`` nodes' ids among
        them) with batch seed ``seed``; the same tensors ``ReferenceSampler.sample`` gives on
        the whole graph (with the virtual nodes added). ``rows`` collects the feature rows the
        hops bring (``hop``)."""
        base = seed_base(seed)
        seeds = seeds.to(torch.int64)
        bound = self.graph.num_nodes if virtual is None else virtual.first + virtual.count
        check_seed_range(seeds, bound)
        sub = SubgraphBuilder(seeds)
        for hop, k in enumerate(fanouts, start=1):
            sub.add_hop(*await self.hop(sub.frontier, k, hop, base, virtual, rows,
                                        hop == len(fanouts)))
        return sub.output()
