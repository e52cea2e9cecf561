"""GPU neighbour samplers: the CUDA kernel of ``quiver_serve/csrc/gpu_sampler.cu``, compiled and
launched by CuPy.

Same semantics and random numbers as :mod:`quiver_serve.sampling.reference` (docs/architecture.md,
"Sampling"), bit for bit.

* :class:`CudaSampler` (``name == "cuda"``) copies ``indptr``/``indices`` into GPU memory once.
* :class:`UvaSampler` (``name == "uva"``) leaves them in host memory, pinned in place
  (``cudaHostRegister``), and the kernel reads them over the bus: for graphs larger than the GPU.

A batch is ONE cooperative kernel launch (see the kernel's header for why) and one stream
synchronisation at the end, after which the host reads the per-hop counts that the kernel wrote
into pinned (mapped) host memory. Seeds and the kernel's parameter block are read by the kernel
straight from pinned host memory too, so a batch issues no copy operations at all. Outputs stay
on the GPU as views of one int64 buffer allocated by torch's caching allocator; ``edge_index`` is
contiguous. Tensors reach the kernel as raw device addresses (``data_ptr``): as zero-copy as
DLPack, without building a CuPy array per tensor and batch.

With an overlay set (:meth:`_GpuSampler.set_overlay`, docs/architecture.md, "The living graph") the
kernel reads each node's base list (from the CSC or the adjacency cache, as without one) followed by
its overlay tail, straight from the view's device tensors: the view is passed by pointer, never
copied.

CuPy is imported lazily, so this module imports on machines without CuPy or CUDA;
:func:`gpu_sampler_available` says whether the samplers can be built here.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.ops.cuda import PinnedRegion, StreamHandle
from quiver_serve.ops.nvrtc import compile_module
from quiver_serve.sampling.base import BaseSampler, SamplerOutput, seed_base, validate_seed

log = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "gpu_sampler.cu"
KERNEL_NAME = "sample_subgraph"

_STATUS_OK, _STATUS_OVERFLOW, _STATUS_BAD_SEED = 0, 1, 2
_STATUS_NOT_RUN = -1  # written by the host before each launch
_COUNTS_HEADER = 4  # status, need_n, need_e_hop, need_e_total; then per-hop counts
_STATE_EMPTY = 2**31 - 1
_MAX_INT32_POSITIONS = 2**31 - 1  # hop-local positions and local ids are int32 in the kernel

_NUM_PARAMS, _MAX_HOPS = 27, 32  # the kernel's parameter block (NUM_PARAMS, MAX_HOPS in the .cu)

#: A launcher takes (number of blocks, address of the parameter block, CUDA stream handle) and
#: launches the kernel asynchronously.
Launcher = Callable[[int, int, int], None]


@functools.cache
def gpu_sampler_available() -> bool:
    """True when CuPy imports and torch sees a CUDA device, i.e. the GPU samplers can run."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CuPy built for another CUDA that fails to load
        return False
    return True


# ---- kernel compilation and launch ---------------------------------------------------------------


class CupyLauncher:
    """Compiles the kernel for one CUDA device and launches it on torch's current stream."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self._cupy = cupy
        self.device = device
        with cupy.cuda.Device(device.index):
            kernel, self.compile_options = _compile_kernel(cupy, device)
            self._function = kernel.kernel  # the loaded cupy.cuda.function.Function
            #: threads per block = the kernel's __launch_bounds__
            self.threads = int(kernel.max_threads_per_block)
            self.binary_arch = int(kernel.binary_version)
            try:
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    self._function.ptr, self.threads, 0
                )
            except Exception:  # an older CuPy without the query: one block per SM always fits
                per_sm = 1
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        # The cooperative launch needs every block resident; more than two per SM only makes
        # the grid barrier slower.
        self.max_blocks = sm_count * max(1, min(int(per_sm), 2))
        self.cooperative = True

    def __call__(self, blocks: int, params_ptr: int, stream_ptr: int) -> None:
        stream = StreamHandle(stream_ptr)
        args = (params_ptr,)
        if self._cupy.cuda.runtime.getDevice() != self.device.index:
            with self._cupy.cuda.Device(self.device.index):
                self._function((blocks,), (self.threads,), args, 0, stream, self.cooperative)
        else:
            self._function((blocks,), (self.threads,), args, 0, stream, self.cooperative)


def _compile_kernel(cupy, device: torch.device):
    """The compiled kernel and the NVRTC options it took (``ops/nvrtc.py``)."""
    major, minor = torch.cuda.get_device_capability(device)
    module, options = compile_module(cupy, KERNEL_SOURCE.read_text(), major * 10 + minor)
    return module.get_function(KERNEL_NAME), options


@functools.cache
def _launcher_for(device_index: int) -> CupyLauncher:
    return CupyLauncher(torch.device("cuda", device_index))


# ---- buffers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Buffer capacities (upper bounds) and grid size for one batch."""

    n_cap: int  # rows of n_id
    e_cap: int  # edges over all hops
    e_hop_cap: int  # edges of the largest hop (and >= number of seeds)
    blocks: int

    def out_len(self, num_seeds: int) -> int:
        return self.n_cap + 2 * self.e_cap + num_seeds


