"""PSGS of a typed graph (docs/architecture.md, "Routing" and "Typed graphs"; decision 0050):
the predicted sampled-subgraph size of a batch, per seed type.

A batch of a typed graph is of one node type, and its subgraph size depends mostly on that type
(a paper reaches hundreds of nodes through its relations, an institution a few). Per seed type the
size is measured at start-up with the engine's own typed sampler: random batches of uniform ids
of that type at a few sizes (``BATCH_SIZES``), a few rounds each; a batch of ``B`` seeds is
predicted by log-log interpolation between the measured sizes (the union of the seeds' subgraphs
grows less than linearly as they share neighbours), and linearly beyond the largest. The homogeneous
per-node table (``routing/psgs.py``) is not built per type: its pass samples every node alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: batch sizes measured per seed type at start-up
BATCH_SIZES = (1, 8, 48, 256)


@dataclass
class TypedPsgs:
    """Per seed type, the mean sampled nodes of a batch at each measured size (ascending)."""

    sizes: dict[str, list[tuple[int, float]]]

    def estimate(self, node_type: str, num_seeds: int) -> float:
        """Predicted unique sampled nodes of a batch of ``num_seeds`` ``node_type`` ids."""
        points = self.sizes.get(node_type)
        if not points or num_seeds <= 0:
            return float(max(num_seeds, 0))
        if num_seeds <= points[0][0]:
            return points[0][1] * num_seeds / points[0][0]
        for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
            if num_seeds <= b1:
                w = math.log(num_seeds / b0) / math.log(b1 / b0)
                return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))
        b_last, s_last = points[-1]
        return s_last * num_seeds / b_last

    def per_seed(self, node_type: str) -> float:
        """Sampled nodes of a one-seed batch of ``node_type`` (its subgraph alone)."""
        return self.estimate(node_type, 1)


def measure_typed_psgs(sampler, num_nodes: Mapping[str, int], fanouts: Mapping,
                       seed_types: Sequence[str], rounds: int = 3,
                       batch_sizes: Sequence[int] = BATCH_SIZES, seed: int = 0) -> TypedPsgs:
    """Measure ``sampler`` (a typed sampler: ``sample(type, seeds, fanouts, seed)``) on uniform
    batches of every seed type (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    sizes: dict[str, list[tuple[int, float]]] = {}
    for t in seed_types:
        count = num_nodes[t]
        if count == 0:
            continue
        points = []
        for b in batch_sizes:
            total = 0
            for r in range(rounds):
                ids = torch.randint(0, count, (b,), generator=gen)
                total += sampler.sample(t, ids, fanouts, seed + r).num_nodes
            points.append((b, max(total / rounds, 1.0)))
        sizes[t] = points
    return TypedPsgs(sizes)
