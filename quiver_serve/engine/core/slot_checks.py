"""What makes a model version ready to serve in an engine core, at start-up and at each load:
its fast layers checked against PyG's on a real sample, and its CUDA graphs captured and checked
(``models/graphed.py``)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import Tensor

from quiver_serve.engine.core.model_slots import ModelSlot
from quiver_serve.engine.core.samplers import SamplingCore
from quiver_serve.models.graphed import GraphedForward
from quiver_serve.sampling.base import BaseSampler, SamplerOutput, new_batch_seed

log = logging.getLogger(__name__)


class SlotCore(SamplingCore, Protocol):
    """The engine core as a model version's checks see it (``core.EngineCore``)."""

    index: int
    num_nodes: int
    on_gpu: bool
    primary: ModelSlot

    @property
    def compute_stream(self) -> torch.cuda.Stream | None: ...


def capture_graphs(core: SlotCore, max_seeds: int, slot: ModelSlot | None = None,
                   sampler: BaseSampler | None = None,
                   stream: torch.cuda.Stream | None = None) -> None:
    """CUDA graphs of gather + model for ``slot``'s (default: the primary's) sampled batches of
    up to ``max_seeds`` seeds (GPU, features on the device); each is checked against the eager
    forward on a real sample. ``stream``: captured on it, beside a serving loop in another
    thread (``model_load.py``; thread-local capture mode)."""
    slot = slot or core.primary
    if not (core.on_gpu and core.features.capturable and max_seeds > 0):
        return
    sampler = sampler or core.gpu_sampler or core.local_sampler
    fanouts = slot.fanouts

    def sample(num_seeds: int) -> SamplerOutput:
        n = min(core.num_nodes, sampler.num_nodes)
        seeds = torch.randint(0, n, (num_seeds,), dtype=torch.int64)
        return sampler.sample(seeds, fanouts, new_batch_seed())

    def model(x: Tensor, n_id: Tensor, edges: Tensor, nodes: list[int],
              edge_counts: list[int]) -> Tensor:
        return slot.served(x, n_id, edges, nodes, edge_counts, False)

    thread_local = stream is not None
    with torch.cuda.stream(stream if thread_local else core.compute_stream):
        graphed = GraphedForward.capture(model, core.features.gather, core.device, fanouts,
                                         max_seeds, sample, thread_local)
    stream.synchronize() if thread_local else torch.cuda.synchronize(core.device)
    slot.graphed = graphed if graphed.graphs else None
    if slot.graphed is not None:
        log.info("engine %d: %s version %d: CUDA graphs for sampled batches of 1..%d seeds",
                 core.index, slot.name, slot.version, slot.graphed.max_seeds)


def check_fast_model(core: SlotCore, num_seeds: int = 64, slot: ModelSlot | None = None,
                     sampler: BaseSampler | None = None) -> float | None:
    """Check ``slot``'s (default: the primary's) fast model path against PyG's layers on one
    real sampled batch (start-up, and each load)."""
    slot = slot or core.primary
    sampler = sampler or core.local_sampler
    n = min(core.num_nodes, sampler.num_nodes)
    seeds = torch.randint(0, n, (num_seeds,), dtype=torch.int64)
    sb = sampler.sample(seeds, slot.fanouts, new_batch_seed())
    n_id = sb.n_id.to(core.device)
    x = core.features.gather(n_id)
    return slot.served.check_fast(x, n_id, sb.edge_index.to(core.device),
                                  sb.num_sampled_nodes, sb.num_sampled_edges)
