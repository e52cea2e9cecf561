"""The typed engine core's GPU parts (engine/core/typed_gpu.py): on the CPU through their torch
twins (the GPU sampler's reference code, CPU tensors as the GPU tier), and on a GPU (``gpu``
marker): seeded answers are the CPU core's for the same seed on both sampling paths, exact answers
equal PyG's full-graph forward on a random typed graph, and batches route by their seed type's
predicted subgraph size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quiver_serve.config import ServeConfig
from quiver_serve.engine.core.typed_core import build_typed_core
from quiver_serve.engine.core.typed_gpu import build_typed_gpu_core
from quiver_serve.routing.router import Route
from quiver_serve.routing.typed_psgs import TypedPsgs
from tests.engine.core.test_typed_core import CONFIG, _answer, _mb
from tests.models.test_typed_models import TYPED_MODELS, full_graph, shop_graph, spec

TOL = 1e-5
DEVICES = [pytest.param("cpu", id="twin"),
           pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


def shop_config(budget_bytes: int, materialize: str = "off") -> ServeConfig:
    cfg = ServeConfig()
    cfg.sampling.fanouts = [4, 3]
    cfg.inference.gpu_cache_bytes = budget_bytes
    cfg.exact.materialize = materialize
    return cfg


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_answers_are_the_cpu_cores_on_both_paths(device: str) -> None:
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.exact.materialize = "off"
    cfg.inference.gpu_cache_bytes = 300_000  # some paper rows on the "GPU", the rest on the host
    from quiver_serve.graph.typed_load import load_typed_graph

    graph = load_typed_graph(cfg.graph)
    cpu = build_typed_core(cfg, graph)
    core = build_typed_gpu_core(cfg, graph, device=torch.device(device))
    placed = core.features.placement.gpu_nodes["paper"].numel()
    assert 0 < placed < graph.num_nodes["paper"]
    for node_type, ids in (("paper", [3, 17, 3, 1000, 2707]), ("word", [0, 1432, 7])):
        seeds = torch.tensor(ids)
        want = cpu.rows(node_type, seeds, False, 99)
        for route in (Route.GPU, Route.LOCAL):
            got = core.rows_on(route, node_type, seeds, False, 99)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    # through the queue: a seeded request answers the same rows
    reply = _answer(core, _mb(1, [3, 17, 3, 1000, 2707], "paper", seed=99))
    np.testing.assert_allclose(reply.rows, cpu.rows("paper", torch.tensor([3, 17, 3, 1000, 2707]),
                                                    False, 99), rtol=0, atol=TOL)
    stats = core.stats_by_type()
    assert stats["paper"]["features"]["hits"] > 0 and stats["paper"]["features"]["misses"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_small_batches_on_the_cpu_answer_as_the_gpu_path(device: str) -> None:
    """``inference.typed_cpu_max_seeds``: batches up to that many seeds are sampled and
    computed on the CPU (the model's twin there); the same rows as the GPU path and the CPU
    core; larger batches stay on the GPU path; -1 on a GPU measures the limit at start."""
    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.exact.materialize = "off"
    cfg.inference.typed_cpu_max_seeds = 3
    from quiver_serve.graph.typed_load import load_typed_graph

    graph = load_typed_graph(cfg.graph)
    cpu = build_typed_core(cfg, graph)
    core = build_typed_gpu_core(cfg, graph, device=torch.device(device))
    assert core.cpu_max_seeds == 3 and core.cpu_twin is not None
    assert next(core.cpu_twin.model.parameters()).device.type == "cpu"
    for ids in ([3, 17, 3], [5], [3, 17, 3, 1000, 2707]):
        seeds = torch.tensor(ids)
        want = cpu.rows("paper", seeds, False, 7)
        np.testing.assert_allclose(core.rows("paper", seeds, False, 7), want, rtol=0, atol=TOL)
        np.testing.assert_allclose(core.rows_on(Route.GPU, "paper", seeds, False, 7), want,
                                   rtol=0, atol=TOL)
    paths = core.stats_by_type()["paper"]
    assert paths[str(Route.CPU)]["batches"] == 2 and paths[str(Route.CPU)]["seeds"] == 4
    cfg.inference.typed_cpu_max_seeds = 0
    assert build_typed_gpu_core(cfg, graph, device=torch.device(device)).cpu_twin is None
    if device == "cuda":
        cfg.inference.typed_cpu_max_seeds = -1
        measured = build_typed_gpu_core(cfg, graph, device=torch.device(device))
        assert measured.cpu_max_seeds in (0, 1, 48, 256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "materialize"), [("to_hetero_sage_sum", "off"),
                                                   ("to_hetero_sage_sum", "on"),
                                                   ("rgcn", "off"), ("hgt", "on")])
def test_exact_answers_equal_pyg_full_graph(device: str, name: str, materialize: str) -> None:
    graph = shop_graph(seed=5)
    pyg_class, kwargs, to_hetero = TYPED_MODELS[name]
    torch.manual_seed(0)
    model_spec = spec(pyg_class, kwargs, to_hetero)
    core = build_typed_gpu_core(shop_config(1000, materialize), graph, spec=model_spec,
                                device=torch.device(device))
    want = full_graph(core.served.to("cpu"), graph)
    core.served.to(device)
    for node_type in ("user", "item", "shop"):
        ids = [0, graph.num_nodes[node_type] - 1, 2, 0]
        reply = _answer(core, _mb(2, ids, node_type, exact=True))
        assert not reply.done.errors
        np.testing.assert_allclose(reply.rows, want[node_type][ids].numpy(), rtol=0, atol=TOL)


def test_batches_route_by_their_seed_types_predicted_size() -> None:
    graph = shop_graph(seed=6)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    core = build_typed_gpu_core(shop_config(0), graph, spec=spec(pyg_class, kwargs, to_hetero),
                                device=torch.device("cpu"))
    # PSGS per seed type: measured, growing with the batch, smaller per seed as seeds share
    for t in ("user", "item", "shop"):
        one, many = core.psgs.estimate(t, 1), core.psgs.estimate(t, 48)
        assert 1 <= one < many <= 48 * one
    # the cost model's lines: GPU cheap per node, CPU here cheap per batch
    cost = core.router.cost
    cost.paths["gpu"].set_line(1e-3, 1e-7, cost.x_range)
    cost.paths["local"].set_line(1e-5, 1e-5, cost.x_range)
    core.psgs = TypedPsgs({"user": [(1, 2.0), (256, 512.0)], "shop": [(1, 500.0), (256, 6e4)]})
    assert core.route("user", 1, False)[0] == Route.LOCAL
    assert core.route("shop", 200, False)[0] == Route.GPU
    core.rows(*("shop", torch.arange(5), False, 1))
    core.rows(*("user", torch.tensor([1]), False, 1))
    stats = core.stats_by_type()
    assert stats["shop"]["gpu"]["batches"] == 1 and stats["user"]["local"]["batches"] == 1
    # exact batches sample every neighbour on the GPU path
    assert core.route("user", 1, True)[0] == Route.GPU


def test_psgs_interpolates_between_measured_sizes() -> None:
    psgs = TypedPsgs({"paper": [(1, 300.0), (8, 2000.0), (48, 9000.0)]})
    assert psgs.estimate("paper", 8) == pytest.approx(2000.0)
    assert 2000.0 < psgs.estimate("paper", 20) < 9000.0
    assert psgs.estimate("paper", 96) == pytest.approx(18000.0)
    assert psgs.estimate("other", 5) == 5.0


def test_each_batch_reports_its_type_route_and_feature_rows_per_type() -> None:
    from quiver_serve.metrics.typed import TypedMetrics

    graph = shop_graph(seed=7)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    core = build_typed_gpu_core(shop_config(1000), graph, spec=spec(pyg_class, kwargs, to_hetero),
                                device=torch.device("cpu"))
    seen: list = []
    metrics = TypedMetrics()
    core.on_typed_stats = lambda s: (seen.append(s), metrics.observe(s))
    core.rows_on(Route.GPU, "shop", torch.tensor([0, 1, 1]), False, 3)
    core.rows_on(Route.LOCAL, "user", torch.tensor([5]), False, 3)
    assert [(s.node_type, s.route, s.num_seeds) for s in seen] == [("shop", "gpu", 3),
                                                                  ("user", "local", 1)]
    first = seen[0]
    # every sampled node of a featured type read one row, from one tier or the other
    out = core.sampler.sample("shop", torch.tensor([0, 1, 1]), core.fanouts, 3)
    assert {t: sum(first.feature_rows[t]) for t in graph.x} == \
        {t: int(out.node[t].numel()) for t in graph.x}
    batches = {tuple(s.labels.values()): s.value for s in metrics.batches.collect()[0].samples
               if s.name.endswith("_total")}
    assert batches == {("shop", "gpu"): 1.0, ("user", "local"): 1.0}
