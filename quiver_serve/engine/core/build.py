"""The engine core's factory: device, model (weights-only), samplers (the GPU sampler with its
adjacency cache, the C++ sampler), feature placement and the PSGS table, the core's parts
(``parts.py``), CUDA graphs, a warm-up through every path, then the cost model
(``engine/core/calibrate.py``) and the exact table."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.batch import SamplerPool
from quiver_serve.engine.core.core import EngineCore
from quiver_serve.engine.core.devices import worker_device
from quiver_serve.engine.core.forming import BatchFormer
from quiver_serve.engine.core.micro_batch import MicroBatch, Reply
from quiver_serve.engine.core.model_load import LoadSettings
from quiver_serve.engine.core.model_tables import ExactTables, TableArgs
from quiver_serve.engine.core.parts import CoreParts
from quiver_serve.engine.core.quiet import QuietGate
from quiver_serve.engine.core.samplers import gpu_sampler_or_none
from quiver_serve.engine.core.slot_checks import capture_graphs, check_fast_model
from quiver_serve.features.build import build_feature_store
from quiver_serve.features.fap import RequestLog
from quiver_serve.features.store import FeatureStore
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.living import Capacities, LiveGraphArgs
from quiver_serve.models.served import ServedModel, build_model
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.startup import StartPlan, start_plan
from quiver_serve.routing.router import EngineRouter
from quiver_serve.sampling import make_cpu_sampler
from quiver_serve.sampling.base import BaseSampler
from quiver_serve.wire import NO_SEED

if TYPE_CHECKING:
    from quiver_serve.engine.core.graph_sync import GraphSync

log = logging.getLogger(__name__)

T = TypeVar("T")
#: longest wait for a device's CUDA context (``start_device``); past it the start fails by name
CUDA_INIT_TIMEOUT_S = 300.0


def build_core(cfg: ServeConfig, graph: GraphData, index: int,
               pool: SamplerPool | None, calibration: str | None = None,
               progress: bool = True, live: LiveGraphArgs | None = None,
               plan: StartPlan | None = None) -> EngineCore:
    """Device, model (weights-only), samplers, feature placement and the PSGS table, then the
    core from its parts (``parts.py``); with ``live``, the updates acknowledged so far are
    applied; then a warm-up batch, the cost model (``engine/core/calibrate.py``;
    ``calibration`` overrides ``sampling.calibration``) and the exact table; ``plan``: the
    models to serve (default: ``models/startup.start_plan``)."""
    with start_up_threads(cfg):
        return _build_core(cfg, graph, index, pool, calibration, progress, live, plan)


@contextmanager
def start_up_threads(cfg: ServeConfig) -> Iterator[int]:
    """Start-up's CPU work (the capacity copy of the features, their placement, the PSGS and
    FAP tables, the exact table on a CPU) on ``inference.startup_threads`` intra-op threads
    (0: every core this process may run on); serving then runs on ``inference.torch_threads``
    again (docs/decisions/0056-start-up-threads.md)."""
    serving = torch.get_num_threads()
    wanted = cfg.inference.startup_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(wanted, serving))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(serving)


def _build_core(cfg: ServeConfig, graph: GraphData, index: int, pool: SamplerPool | None,
                calibration: str | None, progress: bool, live: LiveGraphArgs | None,
                plan: StartPlan | None) -> EngineCore:
    from quiver_serve.engine.core.calibrate import Calibration

    lap = StartLaps(index)
    caps = live.caps if live is not None else None
    rows = caps.node_capacity if caps is not None else graph.num_nodes
    plan = plan or start_plan(cfg)
    spec = plan.primary()
    device = worker_device(cfg, index)
    cuda_init = start_device(device)
    fanouts = spec.fanouts_or(cfg.sampling.fanouts)
    local = make_cpu_sampler(graph.indptr, graph.indices, cfg.sampling.implementation)
    calib = Calibration(cfg, graph, calibration, progress)
    # the PSGS table (CPU passes over every node) beside the model and the features (copies):
    # a start takes the longer of the two, not their sum (docs/decisions/0066-early-spawn.md)
    with ThreadPoolExecutor(1, thread_name_prefix="psgs") as beside:
        psgs_job = beside.submit(timed, calib.psgs_table, fanouts, device, local,
                                 caps.node_capacity if caps else None)
        model, features = place_model_and_features(cfg, graph, device, caps, spec, cuda_init,
                                                   lap)
        gpu = gpu_sampler_or_none(cfg, graph, device)
        lap("samplers")
        psgs, psgs_s = psgs_job.result()
    lap(f"psgs ({psgs_s:.2f} s beside the above)")
    former = BatchFormer(cfg.batching.max_batch_nodes, psgs,
                         RequestLog(cfg.features.request_log_size),
                         expected_fill_for(cfg.batching.expected_fill, device))
    parts = core_parts(cfg, graph, index, former, gpu, pool, live, spec.name,
                       (device, features), rows)
    core = EngineCore(model, features, device, local, fanouts, graph.num_nodes, parts,
                      index=index, spec=spec)
    lap("parts")
    if parts.graph_sync is not None and live is not None:
        replay_updates(core, parts.graph_sync, live, index)
    lap("replay")
    check_fast_model(core)
    capture_graphs(core, cfg.inference.cuda_graph_max_seeds)
    warm_up(core)
    lap("checks, graphs and warm-up")
    calib.cost_model(core)
    lap("cost model")
    core.tables.build(core, core.model, progress)
    if core.exact_table is not None:
        _warm_batches(core, exact_only=True)  # the table's answer path, once
    lap("exact table")
    load_other_models(core, cfg, plan)
    lap("other models")
    lap.report()
    return core


class StartLaps:
    """Seconds of each phase of an engine core's start, logged in one line at the end (the
    restart benchmark's timeline reads it)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.laps: list[tuple[str, float]] = []
        self._last_s = self._first_s = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now_s = time.perf_counter()
        self.laps.append((phase, now_s - self._last_s))
        self._last_s = now_s

    def report(self) -> None:
        log.info("engine %d built in %.2f s: %s", self.index, self._last_s - self._first_s,
                 ", ".join(f"{phase} {s:.2f} s" for phase, s in self.laps))


