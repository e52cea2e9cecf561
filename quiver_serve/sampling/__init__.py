"""Neighbour samplers: one semantics (see ``base``), several implementations.

``reference`` (pure torch, always available), ``cpp`` (compiled CPU extension from
``quiver_serve/csrc/``), ``cuda`` (CuPy kernels, CSC in device memory) and ``uva`` (CuPy kernels,
CSC in pinned host memory).
Each samples the base CSC alone, or with ``set_overlay(view)`` the living graph: the base plus the
overlay of updates since it (``graph/overlay_view.py``, docs/architecture.md, "The living graph"),
with the same semantics.
"""

from __future__ import annotations

import logging

from torch import Tensor

from quiver_serve.sampling.base import BaseSampler, SamplerOutput
from quiver_serve.sampling.reference import ReferenceSampler

log = logging.getLogger(__name__)

__all__ = ["BaseSampler", "SamplerOutput", "ReferenceSampler", "make_cpu_sampler"]


def make_cpu_sampler(indptr: Tensor, indices: Tensor, implementation: str = "auto") -> BaseSampler:
    """The CPU sampler a config asks for: ``cpp`` when it builds (``auto``), else ``reference``."""
    if implementation in ("auto", "cpp"):
        try:
            from quiver_serve.sampling.cpu import CppSampler, cpp_sampler_available

            if cpp_sampler_available():
                return CppSampler(indptr, indices)
            if implementation == "cpp":
                raise RuntimeError("sampling.implementation=cpp but the C++ sampler could not be built")
        except ImportError:
            if implementation == "cpp":
                raise
        log.info("C++ sampler unavailable; using the pure-torch reference sampler")
    return ReferenceSampler(indptr, indices)
