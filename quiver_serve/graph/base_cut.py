"""Removing edges from base lists at the cost of what is removed (docs/architecture.md, "The
living graph"; decision 0069).

A base list is immutable (it is the snapshot's mapped CSC). A node that loses entries of its
counted base list keeps it and takes a cut instead (``graph/overlay_view.py``): its counted
length drops by the number removed, and each removed place below the new length is filled with
the entry that stood at the list's end, recorded as an override pair ``(position, value)`` in
the node's block before its tail. So removing ``m`` entries from a list of ``B`` writes about
``2 * (pairs so far + m)`` arena entries plus the node's tail, not ``B``; a node whose pairs
would outgrow half its base list is rewritten whole instead (the caller's choice, ``worth_cut``).

Everything here is vectorised over the nodes of one update call; positions are relative to a
node's base list. Base lists must be sorted by source id (binary search finds a pair's copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quiver_serve.graph.list_ranges import (
    gather_ranges,
    interleave,
    lower_bound,
    range_positions,
)
from quiver_serve.graph.overlay_view import CUT_MASK, SPENT_POS

#: (node index, position) packed in one int64 key; base positions stay below 2**31
_KEY_SHIFT = 1 << 32


@dataclass
class Pairs:
    """Override pairs of some nodes, grouped per node in position order."""

    owner: np.ndarray  # int64 index of each pair's node (into the caller's node array)
    pos: np.ndarray  # int64 base-list position (SPENT_POS for a filler)
    val: np.ndarray  # int64 source node id there

    @classmethod
    def read(cls, arena: np.ndarray, block_start: np.ndarray, cuts: np.ndarray) -> Pairs:
        """The pairs at the head of each node's block (``cuts[i]`` pairs at ``block_start[i]``)."""
        flat = gather_ranges(arena, np.maximum(block_start, 0), 2 * cuts)
        return cls(np.repeat(np.arange(cuts.size, dtype=np.int64), cuts), flat[0::2], flat[1::2])

    def select(self, keep: np.ndarray) -> Pairs:
        return Pairs(self.owner[keep], self.pos[keep], self.val[keep])

    def renumbered(self, nodes: np.ndarray) -> Pairs:
        """These pairs with owners renumbered as indexes into ``nodes`` (sorted owners)."""
        return Pairs(np.searchsorted(nodes, self.owner), self.pos, self.val)

    def keys(self) -> np.ndarray:
        return self.owner * _KEY_SHIFT + self.pos

    def live(self, counted: np.ndarray) -> Pairs:
        """The pairs that a reader sees (position below the node's counted base length)."""
        return self.select(self.pos < counted[self.owner])


def apply_pairs(out: np.ndarray, node_off: np.ndarray, counted: np.ndarray, pairs: Pairs) -> None:
    """Write the live pairs over base values laid out per node at ``node_off``."""
    live = pairs.live(counted)
    out[node_off[live.owner] + live.pos] = live.val


@dataclass
class Hits:
    """Base positions one call removes: (node index, position) unique and sorted, and the keys
    ``dst * cap + src`` of the pairs found there."""

    owner: np.ndarray
    pos: np.ndarray
    found: np.ndarray


