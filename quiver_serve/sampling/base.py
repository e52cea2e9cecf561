"""Sampler types, the base class, and the counter-based random numbers every sampler shares.

Semantics (docs/architecture.md, "Sampling"), identical for every implementation (reference torch,
C++, CUDA):

* ``n_id`` starts with the unique seeds in first-occurrence order; ``seed_index[i]`` is the row of
  ``seeds[i]`` in ``n_id`` (so repeated ids map to the same row).
* Hop ``l`` (1-based, fanout ``k = fanouts[l-1]``) expands every node added at hop ``l-1``, in
  ``n_id`` order. A node of in-degree ``d`` contributes all its neighbours in CSC order when
  ``k == -1`` or ``d <= k``; otherwise ``k`` distinct neighbours chosen uniformly without
  replacement by Floyd's algorithm, in draw order (below).
* The sampled neighbours of a hop, concatenated in frontier order, are the hop's edges
  (``edge_index[0]`` = local id of the neighbour, ``edge_index[1]`` = local id of the expanded node).
  Neighbours not yet in ``n_id`` are appended in order of first occurrence in that list.
* ``num_sampled_nodes`` has ``L + 1`` entries (hop 0 = unique seeds), ``num_sampled_edges`` ``L``.

Living graph (docs/architecture.md, "The living graph"): with an
:class:`~quiver_serve.graph.overlay_view.OverlayView` set (:meth:`BaseSampler.set_overlay`), node
``v``'s list is its base list (``v < n_base`` and not replaced) followed by its overlay tail, and
everything above reads that combined list: its length is the degree, local offset ``q`` is entry
``q`` of the combined list.

Random numbers are a pure function of (batch seed, hop, node id, draw index), not a stream, so the
same seed yields the same subgraph from every implementation, on any thread count. A typed graph
adds the edge type: relation ``r``'s draws start from ``relation_base(base, r)`` instead of
``base`` (``sampling/typed.py``).
For a node ``v`` expanded at hop ``l`` with fanout ``k`` and degree ``d > k``, draw ``i`` in
``0..k-1`` takes ``t = d - k + i``, ``r = rand32(seed, l, v, i)``, ``j = (r * (t + 1)) >> 32`` and
keeps ``j`` unless an earlier draw took it, in which case it keeps ``t`` (Floyd).
"""

from __future__ import annotations

import os
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from quiver_serve import errors
from quiver_serve.graph.overlay_view import OverlayView

MASK32 = 0xFFFFFFFF
_MIX_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B9
_HOP_MUL = 0x632BE5AB
_DRAW_MUL = 0x85EBCA6B
_REL_MUL = 0xC2B2AE35


@dataclass
class SamplerOutput:
    """A sampled subgraph in PyG's shape (see module docstring)."""

    n_id: Tensor  # int64 [N] global ids, seeds first
    edge_index: Tensor  # int64 [2, E] local ids (row: neighbour/source, col: expanded/target)
    seed_index: Tensor  # int64 [len(seeds)] row of each requested seed in n_id
    num_sampled_nodes: list[int]  # [L + 1]
    num_sampled_edges: list[int]  # [L]

    @property
    def num_nodes(self) -> int:
        return int(self.n_id.numel())

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.size(1))


class BaseSampler(ABC):
    """A neighbour sampler over one CSC graph (``indptr``/``indices`` in-neighbours), and the
    overlay of updates since that CSC when one is set."""

    #: short name shown in metrics and logs ("reference", "cpp", "cuda", "uva")
    name: str = "base"

    def __init__(self, indptr: Tensor, indices: Tensor) -> None:
        self.indptr = indptr
        self.indices = indices
        self.overlay: OverlayView | None = None

    @property
    def num_nodes(self) -> int:
        # Read on every call: the view's owner appends nodes between batches.
        if self.overlay is not None:
            return self.overlay.num_nodes
        return self.indptr.numel() - 1

    def set_overlay(self, view: OverlayView | None) -> None:
        """Sample the base CSC plus ``view`` from the next call on (None: the base alone).

        The view's tensors must live where the sampler reads its graph (``overlay_device``);
        they are read in place on every call, never copied, so their owner may rewrite them
        between batches but must not reallocate them while they are set."""
        if view is not None:
            check_overlay(view, self.indptr.numel() - 1, self.overlay_device)
        self.overlay = view

    @property
    def overlay_device(self) -> torch.device:
        """The device the overlay's tensors must be on."""
        return self.indptr.device

    @abstractmethod
    def sample(self, seeds: Tensor, fanouts: list[int], seed: int) -> SamplerOutput:
        """Sample the ``len(fanouts)``-hop subgraph of ``seeds`` with batch seed ``seed``."""


