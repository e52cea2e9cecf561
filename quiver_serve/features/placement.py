"""Placement: which feature rows live in which memory (docs/architecture.md, "Feature store").

Rows are ranked by a score (FAP, or degree for the baseline) and the hottest go to GPU memory,
``gpu_cache_bytes`` per GPU, which covers the cached rows and the location map (8 bytes per node,
needed only when some rows stay on the host). Policies:

* ``replicate``: every GPU holds the same hottest rows;
* ``partition``: GPUs that reach each other's memory (a peer-access clique, detected, never
  assumed) split a hot set that many times larger; rank ``i`` goes to GPU ``i % G`` so every GPU
  holds an equal share of every temperature.

The rest stay in pinned host memory: the shared matrix itself, read in place, or one shard per
NUMA node where the system has several (``host_numa_nodes``).

A node's location is one int64: tier in the top byte, row inside the tier below (``pack``).
Tiers ``0 .. G-1`` are the GPU shards, then the host shards.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

TIER_SHIFT = 56
ROW_MASK = (1 << TIER_SHIFT) - 1
LOC_BYTES_PER_NODE = 8
POLICIES = ("replicate", "partition")


def pack(tier: int | Tensor, row: Tensor) -> Tensor:
    return (torch.as_tensor(tier, dtype=torch.int64) << TIER_SHIFT) | row


def unpack(loc: Tensor) -> tuple[Tensor, Tensor]:
    return loc >> TIER_SHIFT, loc & ROW_MASK


@dataclass
class Placement:
    """Where every row lives: ``gpu_nodes[g]`` on GPU shard ``g`` (in row order), the rest in
    ``host_nodes[s]`` (host shard ``s``), or, with ``host_in_place``, the host matrix by id."""

    policy: str
    num_nodes: int
    row_bytes: int
    gpu_nodes: list[Tensor]
    host_nodes: list[Tensor] = field(default_factory=list)
    host_in_place: bool = True
    scores_name: str = "fap"

    @property
    def num_gpu_rows(self) -> int:
        return sum(int(t.numel()) for t in self.gpu_nodes)

    @property
    def all_on_gpu(self) -> bool:
        """Every row on GPU shard 0 in id order: no map needed (the all-fits case)."""
        return len(self.gpu_nodes) == 1 and int(self.gpu_nodes[0].numel()) == self.num_nodes \
            and self.policy == "replicate"

    @property
    def needs_map(self) -> bool:
        return self.num_gpu_rows > 0 and not self.all_on_gpu

    def gpu_bytes(self, shard: int) -> int:
        """Bytes this placement puts on GPU ``shard``: its rows plus the location map."""
        rows = int(self.gpu_nodes[shard].numel()) * self.row_bytes
        return rows + (self.num_nodes * LOC_BYTES_PER_NODE if self.needs_map else 0)

    def locations(self) -> Tensor:
        """int64 per node: ``pack(tier, row)`` (tiers as in the module docstring)."""
        loc = torch.empty(self.num_nodes, dtype=torch.int64)
        num_gpu = len(self.gpu_nodes)
        if self.host_in_place:
            loc.copy_(pack(num_gpu, torch.arange(self.num_nodes)))
        for s, nodes in enumerate(self.host_nodes):
            loc[nodes] = pack(num_gpu + s, torch.arange(nodes.numel()))
        for g, nodes in enumerate(self.gpu_nodes):
            loc[nodes] = pack(g, torch.arange(nodes.numel()))
        return loc


def rows_within(budget_bytes: int, num_nodes: int, row_bytes: int) -> int:
    """Rows one GPU holds within ``budget_bytes``: all of them (no map needed), or as many as fit
    beside the location map."""
    if row_bytes <= 0 or budget_bytes >= num_nodes * row_bytes:
        return num_nodes
    return max(0, (budget_bytes - num_nodes * LOC_BYTES_PER_NODE) // row_bytes)


def hottest_first(scores: Tensor, device: torch.device | None = None) -> Tensor:
    """Row ids by descending score, ties in id order (a stable sort: a placement is a pure
    function of the scores); on ``device`` when it is a GPU (22 M rows: ~3-5 s on a CPU's one
    thread, milliseconds there), else, or when it lacks the memory, on the CPU."""
    s = scores.to(torch.float32)
    if device is not None and device.type == "cuda":
        try:
            return torch.sort(s.to(device), descending=True, stable=True).indices.cpu()
        except torch.cuda.OutOfMemoryError:
            pass
    return torch.sort(s, descending=True, stable=True).indices


def plan_placement(scores: Tensor, row_bytes: int, budget_bytes: int, num_gpus: int,
                   policy: str = "replicate", numa_nodes: int = 1,
                   scores_name: str = "fap", device: torch.device | None = None) -> Placement:
    """The placement of ``len(scores)`` rows: hottest (highest score) first on the GPUs
    (``device``: where to rank them, ``hottest_first``)."""
    if policy not in POLICIES:
        raise ValueError(f"feature placement policy must be one of {POLICIES}, got {policy!r}")
    if budget_bytes < 0 or num_gpus < 0:
        raise ValueError("budget_bytes and num_gpus must be >= 0")
    if num_gpus <= 1:
        policy = "replicate"  # one GPU: nothing to split
    num_nodes = int(scores.numel())
    per_gpu = rows_within(budget_bytes, num_nodes, row_bytes) if num_gpus else 0
    if not num_gpus or (policy == "replicate" and per_gpu >= num_nodes):  # nothing to rank
        order = torch.arange(num_nodes)
    else:
        order = hottest_first(scores, device)
    if policy == "replicate":
        hot = order[:per_gpu]
        gpu_nodes = [hot] if num_gpus else []
        if per_gpu == num_nodes and num_gpus:
            gpu_nodes = [torch.arange(num_nodes)]  # everything fits: id order, no map
        num_shards = 1 if num_gpus else 0
    else:  # partition: a map is always needed (rows are spread over the shards)
        fit = max(0, (budget_bytes - num_nodes * LOC_BYTES_PER_NODE) // max(row_bytes, 1))
        per_gpu = min(fit, -(-num_nodes // num_gpus))
        hot = order[:min(num_nodes, per_gpu * num_gpus)]
        gpu_nodes = [hot[g::num_gpus] for g in range(num_gpus)]
        num_shards = num_gpus
    cold = order[sum(int(t.numel()) for t in gpu_nodes):]
    placement = Placement(policy, num_nodes, row_bytes, gpu_nodes[:num_shards],
                          scores_name=scores_name)
    if numa_nodes > 1 and cold.numel() and placement.num_gpu_rows:  # the map exists anyway
        placement.host_in_place = False
        placement.host_nodes = [cold[s::numa_nodes] for s in range(numa_nodes)]
    return placement


# ---- the machine -----------------------------------------------------------------------------
def peer_clique(devices: list[int]) -> list[int]:
    """The largest prefix-greedy set of ``devices`` whose every pair has peer access (the first
    device always included): GPUs that can split one hot set."""
    clique: list[int] = []
    for d in devices:
        if all(torch.cuda.can_device_access_peer(d, o) and torch.cuda.can_device_access_peer(o, d)
               for o in clique):
            clique.append(d)
    return clique


def numa_nodes(sys_root: str = "/sys/devices/system/node") -> list[list[int]]:
    """CPUs of each NUMA node that has any (read from sysfs); one entry on a machine without
    NUMA information."""
    root = Path(sys_root)
    nodes = []
    for entry in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = _parse_cpulist((entry / "cpulist").read_text())
        except OSError:
            continue
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(os.sched_getaffinity(0))]


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus
