"""Two partition servers in one process, without Ray: each reaches the other over the wire, and a
caller sends ``embed`` over the wire as the ingress does (decision 0054). Seeded answers equal
the single-machine engine's, whichever server draws them; concurrent exact requests share
batches and equal PyG's full-graph output; a request's own new nodes are embedded as if added."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.engine.client.local import LocalEngine
from quiver_serve.graph.csc import GraphData
from quiver_serve.models.served import build_model
from quiver_serve.scaleout.partitioned.links import WireLink
from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs
from tests.scaleout.test_partitioned import block_graph, config, partitions, with_nodes

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


def one_machine(graph: GraphData, ids: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One engine's rows of ``ids`` drawn with ``seed``, and PyG's full-graph output."""
    engine = LocalEngine(config(), graph)
    try:
        want = engine.embed(ids, seed=seed)
    finally:
        engine.stop()
    model = build_model(config().model, graph.num_features)
    with torch.no_grad():
        return want, model(graph.x, graph.edge_index()).numpy()


def test_servers_over_the_wire_answer_as_one_machine(tmp_path: Path) -> None:
    graph = block_graph()
    data_dir = partitions(graph, 2, tmp_path)
    ids = np.array([3, 650, 301, 3, 899])
    want, full = one_machine(graph, ids, 21)
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


def test_a_requests_own_new_nodes_are_embedded_as_if_added(tmp_path: Path) -> None:
    """Inductive requests on a partition server: seeded rows equal one machine's on the graph
    with the nodes added, exact rows PyG's full-graph output on it, from either server (the
    in-neighbours owned by one partition, by both, or none); bad rows and ids refused."""
    graph = block_graph()
    data_dir = partitions(graph, 2, tmp_path)
    n = graph.num_nodes
    rng = np.random.default_rng(8)
    features = rng.standard_normal((3, graph.num_features)).astype(np.float32)
    # more in-neighbours than the first fanout (25): the draws hash the new node's id
    lists = [[5, 7, 650, 5] + rng.integers(0, n, 40).tolist(), [], [301, 302, 899]]
    bigger = with_nodes(graph, features, lists)
    ids = np.array([3, 650, 301])
    asked = np.concatenate([ids, np.arange(n, n + 3)])
    want, full = one_machine(bigger, asked, 4)
    offsets = np.cumsum([0] + [len(x) for x in lists]).astype(np.int64)
    neighbors = np.array([u for x in lists for u in x], np.int64)

    async def run() -> None:
        servers, _ = wired(data_dir)
        for s in servers:
            got = await s.embed_new(ids, False, 4, 10.0, features, offsets, neighbors)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            exact = await s.embed_new(ids[:0], True, None, 10.0, features, offsets, neighbors)
            np.testing.assert_allclose(exact, full[n:], atol=1e-4, rtol=0)
        narrow = await servers[0].embed_new(ids, False, 4, 10.0, features[:, :3], offsets,
                                            neighbors)
        assert (narrow["status"], narrow["code"]) == (422, "invalid_new_nodes")
        outside = await servers[1].embed_new(ids, False, 4, 10.0, features, offsets,
                                             np.array([1, 2, 3, 4, n, 6, 7], np.int64))
        assert outside["status"] == 400 and str(n) in outside["message"]
        assert servers[0].num_nodes == n, "nothing was added"

    asyncio.run(run())


@pytest.mark.parametrize("parts", [2, 3])
def test_rows_that_ride_with_the_hops_give_the_same_answers_in_fewer_calls(
        tmp_path: Path, parts: int) -> None:
    """Decision 0070: with ``partitioned.rows_ride_max_seeds`` the peers send the feature rows a batch
    will gather with their hop answers (less the rows replicated at the caller), and the last
    hop's own draws ask for theirs at once: seeded and exact answers equal those of the rows
    calls after the sampling, bit for bit, and the calls after the sampling mostly go away
    (with three partitions a peer's draws may name a third's rows: asked for as they arrive)."""
    rng = np.random.default_rng(parts)
    n = 600  # random edges: most cross partitions, so every path of the rows is taken
    graph = GraphData.from_edge_index(torch.from_numpy(rng.integers(0, n, (2, 6 * n))),
                                      torch.from_numpy(rng.standard_normal(
                                          (n, block_graph().num_features)).astype(np.float32)),
                                      "random")
    data_dir = partitions(graph, parts, tmp_path)
    batches = [rng.integers(0, graph.num_nodes, size) for size in (1, 5, 48)]

    async def answers(ride: bool) -> tuple[list[np.ndarray], int, int]:
        cfg = config(inference__device="cpu",
                     partitioned__rows_ride_max_seeds=1 << 20 if ride else 0)
        servers = [PartitionServer(cfg.model_dump(mode="json"),
                                   ServerArgs("t", str(data_dir), p, 0, 1)) for p in range(parts)]
        addresses = [s.wire.start("127.0.0.1") for s in servers]

        async def address_of(part: int, replica: int) -> str:
            return addresses[part]

        for s in servers:
            s.peers.link = WireLink(address_of)
        out = []
        for s in servers:
            mine = [b[s.graph.owner[torch.from_numpy(b)].numpy() == s.args.part] for b in batches]
            for ids in mine:
                if ids.size:
                    out.append(await s._embed(ids, False, 9))
                    out.append(await s._embed(ids[:2], True, None))
        counts = [s.features.counts for s in servers]
        for s in servers:
            s.close()
        return out, counts

    riding, riding_counts = asyncio.run(answers(True))
    called, counts = asyncio.run(answers(False))
    assert len(riding) == len(called) > 0
    for a, b in zip(riding, called, strict=True):
        np.testing.assert_array_equal(a, b)
    remote = sum(c.remote for c in counts)
    assert sum(c.remote for c in riding_counts) == remote > 0, "the same rows, from the peers"
    assert sum(c.riding for c in riding_counts) == remote, "every one rode or came early"
    assert sum(c.late_calls for c in riding_counts) == 0 < sum(c.late_calls for c in counts)
