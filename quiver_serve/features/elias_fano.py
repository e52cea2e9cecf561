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

#: the per-node offset's bits for the list's low-bit width
L_SHIFT = 58
OFFSET_MASK = (1 << L_SHIFT) - 1
SAMPLE_EVERY = 64
#: the kernel holds a list's length in 27 bits: longer lists stay out of this layout
MAX_DEG = 1 << 27
ENTRIES_PER_CHUNK = 1 << 23
_WORD_MASK = 0xFFFFFFFF


def low_bits(deg: Tensor, num_nodes: int) -> Tensor:
    """``l`` per list: ``floor(log2(U // d))`` (0 when ``d >= U``); int64."""
    ratio = torch.div(num_nodes, deg.clamp(min=1), rounding_mode="floor").clamp(min=1)
    return torch.floor(torch.log2(ratio.to(torch.float64))).to(torch.int64)


def block_words(deg: Tensor, num_nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per list: (sample words, low-bit words, upper words) of its block (int64)."""
    deg = deg.to(torch.int64)
    ell = low_bits(deg, num_nodes)
    samples = (deg + SAMPLE_EVERY - 1) // SAMPLE_EVERY
    low = (deg * ell + 31) // 32
    upper = (deg + (num_nodes >> ell) + 31) // 32
    return samples, low, upper


def list_bits(deg: Tensor, num_nodes: int) -> Tensor:
    """Bits one list's block takes (0 for an empty list)."""
    samples, low, upper = block_words(deg, num_nodes)
    return torch.where(deg > 0, 32 * (samples + low + upper), torch.zeros_like(deg))


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
            pos = torch.repeat_interleave(indptr[part] - first, part_sizes, output_size=total) \
                + torch.arange(total)
            values = indices[pos]
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
    samples, low, upper = block_words(deg, num_nodes)
    ell = low_bits(deg, num_nodes)
    size = torch.where(deg > 0, samples + low + upper, torch.zeros_like(deg))
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
        _add_bits(words, (block[li] + samples[li]) * 32 + i * l_e,
                  v & ((torch.ones_like(l_e) << l_e) - 1), l_e)
        bit = (block[li] + samples[li] + low[li]) * 32 + high_pos
        words.index_add_(0, bit >> 5, torch.ones_like(bit) << (bit & 31))
        if bar is not None:
            bar.update(int(e.numel()))
    if bar is not None:
        bar.close()
    return offsets, torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bar(total: int, show: bool) -> Any:
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="entry", unit_scale=True, desc="adjacency cache (Elias-Fano)")


def _add_bits(words: Tensor, bit: Tensor, value: Tensor, width: Tensor) -> None:
    """OR ``value`` (``width`` bits, < 32) in at bit ``bit`` of the little-endian words."""
    keep = width > 0
    bit, value = bit[keep], value[keep]
    word, shift = bit >> 5, bit & 31
    words.index_add_(0, word, (value << shift) & _WORD_MASK)
    words.index_add_(0, word + 1, value >> (32 - shift))


def decode_list(words: Tensor, code: int, deg: int, num_nodes: int) -> Tensor:
    """The list stored at ``code`` (a per-node offset) of ``deg`` entries, int64: the twin of
    the kernel's reader."""
    if deg == 0:
        return torch.empty(0, dtype=torch.int64)
    start, ell = code & OFFSET_MASK, code >> L_SHIFT
    samples, low, upper = (int(t) for t in block_words(torch.tensor([deg]), num_nodes))
    w = words.to(torch.int64) & _WORD_MASK
    up = w[start + samples + low:start + samples + low + upper]
    bits = (up.unsqueeze(1) >> torch.arange(32)) & 1
    ones = torch.nonzero(bits.reshape(-1)).view(-1)[:deg]
    high = ones - torch.arange(deg)
    if ell == 0:
        return high
    pos = torch.arange(deg) * ell
    lw = w[start + samples:start + samples + low + 1]
    window = lw[pos >> 5] | (lw[(pos >> 5) + 1] << 32)
    return (high << ell) | ((window >> (pos & 31)) & ((1 << ell) - 1))
