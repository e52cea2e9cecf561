"""A copy of the host overlay on a device (``graph/overlay.py``), kept equal by its patches:
what a GPU sampler and a GPU exact table read of the living graph."""

from __future__ import annotations

import numpy as np
import torch

from quiver_serve.graph.overlay import Overlay, Patch
from quiver_serve.graph.overlay_view import OverlayView


class DeviceOverlay:
    """A copy of an :class:`Overlay` on a device, kept equal by applying its patches in order
    (on the current stream, so earlier sampling kernels finish reading first)."""

    def __init__(self, host: Overlay, device: torch.device) -> None:
        self.device = device
        self.n_base, self.num_nodes = host.n_base, host.num_nodes
        self.start = torch.full((host.node_capacity,), -1, dtype=torch.int64, device=device)
        self.length = torch.zeros(host.node_capacity, dtype=torch.int64, device=device)
        self.tail = torch.zeros(host.edge_capacity, dtype=torch.int64, device=device)
        if host.active:
            view = host.view()
            assert view is not None
            self.start.copy_(view.start)
            self.length.copy_(view.length)
            self.tail[:host.top].copy_(view.tail[:host.top])

    def view(self) -> OverlayView:
        return OverlayView(self.n_base, self.num_nodes, self.start, self.length, self.tail)

    def apply(self, patch: Patch) -> None:
        """Write ``patch`` on the current stream: its five arrays travel in one copy from
        page-locked memory that does not wait for the host (a copy from pageable memory would
        block the engine loop until the stream's queued kernels finished); the caching host
        allocator keeps the buffer until the copy is done."""
        parts = (patch.tail_pos, patch.tail_val, patch.nodes, patch.start, patch.length)
        sizes = [int(p.size) for p in parts]
        if sum(sizes):
            staged = torch.empty(sum(sizes), dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda")
            np.concatenate(parts, out=staged.numpy(), casting="same_kind")
            pos, val, nodes, start, length = torch.split(
                staged.to(self.device, non_blocking=True), sizes)
            if sizes[0]:
                self.tail[pos] = val
            if sizes[2]:
                self.start[nodes] = start
                self.length[nodes] = length
        self.num_nodes = patch.num_nodes
