"""Compaction of a partition's log (``scaleout/partitioned/compaction.py``, decision 0063), with
partition servers in one process over the wire (no Ray): far more updates than an overlay holds
are taken without a refusal, each primary folds them into a base in its log folder and serves
from it, a follower replica moves to its primary's base, and servers started again map the base
and replay only the records after it. Exact answers equal PyG's full-graph output over the
updated graph throughout; seeded answers of the follower equal its primary's, and seeded answers
after the restart equal those before it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.log_reader import list_segments
from quiver_serve.models.served import build_model
from quiver_serve.partition.data import load_book
from quiver_serve.scaleout.partitioned.compaction import Moves, base_in_force
from quiver_serve.scaleout.partitioned.links import WireLink
from quiver_serve.scaleout.partitioned.server import PartitionServer, ServerArgs
from quiver_serve.scaleout.partitioned.server_living import LivingPartition
from tests.scaleout.test_partitioned import block_graph, config, partitions

pytestmark = [pytest.mark.slow]

CAPACITY = 1024  # overlay entries per partition: the smallest the config takes


class Expected:
    """The whole graph after the updates, each list as the overlay keeps it (order does not
    matter to exact answers)."""

    def __init__(self, graph: GraphData) -> None:
        self.lists = [graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist()
                      for v in range(graph.num_nodes)]
        self.x = graph.x.clone()

    def edges(self, add: list[list[int]], remove: list[list[int]]) -> None:
        for src, dst in remove:
            self.lists[dst] = [u for u in self.lists[dst] if u != src]
        for src, dst in add:
            self.lists[dst].append(src)

    def nodes(self, rows: np.ndarray) -> None:
        self.lists += [[] for _ in rows]
        self.x = torch.cat([self.x, torch.from_numpy(rows)])

    def graph(self) -> GraphData:
        indptr = np.cumsum([0] + [len(nbrs) for nbrs in self.lists]).astype(np.int64)
        indices = torch.tensor([u for nbrs in self.lists for u in nbrs], dtype=torch.int64)
        return GraphData("updated", torch.from_numpy(indptr), indices, self.x)


def full_rows(expected: Expected) -> np.ndarray:
    new = expected.graph()
    model = build_model(config().model, new.num_features)
    with torch.no_grad():
        return model(new.x, new.edge_index()).numpy()


def servers_for(data_dir: Path, log_dir: Path) -> tuple[list[PartitionServer], WireLink]:
    """Both primaries and a follower of partition 1, peers over the wire."""
    cfg = config(inference__device="cpu", graph__overlay_capacity_edges=CAPACITY,
                 graph__max_new_nodes=64, graph__update_log_dir=str(log_dir),
                 graph__fsync="always")
    d = cfg.model_dump(mode="json")
    servers = [PartitionServer(d, ServerArgs("t", str(data_dir), 0, 0, 2)),
               PartitionServer(d, ServerArgs("t", str(data_dir), 1, 0, 2)),
               PartitionServer(d, ServerArgs("t", str(data_dir), 1, 1, 2))]
    addresses = [s.wire.start("127.0.0.1") for s in servers[:2]]

    async def address_of(part: int, replica: int) -> str:
        return addresses[part]

    for s in servers:
        s.peers.link = WireLink(address_of)
    return servers, WireLink(address_of)


async def update(server: PartitionServer, kind: str, first: Any, second: Any) -> None:
    """One update, retried after a 503 ``overlay_full`` as a client does after Retry-After
    (the overlay filled before the compaction under way freed it)."""
    for _ in range(200):
        answer = await server.update(kind, first, second)
        if answer.get("code") != "overlay_full":
            break
        assert answer["status"] == 503, answer
        await asyncio.sleep(0.05)
    assert "code" not in answer, answer


async def update_many(servers: list[PartitionServer], expected: Expected, owner: list[int],
                      rounds: int) -> None:
    """Edge additions and removals (base edges of hubs among them), each at its owner."""
    rng = np.random.default_rng(7)
    n = len(expected.lists)
    for r in range(rounds):
        add = rng.integers(0, n, (40, 2)).tolist()
        dst = int(rng.integers(0, n))
        remove = [[expected.lists[dst][0], dst]] if expected.lists[dst] else []
        for p in (0, 1):
            mine_a = [e for e in add if owner[e[1]] == p]
            mine_r = [e for e in remove if owner[e[1]] == p]
            if mine_a or mine_r:
                await update(servers[p], "edges", mine_a, mine_r)
        expected.edges(add, remove)
        if r in (30, 70):  # new nodes at partition 1, entered in partition 0's book too
            first, rows = n, rng.standard_normal((3, expected.x.shape[1])).astype(np.float32)
            await update(servers[1], "nodes", [first, 3, 1], rows.tolist())
            await update(servers[0], "nodes", [first, 3, 1], None)
            expected.nodes(rows)
            owner.extend([1, 1, 1])
            n = len(expected.lists)
        if r % 10 == 0:
            v = int(rng.integers(0, n))
            row = rng.standard_normal(expected.x.shape[1]).astype(np.float32)
            for s in servers:  # as the ingress does: replicated copies dropped first
                s.drop_hot(np.array([v]))
            await update(servers[int(owner[v])], "features", [v], [row.tolist()])
            expected.x[v] = torch.from_numpy(row)
        await asyncio.sleep(0)  # the loop runs the compactions the updates started


def ok_refusal(answer: dict[str, Any]) -> str:
    return str(answer.get("code"))


async def settle(servers: list[PartitionServer]) -> None:
    for _ in range(400):
        for s in servers:
            s._follow()
        if all(s.moves.running is None for s in servers) and \
                servers[2].live.base_version == servers[1].live.base_version:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the compactions or the follower's move did not finish")


def test_updates_past_the_overlay_compact_and_a_restart_maps_the_base(tmp_path: Path) -> None:
    graph = block_graph()
    data_dir = partitions(graph, 2, tmp_path)
    owner = load_book(data_dir).owner.tolist()
    log_dir = tmp_path / "logs"
    expected = Expected(graph)
    ids = np.array([3, 650, 301, 17, 899, 450])

    async def exact_rows(link: WireLink) -> list[np.ndarray]:
        every = np.arange(len(expected.lists))
        return [await link.call(p, 0, "embed", every, True, None, 30.0) for p in (0, 1)]

    async def first_life() -> tuple[np.ndarray, list[np.ndarray]]:
        servers, link = servers_for(data_dir, log_dir)
        await update_many(servers, expected, owner, 120)  # ~4,800 edges: 4x the overlay each
        # the follower has read nothing meanwhile: records it needs were folded into a base;
        # a read waits for its move there and answers at its primary's version
        every = np.arange(len(expected.lists))
        rows = await servers[2].embed(every, True, None, 30.0)
        assert servers[2].live.version == servers[1].live.version
        np.testing.assert_allclose(rows[every[np.asarray(owner) == 1]],
                                   full_rows(expected)[np.asarray(owner) == 1], atol=1e-4,
                                   rtol=0)
        await settle(servers)
        for s in servers[:2]:
            assert s.moves.compactions >= 2 and s.moves.failures == 0
            assert s.live.overlay.top < CAPACITY * 0.75
            assert base_in_force(s.live.directory) == s.live.base_version > 0
        follower = servers[2]
        assert follower.moves.moves >= 1 and follower.live.version == servers[1].live.version
        seeded = await link.call(1, 0, "embed", ids, False, 5, 30.0)
        np.testing.assert_array_equal(await follower.embed(ids, False, 5, 30.0), seeded)
        exact = await exact_rows(link)
        for s in servers:
            s.close()
        link.close()
        return seeded, exact

    seeded, exact = asyncio.run(first_life())
    full = full_rows(expected)
    for rows in exact:
        np.testing.assert_allclose(rows, full, atol=1e-4, rtol=0)

    async def second_life() -> None:
        servers, link = servers_for(data_dir, log_dir)
        for s in servers:
            assert 0 < s.live.base_version <= s.live.version
            assert s.live.replayed == s.live.version - s.live.base_version < s.live.version
            assert list_segments(s.live.directory)[0][0] > 1, "the covered log was dropped"
        np.testing.assert_array_equal(await link.call(1, 0, "embed", ids, False, 5, 30.0),
                                      seeded)
        for rows in await exact_rows(link):
            np.testing.assert_allclose(rows, full, atol=1e-4, rtol=0)
        pending = servers[0].live.replayed
        answer = await servers[0].compact()
        assert answer["compacted"] is (pending > 0), answer
        assert servers[0].live.base_version == servers[0].live.version
        assert ok_refusal(await servers[2].compact()) == "not_primary"
        for s in servers:
            s.close()
        link.close()

    asyncio.run(second_life())


class _Following(LivingPartition):
    """A follower whose primary compacted twice while it read nothing: its first move lands on
    a base that the records after it were already folded out of, so it moves again."""

    def __init__(self, moves_needed: int, timeout_s: float = 5.0) -> None:
        self.cfg = config(server__request_timeout_s=timeout_s)
        self.moves, self.left = Moves(), moves_needed
        self.live = SimpleNamespace(stalled=True, version=0)

    def _follow(self) -> None:
        if self.left == 0:
            self.live.stalled = False
        elif self.moves.running is None:
            self.moves.start(self._move())

    async def _move(self) -> None:
        await asyncio.sleep(0.02)
        self.left -= 1
        self.live.version += 1


def test_a_read_waits_for_every_move_its_primarys_compactions_need() -> None:
    async def read(server: _Following) -> tuple[int, bool]:
        return await server._current(
            lambda: asyncio.sleep(0, (server.live.version, server.live.stalled)))

    assert asyncio.run(read(_Following(2))) == (2, False)
    # a read waits at most server.request_timeout_s, then answers at the version it holds
    version, stalled = asyncio.run(read(_Following(1000, timeout_s=0.1)))
    assert stalled and 0 < version < 1000
