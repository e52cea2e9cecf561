"""CUDA runtime helpers (CuPy): a torch stream as CuPy's launch wants it, and host memory pinned in
place and mapped into a GPU's address space (shared by every sampler and feature shard of a
process that reads the same host range)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class StreamHandle:
    """A torch stream for CuPy's launch, which reads only the handle (``.ptr``) of its stream;
    cheaper per batch than ``cupy.cuda.ExternalStream`` (deprecated in CuPy 14)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


# Host ranges this process pinned, by address: [number of regions using it, whether we registered
# it]. Several samplers may share one shared-memory CSC; only the last one to go unpins it.
_pinned_ranges: dict[int, list] = {}
_pinned_lock = threading.Lock()


class PinnedRegion:
    """A CPU tensor's memory, page-locked in place and mapped into the GPU's address space."""

    def __init__(self, tensor: Tensor, device: torch.device) -> None:
        import cupy

        self._runtime = runtime = cupy.cuda.runtime
        self.tensor = tensor  # keeps the memory alive while the GPU may read it
        self._ptr = ptr = tensor.data_ptr()
        with _pinned_lock, cupy.cuda.Device(device.index):
            entry = _pinned_ranges.get(ptr)
            if entry is None:
                registered = False
                if not tensor.is_pinned():  # torch-pinned memory is mapped already
                    try:
                        nbytes = tensor.numel() * tensor.element_size()
                        runtime.hostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED)
                        registered = True
                    except runtime.CUDARuntimeError as exc:
                        # Someone else in this process pinned it: use it, never unpin it.
                        if (
                            getattr(exc, "status", None)
                            != _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
                        ):
                            raise
                entry = _pinned_ranges[ptr] = [0, registered]
            entry[0] += 1
            # With unified addressing the device pointer of mapped host memory is usually the
            # host pointer itself; ask rather than assume.
            self.device_ptr = int(runtime.pointerGetAttributes(ptr).devicePointer) or ptr
        self._held = True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        with _pinned_lock:
            entry = _pinned_ranges[self._ptr]
            entry[0] -= 1
            if entry[0] == 0:
                del _pinned_ranges[self._ptr]
                if entry[1]:
                    self._runtime.hostUnregister(self._ptr)
