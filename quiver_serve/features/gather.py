"""The feature-store gather on a GPU: ``quiver_serve/csrc/feature_gather.cu`` compiled and launched
by CuPy.

One launch per batch, on torch's current stream, with a grid that depends on the number of rows
only, so it can be captured inside the CUDA graphs of ``models/graphed.py``. The pure-torch twin
is :meth:`FeatureStore.gather_torch` (the reference in tests, and the path on a CPU-only box).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from quiver_serve.ops.cuda import StreamHandle
from quiver_serve.ops.nvrtc import compile_module

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "feature_gather.cu"
THREADS = 256
WARPS_PER_BLOCK = THREADS // 32
#: word sizes the kernel copies rows in, widest first
WORD_BYTES = (16, 8, 4, 2)


def word_bytes(row_bytes: int, pointers: list[int]) -> int:
    """The widest word that divides the row and aligns every base address."""
    for w in WORD_BYTES:
        if row_bytes % w == 0 and all(p % w == 0 for p in pointers):
            return w
    raise ValueError(f"rows of {row_bytes} bytes cannot be gathered in 2-byte words or wider")


class GatherKernel:
    """The compiled gather for one device; ``launch`` queues it on the current stream."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._handle = StreamHandle
        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            module, _ = compile_module(cupy, KERNEL_SOURCE.read_text(), major * 10 + minor)
            # the loaded cupy.cuda.function.Function (takes shared memory and a stream handle)
            self._functions = {w: module.get_function(f"gather_w{w}").kernel for w in WORD_BYTES}
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_blocks = sm_count * 16

    def launch(self, n_id: Tensor, table: Tensor, out: Tensor, counts: Tensor,
               word: int) -> None:
        """``out[i] = row of n_id[i]`` (``out`` contiguous, rows of ``word``-byte words)."""
        n = int(n_id.numel())
        if n == 0:
            return
        words = out.size(1) * out.element_size() // word
        blocks = min(self.max_blocks, -(-n // WARPS_PER_BLOCK))
        stream = self._handle(torch.cuda.current_stream(self.device).cuda_stream)
        args = (n_id.data_ptr(), n, table.data_ptr(), words, out.data_ptr(), counts.data_ptr())
        self._functions[word]((blocks,), (THREADS,), args, 0, stream)


@functools.cache
def kernel_for(device_index: int) -> GatherKernel:
    return GatherKernel(torch.device("cuda", device_index))


def enable_peer_access(device: torch.device, peers: list[torch.device]) -> None:
    """Let kernels on ``device`` read the memory of ``peers`` directly (already on: fine)."""
    import cupy

    with cupy.cuda.Device(device.index):
        for p in peers:
            if p.index == device.index:
                continue
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(p.index)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise
