"""The typed sampler on a GPU (docs/architecture.md, "Typed graphs"; decisions 0050, 0062).

``TypedGpuSampler`` is ``TypedReferenceSampler`` with each batch drawn by the CUDA kernels of
``csrc/typed_hop.cu`` (compiled by NVRTC through CuPy; ``sampling/typed_gpu_batch.py`` drives
them): a hop of every relation is a fixed handful of launches and one host synchronisation,
duplicates found through a per-node state array as in the homogeneous GPU sampler. Bit for bit
the reference's output.

Where the relations are: ``"device"`` (copied into GPU memory once) or ``"uva"`` (left in host
memory, pinned in place and read by the kernels over the bus), as the homogeneous GPU sampler
(``sampling/gpu.py``). ``kernels=False`` runs the reference's torch code on the device instead
(the twin, and the path when the kernels do not compile); ``TypedGpuSampler.kernels`` says
which is in use.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.typed import Relation, TypedGraph
from quiver_serve.sampling.base import check_seed_range
from quiver_serve.sampling.typed import (
    TypedFanouts,
    TypedReferenceSampler,
    TypedSamplerOutput,
    typed_fanouts,
)
from quiver_serve.sampling.typed_gpu_batch import TypedKernelBatch

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "typed_hop.cu"
THREADS_PER_BLOCK = 256
#: frontier nodes per block of the draw kernel (one warp each)
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
MAX_BLOCKS = 65535
GPU_MODES = ("device", "uva")


class TypedHopKernels:
    """The kernels of ``csrc/typed_hop.cu`` compiled for one device; ``launch`` runs one on
    torch's current stream with enough threads for ``items`` (a warp per item for
    ``typed_draw``)."""

    NAMES = ("typed_count", "typed_draw", "typed_propose", "typed_mark", "typed_assign",
             "typed_relabel", "typed_reset", "typed_gather_segments", "typed_claim")
    #: kernels that give each item a warp
    PER_WARP = frozenset({"typed_draw"})

    def __init__(self, device: torch.device) -> None:
        import cupy

        from quiver_serve.ops.nvrtc import compile_module

        self.device = device
        major, minor = torch.cuda.get_device_capability(device)
        with cupy.cuda.Device(device.index):
            module, _ = compile_module(cupy, KERNEL_SOURCE.read_text(), major * 10 + minor)
            self._functions = {name: module.get_function(name).kernel for name in self.NAMES}

    def launch(self, name: str, items: int, args: tuple[int, ...]) -> None:
        from quiver_serve.ops.cuda import StreamHandle

        per_block = WARPS_PER_BLOCK if name in self.PER_WARP else THREADS_PER_BLOCK
        blocks = min(MAX_BLOCKS, max(1, -(-items // per_block)))
        stream = StreamHandle(torch.cuda.current_stream(self.device).cuda_stream)
        self._functions[name]((blocks,), (THREADS_PER_BLOCK,), tuple(np.int64(a) for a in args),
                              0, stream, False)


@functools.cache
def kernels_for(device_index: int) -> TypedHopKernels:
    return TypedHopKernels(torch.device("cuda", device_index))


class TypedGpuSampler(TypedReferenceSampler):
    """See the module docstring. ``graph``: the typed graph with its relations on the CPU."""

    name = "typed_gpu"

    def __init__(self, graph: TypedGraph, device: torch.device, mode: str = "device",
                 kernels: bool = True, hop_kernels: Any = None) -> None:
        """``hop_kernels``: launches the kernels as ``TypedHopKernels`` does, used instead of
        the compiled ones (the kernels' source built for the CPU, in tests)."""
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
        self._lock = threading.Lock()
        if self.kernels is not None:
            self._addrs = [self._addresses(rel) for rel in placed.relations.values()]
            self._batch = TypedKernelBatch(placed, device, self.kernels, self._addrs)

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

    def sample(self, seed_type: str, seeds: Tensor, fanouts: TypedFanouts,
               seed: int) -> TypedSamplerOutput:
        if self.kernels is None:
            return super().sample(seed_type, seeds, fanouts, seed)
        graph = self.graph
        graph.check_node_type(seed_type)
        per_rel = typed_fanouts(graph, fanouts)
        num_layers = len(next(iter(per_rel.values()), []))
        # seeds in host memory stay there: the batch de-duplicates them without a sync
        seeds = seeds.to(dtype=torch.int64).contiguous()
        check_seed_range(seeds, graph.num_nodes[seed_type])
        with self._lock:
            st, seed_index, num_nodes, num_edges = self._batch.sample(
                seed_type, seeds, per_rel, num_layers, seed)
            node, edge_index, e_id = self._batch.assemble(st)
        return TypedSamplerOutput(seed_type, node, edge_index, e_id, seed_index, num_nodes,
                                  num_edges)

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
