"""What a sampler reads of the living graph's overlay (docs/architecture.md, "The living graph"):
one layout for every sampler.

The base graph is an immutable CSC (``indptr``, ``indices``) of ``n_base`` nodes. Updates since the
base live in an overlay, and the current neighbour list of node ``v`` is

* its base list ``indices[indptr[v]:indptr[v + 1]]`` (only when ``v < n_base`` and the overlay has
  not replaced it), followed by
* its overlay tail ``tail[start[v] : start[v] + (length[v] & LENGTH_MASK)]`` when ``start[v] >= 0``.

``length[v] & REPLACED`` set means the node's base list no longer counts (an edge into it was
removed, so its whole surviving list was rewritten into the tail). Nodes ``n_base <= v <
num_nodes`` (added since the base) have no base list. Neighbour order is the base order, then the
tail's order (appended edges in the order they were acknowledged, a removed entry's place taken
by the tail's last entry); every sampler reads the same
list, so seeded sampling agrees across samplers at one version.

``start``, ``length`` and ``tail`` are preallocated for the overlay's capacity and written only by
the process that owns them, between the batches it samples: a sampler never sees half a version.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

#: bit of ``length[v]`` saying the base list of ``v`` was replaced by its tail
REPLACED = 1 << 62
#: the tail length of ``v`` is ``length[v] & LENGTH_MASK``
LENGTH_MASK = REPLACED - 1


@dataclass
class OverlayView:
    """The overlay as samplers read it; tensors on the sampler's device (see module docstring)."""

    n_base: int  # nodes of the base CSC
    num_nodes: int  # nodes now (base + appended); valid ids are 0 .. num_nodes - 1
    start: Tensor  # int64 [node capacity]: first tail entry of v, or -1 (no tail)
    length: Tensor  # int64 [node capacity]: tail length | REPLACED
    tail: Tensor  # int64 [edge capacity]: the tails' source node ids

    @property
    def node_capacity(self) -> int:
        return int(self.start.numel())
