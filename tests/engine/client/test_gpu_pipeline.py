"""The serving pipeline on a CUDA device: GPU route, exact mode, and one semantics across routes.

Self-contained (runs under ``pytest --noconftest`` in python -m bench.gpu gate); needs CUDA and pydantic.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("pydantic")

from quiver_serve.config import ServeConfig, resolve_path  # noqa: E402
from quiver_serve.engine.client.pipeline import Pipeline, PipelineObserver  # noqa: E402
from quiver_serve.graph.datasets import load_planetoid_raw  # noqa: E402
from quiver_serve.messages import BatchStats  # noqa: E402
from quiver_serve.models.served import build_model  # noqa: E402
from tests.exact_checks import check_concurrent_exact  # noqa: E402


class Routes(PipelineObserver):
    def __init__(self) -> None:
        self.routes: list[str] = []
        self.hits = self.misses = 0

    def on_batch(self, stats: BatchStats) -> None:
        self.routes.append(stats.route)
        self.hits += stats.cache_hits
        self.misses += stats.cache_misses


def start(route: str, gpu_mode: str = "device") -> tuple[Pipeline, Routes]:
    cfg = ServeConfig.default()
    cfg.inference.device = "cuda"
    cfg.sampling.route = route
    cfg.sampling.gpu_mode = gpu_mode
    cfg.server.start_timeout_s = 300
    graph = load_planetoid_raw(resolve_path(cfg.graph.path), "cora")
    observer = Routes()
    return Pipeline(cfg, graph=graph, observer=observer).start(), observer


@pytest.fixture(scope="module")
def gpu_pipeline():  # type: ignore[no-untyped-def]
    p, routes = start("gpu")
    yield p, routes
    p.stop()


def test_gpu_route_samples_on_the_gpu(gpu_pipeline) -> None:  # type: ignore[no-untyped-def]
    p, routes = gpu_pipeline
    info = p.supervisor.engine_info(0)
    assert info["gpu_sampler"] in ("cuda", "uva")
    assert info["device"].startswith("cuda")
    out = p.embed([0, 1, 2707])
    assert out.shape == (3, 64) and out.device.type == "cpu"
    assert routes.routes and set(routes.routes) == {"gpu"}
    # Cora fits gpu_cache_bytes: every row, the headroom for appended nodes included
    assert info["feature_rows_on_gpu"] == p.node_capacity > p.graph.num_nodes
    assert routes.hits > 0 and routes.misses == 0


def test_features_stay_on_host_when_over_budget() -> None:
    cfg = ServeConfig.default()
    cfg.inference.device, cfg.sampling.route, cfg.inference.gpu_cache_bytes = "cuda", "gpu", 1024
    graph = load_planetoid_raw(resolve_path(cfg.graph.path), "cora")
    observer = Routes()
    p = Pipeline(cfg, graph=graph, observer=observer).start()
    try:
        assert p.supervisor.engine_info(0)["feature_rows_on_gpu"] == 0  # 1 KiB: not even the map
        assert p.embed([1, 2, 3]).shape == (3, 64)
        assert observer.misses > 0 and observer.hits == 0
    finally:
        p.stop()


def test_gpu_exact_mode_equals_pyg_full_graph(gpu_pipeline) -> None:  # type: ignore[no-untyped-def]
    p, _ = gpu_pipeline
    model = build_model(p.cfg.model, p.graph.num_features)
    with torch.no_grad():
        full = model(p.graph.x, p.graph.edge_index())
    ids = [0, 1, 2707, 1, 633, 1862]
    torch.testing.assert_close(p.embed(ids, exact=True), full[ids], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gpu_mode", ["device", "uva"])
def test_same_seed_same_embedding_on_cpu_and_gpu_routes(gpu_pipeline, gpu_mode: str) -> None:  # type: ignore[no-untyped-def]
    gpu, _ = gpu_pipeline
    other, routes = start("cpu") if gpu_mode == "device" else start("gpu", gpu_mode="uva")
    try:
        ids = list(range(0, 2708, 97))
        a = gpu.embed(ids, seed=2024)
        b = other.embed(ids, seed=2024)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # same subgraph, other device
        assert not torch.allclose(a, gpu.embed(ids, seed=2025), atol=1e-4)
    finally:
        other.stop()


def test_concurrent_exact_requests_on_the_gpu_equal_pyg(gpu_pipeline) -> None:  # type: ignore[no-untyped-def]
    """Many exact requests in flight at once: merged batches, two launched at a time, each row
    still equal to the full-graph output."""
    p, _ = gpu_pipeline
    check_concurrent_exact(p, p.graph, 300, 40)
