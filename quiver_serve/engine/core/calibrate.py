"""Start-up calibration of the engine core's PSGS table and cost model.

:class:`Calibration` makes an engine core's PSGS table (cached per graph and fanouts; before the
core is built) with the union correction fitted on measured samples, and, once the core is warm,
its cost model: the saved one when its key (graph, fanouts, hardware, GPU memory mode, model)
matches, else timed here and saved.

Timing (``calibrate_paths``): for batch sizes 1 .. ``max_batch_nodes`` (powers of 4 and 48), random
uniform seeds, every in-engine path (C++ sampler here, GPU sampler) samples a few batches; the
model runs on each sample (gather + forward, as the engine runs it: CUDA graphs for small batches,
device time on a GPU). A line in the measured sampled-node count is fitted per path and for the
model; the points themselves start each line's per-size correction (``cost.LatencyModel``). The pool path is the C++ line plus the hop there and back (a prior; the engine refines
it from round trips to idle samplers). Bounded by ``calibration_s``; progress bar.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from quiver_serve.engine.core.batch import Batch
from quiver_serve.routing.cost import PRIORS, CostModel, cost_key, cost_path, fit_line
from quiver_serve.routing.psgs import (
    PsgsTable,
    alpha_path,
    calibrate_union,
    graph_key,
    load_or_build,
    save_alpha,
    saved_alpha,
)
from quiver_serve.sampling.base import BaseSampler, SamplerOutput, new_batch_seed

if TYPE_CHECKING:
    from quiver_serve.config import ServeConfig
    from quiver_serve.engine.core.core import EngineCore
    from quiver_serve.graph.csc import GraphData

log = logging.getLogger(__name__)

#: timed batches per (path, size) after one untimed warm-up batch; their medians make one point
REPEATS = 5


def calibration_sizes(num_nodes: int, max_batch_nodes: int) -> list[int]:
    top = max(1, min(max_batch_nodes, num_nodes))
    sizes = {1, 48, top}
    s = 4
    while s < top:
        sizes.add(s)
        s *= 4
    return sorted(sizes)


def _time_compute(core: EngineCore, seeds: torch.Tensor, sampled: SamplerOutput) -> float:
    """Gather + model of one sampled batch, timed as the engine times it."""
    batch = Batch(-1, [], seeds, False, 0, sampled=sampled, slot=core.primary)
    if core.compute_stream is None:
        t0 = time.perf_counter()
        core.forward(batch)
        return time.perf_counter() - t0
    core.stage(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(core.compute_stream):
        start.record()
        core.forward(batch)
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _time_sample(core: EngineCore, sampler: BaseSampler,
                 seeds: torch.Tensor) -> tuple[float, SamplerOutput]:
    t0 = time.perf_counter()
    if core.sample_stream is not None:
        with torch.cuda.stream(core.sample_stream):
            out = sampler.sample(seeds, core.fanouts, new_batch_seed())
    else:
        out = sampler.sample(seeds, core.fanouts, new_batch_seed())
    return time.perf_counter() - t0, out


def calibrate_paths(core: EngineCore, budget_s: float = 20.0, progress: bool = True,
                    seed: int = 0) -> CostModel:
    """Time every in-engine path and the model over a range of batch sizes (see module doc)."""
    from tqdm import tqdm

    paths: dict[str, BaseSampler] = {"local": core.local_sampler}
    if core.gpu_sampler is not None:
        paths["gpu"] = core.gpu_sampler
    sizes = calibration_sizes(core.num_nodes, core.former.max_batch_nodes)
    rng = np.random.default_rng(seed)
    points: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    compute: list[tuple[float, float]] = []
    end_s = time.monotonic() + budget_s
    bar = tqdm(total=len(paths) * len(sizes), desc="calibrating paths", unit="size",
               disable=not progress)
    with torch.no_grad():
        for size in sizes:  # small sizes first: a cut-off keeps a line over what was timed
            for name, sampler in paths.items():
                bar.update(1)
                if time.monotonic() > end_s:
                    continue
                timed = []
                for rep in range(REPEATS + 1):
                    seeds = torch.from_numpy(rng.integers(0, core.num_nodes, size, dtype=np.int64))
                    sample_s, out = _time_sample(core, sampler, seeds)
                    compute_s = _time_compute(core, seeds, out)
                    if rep:  # the first of each size pays one-off costs
                        timed.append((float(out.n_id.numel()), sample_s, compute_s))
                x, sample_s, compute_s = np.median(np.array(timed), axis=0).tolist()
                points[name].append((x, sample_s))
                compute.append((x, compute_s))
    bar.close()
    lines = {p: fit_line(pts) for p, pts in points.items() if pts}
    xs = [x for x, _ in compute] or [10.0, 10_000.0]
    x_range = (min(xs), max(xs))
    curves = {p: pts for p, pts in points.items() if pts}
    if compute:
        curves["compute"] = compute
    hop_s = PRIORS["cpu"][0] - PRIORS["local"][0]  # CostModel's prior hop
    if "local" in lines:  # the pool path: the C++ sampler's plus the hop there and back
        lines["cpu"] = (lines["local"][0] + hop_s, lines["local"][1])
        curves["cpu"] = [(x, y + hop_s) for x, y in curves["local"]]
    model = CostModel(lines, fit_line(compute), x_range=x_range, points=curves) if compute \
        else CostModel(lines, x_range=x_range, points=curves)
    model.calibrated = True
    for p, m in model.paths.items():
        log.info("cost %-5s: %.3f ms + %.3f us per sampled node", p, m.fixed_s * 1e3,
                 m.per_seed_s * 1e6)
    log.info("cost model: %.3f ms + %.3f us per sampled node", model.compute.fixed_s * 1e3,
             model.compute.per_seed_s * 1e6)
    return model


def engine_cost_key(cfg: ServeConfig, table: PsgsTable, core: EngineCore) -> dict[str, Any]:
    gpu = getattr(core.gpu_sampler, "name", None)
    spec = core.primary.spec
    model = {"class": spec.pyg_class, "kwargs": spec.kwargs,
             "precision": cfg.inference.precision, "fast": cfg.inference.fast_model,
             "graphs": cfg.inference.cuda_graph_max_seeds,
             # where feature rows live changes the gather's cost
             "gpu_cache_bytes": cfg.inference.gpu_cache_bytes,
             "features": cfg.features.model_dump(mode="json")}
    return cost_key(table.key, core.fanouts, str(core.device),
                    {"gpu_sampler": gpu, "cpu_sampler": core.local_sampler.name,
                     "torch_threads": cfg.inference.torch_threads,
                     "max_batch_nodes": cfg.batching.max_batch_nodes, "model": model})


class Calibration:
    """Start-up routing calibration of one engine core (see the module docstring): ``mode``
    overrides ``cfg.sampling.calibration`` (``auto``: reuse a matching saved cost model;
    ``startup``/``force``: time now and save; ``off``: priors, refined online)."""

    def __init__(self, cfg: ServeConfig, graph: GraphData, mode: str | None = None,
                 progress: bool = True) -> None:
        self.cfg, self.graph, self.progress = cfg, graph, progress
        self.mode = mode or cfg.sampling.calibration

    def psgs_table(self, fanouts: list[int], device: torch.device, sampler: BaseSampler,
                   capacity: int | None = None) -> PsgsTable:
        """The PSGS table of the graph and ``fanouts``, its union correction fitted on
        ``sampler``'s samples; ``capacity``: entries for nodes appended later."""
        rounds = self.cfg.sampling.psgs_rounds
        path = alpha_path(graph_key(self.graph.indptr, self.graph.indices), fanouts, rounds)
        alpha = saved_alpha(path) if self.mode == "auto" else None
        table = load_or_build(self.graph.indptr, self.graph.indices, fanouts, rounds,
                              device=device if device.type == "cuda" else None,
                              progress=self.progress, capacity=capacity, alpha=alpha or 1.0)
        if alpha is None:
            save_alpha(path, *calibrate_union(table, sampler))
        else:
            log.info("PSGS popularity exponent alpha = %.2f, fitted before (%s)", alpha, path)
        return table

    def cost_model(self, core: EngineCore) -> None:
        """Give the warm ``core`` its cost model: loaded when a saved one matches, else timed
        and saved (nothing with mode ``off``)."""
        if self.mode == "off" or core.psgs is None:
            return
        cfg = self.cfg
        key = engine_cost_key(cfg, core.psgs, core)
        path = cost_path(key)
        model = CostModel.load(path, key) if self.mode == "auto" else None
        if model is not None:
            log.info("cost model loaded from %s", path)
        else:
            model = calibrate_paths(core, cfg.sampling.calibration_s, self.progress)
            model.key = key
            try:
                model.save(path)
                log.info("cost model saved to %s", path)
            except OSError as exc:
                log.warning("cost model not saved (%s): calibrated again at the next start",
                            exc)
        core.set_cost_model(model)
