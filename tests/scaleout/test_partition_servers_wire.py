"""Two partition servers in one process, without Ray: each reaches the other over the wire, and a
caller sends ``embed`` over the wire as the ingress does (decision 0054). Seeded answers equal
the single-machine engine's, whichever server draws them; concurrent exact requests share
batches and equal PyG's full-graph output."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.engine.client.local import LocalEngine
from quiver_serve.models.served import build_model
from quiver_serve.scaleout.partitioned.links import WireLink
from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs
from tests.scaleout.test_partitioned import block_graph, config, partitions

pytestmark = [pytest.mark.slow]


def wired(data_dir: Path) -> tuple[list[PartitionServer], WireLink]:
    """Both servers, their peers over the wire, and a caller's link to them."""
    cfg = config(inference__device="cpu")
    servers = [PartitionServer(cfg.model_dump(mode="json"), ServerArgs("t", str(data_dir), p, 0, 1))
               for p in range(2)]
    addresses = [s.wire.start("127.0.0.1") for s in servers]

    async def address_of(part: int, replica: int) -> str:
        return addresses[part]

    for s in servers:
        s.peers.link = WireLink(address_of)
    return servers, WireLink(address_of)


def test_servers_over_the_wire_answer_as_one_machine(tmp_path: Path) -> None:
    graph = block_graph()
    data_dir = partitions(graph, 2, tmp_path)
    engine = LocalEngine(config(), graph)
    try:
        ids = np.array([3, 650, 301, 3, 899])
        want = engine.embed(ids, seed=21)
    finally:
        engine.stop()
    model = build_model(config().model, graph.num_features)
    with torch.no_grad():
        full = model(graph.x, graph.edge_index()).numpy()
    exact_ids = [np.array([i, i + 300, 7]) for i in range(0, 80, 10)]

    async def run() -> None:
        servers, link = wired(data_dir)
        for part in (0, 1):
            got = await link.call(part, 0, "embed", ids, False, 21, 10.0)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        exact = await asyncio.gather(*(link.call(0, 0, "embed", i, True, None, 10.0)
                                       for i in exact_ids))
        for i, rows in zip(exact_ids, exact, strict=True):
            np.testing.assert_allclose(rows, full[i], atol=1e-4, rtol=0)
        assert 0 < servers[0].exact_batches.batches < len(exact_ids), "exact requests merge"
        unknown = await link.call(0, 0, "drop_hot", ids)
        assert isinstance(unknown, dict) and unknown["status"] == 400

    asyncio.run(run())