def core_parts(cfg: ServeConfig, graph: GraphData, index: int, former: BatchFormer,
               gpu_sampler: BaseSampler | None, pool: SamplerPool | None,
               live: LiveGraphArgs | None, table_model: str,
               placed: tuple[torch.device, FeatureStore], rows: int) -> CoreParts:
    """The core's parts around ``former`` and ``gpu_sampler``: router, exact tables of
    ``table_model`` (built once the core is warm), pool overlap, the living graph's follower,
    re-placement and load settings; ``placed``: the core's device and its feature store."""
    from quiver_serve.features.replace import Replacer

    device, features = placed
    tables = ExactTables(TableArgs(cfg.exact, (graph.indptr, graph.indices), rows),
                         table_model, device)  # a new version of it gets a table of its own
    parts = CoreParts(former=former, router=EngineRouter(
        cfg.sampling.route, quiver_threshold=cfg.sampling.quiver_threshold), tables=tables,
        pool=pool, gpu_sampler=gpu_sampler, replacer=Replacer(cfg, graph, features),
        max_waiting=cfg.batching.queue_capacity, quiet=QuietGate(cfg.exact.quiet_wait_ms / 1e3))
    if cfg.sampling.pool_overlap != "off" and cfg.sampling.route == "auto" and pool is not None:
        from quiver_serve.engine.core.overlap import PoolOverlap

        parts.overlap = PoolOverlap(serial=cfg.sampling.pool_overlap == "serial")
    if live is not None:
        from quiver_serve.engine.core.graph_sync import GraphSync
        from quiver_serve.graph.state import GraphState

        parts.graph_sync = GraphSync(graph, live.base_version, live.caps, Path(live.log_dir),
                                     GraphState(live.state), index, cfg)
    parts.current_degrees = degree_source(parts.graph_sync, graph, rows)
    inf = cfg.inference
    parts.loads = LoadSettings(inf.precision, inf.fast_model, inf.cuda_graph_max_seeds,
                               cfg.models.unload_drain_s, cfg.models.table_build_step_ms / 1e3)
    return parts


def load_other_models(core: EngineCore, cfg: ServeConfig, plan: StartPlan) -> None:
    """Every start-up version but the primary, built as a load builds them, and each model's
    traffic split (``models/startup.py``)."""
    from quiver_serve.engine.core.model_load import build_slot

    inf = cfg.inference
    for spec in plan.others():
        slot = build_slot(core, spec, inf.precision, inf.fast_model, inf.cuda_graph_max_seeds)
        core.models.add(slot)
        log.info("engine %d: %s version %d loaded (%s)", core.index, spec.name, spec.version,
                 {k: round(v, 3) for k, v in slot.load_s.items()})
    for model in plan.models:
        core.models.set_traffic(model.name, model.traffic)


