"""Checks shared by the CPU and GPU pipeline tests (no fixtures: the GPU files run without
conftest)."""

from __future__ import annotations

import asyncio

import torch

from quiver_serve.engine.client.pipeline import Pipeline
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import build_model


def check_concurrent_exact(pipeline: Pipeline, graph: GraphData, count: int, max_ids: int) -> None:
    """``count`` exact requests of 1..max_ids ids in flight at once (merged into batches): every
    row equals PyG's full-graph output."""
    model = build_model(pipeline.cfg.model, graph.num_features)
    with torch.no_grad():
        full = model(graph.x, graph.edge_index())
    gen = torch.Generator().manual_seed(3)
    requests = [torch.randint(0, graph.num_nodes, (int(n),), generator=gen)
                for n in torch.randint(1, max_ids, (count,), generator=gen)]

    async def go() -> list[torch.Tensor]:
        return await asyncio.gather(*[pipeline.embed_async(r, exact=True) for r in requests])

    for ids, emb in zip(requests, asyncio.run(go()), strict=True):
        torch.testing.assert_close(emb, full[ids], atol=1e-4, rtol=1e-4)
