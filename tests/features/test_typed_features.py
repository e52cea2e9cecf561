"""Feature rows of a typed graph under one GPU budget (features/typed.py): the FAP of each typed
row against how often sampling really touches it, the hottest rows of every type placed first
within the budget, and gathers that answer the graph's rows wherever they are placed."""

from __future__ import annotations

import torch

from quiver_serve.features.placement import LOC_BYTES_PER_NODE
from quiver_serve.features.typed import (
    TypedFeatures,
    plan_typed_placement,
    typed_access_probability,
    typed_fap,
)
from quiver_serve.sampling.typed import TypedReferenceSampler, typed_fanouts
from tests.sampling.test_typed_sampler import small_typed


def test_fap_is_how_often_sampling_touches_each_typed_row() -> None:
    graph = small_typed(seed=1)
    fanouts = typed_fanouts(graph, [2, 2])
    batch, rounds = 4, 1500
    predicted = typed_access_probability(graph, fanouts, "paper", batch)
    sampler = TypedReferenceSampler(graph)
    seen = {t: torch.zeros(n) for t, n in graph.num_nodes.items()}
    gen = torch.Generator().manual_seed(0)
    for r in range(rounds):
        ids = torch.randperm(graph.num_nodes["paper"], generator=gen)[:batch]
        out = sampler.sample("paper", ids, fanouts, r)
        for t, nodes in out.node.items():
            seen[t][nodes] += 1
    for t, p in predicted.items():
        measured = seen[t] / rounds
        # the recursion treats draws as independent: close, not exact
        assert (p - measured).abs().mean() < 0.03, t
        assert torch.corrcoef(torch.stack([p, measured]))[0, 1] > 0.9, t
    # a type no relation reaches from the seed type's side at one hop is cooler than papers
    assert predicted["venue"].sum() > 0


def test_one_budget_places_the_hottest_rows_of_every_type_first() -> None:
    scores = {"paper": torch.tensor([0.9, 0.1, 0.5, 0.05]),
              "author": torch.tensor([0.7, 0.2, 0.6]),
              "venue": torch.tensor([0.01, 0.02])}
    row_bytes = {"paper": 100, "author": 40, "venue": 8}
    maps = {t: s.numel() * LOC_BYTES_PER_NODE for t, s in scores.items()}
    # room for paper 0 (0.9), author 0 (0.7), author 2 (0.6), paper 2 (0.5) and both maps
    budget = 2 * 100 + 2 * 40 + maps["paper"] + maps["author"]
    placement = plan_typed_placement(scores, row_bytes, budget)
    assert placement.gpu_nodes["paper"].tolist() == [0, 2]
    assert placement.gpu_nodes["author"].tolist() == [0, 2]
    assert placement.gpu_nodes["venue"].tolist() == []
    assert placement.gpu_bytes() <= budget
    placed = torch.cat([scores[t][n] for t, n in placement.gpu_nodes.items()])
    left = torch.cat([scores[t][torch.tensor([i for i in range(s.numel())
                                             if i not in placement.gpu_nodes[t].tolist()],
                                            dtype=torch.int64)] for t, s in scores.items()])
    assert placed.min() >= left.max()
    # everything fits: every row, in id order (no map)
    whole = plan_typed_placement(scores, row_bytes, 10_000)
    assert all(torch.equal(n, torch.arange(scores[t].numel()))
               for t, n in whole.gpu_nodes.items())


def test_fap_ranks_rows_across_types_by_the_seed_types_reach() -> None:
    graph = small_typed(seed=2)
    fanouts = typed_fanouts(graph, [3, 2])
    scores = typed_fap(graph, fanouts, ["paper"], 8)
    assert set(scores) == set(graph.x)
    row_bytes = {t: int(x.size(1)) * 4 for t, x in graph.x.items()}
    budget = sum(n * LOC_BYTES_PER_NODE for n in graph.num_nodes.values()) + 20 * 24
    placement = plan_typed_placement(scores, row_bytes, budget)
    hottest = max((float(scores[t][n].min()) for t, n in placement.gpu_nodes.items()
                   if n.numel()), default=0.0)
    assert placement.gpu_bytes() <= budget and hottest > 0


def test_gathers_answer_the_graphs_rows_from_both_tiers() -> None:
    graph = small_typed(seed=4)
    scores = {t: torch.rand(graph.num_nodes[t]) for t in graph.x}
    row_bytes = {t: int(x.size(1)) * 4 for t, x in graph.x.items()}
    maps = sum(n * LOC_BYTES_PER_NODE for n in graph.num_nodes.values())
    placement = plan_typed_placement(scores, row_bytes, maps + 30 * 24)
    cpu = torch.device("cpu")
    features = TypedFeatures(graph.x, cpu, placement, shard_device=cpu)
    hits = 0
    for t, x in graph.x.items():
        hot = placement.gpu_nodes[t]
        hits += int(hot.numel() > 0) * 2
        ids = torch.cat([hot[:1], hot[:1], torch.tensor([0, 3, graph.num_nodes[t] - 1])])
        assert torch.equal(features.gather(t, ids), x[ids])
    counts = features.counts()
    assert sum(h + m for h, m in counts.values()) == 3 * len(graph.x) + hits
    assert hits and sum(h for h, _ in counts.values()) >= hits
    assert any(m for _, m in counts.values())
