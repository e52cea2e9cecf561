"""Elias-Fano neighbour lists for the adjacency cache (``adjacency.py``, ``index_bits=0``).

A node's neighbour list is sorted by id (``graph/csc.py``), so it can be stored as Elias-Fano:
for a list of ``d`` ids below ``U`` (the node count), each id keeps its ``l = floor(log2(U / d))``
low bits in a packed array and its high part ``v >> l`` as one set bit at position
``(v >> l) + i`` of an upper bit array of ``d + (U >> l)`` bits: about ``l + 2`` bits per entry
instead of the packed layout's ``ceil(log2 U)`` (Reddit: ~10.7 vs 18 bits at its mean degree of
~490), so one budget holds ~1.7x the lists.

The sampler draws entries at random positions, so each read is a select: entry ``i``'s high part
is the position of the ``i``-th set bit minus ``i``. A sample every 64 entries (the position of
set bit ``64 s``, 32 bits) bounds that to a scan of a few words from the sample on.

One list's block of 32-bit words: ``ceil(d / 64)`` samples, ``ceil(d l / 32)`` low-bit words,
``ceil((d + (U >> l)) / 32)`` upper words. The per-node offset is the block's first word with
``l`` in bits 58-62 (``-1``: not cached). The kernel reads this in ``ListReader`` (csrc/
gpu_sampler.cu); :func:`decode_list` is the CPU twin, and tests run the kernel's reader compiled
for the CPU against it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quiver_serve.sampling.graph_cache.packing import (
    WORD_MASK,
    add_bits,
    as_int32_words,
    entry_positions,
    read_bits,
)

#: the per-node offset's bits for the list's low-bit width
L_SHIFT = 58
OFFSET_MASK = (1 << L_SHIFT) - 1
SAMPLE_EVERY = 64
#: the kernel holds a list's length in 27 bits: longer lists stay out of this layout
MAX_DEG = 1 << 27
ENTRIES_PER_CHUNK = 1 << 23


def low_bits(deg: Tensor, num_nodes: int) -> Tensor:
    """``l`` per list: ``floor(log2(U // d))`` (0 when ``d >= U``); int64."""
    ratio = torch.div(num_nodes, deg.clamp(min=1), rounding_mode="floor").clamp(min=1)
    return torch.floor(torch.log2(ratio.to(torch.float64))).to(torch.int64)


def block_words(deg: Tensor, num_nodes: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per list: ``l``, and the sample, low-bit and upper words of its block (int64; an empty
    list's block is empty)."""
    deg = deg.to(torch.int64)
    ell = low_bits(deg, num_nodes)
    samples = (deg + SAMPLE_EVERY - 1) // SAMPLE_EVERY
    low = (deg * ell + 31) // 32
    upper = torch.where(deg > 0, (deg + (num_nodes >> ell) + 31) // 32, torch.zeros_like(deg))
    return ell, samples, low, upper


def list_bits(deg: Tensor, num_nodes: int) -> Tensor:
    """Bits one list's block takes (0 for an empty list)."""
    _, samples, low, upper = block_words(deg, num_nodes)
    return 32 * (samples + low + upper)


def is_sorted(indptr: Tensor, indices: Tensor, nodes: Tensor) -> bool:
    """Whether every list of ``nodes`` is non-decreasing (what Elias-Fano needs); reads the
    lists in chunks of about ``ENTRIES_PER_CHUNK`` entries."""
    deg = indptr[1:] - indptr[:-1]
    sizes = deg[nodes]
    ends = torch.cumsum(sizes, 0)
    lo = 0
    while lo < int(nodes.numel()):
        # the lists up to the chunk's entry budget (at least one)
        hi = max(lo + 1, int(torch.searchsorted(ends, int(ends[lo] - sizes[lo])
                                                + ENTRIES_PER_CHUNK, right=True)))
        part, part_sizes = nodes[lo:hi], sizes[lo:hi]
        total = int(part_sizes.sum())
        if total > 1:
            first = torch.cumsum(part_sizes, 0) - part_sizes
            values = indices[entry_positions(indptr, part, part_sizes)]
            starts = torch.zeros(total, dtype=torch.bool)
            starts[first[part_sizes > 0]] = True
            if bool(((values[1:] < values[:-1]) & ~starts[1:]).any()):
                return False
        lo = hi
    return True


def pack(indptr: Tensor, indices: Tensor, nodes: Tensor, num_nodes: int,
         progress: bool = True) -> tuple[Tensor, Tensor]:
    """(offsets per node with ``l`` in the high bits, the blocks of ``nodes`` as int32 words plus
    one padding word); the lists must be sorted (:func:`is_sorted`). A progress bar when the
    lists hold more than one chunk of entries (~10 s for Reddit's 115 M on one core)."""
    deg = (indptr[1:] - indptr[:-1])[nodes]
    ell, samples, low, upper = block_words(deg, num_nodes)
    size = samples + low + upper
    block = torch.cumsum(size, 0) - size
    total_words = int(size.sum())
    offsets = torch.full((num_nodes,), -1, dtype=torch.int64)
    offsets[nodes] = block | (ell << L_SHIFT)
    words = torch.zeros(total_words + 1, dtype=torch.int64)
    first_entry = torch.cumsum(deg, 0) - deg
    total = int(deg.sum())
    bar = _bar(total, progress and total > ENTRIES_PER_CHUNK)
    for lo in range(0, total, ENTRIES_PER_CHUNK):
        e = torch.arange(lo, min(total, lo + ENTRIES_PER_CHUNK))
        li = torch.searchsorted(first_entry, e, right=True) - 1  # the entry's list
        i = e - first_entry[li]  # its position in the list
        v = indices[indptr[nodes[li]] + i]
        l_e = ell[li]
        high_pos = (v >> l_e) + i
        sample_at = i % SAMPLE_EVERY == 0
        words.index_add_(0, block[li][sample_at] + i[sample_at] // SAMPLE_EVERY,
                         high_pos[sample_at])
        has_low = l_e > 0
        add_bits(words, ((block[li] + samples[li]) * 32 + i * l_e)[has_low],
                 (v & ((torch.ones_like(l_e) << l_e) - 1))[has_low])
        bit = (block[li] + samples[li] + low[li]) * 32 + high_pos
        words.index_add_(0, bit >> 5, torch.ones_like(bit) << (bit & 31))
        if bar is not None:
            bar.update(int(e.numel()))
    if bar is not None:
        bar.close()
    return offsets, as_int32_words(words)


def _bar(total: int, show: bool) -> Any:
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="entry", unit_scale=True, desc="adjacency cache (Elias-Fano)")


def decode_list(words: Tensor, code: int, deg: int, num_nodes: int) -> Tensor:
    """The list stored at ``code`` (a per-node offset) of ``deg`` entries, int64 on the host:
    the twin of the kernel's reader (reads only the list's block)."""
    if deg == 0:
        return torch.empty(0, dtype=torch.int64)
    start, ell = code & OFFSET_MASK, code >> L_SHIFT
    _, samples, low, upper = (int(t) for t in block_words(torch.tensor([deg]), num_nodes))
    # the block and the word after it (the last low-bit window may reach into it)
    w = words[start:start + samples + low + upper + 1].cpu().to(torch.int64) & WORD_MASK
    up = w[samples + low:samples + low + upper]
    bits = (up.unsqueeze(1) >> torch.arange(32)) & 1
    high = torch.nonzero(bits.reshape(-1)).view(-1)[:deg] - torch.arange(deg)
    if ell == 0:
        return high
    return (high << ell) | read_bits(w[samples:], torch.arange(deg) * ell, ell)
