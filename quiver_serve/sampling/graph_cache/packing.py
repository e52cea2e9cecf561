"""Bit-level helpers shared by the adjacency cache's layouts (``adjacency.py``, ``elias_fano.py``):
little-endian 32-bit words built as int64 on the host (disjoint bits, so adding is OR-ing),
handed to the GPU as int32, and read back as a 64-bit window of a word and the next (what the
kernel's ``ListReader`` does)."""

from __future__ import annotations

import torch
from torch import Tensor

WORD_MASK = 0xFFFFFFFF


def entry_positions(indptr: Tensor, nodes: Tensor, sizes: Tensor) -> Tensor:
    """CSC positions of the entries of ``nodes``' lists (``sizes`` their lengths), list after
    list."""
    total = int(sizes.sum())
    first = torch.cumsum(sizes, 0) - sizes
    return torch.repeat_interleave(indptr[nodes] - first, sizes, output_size=total) \
        + torch.arange(total)


def add_bits(words: Tensor, bit: Tensor, value: Tensor) -> None:
    """Add ``value`` (< 2^32, no wider than the room it is given) at bit ``bit`` of ``words``:
    its low part into its word, the rest (if any) into the next."""
    word, shift = bit >> 5, bit & 31
    words.index_add_(0, word, (value << shift) & WORD_MASK)
    words.index_add_(0, word + 1, value >> (32 - shift))


def as_int32_words(words: Tensor) -> Tensor:
    """int64 values in [0, 2^32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def read_bits(words: Tensor, bit: Tensor, width: int) -> Tensor:
    """``width``-bit fields at ``bit`` of int32 (or int64) words, int64 (the kernel's read)."""
    word, shift = bit >> 5, bit & 31
    lo = words[word].to(torch.int64) & WORD_MASK
    hi = words[word + 1].to(torch.int64) & WORD_MASK
    return ((lo | (hi << 32)) >> shift) & ((1 << width) - 1)