def base_hits(indptr: np.ndarray, indices: np.ndarray, pairs: np.ndarray, dsts: np.ndarray,
              counted: np.ndarray, overrides: Pairs, cap: int) -> Hits:
    """Every position of the counted base lists of ``dsts`` (sorted nodes; ``counted`` their
    counted lengths, ``overrides`` their pairs) holding a removed ``(src, dst)`` of ``pairs``:
    the base copies of the pair's source not overridden, and the live pairs with that source.
    Pairs into other nodes are ignored."""
    node_of = np.minimum(np.searchsorted(dsts, pairs[:, 1]), max(dsts.size - 1, 0))
    has = (dsts[node_of] == pairs[:, 1]) & (counted[node_of] > 0) if dsts.size \
        else np.zeros(pairs.shape[0], dtype=bool)
    d, s, o = pairs[has, 1], pairs[has, 0], node_of[has]
    lo0, hi0 = indptr[d], indptr[d + 1]
    lo = lower_bound(indices, lo0, hi0, s)
    copies = lower_bound(indices, lo0, hi0, s + 1) - lo
    owner = np.repeat(o, copies)
    pos = range_positions(lo - lo0, copies)
    key_of_pair = np.repeat(d * cap + s, copies)
    live = overrides.live(counted)
    keep = (pos < counted[owner]) & ~np.isin(owner * _KEY_SHIFT + pos, live.keys())
    pair_keys = np.unique(pairs[:, 1] * cap + pairs[:, 0])
    live_keys = dsts[live.owner] * cap + live.val
    wanted = np.isin(live_keys, pair_keys)
    keys = np.unique(np.concatenate([owner[keep] * _KEY_SHIFT + pos[keep], live.keys()[wanted]]))
    found = np.unique(np.concatenate([key_of_pair[keep], live_keys[wanted]]))
    return Hits(keys // _KEY_SHIFT, keys % _KEY_SHIFT, found)


def worth_cut(full: np.ndarray, cuts: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """Whether a node keeps its base list with a cut after losing ``removed`` more entries: its
    pairs (two entries each) stay below the list's own size, and within the length word."""
    after = cuts + removed
    return (2 * after <= full) & (after <= CUT_MASK)


@dataclass
class CutBlocks:
    """New blocks of the nodes a cut rewrites: per node its pairs, then its surviving tail."""

    cut: np.ndarray  # the nodes' new cut counts
    tail_len: np.ndarray  # their new tail lengths
    content: np.ndarray  # the blocks' entries, node after node
    content_counts: np.ndarray  # entries per node (2 * cut + tail_len)


def cut_blocks(base_start: np.ndarray, indices: np.ndarray, counted: np.ndarray,
               cuts: np.ndarray, overrides: Pairs, hits: Hits, tail_vals: np.ndarray,
               tail_counts: np.ndarray, tail_drop: np.ndarray) -> CutBlocks:
    """The blocks of nodes (arrays indexed alike; ``base_start`` = ``indptr[v]``) after removing
    the base positions ``hits`` and the tail entries ``tail_drop`` (flags over ``tail_vals``,
    grouped per node). The removed places below each new counted length take, in order, the
    surviving entries from the list's end; spent pairs stay (the count of pairs is the cut)."""
    removed = np.bincount(hits.owner, minlength=cuts.size)
    after = counted - removed
    hole = hits.pos < after[hits.owner]
    holes = Pairs(hits.owner[hole], hits.pos[hole], np.empty(0, np.int64))
    # the places between the new and the old counted length that survive move into the holes
    mv_owner = np.repeat(np.arange(cuts.size, dtype=np.int64), removed)
    mv_pos = range_positions(after, removed)
    moving = ~np.isin(mv_owner * _KEY_SHIFT + mv_pos, hits.owner * _KEY_SHIFT + hits.pos)
    mv_owner, mv_pos = mv_owner[moving], mv_pos[moving]
    values = indices[base_start[mv_owner] + mv_pos]
    live = overrides.live(counted)
    at = np.searchsorted(live.keys(), mv_owner * _KEY_SHIFT + mv_pos)
    over = (at < live.pos.size) & (live.keys()[np.minimum(at, max(live.pos.size - 1, 0))]
                                   == mv_owner * _KEY_SHIFT + mv_pos) if live.pos.size \
        else np.zeros(mv_pos.size, dtype=bool)
    values[over] = live.val[at[over]]
    assert values.size == holes.pos.size, "a cut pairs each hole with one entry from the end"
    kept = overrides.select(~np.isin(overrides.keys(), holes.keys()))
    new_cut = cuts + removed
    fill = new_cut - np.bincount(np.concatenate([kept.owner, holes.owner]), minlength=cuts.size)
    filler = np.repeat(np.arange(cuts.size, dtype=np.int64), fill)
    owner = np.concatenate([kept.owner, holes.owner, filler])
    pos = np.concatenate([kept.pos, holes.pos, np.full(filler.size, SPENT_POS, np.int64)])
    val = np.concatenate([kept.val, values, np.full(filler.size, -1, np.int64)])
    order = np.lexsort((pos, owner))
    flat = np.stack([pos[order], val[order]], 1).reshape(-1)
    t_owner = np.repeat(np.arange(cuts.size, dtype=np.int64), tail_counts)
    tail_len = np.bincount(t_owner[~tail_drop], minlength=cuts.size)
    survivors = rotated(tail_vals[~tail_drop], tail_len, np.minimum(2 * removed, tail_len))
    content = interleave(flat, 2 * new_cut, survivors, tail_len)
    return CutBlocks(new_cut, tail_len, content, 2 * new_cut + tail_len)


def rotated(values: np.ndarray, counts: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Each node's entries (grouped per node) with its first ``shift`` moved to its end: a
    block rewritten in place whose pairs grow by ``2m`` then keeps all but ``2m`` of its tail
    entries where they were (the tail starts ``2m`` later; its first ``2m`` entries move on)."""
    if values.size == 0:
        return values
    owner = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    off = np.cumsum(counts) - counts
    rank = np.arange(values.size, dtype=np.int64) - off[owner]
    out = np.empty_like(values)
    out[off[owner] + (rank - shift[owner]) % counts[owner]] = values
    return out


__all__ = ["CutBlocks", "Hits", "Pairs", "apply_pairs", "base_hits", "cut_blocks", "rotated",
           "worth_cut"]
