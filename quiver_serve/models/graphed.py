"""CUDA graphs of gather + model for small sampled batches: the fix for the model's launch overhead.

A 1-48 seed batch costs the GPU microseconds but costs the host about a millisecond of kernel
launches (PyG's message passing is dozens of small kernels, each launched from Python). A CUDA
graph replays all of them with one launch. Graphs need fixed shapes, so a batch of up to ``S``
seeds is laid out in a padded subgraph whose size depends on ``S`` and the fanouts alone:

* hop ``h`` gets ``S * prod(fanouts[:h]) + 1`` node slots (a strict upper bound on the nodes a
  hop can add, plus one slot that is always padding) and its edges
  ``S * prod(fanouts[:h + 1])`` edge slots;
* real nodes keep their order inside their hop's slots; real edges are renumbered to the slots;
* padding edges join the spare slot of hop ``h + 1`` to the padding slots of hop ``h`` (spread
  evenly, targets non-decreasing), so they only ever reach padding nodes (whose rows are read
  from feature row 0 and are never returned).

PyG's per-layer trimming sees the per-hop slot counts, which are constants, so every shape in the
forward is fixed. Real rows are bit-for-bit what the eager forward computes on the unpadded
subgraph for every conv whose output row depends only on its in-edges (GraphSAGE, GAT, GCN in
sampled mode); the engine still checks each captured graph against the eager forward at start-up
and serves eagerly where capture fails (ops that sync the host, such as GCN's and GAT's self-loop
handling, cannot be captured) or results differ. Exact mode (unbounded fanouts) is always eager.

:class:`PaddedLayout` is pure torch and runs on any device (the tests check padded == unpadded on
the CPU); :class:`GraphedForward` holds the captured graphs on one GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from quiver_serve.sampling.base import SamplerOutput

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PaddedLayout:
    """Fixed slot counts for batches of at most ``max_seeds`` seeds and the given fanouts."""

    max_seeds: int
    node_caps: tuple[int, ...]  # [L + 1] slots per hop, the last of each always padding
    edge_caps: tuple[int, ...]  # [L]

    @classmethod
    def for_fanouts(cls, max_seeds: int, fanouts: list[int]) -> PaddedLayout:
        if max_seeds < 1 or any(f < 1 for f in fanouts):
            raise ValueError("a padded layout needs max_seeds >= 1 and bounded fanouts")
        reach = [max_seeds * math.prod(fanouts[:h]) for h in range(len(fanouts) + 1)]
        return cls(max_seeds, tuple(r + 1 for r in reach), tuple(reach[1:]))

    @property
    def num_nodes(self) -> int:
        return sum(self.node_caps)

    @property
    def num_edges(self) -> int:
        return sum(self.edge_caps)

    def node_offsets(self) -> list[int]:
        return self._offsets[0]

    def edge_offsets(self) -> list[int]:
        return self._offsets[1]

    @functools.cached_property
    def _offsets(self) -> tuple[list[int], list[int]]:  # computed once: read for every batch
        return ([sum(self.node_caps[:h]) for h in range(len(self.node_caps))],
                [sum(self.edge_caps[:h]) for h in range(len(self.edge_caps))])

    def fits(self, sb: SamplerOutput) -> bool:
        if len(sb.num_sampled_nodes) != len(self.node_caps) \
                or sb.seed_index.numel() > self.max_seeds:
            return False
        return (all(n < c for n, c in zip(sb.num_sampled_nodes, self.node_caps, strict=True))
                and all(e <= c for e, c in zip(sb.num_sampled_edges, self.edge_caps, strict=True)))

    def padding_edges_np(self) -> np.ndarray:
        """int64 [2, num_edges]: every edge slot joined spare slot of hop h+1 -> spare of hop h."""
        offs, out = self.node_offsets(), np.empty((2, self.num_edges), np.int64)
        for h, at in enumerate(self.edge_offsets()):
            out[0, at:at + self.edge_caps[h]] = offs[h + 1] + self.node_caps[h + 1] - 1
            out[1, at:at + self.edge_caps[h]] = offs[h] + self.node_caps[h] - 1
        return out

    def _spread(self, hop: int, real_nodes: int, pad_edges: int) -> np.ndarray:
        """Targets of hop ``hop + 1``'s padding edges: the hop's padding slots, in
        non-decreasing order (targets stay sorted, as the fast model's CSR needs) and evenly
        (no single row of thousands of edges for a sparse kernel to crawl through)."""
        first = self.node_offsets()[hop] + real_nodes
        slots = self.node_caps[hop] - real_nodes  # >= 1: the last slot is always padding
        return first + (np.arange(pad_edges, dtype=np.int64) * slots) // pad_edges

    @property
    def flat_size(self) -> int:
        """int64 words of one packed batch: n_id, edge_index (2 rows), seed_index."""
        return self.num_nodes + 2 * self.num_edges + self.max_seeds

    def views(self, flat: Tensor) -> PaddedBuffers:
        """The model's inputs as views of one packed buffer (one copy moves a whole batch)."""
        n, e = self.num_nodes, self.num_edges
        return PaddedBuffers(flat[:n], flat[n:n + 2 * e].view(2, e), flat[n + 2 * e:])

    def new_flat(self) -> np.ndarray:
        """A packed batch of padding only (pad slots read feature row 0)."""
        flat = np.zeros(self.flat_size, np.int64)
        flat[self.num_nodes:self.num_nodes + 2 * self.num_edges] = self.padding_edges_np().ravel()
        return flat

    def pack(self, flat: np.ndarray, sb: SamplerOutput) -> None:
        """Write one sample into a packed host buffer made by :meth:`new_flat` (or a copy).

        Only what the sample covers is written, plus the padding edges over stale real edges."""
        n_id, edges, seed_index = _host(sb)
        n_off, e_off = self.node_offsets(), self.edge_offsets()
        starts = np.cumsum([0, *sb.num_sampled_nodes[:-1]])
        for h, n in enumerate(sb.num_sampled_nodes):
            flat[n_off[h]:n_off[h] + n] = n_id[starts[h]:starts[h] + n]
        # local id -> slot: add the shift of the node's hop
        shift = np.repeat(np.asarray(n_off, np.int64) - starts, sb.num_sampled_nodes)
        slots = (shift + np.arange(n_id.size, dtype=np.int64))[edges]
        base, e_start, cap = self.num_nodes, 0, self.num_edges
        for h, e in enumerate(sb.num_sampled_edges):
            src, dst = base + e_off[h], base + cap + e_off[h]
            flat[src:src + e] = slots[0, e_start:e_start + e]
            flat[dst:dst + e] = slots[1, e_start:e_start + e]
            pad = self.edge_caps[h] - e
            if pad:
                flat[src + e:src + e + pad] = n_off[h + 1] + self.node_caps[h + 1] - 1
                flat[dst + e:dst + e + pad] = self._spread(h, sb.num_sampled_nodes[h], pad)
            e_start += e
        at = base + 2 * cap
        flat[at:at + seed_index.size] = seed_index  # hop 0 is not shifted


def _host(sb: SamplerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n_id, edge_index and seed_index as host int64 arrays (one device-to-host copy if on a GPU)."""
    if not sb.n_id.is_cuda:
        return (sb.n_id.numpy(), sb.edge_index.numpy().astype(np.int64, copy=False),
                sb.seed_index.numpy())
    n, e = sb.n_id.numel(), sb.edge_index.size(1)
    packed = torch.cat([sb.n_id, sb.edge_index.reshape(-1).to(torch.int64), sb.seed_index]).cpu()
    flat = packed.numpy()
    return flat[:n], flat[n:n + 2 * e].reshape(2, e), flat[n + 2 * e:]


@dataclass
class PaddedBuffers:
    n_id: Tensor
    edge_index: Tensor
    seed_index: Tensor


#: (x, n_id, edge_index, num_nodes per hop, num_edges per hop) -> node outputs
ModelFn = Callable[[Tensor, Tensor, Tensor, list[int], list[int]], Tensor]
#: n_id (on the GPU) -> feature rows; must not synchronise the host (the feature store's kernel,
#: or ``features.index_select`` with ``partial(torch.index_select, features, 0)``)
GatherFn = Callable[[Tensor], Tensor]


def padded_forward(model: ModelFn, gather: GatherFn, layout: PaddedLayout,
                   buf: PaddedBuffers) -> Tensor:
    """Gather + model on the padded buffers; rows of the ``max_seeds`` seed slots (float32)."""
    x = gather(buf.n_id)
    out = model(x, buf.n_id, buf.edge_index, list(layout.node_caps), list(layout.edge_caps))
    return out.index_select(0, buf.seed_index).float()


#: pinned host buffers per bucket, used in turn: more than the batches in flight at once, so the one
#: written next has always been copied to the GPU already (an event checks it)
HOST_RING = 4


@dataclass
class _Slot:
    pinned: Tensor
    array: np.ndarray  # the same memory
    copied: torch.cuda.Event


@dataclass
class _Graph:
    layout: PaddedLayout
    flat: Tensor  # the graph's packed input on the GPU
    graph: torch.cuda.CUDAGraph
    out: Tensor  # [max_seeds, dim], rewritten by each replay
    ring: list[_Slot]
    turn: int = 0

    def stage(self, sb: SamplerOutput) -> Staged:
        slot = self.ring[self.turn % len(self.ring)]
        self.turn += 1
        slot.copied.synchronize()  # long done: HOST_RING > batches in flight
        self.layout.pack(slot.array, sb)
        return Staged(self, slot, int(sb.seed_index.numel()))


@dataclass
class Staged:
    """A batch packed in pinned host memory, ready for :meth:`GraphedForward.launch`."""

    graph: _Graph
    slot: _Slot
    num_seeds: int


@dataclass
class GraphedForward:
    """Captured graphs for seed buckets 1, 2, 4, ... up to ``max_seeds`` on one GPU."""

    graphs: list[_Graph] = field(default_factory=list)

    @property
    def max_seeds(self) -> int:
        return self.graphs[-1].layout.max_seeds if self.graphs else 0

    def stage(self, sb: SamplerOutput) -> Staged | None:
        """Pack a sample for the smallest bucket that holds it (None: none does). A sample on
        the GPU is copied to the host on the current stream, so call this where it was made."""
        for g in self.graphs:
            if g.layout.fits(sb):
                return g.stage(sb)
        return None

    @staticmethod
    def launch(staged: Staged) -> Tensor:
        """One host-to-device copy and one graph launch, queued on the current stream; rows for
        the batch's requested seeds (a view of the graph's output, valid until that bucket's
        next launch on this stream)."""
        g, slot = staged.graph, staged.slot
        g.flat.copy_(slot.pinned, non_blocking=True)
        slot.copied.record()
        g.graph.replay()
        return g.out[:staged.num_seeds]

    def run(self, sb: SamplerOutput) -> Tensor | None:
        """:meth:`stage` then :meth:`launch` (None when no bucket holds the sample)."""
        staged = self.stage(sb)
        return None if staged is None else self.launch(staged)

    @classmethod
    def capture(cls, model: ModelFn, gather: GatherFn, device: torch.device, fanouts: list[int],
                max_seeds: int, check: Callable[[int], SamplerOutput],
                thread_local: bool = False) -> GraphedForward:
        """Capture one graph per bucket (largest first, one shared memory pool) and check each
        against the eager forward on a real sample of that size (``check(num_seeds)``).
        Returns an empty object (eager everywhere) when capture fails or results differ.
        ``thread_local``: other threads keep launching work meanwhile (a model loaded beside
        the serving loop); only this thread's calls are checked for capture safety."""
        buckets = [1 << i for i in range(max(max_seeds, 1).bit_length()) if 1 << i <= max_seeds]
        if max_seeds < 1 or device.type != "cuda" or any(f < 1 for f in fanouts):
            return cls()
        pool = torch.cuda.graph_pool_handle()
        graphs: list[_Graph] = []
        try:
            for s in reversed(buckets):
                graphs.append(_capture_one(model, gather, device,
                                           PaddedLayout.for_fanouts(s, fanouts), pool,
                                           thread_local))
            graphed = cls(list(reversed(graphs)))
            for s in buckets:
                _check_bucket(graphed, model, gather, device, check(s))
        except Exception as exc:  # noqa: BLE001 - any failure: serve eagerly, say why
            log.warning("CUDA graphs off (batches run eagerly): %s: %s", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            torch.cuda.synchronize(device)
            return cls()
        return graphed


@contextlib.contextmanager
def beside_serving(graph: torch.cuda.CUDAGraph, pool: object,
                   stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture into ``graph`` on ``stream`` (thread-local mode: other threads keep launching)
    without what ``torch.cuda.graph`` does first: a device-wide synchronize and emptying the
    caching allocator's and the pinned-host allocator's free blocks. Beside a serving loop those
    stall it once per captured bucket (the allocator's lock is held while the device drains),
    and its next batches allocate device and pinned memory afresh (docs/decisions/0040)."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def _capture_one(model: ModelFn, gather: GatherFn, dev: torch.device, layout: PaddedLayout,
                 pool: object, thread_local: bool = False) -> _Graph:
    first = layout.new_flat()
    flat = torch.from_numpy(first).to(dev)
    buf = layout.views(flat)
    # beside a serving loop (thread_local) the caller's stream is already its own; a new
    # stream per capture would also leave a cuBLAS workspace behind per load
    side = torch.cuda.current_stream(dev) if thread_local else torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside capture (lazy inits, allocator)
        for _ in range(2):
            padded_forward(model, gather, layout, buf)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    capturing = beside_serving(graph, pool, side) if thread_local else torch.cuda.graph(
        graph, pool=pool, capture_error_mode="global")
    with capturing:
        out = padded_forward(model, gather, layout, buf)
    ring = []
    for _ in range(HOST_RING):
        pinned = torch.from_numpy(first.copy()).pin_memory()
        ring.append(_Slot(pinned, pinned.numpy(), torch.cuda.Event()))
    return _Graph(layout, flat, graph, out, ring)


def _check_bucket(graphed: GraphedForward, model: ModelFn, gather: GatherFn, dev: torch.device,
                  sb: SamplerOutput) -> None:
    got = graphed.run(sb)
    if got is None:
        raise RuntimeError(f"no bucket fits a {sb.seed_index.numel()}-seed sample")
    n_id = sb.n_id.to(dev)
    want = model(gather(n_id), n_id, sb.edge_index.to(dev, torch.int64),
                 sb.num_sampled_nodes, sb.num_sampled_edges)
    want = want.index_select(0, sb.seed_index.to(dev)).float()
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        err = (got - want).abs().max().item()
        raise RuntimeError(f"graph replay differs from the eager forward by {err:.3g} "
                           f"({sb.seed_index.numel()} seeds)")