def degree_source(sync: GraphSync | None, graph: GraphData,
                  rows: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
    """() -> in-degree and self-loop count of every node (``rows`` of them) on the graph the
    core serves now (``sync``'s overlay; None: the fixed ``graph``): a GCN loaded later
    normalises by them."""

    def current() -> tuple[torch.Tensor, torch.Tensor | None]:
        if sync is None:
            return _padded(graph.degree(), rows), _padded(graph.self_loop_count(), rows)
        nodes = np.arange(sync.overlay.num_nodes, dtype=np.int64)
        return (_padded(torch.from_numpy(sync.overlay.degree(nodes)), rows),
                _padded(torch.from_numpy(sync.overlay.self_loops(nodes)), rows))

    return current


def replay_updates(core: EngineCore, sync: GraphSync, live: LiveGraphArgs, index: int) -> None:
    """Apply what the log holds to ``core`` (start-up replay) and publish its version."""
    t0 = time.perf_counter()
    sync.catch_up(core)
    assert sync.state is not None
    sync.state.publish_engine(index, sync.version, 0.0)
    if sync.version > live.base_version:
        log.info("engine %d: %d update(s) applied over base version %d in %.2f s", index,
                 sync.version - live.base_version, live.base_version, time.perf_counter() - t0)


def warm_up(core: EngineCore) -> None:
    """Tiny batches through every path in this process (GPU and CPU sampling, sampled and exact),
    so the first request pays no lazy initialisation; the pool is not used here."""
    mode = core.router.forced
    core.learn_costs = False
    try:
        for route in ("gpu", "local") if core.gpu_sampler is not None else ("local",):
            core.router.forced = route
            _warm_batches(core)
    finally:
        core.router.forced = mode
        core.learn_costs = True
    core.reset_cost_models()  # warm-up timings include one-off costs: forget them
    core.reset_feature_counts()  # and their rows are no requests' hits or misses


def _warm_batches(core: EngineCore, exact_only: bool = False) -> None:
    for exact in (True,) if exact_only else (False, True):
        mb = MicroBatch(b"", -1, exact, NO_SEED, np.zeros(1, np.int64), np.ones(1, np.int64),
                        np.array([time.time() + 60.0]))
        refused = core.add(mb)
        if refused is not None:
            if exact and refused.done.errors[0].code == "exact_unsupported":
                continue  # the model gives no exact answers (a graph-wide norm)
            raise RuntimeError(f"warm-up batch refused: {refused.done.errors}")
        deadline = time.monotonic() + 60
        replies: list[Reply] = []
        while not replies and time.monotonic() < deadline:
            replies = core.step()
        if not replies or replies[0].done.errors:
            raise RuntimeError(f"warm-up batch failed: {replies[0].done.errors if replies else 'no reply'}")


def start_device(device: torch.device) -> threading.Thread | None:
    """Creates ``device``'s CUDA context on a thread of its own (seconds on some hosts), so
    that the CPU work of a start runs meanwhile; join it before the device's first use. None
    for a CPU."""
    if device.type != "cuda":
        return None

    def init() -> None:
        torch.cuda.set_device(device)
        torch.cuda.init()

    thread = threading.Thread(target=init, name="cuda-init", daemon=True)
    thread.start()
    return thread


def timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    """``fn(*args)`` and its seconds."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def place_model_and_features(cfg: ServeConfig, graph: GraphData, device: torch.device,
                             caps: Capacities | None = None, spec: ModelSpec | None = None,
                             cuda_init: threading.Thread | None = None,
                             lap: Callable[[str], None] = lambda _: None,
                             ) -> tuple[ServedModel, FeatureStore]:
    """The model on ``device`` (weights-only) and the feature store: the hottest rows on the
    GPU within ``inference.gpu_cache_bytes``, the rest in host memory. With ``caps`` (a living
    graph) per-node state is sized for ``caps.node_capacity`` nodes, the rows past the graph's
    nodes unused until nodes are appended. ``cuda_init`` (``start_device``) is joined once the
    host-side work is done; ``lap`` is told each phase."""
    rows = caps.node_capacity if caps is not None else graph.num_nodes
    spec = spec or ModelSpec.from_config(cfg.model)
    self_loops = _padded(graph.self_loop_count(), rows) if spec.pyg_class == "GCN" else None
    model = ServedModel(build_model(spec, graph.num_features),
                        _padded(graph.degree(), rows), self_loops,
                        precision=cfg.inference.precision, fast=cfg.inference.fast_model)
    x = None
    if rows > graph.num_nodes or (graph.mapped_from is not None and caps is not None):
        x = capacity_copy(graph.x, rows)  # feature updates write the store's rows, not files
    lap("model and features on the host")
    if cuda_init is not None:
        cuda_init.join(timeout=CUDA_INIT_TIMEOUT_S)
        if cuda_init.is_alive():
            raise RuntimeError(f"the CUDA context of {device} was not created within "
                               f"{CUDA_INIT_TIMEOUT_S:.0f} s")
        lap("device (its context created beside the above)")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's current device (the init thread set its own)
    model = model.to(device)
    store = build_feature_store(cfg, graph, device, x)
    lap("model and features on the device")
    return model, store


def capacity_copy(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` in private memory with zero rows up to ``rows``: one parallel copy (torch's
    intra-op threads, ``start_up_threads``), not a zero fill of the whole matrix and a copy
    over it; the capacity rows are written once, as zeros."""
    out = torch.empty((max(rows, x.size(0)), x.size(1)), dtype=x.dtype)
    out[:x.size(0)].copy_(x)
    out[x.size(0):].zero_()
    return out


def _padded(values: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-node values followed by zeros for the capacity rows."""
    if rows <= values.numel():
        return values
    return torch.cat([values, values.new_zeros(rows - values.numel())])


def expected_fill_for(setting: bool | str, device: torch.device) -> bool:
    """``batching.expected_fill`` for an engine core on ``device`` (``auto``: on a CPU only;
    decision 31)."""
    return device.type != "cuda" if setting == "auto" else bool(setting)
