"""The typed sampler on a GPU (docs/architecture.md, "Typed graphs"; decision 0050).

``TypedGpuSampler`` is ``TypedReferenceSampler`` with each (relation, hop) drawn by the CUDA
kernels of ``csrc/typed_hop.cu`` (compiled by NVRTC through CuPy) instead of the reference's
dozen small torch kernels: one kernel counts the reads of every frontier node, torch scans the
counts, and one kernel writes the neighbours' ids and edge ids, warp per frontier node, with
Floyd's draws on the relation's salted base. The bookkeeping between hops (new nodes per type in
order of first occurrence) stays in torch on the GPU. Bit for bit the reference's output.

Where the relations are: ``"device"`` (copied into GPU memory once) or ``"uva"`` (left in host
memory, pinned in place and read by the kernels over the bus), as the homogeneous GPU sampler
(``sampling/gpu.py``). ``kernels=False`` runs the reference's torch code on the device instead
(the twin, and the path when the kernels do not compile); ``TypedGpuSampler.kernels`` says
which is in use.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.typed import Relation, TypedGraph
from quiver_serve.sampling.typed import TypedReferenceSampler

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "typed_hop.cu"
THREADS_PER_BLOCK = 256
#: frontier nodes per block of the draw kernel (one warp each)
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
MAX_BLOCKS = 65535
GPU_MODES = ("device", "uva")


class TypedHopKernels:
    """The two kernels of ``csrc/typed_hop.cu`` compiled for one device; launched on torch's
    current stream."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        from quiver_serve.ops.nvrtc import compile_module

        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            module, _ = compile_module(cupy, KERNEL_SOURCE.read_text(), major * 10 + minor)
            self._count = module.get_function("typed_hop_count").kernel
            self._draw = module.get_function("typed_hop_draw").kernel

    def _launch(self, function, blocks: int, args: tuple[int, ...]) -> None:
        from quiver_serve.ops.cuda import StreamHandle

        stream = StreamHandle(torch.cuda.current_stream(self.device).cuda_stream)
        function((max(1, blocks),), (THREADS_PER_BLOCK,), tuple(np.int64(a) for a in args), 0,
                 stream, False)

    def count(self, indptr_addr: int, frontier: Tensor, k: int, out: Tensor) -> None:
        n = frontier.numel()
        blocks = min(MAX_BLOCKS, -(-n // THREADS_PER_BLOCK))
        self._launch(self._count, blocks, (indptr_addr, frontier.data_ptr(), n, k,
                                           out.data_ptr()))

    def draw(self, csc_addrs: tuple[int, int, int], frontier: Tensor, k: int, base: int,
             hop: int, offset: Tensor, nbr: Tensor, eid: Tensor) -> None:
        n = frontier.numel()
        blocks = min(MAX_BLOCKS, -(-n // WARPS_PER_BLOCK))
        self._launch(self._draw, blocks, (*csc_addrs, frontier.data_ptr(), n, k, base, hop,
                                          offset.data_ptr(), nbr.data_ptr(), eid.data_ptr()))


@functools.cache
def kernels_for(device_index: int) -> TypedHopKernels:
    return TypedHopKernels(torch.device("cuda", device_index))


class TypedGpuSampler(TypedReferenceSampler):
    """See the module docstring. ``graph``: the typed graph with its relations on the CPU."""

    name = "typed_gpu"

    def __init__(self, graph: TypedGraph, device: torch.device, mode: str = "device",
                 kernels: bool = True, hop_kernels: Any = None) -> None:
        """``hop_kernels``: launches ``count`` and ``draw`` as ``TypedHopKernels`` does, used
        instead of the compiled kernels (the kernels' source built for the CPU, in tests)."""
        if mode not in GPU_MODES:
            raise ValueError(f"typed GPU sampler mode must be one of {GPU_MODES}, got {mode!r}")
        if mode == "uva" and (device.type != "cuda" or not kernels) and hop_kernels is None:
            raise ValueError("the typed GPU sampler reads host-memory relations (uva) only "
                             "through its kernels on a CUDA device")
        self.mode, self._regions = mode, []
        placed = graph.to(device) if mode == "device" else graph
        super().__init__(placed)
        self.device = device
        #: the relations' (indptr, indices, edge_id or 0) addresses the kernels read
        self._addrs: list[tuple[int, int, int]] = []
        self.kernels: Any = hop_kernels
        if self.kernels is None and kernels and device.type == "cuda":
            self.kernels = kernels_for(device.index)
        if self.kernels is not None:
            self._addrs = [self._addresses(rel) for rel in placed.relations.values()]

    def _addresses(self, rel: Relation) -> tuple[int, int, int]:
        tensors = [rel.indptr, rel.indices, rel.edge_id]
        if self.mode == "uva" and self.device.type == "cuda":
            from quiver_serve.ops.cuda import PinnedRegion

            out = []
            for t in tensors:
                if t is None or t.numel() == 0:
                    out.append(0)
                    continue
                region = PinnedRegion(t.contiguous(), self.device)
                self._regions.append(region)
                out.append(region.device_ptr)
            return out[0], out[1], out[2]
        for label, t in zip(("indptr", "indices", "edge_id"), tensors, strict=True):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"relation {list(rel.edge_type)}: {label} must be contiguous "
                                 "(the kernels read it in place)")
        return tuple(0 if t is None or t.numel() == 0 else t.data_ptr()  # type: ignore[return-value]
                     for t in tensors)

    def hop_edges(self, number: int, rel: Relation, frontier: Tensor, k: int, hop: int,
                  base: int) -> tuple[Tensor, Tensor, Tensor]:
        if self.kernels is None:
            return super().hop_edges(number, rel, frontier, k, hop, base)
        frontier = frontier.contiguous()
        n, dev = frontier.numel(), self.device
        count = torch.empty(n, dtype=torch.int64, device=dev)
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return empty, empty.clone(), count
        addrs = self._addrs[number]
        self.kernels.count(addrs[0], frontier, k, count)
        end = torch.cumsum(count, 0)
        total = int(end[-1])  # the hop's one host synchronisation (the output's size)
        nbr = torch.empty(total, dtype=torch.int64, device=dev)
        eid = torch.empty(total, dtype=torch.int64, device=dev)
        if total:
            self.kernels.draw(addrs, frontier, k, base, hop, end - count, nbr, eid)
        return nbr, eid, count

    def close(self) -> None:
        """Unpin host-memory relations (uva); the sampler must not be used afterwards."""
        for region in self._regions:
            region.release()
        self._regions = []


def typed_gpu_mode(graph: TypedGraph, device: torch.device, setting: str) -> str:
    """``sampling.gpu_mode`` for a typed graph: ``device`` when its relations take under half
    the GPU's free memory (``auto``), else ``uva``."""
    if setting != "auto":
        return setting
    csc_bytes = sum((rel.indptr.numel() + 2 * rel.indices.numel()) * 8
                    for rel in graph.relations.values())
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return "device" if csc_bytes < free_bytes // 2 else "uva"