def _grown(buf: Tensor | None, numel: int, make: Callable[[int], Tensor]) -> Tensor:
    """``buf`` when it holds ``numel`` elements, else a new one with 50% headroom."""
    if buf is not None and buf.numel() >= numel:
        return buf
    return make(max(numel, int(numel * 1.5), 1))


class _Workspace:
    """Per-sampler device scratch, reused by every batch (batches are serialised by a lock)."""

    def __init__(self, num_nodes: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.state = torch.full(
            (max(num_nodes, 1),), _STATE_EMPTY, dtype=torch.int32, device=device
        )
        self.barrier = torch.zeros(4, dtype=torch.int32, device=device)
        self.block_sums = torch.zeros(max_blocks, dtype=torch.int64, device=device)
        self.col_buf: Tensor | None = None
        self.front_off: Tensor | None = None
        # per frontier node (start, degree), or with an overlay (start, base count, tail start,
        # tail count)
        self.front_csc: Tensor | None = None
        self.rank_buf: Tensor | None = None
        # The kernel's parameters, in host memory it reads directly (pinned, hence mapped).
        self.params = torch.zeros(_NUM_PARAMS + _MAX_HOPS, dtype=torch.int64, pin_memory=pinned)
        self.params_view = self.params.numpy()
        self.host_counts = torch.empty(64, dtype=torch.int64, pin_memory=pinned)
        self.host_seeds: Tensor | None = None
        self.dev_seeds: Tensor | None = None

    def grow_state(self, num_nodes: int) -> None:
        """Room in ``state`` for node ids below ``num_nodes`` (between batches: every entry of
        the old array is back to empty, so a fresh one replaces it)."""
        if num_nodes > self.state.numel():
            self.state = torch.full((num_nodes,), _STATE_EMPTY, dtype=torch.int32,
                                    device=self.device)

    def ensure(self, plan: _Plan, csc_words: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Scratch grown to the plan: (col_buf, front_off, front_csc, rank_buf); ``csc_words``
        per frontier node in front_csc."""

        # zeros, not empty: uninitialised tails are never read, but keep them harmless anyway
        def zeros(n: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        self.col_buf = _grown(self.col_buf, plan.e_cap, zeros)
        self.front_off = _grown(self.front_off, plan.n_cap, zeros)
        self.front_csc = _grown(self.front_csc, csc_words * plan.n_cap,
                                lambda n: zeros(n, torch.int64))
        self.rank_buf = _grown(self.rank_buf, plan.e_hop_cap, zeros)
        return self.col_buf, self.front_off, self.front_csc, self.rank_buf

    def stage_seeds(self, seeds: Tensor) -> tuple[int, Tensor, Tensor]:
        """(pointer the kernel reads the request from, tensor that owns it, device seed scratch).

        CPU seeds are copied into pinned host memory, which the kernel reads directly (mapped):
        that replaces a separate host-to-device copy, one more operation per batch.
        """
        n = seeds.numel()
        self.dev_seeds = _grown(
            self.dev_seeds, n, lambda m: torch.empty(m, dtype=torch.int64, device=self.device)
        )
        if self.device.type == "cuda" and seeds.device.type == "cpu":
            self.host_seeds = _grown(
                self.host_seeds, n, lambda m: torch.empty(m, dtype=torch.int64, pin_memory=True)
            )
            request = self.host_seeds[:n]
            request.copy_(seeds)  # safe to reuse: the previous batch has finished (it synced)
        else:
            request = seeds.to(self.device, torch.int64).contiguous()
        return request.data_ptr(), request, self.dev_seeds

    def counts_buffer(self, numel: int) -> tuple[int, np.ndarray]:
        """Host memory the kernel writes the per-hop counts into (pinned, hence mapped): its
        address, and a NumPy view whose status word is poisoned until the kernel overwrites it."""
        pinned = self.device.type == "cuda"
        self.host_counts = _grown(
            self.host_counts, numel, lambda m: torch.empty(m, dtype=torch.int64, pin_memory=pinned)
        )
        view = self.host_counts.numpy()[:numel]
        view[0] = _STATUS_NOT_RUN
        return self.host_counts.data_ptr(), view


# ---- the samplers --------------------------------------------------------------------------------


class _GpuSampler(BaseSampler):
    """Shared body of the two modes; subclasses only decide where the CSC lives."""

    #: edges of upper-bound work per block when sizing the grid (the p50 moves by under 2%
    #: between 256 and 8192 at batches of 128 and 1024 seeds)
    items_per_block: int = 2048
    #: per-hop edge capacity tried first when the exact bound is larger (e.g. fanout -1);
    #: a batch that needs more is re-run once per hop with larger buffers, and the size sticks
    hop_edges_guess: int = 1 << 22

    def __init__(
        self,
        indptr: Tensor,
        indices: Tensor,
        device: torch.device | str | int | None,
        csc_pointers: tuple[int, int],
        launcher: Launcher | None = None,
    ) -> None:
        super().__init__(indptr, indices)
        self.device = _as_device(device)
        if self.num_nodes >= _MAX_INT32_POSITIONS:
            raise ValueError(f"{self.num_nodes} nodes: the GPU sampler keeps local ids in int32")
        self._indptr_ptr, self._indices_ptr = csc_pointers
        #: adjacency cache (UVA): per-node offsets into a GPU copy of the hottest lists; 0 = none
        self._cache_off_ptr, self._cache_indices_ptr = getattr(self, "_cache_pointers", (0, 0))
        #: bits per cached entry (64: int64 entries; 1-32: bit-packed int32 words)
        self._cache_bits = getattr(self, "_cache_bits", 64)
        self._num_edges = int(indices.numel())
        degree = indptr[1:] - indptr[:-1]
        self._max_degree = int(degree.max()) if degree.numel() else 0
        self._launcher = launcher if launcher is not None else _launcher_for(self.device.index)
        max_blocks = getattr(self._launcher, "max_blocks", 1)
        self._max_blocks = max_blocks
        self._work = _Workspace(self.num_nodes, max_blocks, self.device)
        self._lock = threading.Lock()
        self._plans: dict[tuple, _Plan] = {}
        #: the overlay's (start, length, tail) device addresses; 0s: no overlay
        self._overlay_ptrs = (0, 0, 0)

    @property
    def overlay_device(self) -> torch.device:
        return self.device

    def set_overlay(self, view: OverlayView | None) -> None:
        """See :meth:`BaseSampler.set_overlay`; the view's tensors must be on ``self.device``.

        Costs nothing per batch beyond reading the view: its addresses are taken here, and the
        per-node scratch grows here (once) to the view's node capacity."""
        if view is not None and view.node_capacity >= _MAX_INT32_POSITIONS:
            raise ValueError(f"overlay of {view.node_capacity} nodes: the GPU sampler keeps "
                             "local ids in int32")
        with self._lock:  # not while a batch reads the old view
            super().set_overlay(view)
            if view is None or view.node_capacity == 0:
                self._overlay_ptrs = (0, 0, 0)
                return
            self._work.grow_state(view.node_capacity)
            self._overlay_ptrs = (view.start.data_ptr(), view.length.data_ptr(),
                                  view.tail.data_ptr())

    def plan(self, num_seeds: int, fanouts: list[int]) -> _Plan:
        """Capacities from per-hop upper bounds; a hop's bound above the guess uses the guess."""
        view = self.overlay
        # With an overlay, a list may be as long as its base list plus every tail entry, and
        # the nodes grow: the bounds take the view's sizes (read per call, as they change).
        shape = (view.num_nodes, view.tail.numel()) if view is not None else None
        key = (num_seeds, tuple(fanouts), self.hop_edges_guess, shape)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:  # many distinct batch sizes: keep the cache bounded
                self._plans.clear()
            plan = self._plans[key] = self._make_plan(num_seeds, fanouts, shape)
        return plan

    def _make_plan(self, num_seeds: int, fanouts: list[int],
                   overlay_shape: tuple[int, int] | None = None) -> _Plan:
        num_nodes, max_degree, num_edges = self.num_nodes, self._max_degree, self._num_edges
        if overlay_shape is not None:
            num_nodes, tail_entries = overlay_shape
            max_degree += tail_entries
            num_edges += tail_entries
        frontier = num_seeds
        n_bound, e_total, e_hop_max, e_hop_bound_max = num_seeds, 0, num_seeds, num_seeds
        for k in fanouts:
            per_node = max_degree if k < 0 else min(k, max_degree)
            bound = min(frontier * per_node, num_edges)
            e_hop = min(bound, self.hop_edges_guess, _MAX_INT32_POSITIONS)
            e_total += e_hop
            e_hop_max = max(e_hop_max, e_hop)
            e_hop_bound_max = max(e_hop_bound_max, bound)
            frontier = min(bound, num_nodes)
            n_bound = min(n_bound + e_hop, num_nodes)
        blocks = min(self._max_blocks, max(1, math.ceil(e_hop_bound_max / self.items_per_block)))
        return _Plan(
            n_cap=max(n_bound, 1), e_cap=max(e_total, 1), e_hop_cap=max(e_hop_max, 1), blocks=blocks
        )

    def sample(self, seeds: Tensor, fanouts: list[int], seed: int) -> SamplerOutput:
        base = seed_base(validate_seed(seed))
        if len(fanouts) > _MAX_HOPS:
            raise ValueError(f"at most {_MAX_HOPS} hops, got {len(fanouts)}")
        seeds = seeds.reshape(-1)
        if seeds.numel() == 0:
            return self._empty_output(len(fanouts))
        with self._lock:
            num_nodes = self.num_nodes  # one value for the whole batch
            if num_nodes > self._work.state.numel():
                raise ValueError(f"the overlay has {num_nodes} nodes, more than the node "
                                 f"capacity {self._work.state.numel()} it was set with")
            request_ptr, _request, dev_seeds = self._work.stage_seeds(seeds)
            for _attempt in range(len(fanouts) + 2):
                plan = self.plan(seeds.numel(), fanouts)
                out, counts = self._launch(
                    request_ptr, dev_seeds, seeds.numel(), fanouts, base, plan, num_nodes
                )
                if counts[0] == _STATUS_OK:
                    return _outputs(out, counts, plan, seeds.numel(), len(fanouts))
                if counts[0] == _STATUS_BAD_SEED:
                    raise IndexError(f"seed node ids must be in [0, {num_nodes})")
                if counts[0] != _STATUS_OVERFLOW:
                    raise RuntimeError(f"GPU sampler kernel did not finish (status {counts[0]})")
                # Overflow: only a hop whose bound exceeded the guess can get here.
                self.hop_edges_guess = max(2 * self.hop_edges_guess, counts[3], counts[1])
        raise RuntimeError(f"GPU sampler buffers still too small after {len(fanouts) + 2} attempts")

    def _launch(
        self, request_ptr: int, dev_seeds: Tensor, num_seeds: int, fanouts: list[int], base: int,
        plan: _Plan, num_nodes: int,
    ) -> tuple[Tensor, list[int]]:  # fmt: skip
        work = self._work
        ov_start, ov_length, ov_tail = self._overlay_ptrs
        col_buf, front_off, front_csc, rank_buf = work.ensure(plan, 4 if ov_start else 2)
        out = torch.empty(plan.out_len(num_seeds), dtype=torch.int64, device=self.device)
        counts_ptr, counts = work.counts_buffer(_COUNTS_HEADER + 2 * len(fanouts) + 1)
        params = work.params_view  # order: the kernel's parameter block
        params[:_NUM_PARAMS] = (
            self._indptr_ptr, self._indices_ptr, num_nodes, work.state.data_ptr(),
            request_ptr, dev_seeds.data_ptr(), num_seeds, len(fanouts), base,
            out.data_ptr(), plan.n_cap, plan.e_cap, plan.e_hop_cap, counts_ptr,
            col_buf.data_ptr(), front_off.data_ptr(), front_csc.data_ptr(), rank_buf.data_ptr(),
            work.block_sums.data_ptr(), work.barrier.data_ptr(),
            self._cache_off_ptr, self._cache_indices_ptr, self._cache_bits,
            ov_start, ov_length, ov_tail, self.indptr.numel() - 1,
        )  # fmt: skip
        params[_NUM_PARAMS : _NUM_PARAMS + len(fanouts)] = fanouts
        # The block is reused by the next batch only after this one's final sync.
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            self._launcher(plan.blocks, work.params.data_ptr(), stream.cuda_stream)
            stream.synchronize()  # the batch's one host synchronisation
        else:  # emulated launches run synchronously
            self._launcher(plan.blocks, work.params.data_ptr(), 0)
        return out, counts.tolist()

    def _empty_output(self, num_hops: int) -> SamplerOutput:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        edge_index = torch.empty((2, 0), dtype=torch.int64, device=self.device)
        return SamplerOutput(empty, edge_index, empty.clone(), [0] * (num_hops + 1), [0] * num_hops)


def _outputs(
    out: Tensor, counts: list[int], plan: _Plan, num_seeds: int, num_hops: int
) -> SamplerOutput:
    """Views of the batch's output buffer (no copies)."""
    num_nodes = counts[_COUNTS_HEADER : _COUNTS_HEADER + num_hops + 1]
    num_edges = counts[_COUNTS_HEADER + num_hops + 1 : _COUNTS_HEADER + 2 * num_hops + 1]
    total_nodes, total_edges = sum(num_nodes), sum(num_edges)
    edges_at = plan.n_cap
    seeds_at = edges_at + 2 * plan.e_cap
    return SamplerOutput(
        n_id=out[:total_nodes],
        edge_index=out[edges_at : edges_at + 2 * total_edges].view(2, total_edges),
        seed_index=out[seeds_at : seeds_at + num_seeds],
        num_sampled_nodes=num_nodes,
        num_sampled_edges=num_edges,
    )


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class CudaSampler(_GpuSampler):
    """GPU sampler with the CSC copied into GPU memory once (fastest; needs the graph to fit)."""

    name = "cuda"
    uses_uva = False

    def __init__(
        self, indptr: Tensor, indices: Tensor, device: torch.device | str | int | None = None,
        launcher: Launcher | None = None,
    ) -> None:  # fmt: skip
        target = _as_device(device)
        self.indptr_device = indptr.to(target, torch.int64).contiguous()
        self.indices_device = indices.to(target, torch.int64).contiguous()
        if self.indices_device.numel() == 0:  # keep a valid pointer for an edgeless graph
            self.indices_device = torch.zeros(1, dtype=torch.int64, device=target)
        pointers = (self.indptr_device.data_ptr(), self.indices_device.data_ptr())
        super().__init__(indptr, indices, target, pointers, launcher)


class UvaSampler(_GpuSampler):
    """GPU sampler over a CSC left in host memory (pinned in place, read over the bus by the kernel).

    ``indptr``/``indices`` must be CPU tensors; shared-memory tensors are pinned where they are,
    so CPU sampler workers and this GPU sampler read the same single copy. Call :meth:`close`
    (or drop the sampler) to unpin.

    ``adjacency_cache`` (``sampling/graph_cache/adjacency.py``): indptr and the hottest nodes' neighbour
    lists (bit-packed, or int64) in GPU memory; the kernel reads a cached list there and the
    rest over the bus, and samples exactly what it samples without the cache.
    """

    name = "uva"
    uses_uva = True

    def __init__(
        self, indptr: Tensor, indices: Tensor, device: torch.device | str | int | None = None,
        launcher: Launcher | None = None, adjacency_cache: Any = None,
    ) -> None:  # fmt: skip
        if indptr.device.type != "cpu" or indices.device.type != "cpu":
            raise ValueError("UvaSampler needs the CSC in CPU memory")
        target = _as_device(device)
        self._regions: list[PinnedRegion] = []
        host = [t.to(torch.int64).contiguous() for t in (indptr, indices)]  # no copy if already so
        if host[1].numel() == 0:  # keep a valid pointer for an edgeless graph
            host[1] = torch.zeros(1, dtype=torch.int64)
        if target.type == "cuda":
            self._regions = [PinnedRegion(t, target) for t in host]
            pointers = (self._regions[0].device_ptr, self._regions[1].device_ptr)
        else:  # emulated launches read host memory directly
            pointers = (host[0].data_ptr(), host[1].data_ptr())
        self.adjacency_cache = adjacency_cache
        if adjacency_cache is not None:
            pointers = (adjacency_cache.indptr.data_ptr(), pointers[1])
            self._cache_pointers = (adjacency_cache.offsets.data_ptr(),
                                    adjacency_cache.indices.data_ptr())
            self._cache_bits = adjacency_cache.index_bits
        self._host_csc = host
        super().__init__(indptr, indices, target, pointers, launcher)

    def close(self) -> None:
        """Unpin the CSC; the sampler must not be used afterwards."""
        for region in self._regions:
            region.release()
        self._regions = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CuPy may already be gone
            pass