def check_overlay(view: OverlayView, n_base: int, device: torch.device) -> None:
    """Raise unless ``view`` fits a base of ``n_base`` nodes and lies on ``device`` as int64."""
    if view.n_base != n_base:
        raise ValueError(f"overlay is over a base of {view.n_base} nodes, the sampler's has "
                         f"{n_base}")
    if not n_base <= view.num_nodes <= view.node_capacity:
        raise ValueError(f"overlay num_nodes={view.num_nodes} is outside [n_base={n_base}, "
                         f"node capacity={view.node_capacity}]")
    for field in ("start", "length", "tail"):
        t = getattr(view, field)
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"overlay.{field} must be a contiguous 1-D int64 tensor, got {t.dtype} "
                            f"{tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"overlay.{field} is on {t.device}; this sampler reads it on {device}")
    if view.length.numel() != view.node_capacity:
        raise ValueError(f"overlay.length has {view.length.numel()} entries, overlay.start "
                         f"{view.node_capacity}")


def check_seed_range(seeds: Tensor, num_nodes: int) -> None:
    """IndexError naming the valid range when a seed id is outside ``[0, num_nodes)``."""
    if seeds.numel() and (int(seeds.min()) < 0 or int(seeds.max()) >= num_nodes):
        raise IndexError(f"seed node ids must be in [0, {num_nodes})")


# ---- counter-based random numbers (shared spec; see csrc/ for the C++ and CUDA twins) ----------


def mix32(x: Tensor) -> Tensor:
    """32-bit avalanche mix of int64 values in [0, 2**32); every product stays below 2**63."""
    x = ((x >> 16) ^ x) * _MIX_MUL & MASK32
    x = ((x >> 16) ^ x) * _MIX_MUL & MASK32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    x = (((x >> 16) ^ x) * _MIX_MUL) & MASK32
    x = (((x >> 16) ^ x) * _MIX_MUL) & MASK32
    return (x >> 16) ^ x


def seed_base(seed: int) -> int:
    """Fold a 64-bit batch seed into the 32-bit base every draw of the batch starts from."""
    seed &= 2**64 - 1
    return _mix32_int((seed & MASK32) ^ _mix32_int(((seed >> 32) & MASK32) ^ _GOLDEN))


def relation_base(base: int, relation: int) -> int:
    """The batch base of edge type number ``relation`` of a typed graph (its position in the
    graph's edge types): ``base`` itself for relation 0, so a one-type graph draws exactly the
    homogeneous numbers; every other relation draws independent ones (docs/architecture.md,
    "Typed graphs")."""
    if relation < 0:
        raise ValueError(f"relation number must be >= 0, got {relation}")
    return base ^ _mix32_int((relation * _REL_MUL) & MASK32)


def node_hash(base: int, hop: int, nodes: Tensor) -> Tensor:
    """Per-(batch, hop, node) hash; ``hop`` is 1-based. A typed graph's relation passes its
    :func:`relation_base` as ``base``."""
    hop_term = (_HOP_MUL * hop) & MASK32
    return mix32(base ^ mix32(((nodes & MASK32) + hop_term) & MASK32))


def draw32(node_h: Tensor, draw: int | Tensor) -> Tensor:
    """The ``draw``-th 32-bit random number of a node, from its :func:`node_hash` (``draw`` an
    int, or int64 draw numbers broadcast against ``node_h``)."""
    return mix32(node_h ^ ((draw * _DRAW_MUL) & MASK32))


def validate_seed(seed: int) -> int:
    """``seed``, or a ValueError (a sampler's argument; requests were refused 400 before)."""
    try:
        errors.check_seed(seed)
    except errors.ServeError as exc:
        raise ValueError(str(exc)) from None
    return seed


_SEEDS = random.Random(int.from_bytes(os.urandom(16), "little"))


def new_batch_seed(generator: torch.Generator | None = None) -> int:
    """A fresh random batch seed for requests that did not ask for one (a process-local PRNG
    seeded from the OS: microseconds, not a torch op, on the serving path)."""
    if generator is not None:
        return int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return _SEEDS.getrandbits(62)
