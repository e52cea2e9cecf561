"""Vectorised helpers over concatenated per-node lists (NumPy): ranges, ranks, searches."""

from __future__ import annotations

import numpy as np


def range_positions(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + c) for s, c in zip(starts, counts))``, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, np.int64)
    offsets = np.cumsum(counts) - counts
    within = np.arange(total, dtype=np.int64) - np.repeat(offsets, counts)
    return np.repeat(starts, counts) + within


def gather_ranges(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(values[s:s + c] for s, c in zip(starts, counts))``, vectorised."""
    return values[range_positions(starts, counts)]


def rank_within(owner: np.ndarray) -> np.ndarray:
    """Position of each entry among the entries of its owner (``owner`` sorted ascending)."""
    if owner.size == 0:
        return owner
    first = np.r_[0, np.flatnonzero(np.diff(owner)) + 1]
    counts = np.diff(np.r_[first, owner.size])
    return np.arange(owner.size) - np.repeat(first, counts)


def lower_bound(values: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                target: np.ndarray) -> np.ndarray:
    """Per query, the first position in ``values[lo:hi]`` (sorted) not below ``target``."""
    lo, hi = lo.copy(), hi.copy()
    last = max(values.size - 1, 0)
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        below = open_ & (values[np.minimum(mid, last)] < target)
        lo = np.where(below, mid + 1, lo)
        hi = np.where(open_ & ~below, mid, hi)



def interleave(old: np.ndarray, old_counts: np.ndarray, new: np.ndarray,
                new_counts: np.ndarray) -> np.ndarray:
    """Per node: its old entries, then its new ones (both grouped by node in the same order)."""
    counts = old_counts + new_counts
    out = np.empty(int(counts.sum()), np.int64)
    node_off = np.cumsum(counts) - counts
    owner_old = np.repeat(np.arange(counts.size), old_counts)
    owner_new = np.repeat(np.arange(counts.size), new_counts)
    out[node_off[owner_old] + rank_within(owner_old)] = old
    out[node_off[owner_new] + old_counts[owner_new] + rank_within(owner_new)] = new
    return out
