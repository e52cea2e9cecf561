"""GCN's exact normalisation follows edge updates (docs/architecture.md, "The living graph"): after
``update_degrees`` with the changed nodes' new in-degree and self-loop counts, exact mode on the new
graph equals PyG's ``model(x, edge_index)`` on it, for every normalisation setting, on the fast and
the PyG path, for nodes appended into the capacity (with in-edges, or none: isolated as ``gcn_norm``
sees it).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch_geometric.nn import models as pyg_models

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.exact_gcn import ExactGcnNorm
from quiver_serve.models.fast import _unsupported
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.reference import ReferenceSampler
from tests.models.test_exact_fidelity import NUM_FEATURES, NUM_NODES, awkward_edges

ADDED, CAPACITY = 4, NUM_NODES + 6  # nodes NUM_NODES .. +3 appended; two capacity rows unused


def updated_edges(edge_index: Tensor, seed: int) -> Tensor:
    """Edges into some nodes removed, new edges (loops, duplicates) into others, and edges into,
    out of and between the appended nodes; the last appended node gets no in-edge."""
    g = torch.Generator().manual_seed(seed + 10)
    lost = torch.randperm(NUM_NODES - 2, generator=g)[:5]
    keep = ~torch.isin(edge_index[1], lost[:3]) & ~torch.isin(edge_index[0], lost[3:])
    new = torch.arange(NUM_NODES, NUM_NODES + ADDED)
    added = torch.cat([
        torch.randint(0, NUM_NODES + ADDED, (2, 30), generator=g),
        torch.stack([new[:3], new[:3]]),  # loops on appended nodes
        torch.tensor([[5, 5, 6], [7, 7, 7]]),  # a duplicated edge
        torch.stack([new[3].expand(3), torch.tensor([1, 2, 3])]),  # out-edges only
    ], dim=1)
    added = added[:, added[1] != new[3]]
    return torch.cat([edge_index[:, keep], added], dim=1)


def counts(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """(in-degree, self-loop count) per node."""
    deg = torch.bincount(edge_index[1], minlength=num_nodes)
    loops = torch.bincount(edge_index[1][edge_index[0] == edge_index[1]], minlength=num_nodes)
    return deg, loops


def exact(served: ServedModel, graph: GraphData, seeds: Tensor, layers: int) -> Tensor:
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, [-1] * layers, seed=0)
    return served(graph.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
                  out.num_sampled_edges, exact=True)[out.seed_index]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("improved", [False, True])
@pytest.mark.parametrize("add_self_loops", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_mode_follows_degree_updates(add_self_loops: bool, improved: bool, layers: int,
                                           fast: bool, seed: int) -> None:
    old_edges, _ = awkward_edges(seed)
    x = torch.randn(CAPACITY, NUM_FEATURES, generator=torch.Generator().manual_seed(seed))
    old = GraphData.from_edge_index(old_edges, x[:NUM_NODES], name="old")
    torch.manual_seed(seed)
    model = pyg_models.GCN(NUM_FEATURES, 16, layers, 5, improved=improved,
                           add_self_loops=add_self_loops).eval()
    served = ServedModel(model, old.degree(), old.self_loop_count(), fast=fast, capacity=CAPACITY)
    assert served.gcn_norm is not None and served.gcn_norm.capacity == CAPACITY
    assert (served.fast is not None) == (fast and _unsupported(model) is None)
    degree_storage = served.gcn_norm.degree.data_ptr()

    n = NUM_NODES + ADDED
    new_edges = updated_edges(old_edges, seed)
    new = GraphData.from_edge_index(new_edges, x[:n], name="new")
    deg_old, loops_old = counts(old_edges, n)
    deg_new, loops_new = counts(new_edges, n)
    changed = ((deg_new != deg_old) | (loops_new != loops_old)).nonzero().view(-1)
    assert NUM_NODES + ADDED - 1 not in changed.tolist()  # stays as built: an isolated node
    with torch.no_grad():
        full = model(x[:n], new_edges)
    seeds = torch.cat([changed, torch.arange(n)])
    stale = exact(served, new, seeds, layers)
    served.update_degrees(changed, deg_new[changed], loops_new[changed])
    assert served.gcn_norm.degree.data_ptr() == degree_storage  # in place
    torch.testing.assert_close(exact(served, new, seeds, layers), full[seeds], atol=1e-5,
                               rtol=1e-5)
    assert not torch.allclose(stale, full[seeds], atol=1e-5, rtol=1e-5)  # the update mattered


@pytest.mark.parametrize("improved", [False, True])
@pytest.mark.parametrize("add_self_loops", [True, False])
def test_capacity_nodes_are_isolated_until_updated(add_self_loops: bool, improved: bool) -> None:
    """A capacity node's terms are those ``ExactGcnNorm`` computes for a node without in-edges,
    and an update is the same as building the norm with the new counts."""
    deg, loops = torch.tensor([3, 0, 2]), torch.tensor([1, 0, 0])
    norm = ExactGcnNorm(deg, loops, improved, add_self_loops, capacity=6)
    isolated = ExactGcnNorm(torch.zeros(1, dtype=torch.int64), None, improved, add_self_loops)
    assert torch.equal(norm.degree[3:], isolated.degree.expand(3))
    norm.update(torch.tensor([4, 0]), torch.tensor([5, 1]), torch.tensor([2, 1]))
    want = ExactGcnNorm(torch.tensor([1, 0, 2, 0, 5, 0]), torch.tensor([1, 0, 0, 0, 2, 0]),
                        improved, add_self_loops)
    assert torch.equal(norm.degree, want.degree)
    assert (norm.loop_weight is None) == (want.loop_weight is None)
    if want.loop_weight is not None:
        assert torch.equal(norm.loop_weight, want.loop_weight)
    norm.update(torch.tensor([1]), torch.tensor([4]))  # self_loops None: no loops
    assert float(norm.degree[1]) == 4 + (want.fill if add_self_loops else 0)
    with pytest.raises(IndexError):
        norm.update(torch.tensor([6]), torch.tensor([1]))
    with pytest.raises(ValueError, match="same length"):
        norm.update(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="capacity"):
        ExactGcnNorm(deg, loops, improved, add_self_loops, capacity=2)


def test_models_without_gcn_normalisation_ignore_degree_updates() -> None:
    served = ServedModel(pyg_models.GraphSAGE(NUM_FEATURES, 8, 2, 4).eval())
    served.update_degrees(torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))
    assert served.gcn_norm is None
