"""Synthetic power-law graphs matched to published dataset sizes, built straight into CSC.

Model (a Chung–Lu graph with an exact in-degree sequence):

* Expected degrees by rank r = 0..N-1 follow ``(r + r0) ** (-1 / (gamma - 1))``: a power-law degree
  distribution with exponent ``gamma`` in its tail. The offset ``r0`` flattens the head so that the
  largest degree is ``max_degree_ratio * sqrt(scale)`` times the mean (never above the node count;
  the sqrt keeps ``d_max**2 / E`` the same at every scale). Ranks are given to node ids by a seeded
  permutation, so hubs are spread over the id space as in real data.
* Every node v gets exactly ``d_v`` in-edges (systematic rounding of the expected degrees, so the
  total is exactly the requested edge count). Their sources are drawn independently with
  probability proportional to the same weights, so expected out-degree equals expected in-degree
  (as in the undirected graphs Reddit and ogbn-products are).
* No duplicate edges: a source drawn twice for the same target (hub-to-hub pairs are drawn more
  than once when ``d_u * d_v > E``) is moved to the next free id above it (below it at the end of
  the id range), which is a random, mostly low-degree node because ids are permuted. The share
  moved is logged (measured with seed 0: Reddit 1.5% at scale 1, 5.4% at 0.1; ogbn-products 0.35%
  at scale 1). Hubs thus end with a somewhat lower out-degree than in-degree; in-degrees are exact.
* Self loops are kept (expected ``sum d_v**2 / E``: 1,517 of Reddit's 114.6 M edges); removing
  them would change the exact edge count, and GNN layers that add self loops handle them.
* Node features are i.i.d. standard normal float32, labels uniform random ints: they carry no
  signal; the graph exists to measure serving, not accuracy.

Only nodes, edges, feature width and class count are published statistics; ``gamma`` and
``max_degree_ratio`` are this generator's choices for a realistic heavy tail. The same config
(seed included) gives the same graph bit for bit: all randomness comes from seeded CPU generators
consumed in a fixed order and fixed chunk sizes, independent of the thread count.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve.config import GraphConfig
from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)

# Edges generated per step: bounds the temporary memory (~10 int64/float64 arrays of this size).
_CHUNK_EDGES = 1 << 22
_CUSTOM_NUM_CLASSES = 10


@dataclass(frozen=True)
class SyntheticPreset:
    num_nodes: int
    num_edges: int  # directed edges (an undirected edge counts twice), as PyG reports them
    num_features: int
    num_classes: int
    gamma: float = 2.5  # power-law exponent of the degree distribution's tail
    max_degree_ratio: float = 50.0  # largest expected degree / mean degree


PRESETS: dict[str, SyntheticPreset] = {
    # PyG Reddit: 232,965 nodes, 114,615,892 edges, 602 features, 41 classes (mean degree 492).
    "reddit": SyntheticPreset(232_965, 114_615_892, 602, 41, gamma=2.5, max_degree_ratio=44.0),
    # ogbn-products: 2,449,029 nodes, 123,718,280 directed edges, 100 features, 47 classes.
    "products": SyntheticPreset(2_449_029, 123_718_280, 100, 47, gamma=2.3, max_degree_ratio=350.0),
    # ogbn-papers100M: 111,059,956 nodes, 1,615,685,872 edges, 128 features, 172 classes.
    "papers100m": SyntheticPreset(
        111_059_956, 1_615_685_872, 128, 172, gamma=2.2, max_degree_ratio=2000.0
    ),
}


def generate_synthetic(cfg: GraphConfig) -> GraphData:
    """Generate the graph ``cfg`` describes (preset × ``synthetic_scale``), deterministically."""
    t0 = time.perf_counter()
    preset = _preset(cfg)
    num_nodes = max(1, round(preset.num_nodes * cfg.synthetic_scale))
    num_edges = round(preset.num_edges * cfg.synthetic_scale)
    if not 0 < num_edges <= num_nodes * (num_nodes - 1):
        raise ValueError(
            f"synthetic {cfg.synthetic_preset} at scale {cfg.synthetic_scale}: {num_edges:,} edges "
            f"on {num_nodes:,} nodes (mean degree {num_edges / num_nodes:.1f}) is not a graph "
            f"without duplicate edges (mean degree must be in (0, nodes - 1]); "
            f"use a larger synthetic_scale"
        )
    log.info(
        "synthetic %s scale %g: %s nodes, %s edges, %d features (seed %d)",
        cfg.synthetic_preset,
        cfg.synthetic_scale,
        f"{num_nodes:,}",
        f"{num_edges:,}",
        preset.num_features,
        cfg.synthetic_seed,
    )
    weights_by_rank = _expected_degrees(num_nodes, num_edges, preset, cfg.synthetic_scale)
    degrees_by_rank = _round_degrees(weights_by_rank, num_edges)
    # Ranks -> node ids, so that hubs are scattered over the id space.
    perm = torch.randperm(num_nodes, generator=_generator(cfg.synthetic_seed, 0))
    weights = torch.empty_like(weights_by_rank).index_copy_(0, perm, weights_by_rank)
    degrees = torch.empty_like(degrees_by_rank).index_copy_(0, perm, degrees_by_rank)
    del weights_by_rank, degrees_by_rank, perm
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    torch.cumsum(degrees, 0, out=indptr[1:])
    log.info(
        "degrees: mean %.1f, max %d, nodes without in-edges %d (%.2f s)",
        num_edges / num_nodes,
        int(degrees.max()),
        int((degrees == 0).sum()),
        time.perf_counter() - t0,
    )
    indices = _fill_sources(indptr, weights, _generator(cfg.synthetic_seed, 1))
    del weights, degrees
    x = torch.randn(num_nodes, preset.num_features, generator=_generator(cfg.synthetic_seed, 2))
    y = torch.randint(
        0, preset.num_classes, (num_nodes,), generator=_generator(cfg.synthetic_seed, 3)
    )
    graph = GraphData(
        name=f"synthetic-{cfg.synthetic_preset}", indptr=indptr, indices=indices, x=x, y=y
    )
    log.info("synthetic graph ready in %.1f s", time.perf_counter() - t0)
    return graph


def _preset(cfg: GraphConfig) -> SyntheticPreset:
    if cfg.synthetic_preset in PRESETS:
        return PRESETS[cfg.synthetic_preset]
    if cfg.synthetic_preset != "custom":
        raise ValueError(f"graph.synthetic_preset {cfg.synthetic_preset!r} is a typed graph "
                         f"(docs/architecture.md, \"Typed graphs\"); the one-type presets are "
                         f"{sorted(PRESETS)} and 'custom'")
    sizes = {
        "synthetic_num_nodes": cfg.synthetic_num_nodes,
        "synthetic_num_edges": cfg.synthetic_num_edges,
        "synthetic_num_features": cfg.synthetic_num_features,
    }
    missing = [k for k, v in sizes.items() if v is None]
    if missing:
        raise ValueError(f"graph.synthetic_preset 'custom' needs graph.{', graph.'.join(missing)}")
    num_nodes, num_edges, num_features = (int(v) for v in sizes.values())  # type: ignore[arg-type]
    return SyntheticPreset(num_nodes, num_edges, num_features, _CUSTOM_NUM_CLASSES)


def _generator(seed: int, stream: int) -> torch.Generator:
    return stream_generator(seed, stream)


def stream_generator(seed: int, stream: int) -> torch.Generator:
    """One independent CPU generator per stage, so each stage's draws never depend on another's."""
    state = np.random.SeedSequence([seed % (1 << 63), stream]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def _expected_degrees(
    num_nodes: int, num_edges: int, preset: SyntheticPreset, scale: float
) -> Tensor:
    """Expected in-degree by rank (float64, descending), summing to ``num_edges``, each <= cap."""
    return power_law_degrees(num_nodes, num_edges, preset.gamma, preset.max_degree_ratio, scale,
                             num_nodes)


def power_law_degrees(num_nodes: int, num_edges: int, gamma: float, max_degree_ratio: float,
                      scale: float, num_sources: int) -> Tensor:
    """Expected in-degree by rank (float64, descending) of ``num_nodes`` targets whose sources
    are ``num_sources`` nodes (the targets themselves in a one-type graph), summing to
    ``num_edges``, each <= the cap (see the module docstring)."""
    mean_degree = num_edges / num_nodes
    # The largest degree shrinks with sqrt(scale) so that d_max**2 / E, which sets how often hub
    # pairs are drawn twice, is the same at every scale; and stays half a slot below the source
    # count, so that rounding never asks for more than that many distinct sources.
    cap = min(max_degree_ratio * mean_degree * math.sqrt(scale), num_sources - 0.5)
    beta = 1.0 / (gamma - 1.0)
    offset = _solve_rank_offset(num_nodes, beta, cap / mean_degree)
    ranks = torch.arange(num_nodes, dtype=torch.float64)
    weights = ranks.add_(offset).pow_(-beta)
    weights.mul_(num_edges / float(weights.sum()))
    # Water-filling: clamp the head at the cap and give the excess to the rest, until none exceeds.
    for _ in range(100):
        num_capped = int((weights > cap).sum())  # descending, so the capped nodes are a prefix
        if num_capped == 0:
            break
        weights[:num_capped] = cap
        rest = weights[num_capped:]
        rest.mul_((num_edges - cap * num_capped) / float(rest.sum()))
    return weights


def _solve_rank_offset(num_nodes: int, beta: float, ratio: float) -> float:
    """Offset r0 with max/mean of ``(r + r0) ** -beta`` over r in [0, N) equal to ``ratio``
    (continuous approximation; the cap is enforced exactly afterwards). Bisection in log space."""

    def max_over_mean(r0: float) -> float:
        if abs(beta - 1.0) < 1e-9:
            integral = math.log((num_nodes + r0) / r0)
        else:
            integral = ((num_nodes + r0) ** (1 - beta) - r0 ** (1 - beta)) / (1 - beta)
        return r0 ** (-beta) * num_nodes / integral

    lo, hi = 0.0, 60.0  # log(r0): r0 from 1 (steepest head) to ~1e26 (flat)
    if ratio <= 1.0 or max_over_mean(math.exp(lo)) <= ratio:
        return math.exp(hi) if ratio <= 1.0 else 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if max_over_mean(math.exp(mid)) > ratio else (lo, mid)
    return math.exp(0.5 * (lo + hi))


def _round_degrees(expected: Tensor, num_edges: int) -> Tensor:
    return round_degrees(expected, num_edges)


def round_degrees(expected: Tensor, num_edges: int, max_degree: int | None = None) -> Tensor:
    """Integer degrees summing to exactly ``num_edges``, each floor or ceil of the expected value
    (systematic rounding of the running total: vectorised, no sort), none above ``max_degree``
    (default: the node count)."""
    running = torch.cumsum(expected, 0)
    running.mul_(num_edges / float(running[-1]))
    running[-1] = num_edges
    totals = running.floor_().to(torch.int64)
    totals = torch.cummax(totals, 0).values  # guards against float jitter making a step negative
    degrees = torch.diff(totals, prepend=torch.zeros(1, dtype=torch.int64))
    limit = expected.numel() if max_degree is None else max_degree
    if int(degrees.sum()) != num_edges or int(degrees.max()) > limit:
        raise RuntimeError("degree rounding failed: this is a bug in the synthetic generator")
    return degrees


def _fill_sources(indptr: Tensor, weights: Tensor, gen: torch.Generator) -> Tensor:
    return draw_sources(indptr, weights, gen)


def draw_sources(indptr: Tensor, weights: Tensor, gen: torch.Generator) -> Tensor:
    """Draw every target's in-neighbours, sorted and distinct, chunk by chunk into one int64
    array: target ``v`` gets ``indptr[v+1] - indptr[v]`` sources among ``weights.numel()`` nodes,
    each drawn with probability proportional to its weight."""
    num_nodes, num_edges = indptr.numel() - 1, int(indptr[-1])
    num_sources = weights.numel()
    cdf = torch.cumsum(weights, 0)
    cdf.div_(float(cdf[-1]))
    indices = torch.empty(num_edges, dtype=torch.int64)
    # Chunk boundaries at node starts near multiples of _CHUNK_EDGES (fixed: reproducible draws).
    marks = torch.arange(0, num_edges, _CHUNK_EDGES, dtype=torch.int64)
    bounds = torch.unique(torch.cat([torch.searchsorted(indptr, marks), torch.tensor([num_nodes])]))
    t0, moved, self_loops, next_report = time.perf_counter(), 0, 0, 0.1
    start = 0
    for stop in bounds.tolist():
        if stop <= start:
            continue
        lo, hi = int(indptr[start]), int(indptr[stop])
        counts = indptr[start + 1 : stop + 1] - indptr[start:stop]
        src, segment, n_moved = _draw_segment_sources(counts, cdf, num_sources, gen)
        indices[lo:hi] = src
        moved += n_moved
        self_loops += int((src == segment + start).sum())
        start = stop
        if num_edges and hi / num_edges >= next_report:
            log.info("edges %3.0f%% (%.1f s)", 100 * hi / num_edges, time.perf_counter() - t0)
            next_report = hi / num_edges + 0.1
    log.info(
        "edges done: %d duplicate draws moved to free ids (%.3f%%), %d self loops kept",
        moved,
        100 * moved / max(num_edges, 1),
        self_loops,
    )
    return indices


def _draw_segment_sources(
    counts: Tensor, cdf: Tensor, num_nodes: int, gen: torch.Generator
) -> tuple[Tensor, Tensor, int]:
    """Sources for consecutive targets with in-degrees ``counts``: sorted within each target and
    distinct. Returns (sources, local target index of each slot, number of draws moved)."""
    num_targets, num_slots = counts.numel(), int(counts.sum())
    segment = torch.repeat_interleave(torch.arange(num_targets), counts)
    u = _sorted_uniforms(counts, segment, gen)
    # Inverse-CDF draw: monotone in u, so sorted uniforms give sorted sources with no sort at all.
    src = torch.searchsorted(cdf, u, right=True).clamp_(max=num_nodes - 1)
    del u
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(num_slots) - starts[segment]  # slot index within its target
    # Make each run strictly increasing: t_i = i + max_{j<=i}(s_j - j) only moves repeated ids up.
    # The per-target offset keeps the running max from crossing target boundaries.
    offset = segment * (2 * num_nodes + 2)
    key = src - pos + offset
    dist = torch.cummax(key, 0).values
    # Then pull down ids pushed past the end: t_i <= N - d + i, via a running min from the right.
    limit = (num_nodes - counts)[segment] + offset  # (N - d + i) - i + offset
    dist = torch.minimum(dist, limit)
    dist = torch.flip(torch.cummin(torch.flip(dist, [0]), 0).values, [0])
    dist.sub_(offset).add_(pos)
    n_moved = int((dist != src).sum())
    return dist, segment, n_moved


def _sorted_uniforms(counts: Tensor, segment: Tensor, gen: torch.Generator) -> Tensor:
    """For each target, ``counts[v]`` sorted U(0,1) draws, from normalised exponential spacings
    (d + 1 spacings per target: the first d partial sums over the total are sorted uniforms)."""
    num_targets, num_slots = counts.numel(), segment.numel()
    # -log(1 - U) is Exp(1); uniform_ draws are sequential, hence identical for any thread count.
    gaps = torch.rand(num_slots + num_targets, dtype=torch.float64, generator=gen)
    partial = gaps.neg_().log1p_().neg_().cumsum_(0)
    ext_end = torch.cumsum(counts + 1, 0)  # one past each target's last spacing
    ext_start = ext_end - counts - 1
    before = torch.where(ext_start > 0, partial[(ext_start - 1).clamp_(min=0)], 0.0)
    total = partial[ext_end - 1] - before
    is_slot = torch.ones(num_slots + num_targets, dtype=torch.bool)
    is_slot[ext_end - 1] = False  # the last spacing of each target only normalises
    u = partial[is_slot].sub_(before[segment]).div_(total[segment])
    return u
