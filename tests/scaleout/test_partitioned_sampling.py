"""Sampling across partitions draws the whole graph's subgraph: for any assignment of nodes to
partitions, ``PartitionSampler`` gives the tensors ``ReferenceSampler`` gives on the whole graph
(seeded, every fanout including -1), and a hop's remote ids go in one call per partition."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from quiver_serve.sampling.reference import ReferenceSampler
from quiver_serve.scaleout.partitioned.sampling import LocalGraph, PartitionSampler, local_hop


def random_graph(num_nodes: int, num_edges: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSC (indptr, indices) of a random graph with hubs (sources drawn by a power law)."""
    rng = np.random.default_rng(seed)
    dst = rng.integers(0, num_nodes, num_edges)
    src = (rng.pareto(1.2, num_edges) * 7).astype(np.int64) % num_nodes
    pairs = np.unique(np.stack([dst, src], 1), axis=0)
    indptr = np.zeros(num_nodes + 1, np.int64)
    np.add.at(indptr, pairs[:, 0] + 1, 1)
    return torch.from_numpy(np.cumsum(indptr)), torch.from_numpy(pairs[:, 1].copy())


def split(indptr: torch.Tensor, indices: torch.Tensor, owner: np.ndarray) -> list[LocalGraph]:
    """Each partition's owned in-edge lists, rows in global-id order within the partition."""
    num_parts = int(owner.max()) + 1
    local = np.zeros(owner.size, np.int64)
    graphs = []
    for p in range(num_parts):
        ids = np.flatnonzero(owner == p)
        local[ids] = np.arange(ids.size)
        deg = (indptr[1:] - indptr[:-1]).numpy()[ids]
        sub_indptr = np.concatenate([[0], np.cumsum(deg)])
        sub_indices = np.concatenate([indices[indptr[v]:indptr[v + 1]].numpy() for v in ids]) \
            if ids.size else np.zeros(0, np.int64)
        graphs.append((p, torch.from_numpy(sub_indptr), torch.from_numpy(sub_indices)))
    owner_t, local_t = torch.from_numpy(owner.astype(np.int32)), torch.from_numpy(local)
    return [LocalGraph(p, owner_t, local_t, ip, ix) for p, ip, ix in graphs]


def samplers(graphs: list[LocalGraph], calls: list[tuple[int, int, int]]) -> list[PartitionSampler]:
    async def remote(q: int, ids: np.ndarray, k: int, hop: int, base: int):
        calls.append((q, hop, ids.size))
        nbr, cnt = local_hop(graphs[q], torch.from_numpy(ids), k, hop, base)
        return nbr.numpy(), cnt.numpy()

    return [PartitionSampler(g, len(graphs), remote) for g in graphs]


@pytest.mark.parametrize("num_parts", [2, 3])
@pytest.mark.parametrize("fanouts", [[5, 3], [2, 2, 2], [-1, -1]])
def test_every_partition_samples_the_whole_graphs_subgraph(num_parts: int,
                                                           fanouts: list[int]) -> None:
    indptr, indices = random_graph(600, 5000, seed=num_parts)
    owner = np.random.default_rng(7).integers(0, num_parts, 600)
    calls: list[tuple[int, int, int]] = []
    parts = samplers(split(indptr, indices, owner), calls)
    whole = ReferenceSampler(indptr, indices)
    seeds = torch.tensor([5, 17, 5, 399, 0, 599, 123])
    for seed in (0, 1, 2**40 + 3):
        want = whole.sample(seeds, fanouts, seed)
        for p, sampler in enumerate(parts):
            calls.clear()
            got = asyncio.run(sampler.sample(seeds, fanouts, seed))
            assert torch.equal(got.n_id, want.n_id), (p, seed)
            assert torch.equal(got.edge_index, want.edge_index), (p, seed)
            assert torch.equal(got.seed_index, want.seed_index)
            assert got.num_sampled_nodes == want.num_sampled_nodes
            assert got.num_sampled_edges == want.num_sampled_edges
            per_hop = [(q, hop) for q, hop, _ in calls]
            assert len(per_hop) == len(set(per_hop)), "more than one call per partition per hop"
            assert all(q != p for q, _ in per_hop), "a partition called itself"


def test_a_hop_of_ids_another_partition_owns_is_refused_by_name() -> None:
    indptr, indices = random_graph(50, 200, seed=1)
    owner = np.arange(50) % 2
    graphs = split(indptr, indices, owner)
    with pytest.raises(ValueError, match="node 1 is owned by partition 1, not 0"):
        local_hop(graphs[0], torch.tensor([0, 1]), 3, 1, 0)


def test_a_failed_remote_hop_fails_the_sample() -> None:
    indptr, indices = random_graph(80, 400, seed=2)
    graphs = split(indptr, indices, np.arange(80) % 2)

    async def lost(*_: object):
        raise ConnectionError("partition 1 is gone")

    with pytest.raises(ConnectionError, match="partition 1 is gone"):
        asyncio.run(PartitionSampler(graphs[0], 2, lost).sample(torch.tensor([0, 1]), [3, 3], 5))
