"""CUDA graphs of small batches: the padded layout (pure torch, any device) gives the eager rows;
on a GPU the captured graphs replay them, inside the engine core too."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import pytest
import torch
from torch_geometric.nn import models as pyg_models

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.graphed import GraphedForward, PaddedLayout, padded_forward
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.base import SamplerOutput
from quiver_serve.sampling.reference import ReferenceSampler
from tests.engine.core.test_engine_core import make_core, mb, run
from tests.models.test_exact_fidelity import NUM_FEATURES, NUM_NODES, awkward_edges

FANOUTS = [3, 2]
MODELS = [("GraphSAGE", {}), ("GAT", {}), ("GCN", {}), ("GCN", {"add_self_loops": False})]


def served_model(cls: str, kwargs: dict, graph: GraphData) -> ServedModel:
    torch.manual_seed(0)
    model = getattr(pyg_models, cls)(NUM_FEATURES, 16, len(FANOUTS), 5, **kwargs).eval()
    return ServedModel(model, graph.degree(), graph.self_loop_count())


def model_fn(served: ServedModel):  # noqa: ANN201 - the ModelFn shape
    return lambda x, n_id, e, nodes, edges: served(x, n_id, e, nodes, edges, False)


def eager_rows(served: ServedModel, x: torch.Tensor, sb: SamplerOutput) -> torch.Tensor:
    n_id, edges = sb.n_id.to(x.device), sb.edge_index.to(x.device)
    out = served(x[n_id], n_id, edges, sb.num_sampled_nodes, sb.num_sampled_edges, False)
    return out[sb.seed_index.to(x.device)]


@pytest.fixture(scope="module")
def awkward() -> GraphData:
    edge_index, _ = awkward_edges(3)
    x = torch.randn(NUM_NODES, NUM_FEATURES, generator=torch.Generator().manual_seed(3))
    return GraphData.from_edge_index(edge_index, x, name="awkward")


def test_layout_caps_bound_every_hop() -> None:
    layout = PaddedLayout.for_fanouts(4, [25, 10])
    assert layout.node_caps == (5, 101, 1001) and layout.edge_caps == (100, 1000)
    assert layout.num_nodes == 1107 and layout.num_edges == 1100
    with pytest.raises(ValueError):
        PaddedLayout.for_fanouts(4, [-1, 10])  # exact mode has no bound: never padded


def test_padding_edges_reach_only_padding_slots_sorted_and_spread(awkward: GraphData) -> None:
    layout = PaddedLayout.for_fanouts(4, FANOUTS)
    sampler = ReferenceSampler(awkward.indptr, awkward.indices)
    sb = sampler.sample(torch.tensor([1, 2]), FANOUTS, seed=0)
    flat = layout.new_flat()
    layout.pack(flat, sb)
    edges = layout.views(torch.from_numpy(flat)).edge_index.numpy()
    offs, e_offs = layout.node_offsets(), layout.edge_offsets()
    assert (np.diff(edges[1]) >= 0).all()  # targets sorted: the fast model's CSR needs it
    for h, e in enumerate(sb.num_sampled_edges):
        pad = edges[:, e_offs[h] + e:e_offs[h] + layout.edge_caps[h]]
        first_pad_slot = offs[h] + sb.num_sampled_nodes[h]
        assert (pad[1] >= first_pad_slot).all() and (pad[1] < offs[h + 1]).all()
        assert (pad[0] == offs[h + 1] + layout.node_caps[h + 1] - 1).all()  # deeper spare slot
        slots = layout.node_caps[h] - sb.num_sampled_nodes[h]
        assert np.bincount(pad[1]).max() <= -(-pad.shape[1] // slots)  # evenly spread


@pytest.mark.parametrize(("cls", "kwargs"), MODELS, ids=lambda v: str(v) if v else "default")
@pytest.mark.parametrize("max_seeds", [1, 4, 8])
def test_padded_forward_equals_eager(awkward: GraphData, cls: str, kwargs: dict,
                                     max_seeds: int) -> None:
    """Real rows of the padded subgraph are the eager rows, for any batch that fits."""
    served = served_model(cls, kwargs, awkward)
    if max_seeds == 4:
        served.fast = None  # PyG's layers on the padded layout too
    sampler = ReferenceSampler(awkward.indptr, awkward.indices)
    layout = PaddedLayout.for_fanouts(max_seeds, FANOUTS)
    flat = layout.new_flat()
    g = torch.Generator().manual_seed(max_seeds)
    for trial in range(6):
        k = int(torch.randint(1, max_seeds + 1, (1,), generator=g))
        seeds = torch.randint(0, NUM_NODES, (k,), generator=g)
        if k > 1 and trial % 2:
            seeds[-1] = seeds[0]  # a repeated id
        sb = sampler.sample(seeds, FANOUTS, seed=trial)
        assert layout.fits(sb)
        layout.pack(flat, sb)  # one buffer reused: stale slots of the last batch must not leak
        got = padded_forward(model_fn(served), partial(torch.index_select, awkward.x, 0), layout,
                             layout.views(torch.from_numpy(flat)))[:k]
        torch.testing.assert_close(got, eager_rows(served, awkward.x, sb), atol=1e-5, rtol=1e-5)


def test_fits_rejects_what_the_layout_cannot_hold(awkward: GraphData) -> None:
    sampler = ReferenceSampler(awkward.indptr, awkward.indices)
    layout = PaddedLayout.for_fanouts(2, FANOUTS)
    assert not layout.fits(sampler.sample(torch.arange(3), FANOUTS, seed=0))  # 3 seeds > 2
    assert not layout.fits(sampler.sample(torch.arange(2), [-1, -1], seed=0))  # exact mode
    assert not layout.fits(sampler.sample(torch.arange(2), [3], seed=0))  # other depth


def test_capture_is_a_no_op_without_cuda(awkward: GraphData) -> None:
    served = served_model("GraphSAGE", {}, awkward)
    graphed = GraphedForward.capture(model_fn(served), partial(torch.index_select, awkward.x, 0),
                                     torch.device("cpu"), FANOUTS, 8, lambda k: None)  # type: ignore[arg-type,return-value]
    assert graphed.graphs == [] and graphed.max_seeds == 0


# ---- on a GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("cls", "kwargs"), MODELS, ids=lambda v: str(v) if v else "default")
def test_replayed_graphs_equal_eager_rows(awkward: GraphData, cls: str, kwargs: dict) -> None:
    """Every bucket replays the eager rows; models whose forward cannot be captured (a host
    sync) come back empty, and serve eagerly."""
    dev = torch.device("cuda")
    served = served_model(cls, kwargs, awkward).to(dev)
    x = awkward.x.to(dev)
    sampler = ReferenceSampler(awkward.indptr, awkward.indices)

    def sample(k: int) -> SamplerOutput:
        return sampler.sample(torch.randint(0, NUM_NODES, (k,)), FANOUTS, seed=k)

    graphed = GraphedForward.capture(model_fn(served), partial(torch.index_select, x, 0), dev,
                                     FANOUTS, 8, sample)
    if cls == "GraphSAGE":
        assert [g.layout.max_seeds for g in graphed.graphs] == [1, 2, 4, 8]
    for k in range(1, 9):
        sb = sample(k)
        got = graphed.run(sb)
        if not graphed.graphs:
            assert got is None
            continue
        assert got is not None
        torch.testing.assert_close(got, eager_rows(served, x, sb).float(), atol=1e-4, rtol=1e-4)
    assert graphed.run(sample(9)) is None  # beyond the largest bucket: eager


@pytest.mark.gpu
def test_engine_core_replays_graphs_for_small_batches(cora: GraphData) -> None:
    """Same seed, same subgraph: the graphed engine answers what the eager engine answers."""
    graphed = make_core(cora, "cuda", inference__cuda_graph_max_seeds=16)
    eager = make_core(cora, "cuda", inference__cuda_graph_max_seeds=0)
    assert graphed.graphed is not None and graphed.graphed.max_seeds == 16
    assert eager.graphed is None
    for i, ids in enumerate([[7], [1, 2, 3], list(range(100, 116)), list(range(40))]):
        deadline = time.time() + 30
        a = run(graphed, mb(i, [ids], seed=1234 + i, deadline_s=deadline))[i]
        b = run(eager, mb(i, [ids], seed=1234 + i, deadline_s=deadline))[i]
        assert a.rows is not None and b.rows is not None
        np.testing.assert_allclose(a.rows, b.rows, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_capture_beside_serving_replays_and_leaves_the_allocators_caches(
        awkward: GraphData) -> None:
    """A model loaded beside the serving loop captures on its own stream (thread-local mode)
    and replays the eager rows; the capture frees none of the cached device blocks the serving
    batches allocate from (``torch.cuda.graph`` empties the caches at every capture)."""
    dev = torch.device("cuda")
    served = served_model("GraphSAGE", {}, awkward).to(dev)
    x = awkward.x.to(dev)
    sampler = ReferenceSampler(awkward.indptr, awkward.indices)

    def sample(k: int) -> SamplerOutput:
        return sampler.sample(torch.randint(0, NUM_NODES, (k,)), FANOUTS, seed=k)

    held = torch.empty(64 << 20, dtype=torch.uint8, device=dev)  # a serving batch's block
    del held  # freed into the caching allocator, still reserved
    reserved = torch.cuda.memory_reserved(dev)
    loader = torch.cuda.Stream(dev)
    with torch.cuda.stream(loader):
        graphed = GraphedForward.capture(model_fn(served), partial(torch.index_select, x, 0),
                                         dev, FANOUTS, 8, sample, thread_local=True)
    loader.synchronize()
    assert [g.layout.max_seeds for g in graphed.graphs] == [1, 2, 4, 8]
    assert torch.cuda.memory_reserved(dev) >= reserved
    for k in (1, 3, 8):
        sb = sample(k)
        got = graphed.run(sb)
        assert got is not None
        torch.testing.assert_close(got, eager_rows(served, x, sb).float(), atol=1e-4, rtol=1e-4)
