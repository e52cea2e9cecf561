"""The living graph on the GPU paths (docs/architecture.md, "The living graph"): exact answers after
a held-out update stream equal PyG's ``model(x, edge_index)``, served by the CUDA sampler in device
and UVA mode (with the adjacency cache), including after a compaction the engine core moved onto
while serving; inductive rows equal the rows of the same nodes once added."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.stream import StreamMix, hold_out
from tests.engine.test_living_graph import awkward_graph, full_graph_rows, living_cfg, run_ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("cls", "mode", "cache_bytes"), [
    ("GraphSAGE", "device", 0), ("GCN", "uva", 0), ("GAT", "uva", 1 << 12),
    ("GraphSAGE", "uva", 1 << 12)])
def test_exact_after_updates_and_a_compaction_on_the_gpu(
        tmp_path: Path, cls: str, mode: str, cache_bytes: int) -> None:
    base, stream = hold_out(awkward_graph(8), 0.4, seed=9,
                            mix=StreamMix(edges_per_call=30, nodes_every=2, features_every=2))
    cfg = living_cfg(tmp_path, cls, "gpu")
    cfg.inference.device = "cuda"
    cfg.sampling.gpu_mode = mode  # type: ignore[assignment]
    cfg.sampling.gpu_graph_cache_bytes = cache_bytes
    cfg.graph.compact_interval_s = 0
    want = full_graph_rows(cfg, stream.final_x(), stream.final_edge_index())
    half = len(stream.ops) // 2
    pipeline = Pipeline(cfg, graph=base).start()
    try:
        writer = pipeline.supervisor.graph_writer  # type: ignore[union-attr]
        run_ops(writer, stream.ops[:half])
        mid = writer.compact()["version"]
        deadline = time.monotonic() + 60
        while writer.base_version != mid and time.monotonic() < deadline:
            pipeline.embed(torch.arange(4))
            time.sleep(0.2)
        assert writer.base_version == mid
        version = run_ops(writer, stream.ops[half:])
        got = pipeline.embed(torch.arange(stream.final_num_nodes()), exact=True,
                             min_version=version)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        pipeline.stop()
