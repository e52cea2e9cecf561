"""What a sampler reads of the living graph's overlay (docs/architecture.md, "The living graph"):
one layout for every sampler.

The base graph is an immutable CSC (``indptr``, ``indices``) of ``n_base`` nodes. Updates since the
base live in an overlay. Node ``v``'s word ``length[v]`` packs three things: its tail length
(``& LENGTH_MASK``), its cut ``c`` (``cut_of``: base entries removed without copying the list) and
``REPLACED`` (its base list no longer counts). Its block in the arena ``tail`` starts at
``start[v]`` (-1: none) and holds ``c`` override pairs ``(position, value)`` sorted by position,
then its tail. Its current neighbour list is

* its counted base list: ``indices[indptr[v] + r]`` for ``r < B - c`` (``B`` its base degree;
  only when ``v < n_base`` and not ``REPLACED``), except where a pair names ``r``: then the pair's
  value (pairs at positions ``>= B - c`` are spent and never read), followed by
* its tail ``tail[start[v] + 2c : start[v] + 2c + (length[v] & LENGTH_MASK)]``.

A removal from a base list fills each removed place below the new count with the entry from the
list's end, as a pair, so it costs what it removes (``graph/base_cut.py``); a node whose pairs
would outgrow half its base list has its surviving list written into a tail instead (``REPLACED``).
Nodes ``n_base <= v < num_nodes`` (added since the base) have no base list. Every sampler reads
the same list, so seeded sampling agrees across samplers at one version.

``start``, ``length`` and ``tail`` are preallocated for the overlay's capacity and written only by
the process that owns them, between the batches it samples: a sampler never sees half a version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

#: bit of ``length[v]`` saying the base list of ``v`` was replaced by its tail
REPLACED = 1 << 62
#: the tail length of ``v`` is ``length[v] & LENGTH_MASK``
LENGTH_MASK = (1 << 32) - 1
#: the cut of ``v`` (override pairs before its tail) is ``(length[v] >> CUT_SHIFT) & CUT_MASK``
CUT_SHIFT = 32
CUT_MASK = (1 << 30) - 1
#: position of a spent filler pair (above every base count: never read)
SPENT_POS = 1 << 62


def cut_of(raw: Any) -> Any:
    """The cut (override pairs) packed in length words (NumPy or torch int64)."""
    return (raw >> CUT_SHIFT) & CUT_MASK


@dataclass
class OverlayView:
    """The overlay as samplers read it; tensors on the sampler's device (see module docstring)."""

    n_base: int  # nodes of the base CSC
    num_nodes: int  # nodes now (base + appended); valid ids are 0 .. num_nodes - 1
    start: Tensor  # int64 [node capacity]: first entry of v's block (pairs, tail), or -1
    length: Tensor  # int64 [node capacity]: tail length | cut << CUT_SHIFT | REPLACED
    tail: Tensor  # int64 [edge capacity]: the blocks: override pairs, then tail source ids

    @property
    def node_capacity(self) -> int:
        return int(self.start.numel())
