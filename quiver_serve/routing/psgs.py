"""PSGS (docs/architecture.md, "Routing"): the predicted sampled-graph size of a node and of a
batch.

Per node, the expected number of unique nodes in its sampled subgraph for the configured fanouts
(``mean_size``), measured by sampling EVERY node alone ``rounds`` times with the project's own
hop sampler (``sampling.reference.sample_hop``, the semantics every sampler shares), vectorised
over all nodes of a chunk at once, on the GPU when there is one. The access recursion
(``graph.access``) gives a batch's union size but cannot give every node's own size (that is N
separate recursions); sampling can, exactly under the sampler's semantics (duplicates, self loops,
Floyd's draws), and the same pass yields ``one_draw`` (torch-quiver's table: one random sample per
node) and how often each node turns up in other nodes' subgraphs (``reach``).

Per batch (``PsgsTable.estimate``, a few microseconds of NumPy): a union-aware size. A seed ``v``
brings ``m_v - 1`` nodes besides itself; the model treats them as ``m_v - 1`` draws of the node
popularity distribution ``q`` (``reach`` normalised: the share of all subgraph memberships that
fall on each node), independent across seeds. With ``B`` unique seeds and ``D = sum (m_v - 1)``
draws (``d = D / B`` per seed) a node ``w`` is in the union with probability
``1 - (1 - min(1, d q_w)) ** B``; summed over all nodes that is ``f(D, B)``, tabulated once on a
log grid (bilinear lookup per batch). The seeds are in the union for sure, so

    raw(B) = B + f(D, B) - sum_{v in seeds} [1 - (1 - min(1, d q_v)) ** B]

which is exact for one seed (``raw = m_v`` up to ``d q_v``) and accounts for shared neighbours
as the batch grows (a plain sum of ``m_v`` over-counts them: ~2x on 48 power-law seeds). The
remaining bias (a batch's subgraphs concentrate on popular nodes more than independent draws
would) is one exponent, ``q ~ reach ** alpha``, fitted against measured sample sizes of random
batches at start-up (``calibrate_union``; measured: alpha 1.0-1.1 on Cora and power-law graphs,
1.2 on Tolokers, where alpha 1 over-predicts 512 seeds by 11%).

Tables are cached on disk (``.npz``, no pickle) keyed by the graph (``graph_key``), the fanouts,
the number of rounds and ``PSGS_VERSION``.

A living graph (docs/architecture.md, "The living graph"): a table may be sized to a node capacity
beyond the nodes that exist (rows of nodes not added yet: an isolated node's values), and
``PsgsTable.update_nodes`` approximates the sizes of nodes whose in-edges changed, or that were
appended, from their new in-degree; the sampled values come back when the table is rebuilt at
compaction.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from quiver_serve import envs
from quiver_serve.graph.snapshot import csc_key
from quiver_serve.sampling.base import seed_base
from quiver_serve.sampling.reference import sample_hop

log = logging.getLogger(__name__)

#: bump when the table's meaning or layout changes: old cache files are then recomputed
PSGS_VERSION = 1
#: candidate (owner, node) pairs held at once while sampling every node alone (~40 bytes each)
PAIRS_PER_CHUNK = 1 << 24
#: occupancy grid: seeds per batch (powers of two) and draws per seed (log-spaced)
GRID_MAX_SEEDS_LOG2 = 16
GRID_DRAW_POINTS = 48
#: popularity is compressed into this many log-spaced bins before the grid is tabulated
Q_BINS = 4096


def graph_key(indptr: Tensor, indices: Tensor) -> str:
    """The CSC's content key (``graph/snapshot.py``, ``csc_key``): what the table is cached by."""
    return csc_key(indptr, indices)


def cache_dir() -> Path:
    """``$QUIVER_SERVE_CACHE/psgs`` (else ``~/.cache/quiver_serve/psgs``)."""
    return envs.QUIVER_SERVE_CACHE / "psgs"


# ---- per-node sizes: every node sampled alone -------------------------------------------------
def _pairs_bound(indptr: Tensor, fanouts: list[int]) -> int:
    """Most (owner, node) candidate pairs one node can produce (``-1`` = its largest degree)."""
    max_degree = int((indptr[1:] - indptr[:-1]).max()) if indptr.numel() > 1 else 0
    bound, width = 1, 1
    for k in fanouts:
        width *= max_degree if k < 0 else min(k, max(max_degree, 1))
        bound += width
    return max(bound, 1)


