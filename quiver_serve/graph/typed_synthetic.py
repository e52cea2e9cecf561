"""A synthetic typed graph matched to ogbn-mag's published statistics, at a scale factor.

ogbn-mag (OGB's node property prediction table): paper 736,389, author 1,134,649, institution
8,740 and field_of_study 59,965 nodes; four relations: author-writes-paper 7,145,660,
author-affiliated_with-institution 1,043,998, paper-cites-paper 5,416,271 and
paper-has_topic-field_of_study 7,505,078 edges (21.1 M); 128 paper features, 349 venue classes.
Only papers have features, as in the dataset.

Each relation is drawn as the homogeneous generator draws its graph (``graph/synthetic.py``): exact
in-degrees of the destination type from a power law, sources drawn in proportion to a power-law
weight over the source type, distinct and sorted per destination; every node and edge count is
the published one times ``scale`` (rounded). The exponents are this generator's choices, not
published figures. Same seed, same graph, bit for bit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from quiver_serve.graph.synthetic import (
    draw_sources,
    power_law_degrees,
    round_degrees,
    stream_generator,
)
from quiver_serve.graph.typed import EdgeType, Relation, TypedGraph

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TypedPreset:
    num_nodes: dict[str, int]
    num_edges: dict[EdgeType, int]
    num_features: dict[str, int]  # featured types only
    label_type: str
    num_classes: int
    gamma: float = 2.3
    max_degree_ratio: float = 100.0


TYPED_PRESETS: dict[str, TypedPreset] = {
    "mag": TypedPreset(
        num_nodes={"paper": 736_389, "author": 1_134_649, "institution": 8_740,
                   "field_of_study": 59_965},
        num_edges={("author", "writes", "paper"): 7_145_660,
                   ("author", "affiliated_with", "institution"): 1_043_998,
                   ("paper", "cites", "paper"): 5_416_271,
                   ("paper", "has_topic", "field_of_study"): 7_505_078},
        num_features={"paper": 128},
        label_type="paper",
        num_classes=349,
    ),
}


def generate_typed_synthetic(preset_name: str, scale: float, seed: int = 0) -> TypedGraph:
    """The typed graph of ``TYPED_PRESETS[preset_name]`` at ``scale`` (0 < scale <= 1)."""
    if preset_name not in TYPED_PRESETS:
        raise ValueError(f"unknown typed synthetic preset {preset_name!r}; presets: "
                         f"{sorted(TYPED_PRESETS)}")
    if not 0 < scale <= 1:
        raise ValueError(f"synthetic scale must be in (0, 1], got {scale}")
    t0 = time.perf_counter()
    preset = TYPED_PRESETS[preset_name]
    num_nodes = {t: max(1, round(n * scale)) for t, n in preset.num_nodes.items()}
    relations = {}
    for stream, (et, full_edges) in enumerate(preset.num_edges.items()):
        relations[et] = _relation(et, num_nodes, round(full_edges * scale), preset, scale,
                                  seed, 10 + 3 * stream)
    x = {t: torch.randn(num_nodes[t], width, generator=stream_generator(seed, 2 + i))
         for i, (t, width) in enumerate(preset.num_features.items())}
    y = {preset.label_type: torch.randint(0, preset.num_classes, (num_nodes[preset.label_type],),
                                          generator=stream_generator(seed, 1))}
    graph = TypedGraph(f"synthetic-{preset_name}", num_nodes, x, relations, y)
    log.info("typed synthetic graph ready in %.1f s: %s", time.perf_counter() - t0,
             graph.describe())
    return graph


def _relation(et: EdgeType, num_nodes: dict[str, int], num_edges: int, preset: TypedPreset,
              scale: float, seed: int, stream: int) -> Relation:
    """One relation's CSC: power-law in-degrees over the destinations, power-law weighted
    sources, distinct and sorted per destination."""
    src, _, dst = et
    num_src, num_dst = num_nodes[src], num_nodes[dst]
    if not 0 < num_edges <= num_src * num_dst:
        raise ValueError(f"synthetic relation {'-'.join(et)} at scale {scale}: {num_edges:,} "
                         f"edges between {num_src:,} and {num_dst:,} nodes cannot be distinct; "
                         "use a larger scale")
    in_weights = _permuted(power_law_degrees(num_dst, num_edges, preset.gamma,
                                             preset.max_degree_ratio, scale, num_src),
                           seed, stream)
    degrees = round_degrees(in_weights, num_edges, max_degree=num_src)
    out_weights = _permuted(power_law_degrees(num_src, num_edges, preset.gamma,
                                              preset.max_degree_ratio, scale, num_dst),
                            seed, stream + 1)
    indptr = torch.zeros(num_dst + 1, dtype=torch.int64)
    torch.cumsum(degrees, 0, out=indptr[1:])
    indices = draw_sources(indptr, out_weights, stream_generator(seed, stream + 2))
    return Relation(et, indptr, indices)


def _permuted(by_rank: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """Weights by rank given to node ids by a seeded permutation (hubs spread over the ids)."""
    perm = torch.randperm(by_rank.numel(), generator=stream_generator(seed, stream))
    return torch.empty_like(by_rank).index_copy_(0, perm, by_rank)
