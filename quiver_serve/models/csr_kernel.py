"""The sampled layers' neighbour aggregation on a GPU: ``quiver_serve/csrc/csr_aggregate.cu`` by CuPy.

``out[v] = sum (or mean) of dense[col[e]]`` over the in-edges ``e`` of each target ``v`` of one
layer, in one launch on torch's current stream. It replaces the per-edge weights, the CSR tensor
and cuSPARSE's set-up of :func:`quiver_serve.models.fast.aggregate`, which cost a sampled batch
more host time than GPU time. fp32 only; the torch path (``aggregate``) is its twin and the
reference in tests, and serves exact mode (unbounded in-degrees), other precisions and machines
without CuPy.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from quiver_serve.ops.cuda import StreamHandle
from quiver_serve.ops.nvrtc import compile_module

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "csr_aggregate.cu"
THREADS = 256
WARPS_PER_BLOCK = THREADS // 32


class CsrAggregate:
    """The compiled aggregation for one device; calls queue it on the current stream."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            module, _ = compile_module(cupy, KERNEL_SOURCE.read_text(), major * 10 + minor)
            self._functions = {torch.int32: module.get_function("csr_aggregate_i32").kernel,
                               torch.int64: module.get_function("csr_aggregate_i64").kernel}
        self.max_blocks = torch.cuda.get_device_properties(device).multi_processor_count * 16

    def __call__(self, rowptr: Tensor, col: Tensor, dense: Tensor, num_dst: int,
                 mean: bool) -> Tensor:
        """float32 [num_dst, dim]: row ``v`` sums (``mean``: averages) the ``dense`` rows of
        ``col[rowptr[v]:rowptr[v + 1]]``; ``rowptr`` and ``col`` of one integer type."""
        dense = dense.contiguous()
        dim = int(dense.size(1))
        out = torch.empty((num_dst, dim), dtype=torch.float32, device=dense.device)
        if num_dst == 0 or dim == 0:
            return out
        blocks = min(self.max_blocks, -(-num_dst // WARPS_PER_BLOCK))
        stream = StreamHandle(torch.cuda.current_stream(self.device).cuda_stream)
        args = (rowptr.data_ptr(), col.data_ptr(), dense.data_ptr(), dim, out.data_ptr(),
                num_dst, int(mean))
        self._functions[rowptr.dtype]((blocks,), (THREADS,), args, 0, stream)
        return out


@functools.cache
def kernel_for(device_index: int) -> CsrAggregate | None:
    """The aggregation for a GPU, or None (logged once) where CuPy cannot build it."""
    try:
        return CsrAggregate(torch.device("cuda", device_index))
    except Exception as exc:  # noqa: BLE001 - no CuPy / NVRTC here: the torch path serves
        log.info("CSR aggregation kernel unavailable on cuda:%d (%s); torch's path serves",
                 device_index, exc)
        return None