def _sample_alone(indptr: Tensor, indices: Tensor, nodes: Tensor, fanouts: list[int],
                  base: int) -> Tensor:
    """Keys ``owner * N + node`` (sorted, unique) of the subgraph each of ``nodes`` gets when it
    is sampled as a batch of its own (every owner's hop draws are those of the shared sampler)."""
    n = indptr.numel() - 1
    known = nodes * n + nodes
    owner, frontier = nodes, nodes
    for hop, k in enumerate(fanouts, start=1):
        if frontier.numel() == 0:
            break
        nbr, pos = sample_hop(indptr, indices, frontier, k, hop, base)
        keys = torch.unique(owner[pos] * n + nbr)
        new = keys[~torch.isin(keys, known)]
        known = torch.sort(torch.cat([known, new])).values
        owner, frontier = new // n, new % n
    return known


def node_sample_sizes(indptr: Tensor, indices: Tensor, fanouts: list[int], rounds: int = 4,
                      seed: int = 0, device: torch.device | str | None = None,
                      progress: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean_size, one_draw, reach)`` over ``rounds`` independent samples of every node alone:
    mean unique nodes per node (float32), the first round's size (torch-quiver's one-draw table,
    int32), and how often each node appeared in another node's subgraph (float64)."""
    from tqdm import tqdm

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = indptr.numel() - 1
    ip, ix = indptr.to(dev), indices.to(dev)
    chunk = max(1, PAIRS_PER_CHUNK // _pairs_bound(indptr, fanouts))
    total = torch.zeros(n, dtype=torch.float64, device=dev)
    one_draw = torch.zeros(n, dtype=torch.int32, device=dev)
    reach = torch.zeros(n, dtype=torch.float64, device=dev)
    bar = tqdm(total=rounds * n, desc="PSGS per node", unit="node", disable=not progress,
               mininterval=1.0)
    for r in range(rounds):
        base = seed_base(seed * 7919 + r)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            keys = _sample_alone(ip, ix, torch.arange(lo, hi, device=dev), fanouts, base)
            owners, members = keys // n, keys % n
            sizes = torch.bincount(owners - lo, minlength=hi - lo)
            total[lo:hi] += sizes
            if r == 0:
                one_draw[lo:hi] = sizes.to(torch.int32)
            reach += torch.bincount(members[members != owners], minlength=n)
            bar.update(hi - lo)
    bar.close()
    return (total / max(rounds, 1)).float().cpu(), one_draw.cpu(), reach.cpu()


# ---- the batch estimate -------------------------------------------------------------------------
@dataclass
class PsgsTable:
    """Per-node tables and the occupancy grid of one graph and fanouts (see module docstring).

    Per-node arrays have ``capacity`` entries; ids ``num_nodes .. capacity - 1`` are nodes not
    added yet, with an isolated node's values (size 1, never reached) until ``update_nodes``."""

    key: str
    fanouts: list[int]
    mean_size: np.ndarray  # float32 [C]: expected unique nodes of each node sampled alone
    one_draw: np.ndarray  # int32 [C]: one sample's size per node (torch-quiver's table)
    reach: np.ndarray  # float64 [C]: memberships in other nodes' subgraphs (all rounds)
    alpha: float = 1.0  # popularity exponent, fitted by ``calibrate_union``
    #: int32 [C]: nodes drawn at hop 1, min(fanouts[0], in-degree), when the sizes were taken;
    #: None: unknown (``update_nodes`` then estimates without the node's own measured size)
    first_hop: np.ndarray | None = None
    live_nodes: int | None = None  # nodes that exist (None: every entry)
    _stamp: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # float32 throughout: a start pays each pass over every node (22 M at papers100M x 0.2)
        draws = np.subtract(self.mean_size, np.float32(1.0), dtype=np.float32)
        lowest = float(np.min(draws, where=draws > 0, initial=np.inf)) if draws.size else np.inf
        self.draw_lo = max(lowest if np.isfinite(lowest) else 1.0, 1e-2) * 0.5
        self.draw_hi = max(float(draws.max()) if draws.size else 1.0, self.draw_lo * 4.0)
        self._log_lo = math.log(self.draw_lo)
        self._log_step = (math.log(self.draw_hi) - self._log_lo) / (GRID_DRAW_POINTS - 1)
        self._draws = draws
        if self.live_nodes is None:
            self.live_nodes = self.capacity
        self.branch = self._branch_size()
        if self._stamp is None and self.capacity <= 1 << 26:
            self._stamp = np.full(self.capacity, -1, dtype=np.int32)
        self.set_alpha(self.alpha)

    def _branch_size(self) -> float:
        """Mean nodes one hop-1 draw brings into a node's subgraph (itself and what its own
        neighbourhood adds at the deeper hops): measured draws over hop-1 draws, summed over the
        nodes that have any. Without ``first_hop``, assumes every node drew its full fanout."""
        draws = self._draws[:self.live_nodes]
        if self.first_hop is not None:
            some = self.first_hop[:self.live_nodes] > 0
            hop1 = float(np.sum(self.first_hop[:self.live_nodes], dtype=np.float64))
            return float(np.sum(draws, where=some, dtype=np.float64)) / hop1 if hop1 > 0 else 1.0
        positive = draws > 0
        count = int(np.count_nonzero(positive))
        k1 = self.fanouts[0] if self.fanouts and self.fanouts[0] > 0 else 1
        mean = float(np.sum(draws, where=positive, dtype=np.float64)) / max(count, 1)
        return max(mean / k1, 1.0) if count else 1.0

    def set_alpha(self, alpha: float) -> None:
        """Popularity ``q ~ reach ** alpha`` (normalised) and its occupancy grid."""
        self.alpha = float(alpha)
        q = self.reach if self.alpha == 1.0 else np.power(self.reach, self.alpha)
        total = float(q.sum())
        self.popularity = (q / total if total > 0 else np.zeros_like(q)).astype(np.float32)
        #: f(B d, B) / (B d) on the grid (``occupancy_grid``)
        self.grid = occupancy_grid(self.popularity, self.draw_lo, self.draw_hi)
        #: [N, 2] float32: draws (m_v - 1) and popularity q_v, gathered together per batch
        self._per_node = np.stack([self._draws, self.popularity], axis=1)

    @property
    def num_nodes(self) -> int:
        """Nodes that exist (ids below it are valid seeds for a sampler)."""
        return int(self.live_nodes if self.live_nodes is not None else self.mean_size.size)

    @property
    def capacity(self) -> int:
        """Entries of the per-node arrays: every id below it may be estimated."""
        return int(self.mean_size.size)

    def first_hop_draws(self, degree: np.ndarray) -> np.ndarray:
        """Nodes drawn at hop 1 from an in-degree: ``min(fanouts[0], degree)`` (-1: all)."""
        degree = np.maximum(np.asarray(degree, dtype=np.int64), 0)
        k1 = self.fanouts[0] if self.fanouts else 0
        return degree if k1 < 0 else np.minimum(degree, k1)

    def update_nodes(self, nodes: np.ndarray | Tensor, degree: np.ndarray | Tensor) -> None:
        """Approximate sizes for ``nodes`` (ids below ``capacity``, no repeats) whose in-edges
        changed or that were appended, from their new in-degree.

        A node's size is ``1 + draws``, and ``draws`` is taken as (hop-1 draws) x (nodes each
        hop-1 draw brings): hop-1 draws are ``min(fanouts[0], degree)``; what each brings is the
        node's own measured ``draws / hop-1 draws`` where the table holds a measured or earlier
        value for it (so its neighbourhood's depth is kept), else the table's mean
        (``branch``: deeper hops as an average node's). A node left with no in-edge is size 1.
        Not updated: how often nodes reach each other (popularity stays as sampled, a new
        node's is 0) and the sizes of nodes whose neighbours changed; the exact values come back
        when the table is rebuilt (compaction). Sizes saturate once the degree passes
        ``fanouts[0]``: sampling draws no more than that at hop 1.
        """
        ids = np.asarray(nodes, dtype=np.int64).reshape(-1)
        deg = np.asarray(degree, dtype=np.int64).reshape(-1)
        if ids.size != deg.size:
            raise ValueError(f"{ids.size} nodes but {deg.size} degrees")
        if ids.size == 0:
            return
        if int(ids.min()) < 0 or int(ids.max()) >= self.capacity:
            raise IndexError(f"node ids must lie in [0, {self.capacity}) (the table's capacity)")
        hop1 = self.first_hop_draws(deg).astype(np.float64)
        per_draw = np.full(ids.size, self.branch)
        if self.first_hop is not None:
            old = self.first_hop[ids].astype(np.float64)
            known = (old > 0) & (self._draws[ids] > 0)
            per_draw[known] = self._draws[ids[known]] / old[known]
            self.first_hop[ids] = hop1.astype(np.int32)
        draws = (hop1 * per_draw).astype(np.float32)
        self._draws[ids] = draws
        self._per_node[ids, 0] = draws
        self.mean_size[ids] = 1.0 + draws
        self.one_draw[ids] = np.rint(1.0 + draws).astype(np.int32)
        self.live_nodes = max(self.num_nodes, int(ids.max()) + 1)

    def with_capacity(self, capacity: int) -> PsgsTable:
        """This table with per-node arrays of ``capacity`` entries (new ids: isolated nodes)."""
        extra = capacity - self.capacity
        if extra < 0:
            raise ValueError(f"capacity {capacity} is below the table's {self.capacity} entries")
        first_hop = None if self.first_hop is None else np.concatenate(
            [self.first_hop, np.zeros(extra, np.int32)])
        return PsgsTable(self.key, list(self.fanouts),
                         np.concatenate([self.mean_size, np.ones(extra, np.float32)]),
                         np.concatenate([self.one_draw, np.ones(extra, np.int32)]),
                         np.concatenate([self.reach, np.zeros(extra, np.float64)]),
                         self.alpha, first_hop, self.num_nodes)

    def unique(self, seeds: np.ndarray) -> np.ndarray:
        """The distinct ids of ``seeds`` (a stamp array: O(n), no sort, for graphs to 64 M nodes)."""
        if self._stamp is None or seeds.size > 1 << 30:
            return np.unique(seeds)
        pos = np.arange(seeds.size, dtype=np.int32)
        self._stamp[seeds] = pos
        return seeds[self._stamp[seeds] == pos]

    def occupancy(self, draws: float, seeds: int) -> float:
        """``f(D, B)``: expected distinct non-seed... nodes hit by ``draws`` draws from ``seeds`` seeds
        (bilinear in log2 seeds and log draws-per-seed on the grid)."""
        if draws <= 0.0 or seeds <= 0:
            return 0.0
        per_seed = draws / seeds
        lb = min(math.log2(seeds), float(GRID_MAX_SEEDS_LOG2))
        i = min(int(lb), GRID_MAX_SEEDS_LOG2 - 1)
        fi = lb - i
        x = (math.log(max(per_seed, self.draw_lo)) - self._log_lo) / self._log_step
        j = min(max(int(x), 0), GRID_DRAW_POINTS - 2)
        fj = min(max(x - j, 0.0), 1.0)
        g = self.grid
        lo = g[i, j] + (g[i, j + 1] - g[i, j]) * fj
        hi = g[i + 1, j] + (g[i + 1, j + 1] - g[i + 1, j]) * fj
        per_draw = lo + (hi - lo) * fi  # the grid holds f / D (smooth in both axes)
        if per_seed > self.draw_hi:
            per_draw *= self.draw_hi / per_seed  # beyond the grid: saturated, f flat
        return float(per_draw * draws)

    def estimate_parts(self, seeds: np.ndarray) -> tuple[float, float]:
        """``(S, raw)``: the plain sum of per-node sizes and the union estimate.

        The seeds' own chance of being drawn by the other seeds, ``sum_v 1 - (1 - d q_v) ** B``,
        is taken at the seeds' mean popularity (``B (1 - exp(-D mean q))``: exact to first order,
        an upper bound by Jensen), so a batch costs one gather of two columns."""
        if seeds.size == 1:  # one seed: its own expected size is the answer
            size = float(self.mean_size[int(seeds[0])])
            return size, size
        uniq = self.unique(seeds)
        b = int(uniq.size)
        if b == 0:
            return 0.0, 0.0
        draws, pop = np.take(self._per_node, uniq, axis=0).sum(axis=0, dtype=np.float64)
        plain = b + float(draws)
        if draws <= 0.0:
            return plain, plain
        seeds_hit = b * -math.expm1(-float(draws) * float(pop) / b)
        return plain, float(b + self.occupancy(float(draws), b) - seeds_hit)

    def estimate(self, seeds: np.ndarray) -> float:
        """Predicted unique nodes of one batch's sampled subgraph (``seeds`` int64, may repeat)."""
        return self.estimate_parts(seeds)[1]

    def draws(self, ids: np.ndarray) -> float:
        """Sum of ``m_v - 1`` over ``ids`` (repeats counted): what a micro-batch adds to a batch."""
        if ids.size == 1:
            return float(self._draws[int(ids[0])])
        return float(self._draws[ids].sum(dtype=np.float64))

    def union_of(self, draws: float, seeds: int) -> float:
        """Union estimate from totals only (no per-seed terms): the batch former's sizing."""
        return seeds + self.occupancy(draws, seeds)

    def quiver_sum(self, seeds: np.ndarray) -> int:
        """torch-quiver's batch size: the sum of one draw's size per seed (repeats counted)."""
        return int(self.one_draw[seeds].sum(dtype=np.int64))


# ---- building, caching, calibrating ------------------------------------------------------------
def occupancy_grid(popularity: np.ndarray, draw_lo: float, draw_hi: float) -> np.ndarray:
    """``f(B d, B) / (B d)`` for ``B = 2**i`` and ``d`` log-spaced in [draw_lo, draw_hi], with
    ``f(D, B) = sum_w 1 - (1 - min(1, d q_w)) ** B``; ``q`` is first put into ``Q_BINS``
    log-spaced bins (count and mean per bin), so the cost does not grow with the graph."""
    q = popularity[popularity > 0]
    if q.size == 0:
        return np.ones((GRID_MAX_SEEDS_LOG2 + 1, GRID_DRAW_POINTS))
    # the bin of each q from its logarithm (log-spaced edges): one pass, not a binary search
    log_lo, log_hi = math.log(float(q.min())), math.log(float(q.max()) * (1 + 1e-6))
    scale = np.float32(Q_BINS / max(log_hi - log_lo, 1e-12))
    which = ((np.log(q) - np.float32(log_lo)) * scale).astype(np.int32)
    np.clip(which, 0, Q_BINS - 1, out=which)
    count = np.bincount(which, minlength=Q_BINS).astype(np.float64)
    q_bin = np.bincount(which, weights=q, minlength=Q_BINS) / np.maximum(count, 1.0)
    keep = count > 0
    count, q_bin = count[keep], q_bin[keep]
    per_seed = np.geomspace(draw_lo, draw_hi, GRID_DRAW_POINTS)
    grid = np.empty((GRID_MAX_SEEDS_LOG2 + 1, GRID_DRAW_POINTS))
    for i in range(GRID_MAX_SEEDS_LOG2 + 1):
        b = float(2**i)
        x = np.minimum(np.outer(per_seed, q_bin), 1.0)  # [draw points, bins]
        with np.errstate(divide="ignore"):
            miss = np.exp(b * np.log1p(-x))
        grid[i] = ((1.0 - miss) @ count) / (b * per_seed)
    return grid


def table_from_samples(key: str, fanouts: list[int], mean_size: np.ndarray, one_draw: np.ndarray,
                       reach: np.ndarray, degree: np.ndarray | None = None,
                       capacity: int | None = None, alpha: float = 1.0) -> PsgsTable:
    """The table (popularity, grid) from :func:`node_sample_sizes`' three arrays, the nodes'
    in-degrees (for ``update_nodes``), a capacity for nodes appended later (entries of isolated
    nodes) and the popularity exponent: built once (each build costs a pass over every node)."""
    num_nodes = int(mean_size.size)
    extra = max(0, (capacity or 0) - num_nodes)

    def padded(values: np.ndarray, fill: float, dtype: type) -> np.ndarray:
        values = values.astype(dtype, copy=False)
        return np.concatenate([values, np.full(extra, fill, dtype)]) if extra else values

    first_hop = None
    if degree is not None:
        k1 = fanouts[0] if fanouts else 0
        degree = np.maximum(np.asarray(degree, dtype=np.int64), 0)
        first_hop = padded(degree if k1 < 0 else np.minimum(degree, k1), 0, np.int32)
    return PsgsTable(key, list(fanouts), padded(mean_size, 1, np.float32),
                     padded(one_draw, 1, np.int32), padded(reach, 0, np.float64), alpha,
                     first_hop, num_nodes)


def cache_path(key: str, fanouts: list[int], rounds: int) -> Path:
    tag = "_".join(str(k) for k in fanouts)
    return cache_dir() / f"psgs-v{PSGS_VERSION}-{key}-f{tag}-r{rounds}.npz"


def load_or_build(indptr: Tensor, indices: Tensor, fanouts: list[int], rounds: int = 4,
                  device: torch.device | str | None = None, progress: bool = True,
                  use_cache: bool = True, capacity: int | None = None,
                  alpha: float = 1.0) -> PsgsTable:
    """The PSGS table of a graph and fanouts: from the cache file when its key matches, else
    computed (progress bar) and saved (atomically; NumPy arrays only, loaded without pickle).
    ``capacity``: entries for nodes appended later (``PsgsTable.with_capacity``); ``alpha``:
    the popularity exponent (``calibrate_union``, ``saved_alpha``)."""
    key = graph_key(indptr, indices)
    path = cache_path(key, fanouts, rounds)
    degree = (indptr[1:] - indptr[:-1]).cpu().numpy()
    if use_cache and path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                table = table_from_samples(key, fanouts, z["mean_size"], z["one_draw"], z["reach"],
                                           degree, capacity, alpha)
            log.info("PSGS table loaded from %s", path)
            return table
        except (OSError, ValueError, KeyError) as exc:
            log.warning("PSGS cache %s unreadable (%s); recomputing", path, exc)
    t0 = time.perf_counter()
    mean_size, one_draw, reach = node_sample_sizes(indptr, indices, fanouts, rounds,
                                                   device=device, progress=progress)
    arrays = {"mean_size": mean_size.numpy(), "one_draw": one_draw.numpy(),
              "reach": reach.numpy()}
    log.info("PSGS per node for fanouts %s: %d nodes x %d rounds in %.1f s (mean %.1f nodes)",
             fanouts, mean_size.numel(), rounds, time.perf_counter() - t0,
             float(mean_size.mean()) if mean_size.numel() else 0.0)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("PSGS cache not written (%s): recomputed at the next start", exc)
    return table_from_samples(key, fanouts, **arrays, degree=degree, capacity=capacity,
                              alpha=alpha)


def alpha_path(key: str, fanouts: list[int], rounds: int) -> Path:
    """Where the exponent fitted for the table at ``cache_path`` is kept."""
    return cache_path(key, fanouts, rounds).with_suffix(".alpha.json")


def saved_alpha(path: Path) -> float | None:
    """The exponent a start fitted for this table and saved (None: none, or unreadable)."""
    try:
        alpha = float(json.loads(path.read_text())["alpha"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return alpha if 0.0 < alpha < 10.0 else None


def save_alpha(path: Path, alpha: float, error: float) -> None:
    """Keep the fitted exponent beside its table (atomically): a start whose table matches
    reuses it instead of fitting it again (a pass over every node per candidate)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"alpha": alpha, "mean_relative_error": error}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("PSGS exponent not saved (%s): fitted again at the next start", exc)


def calibrate_union(table: PsgsTable, sampler, sizes: tuple[int, ...] = (48, 512, 2048),
                    batches_per_size: int = 4, seed: int = 0) -> tuple[float, float]:
    """Fit the popularity exponent ``alpha`` on measured sample sizes of random batches: the
    value (a grid from 0.8 to 1.6, then +-0.05) with the least mean |relative error|, each size
    weighted alike. Sets it on ``table`` and returns it with its error. ``sampler``: any
    ``BaseSampler``."""
    rng = np.random.default_rng(seed)
    n = table.num_nodes
    measured: list[tuple[int, np.ndarray, float]] = []
    for i, size in enumerate(sorted({max(1, min(s, n // 2 or 1)) for s in sizes})):
        for _ in range(batches_per_size):
            seeds = rng.integers(0, n, size, dtype=np.int64)
            out = sampler.sample(torch.from_numpy(seeds), table.fanouts, int(rng.integers(0, 2**62)))
            measured.append((i, seeds, float(out.n_id.numel())))

    def error(alpha: float) -> float:
        table.set_alpha(alpha)
        per_size: dict[int, list[float]] = {}
        for i, seeds, m in measured:
            per_size.setdefault(i, []).append(abs(table.estimate(seeds) - m) / m)
        return float(np.mean([np.mean(v) for v in per_size.values()]))

    errors = {a: error(a) for a in (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.6)}
    best = min(errors, key=errors.__getitem__)
    errors.update({a: error(a) for a in (best - 0.05, best + 0.05)})
    best = min(errors, key=errors.__getitem__)
    table.set_alpha(best)
    log.info("PSGS popularity exponent alpha = %.2f (mean |relative error| %.3f on %d measured "
             "batches)", best, errors[best], len(measured))
    return best, errors[best]
