"""The router is a plain decision function over queue depths."""

from __future__ import annotations

import pytest
import torch

from quiver_serve.engine.router import QueueDepthRouter, RouterState
from quiver_serve.messages import BatchedRequest

BATCH = BatchedRequest(batch_id=0, request_ids=["r"], offsets=[0, 1], node_ids=torch.tensor([1]),
                       exact=False, seed=0, deadlines_s=[1e12])


def test_cpu_only_box_uses_pool_or_local() -> None:
    r = QueueDepthRouter()
    assert r.decide(BATCH, RouterState([3, 1], [0], False)).route == "cpu"
    assert r.decide(BATCH, RouterState([3, 1], [0], False)).sampler == 1
    assert r.decide(BATCH, RouterState([], [0], False)).route == "local"


def test_gpu_box_joins_shortest_queue() -> None:
    r = QueueDepthRouter()
    assert r.decide(BATCH, RouterState([0], [2, 1], True)).route == "cpu"
    d = r.decide(BATCH, RouterState([5], [2, 1], True))
    assert (d.route, d.worker) == ("gpu", 1)
    assert r.decide(BATCH, RouterState([], [0], True)).route == "gpu"


def test_forced_routes_and_impossible_ones() -> None:
    assert QueueDepthRouter("gpu").decide(BATCH, RouterState([0], [9], True)).route == "gpu"
    with pytest.raises(RuntimeError, match="CUDA"):
        QueueDepthRouter("gpu").decide(BATCH, RouterState([0], [0], False))
    with pytest.raises(RuntimeError, match="num_cpu_workers"):
        QueueDepthRouter("cpu").decide(BATCH, RouterState([], [0], False))
    with pytest.raises(ValueError):
        QueueDepthRouter("fastest")
