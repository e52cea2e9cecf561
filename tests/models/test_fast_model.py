"""The fast model path (``models/fast.py``) equals PyG's own layers on the same subgraph.

Random graphs with isolated nodes, self loops (some repeated) and duplicate edges; GraphSAGE,
GCN (every normalisation setting) and GAT (one and several heads) at 1 to 3 layers; sampled mode
(bounded fanouts, so hubs are cut) and exact mode; both aggregation kernels (CSR x dense and
index_add). fp32 to 1e-5; bf16/fp16 within a stated error of fp32.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch_geometric.nn import models as pyg_models

from quiver_serve.graph.csc import GraphData
from quiver_serve.models.fast import FastGNN, sparse_mm_works
from quiver_serve.models.served import ServedModel
from quiver_serve.sampling.reference import ReferenceSampler
from tests.models.test_exact_fidelity import NUM_FEATURES, NUM_NODES, awkward_edges

MODELS = [
    ("GraphSAGE", {}),
    ("GraphSAGE", {"aggr": "sum"}),
    ("GraphSAGE", {"normalize": True, "root_weight": False}),
    ("GraphSAGE", {"bias": False}),
    ("GraphSAGE", {"bias": False, "root_weight": False}),
    ("GAT", {}),
    ("GAT", {"heads": 4}),
    ("GAT", {"add_self_loops": False}),
    ("GCN", {}),
    ("GCN", {"improved": True}),
    ("GCN", {"add_self_loops": False}),
    ("GCN", {"normalize": False}),
]


def _setup(cls: str, kwargs: dict, layers: int, seed: int,
           precision: str = "fp32") -> tuple[GraphData, ServedModel, torch.Tensor]:
    edge_index, isolated = awkward_edges(seed)
    x = torch.randn(NUM_NODES, NUM_FEATURES, generator=torch.Generator().manual_seed(seed))
    graph = GraphData.from_edge_index(edge_index, x, name="awkward")
    torch.manual_seed(seed)
    model = getattr(pyg_models, cls)(NUM_FEATURES, 16, layers, 8, **kwargs).eval()
    served = ServedModel(model, graph.degree(), graph.self_loop_count(), precision=precision)
    seeds = torch.cat([torch.tensor([3, 3, 17, 0]), isolated,
                       edge_index[1, edge_index[0] == edge_index[1]][:3]])
    return graph, served, seeds


def _both(served: ServedModel, graph: GraphData, seeds: torch.Tensor, fanouts: list[int],
          batch_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, fanouts, batch_seed)
    args = (graph.x[out.n_id], out.n_id, out.edge_index, out.num_sampled_nodes,
            out.num_sampled_edges, all(f < 0 for f in fanouts))
    fast = served(*args)[out.seed_index]
    ref = served.pyg(*args)[out.seed_index]
    return fast, ref


@pytest.mark.parametrize("sparse", [True, False], ids=["csr", "index_add"])
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize(("cls", "kwargs"), MODELS, ids=lambda v: str(v) if v else "default")
def test_fast_equals_pyg_layers(cls: str, kwargs: dict, layers: int, sparse: bool) -> None:
    for seed in (0, 1):
        graph, served, seeds = _setup(cls, kwargs, layers, seed)
        assert served.fast is not None, "this configuration must have a fast twin"
        served.fast.sparse = {torch.float32: sparse}
        orders = ["transform", "aggregate"] if cls == "GraphSAGE" else ["auto"]
        for order, fanouts in itertools.product(orders, ([2] * layers, [3, 1, 2][:layers],
                                                         [-1] * layers)):
            for layer in served.fast.layers:
                layer.order = order  # type: ignore[attr-defined]
            fast, ref = _both(served, graph, seeds, fanouts, batch_seed=seed + 7)
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_fast_path_handles_empty_hops_and_single_seed() -> None:
    graph, served, _ = _setup("GraphSAGE", {}, 2, 0)
    isolated = torch.tensor([NUM_NODES - 1])  # no in-edges: every later hop is empty
    fast, ref = _both(served, graph, isolated, [5, 5], batch_seed=1)
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("cls", ["GraphSAGE", "GCN", "GAT"])
def test_low_precision_close_to_fp32_and_exact_mode_stays_fp32(cls: str, precision: str) -> None:
    graph, served, seeds = _setup(cls, {}, 2, 0, precision=precision)
    assert served.fast is not None and served.fast.dtype != torch.float32
    fast, ref = _both(served, graph, seeds, [3, 3], batch_seed=3)
    rel = ((fast - ref).norm() / ref.norm()).item()
    assert 0 < rel < 2e-2, f"{precision} relative error {rel:.3g} (fp32 reference)"
    exact, ref = _both(served, graph, seeds, [-1, -1], batch_seed=3)
    torch.testing.assert_close(exact, ref, atol=1e-5, rtol=1e-5)


def test_unsupported_layers_fall_back_to_pyg() -> None:
    model = pyg_models.GraphSAGE(4, 8, 2, 3, aggr="max").eval()
    assert FastGNN.from_pyg(model) is None
    model = pyg_models.GraphSAGE(4, 8, 2, 3, jk="cat").eval()
    assert FastGNN.from_pyg(model) is None
    served = ServedModel(pyg_models.GAT(4, 8, 2, 3, v2=True).eval())
    assert served.fast is None  # GATv2: PyG's layers serve it
    with pytest.raises(ValueError, match="precision"):
        FastGNN.from_pyg(pyg_models.GraphSAGE(4, 8, 2, 3), precision="fp8")


def test_sparse_probe_on_cpu() -> None:
    assert sparse_mm_works(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("cls", ["GraphSAGE", "GCN", "GAT"])
def test_fast_equals_pyg_on_gpu(cls: str, precision: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graph, served, seeds = _setup(cls, {}, 2, 0, precision=precision)
    served.to(torch.device("cuda"))
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, [3, 3], 5)
    dev = torch.device("cuda")
    args = (graph.x[out.n_id].to(dev), out.n_id.to(dev), out.edge_index.to(dev),
            out.num_sampled_nodes, out.num_sampled_edges, False)
    fast, ref = served(*args)[out.seed_index.to(dev)], served.pyg(*args)[out.seed_index.to(dev)]
    tol = 1e-5 if precision == "fp32" else 2e-2
    rel = ((fast - ref).norm() / ref.norm()).item()
    assert rel < tol, f"{precision}: relative error {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("cls", ["GraphSAGE", "GCN", "GAT"])
def test_a_batch_without_edges_on_gpu(cls: str) -> None:
    """An isolated seed (no in-edge, so every hop is empty): cuSPARSE refuses an empty CSR, so
    the aggregation of nothing is zeros without it, as PyG's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graph, served, _ = _setup(cls, {}, 2, 0)
    served.to(torch.device("cuda"))
    out = ReferenceSampler(graph.indptr, graph.indices).sample(
        torch.tensor([NUM_NODES - 1]), [-1, -1], 5)
    assert out.edge_index.size(1) == 0
    dev = torch.device("cuda")
    args = (graph.x[out.n_id].to(dev), out.n_id.to(dev), out.edge_index.to(dev),
            out.num_sampled_nodes, out.num_sampled_edges, True)
    torch.testing.assert_close(served(*args), served.pyg(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_more_repeated_edges_than_rows_times_columns_on_gpu() -> None:
    """One target with 12 in-edges from 3 sources (repeated edges): cuSPARSE refuses a CSR with
    more entries than rows x columns, so the aggregation takes the index_add path there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from quiver_serve.models.fast import BatchGraph, aggregate

    dev = torch.device("cuda")
    edge_index = torch.tensor([[1, 2, 3] * 4, [0] * 12], device=dev)
    g = BatchGraph(edge_index, [1, 3], [12], use_sparse=True).layer(0)
    dense = torch.arange(8.0, device=dev).view(4, 2)
    got = aggregate(g, None, dense)
    torch.testing.assert_close(got.cpu(), torch.tensor([[4.0 * (2 + 4 + 6), 4.0 * (3 + 5 + 7)]]))


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_gat_with_several_heads_on_gpu(exact: bool) -> None:
    """Each head aggregates with its own column of the [E, heads] attention weights: a strided
    view, which cuSPARSE must not read as if it were contiguous."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graph, served, seeds = _setup("GAT", {"heads": 4}, 2, 0)
    served.to(torch.device("cuda"))
    fanouts = [-1, -1] if exact else [3, 3]
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, fanouts, 5)
    dev = torch.device("cuda")
    args = (graph.x[out.n_id].to(dev), out.n_id.to(dev), out.edge_index.to(dev),
            out.num_sampled_nodes, out.num_sampled_edges, exact)
    seed_rows = out.seed_index.to(dev)
    torch.testing.assert_close(served(*args)[seed_rows], served.pyg(*args)[seed_rows],
                               atol=1e-5, rtol=1e-5)


def _sorted_edges(num_dst: int, num_src: int, degrees: list[int], seed: int) -> torch.Tensor:
    """Edges grouped by target in order (as every sampler emits them), with the given
    in-degree per target (zeros included), sources drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.repeat_interleave(torch.arange(num_dst), torch.tensor(degrees))
    src = torch.randint(0, num_src, (dst.numel(),), generator=gen)
    return torch.stack([src, dst])


def test_batch_csr_row_pointers_count_each_targets_in_edges() -> None:
    """Targets without in-edges (first, inner and last) keep empty rows."""
    from quiver_serve.models.fast import BatchGraph

    degrees = [0, 3, 0, 0, 2, 1, 0]
    edge_index = _sorted_edges(len(degrees), 20, degrees, seed=0)
    for sparse in (True, False):
        g = BatchGraph(edge_index, [3, 4, 13], [6, 0], use_sparse=sparse)
        expected = torch.tensor([0, 0, 3, 3, 3, 5, 6, 6])
        assert torch.equal(g.rowptr.to(torch.int64), expected)
        assert g.in_count.tolist() == degrees
        assert g.layer(1).rowptr.tolist() == [0, 0, 3, 3]  # the last layer's 3 targets
        assert g.rowptr.dtype == g.col.dtype == (torch.int32 if sparse else torch.int64)


def test_row_bounds_are_slices_of_a_range_that_grows_without_freeing() -> None:
    """Every size gets 0..n; a slice handed out before the cache grew keeps its values."""
    from quiver_serve.models.fast import row_bounds

    like = torch.zeros(1, dtype=torch.int64)
    early = row_bounds(10, like)
    for n in (0, 1, 10, 5000, 70_000, 3):
        got = row_bounds(n, like)
        assert got.dtype == torch.int64 and torch.equal(got, torch.arange(n + 1))
    assert torch.equal(early, torch.arange(11))
    assert torch.equal(row_bounds(7, like.to(torch.int32)), torch.arange(8, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mean", [True, False])
def test_csr_aggregation_kernel_equals_its_torch_twin(index_dtype: torch.dtype,
                                                      mean: bool) -> None:
    """Rows with no, one and many in-edges, widths that are and are not multiples of a warp."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from quiver_serve.models.csr_kernel import kernel_for
    from quiver_serve.models.fast import BatchGraph, aggregate

    kernel = kernel_for(0)
    assert kernel is not None, "CuPy must build the kernel on a CUDA machine"
    dev = torch.device("cuda")
    degrees = [0, 1, 25, 0, 7, 3, 0, 40, 2, 0]
    for width in (1, 31, 64, 602):
        edge_index = _sorted_edges(len(degrees), 300, degrees, seed=width).to(dev)
        g = BatchGraph(edge_index, [len(degrees), 290], [sum(degrees)],
                       use_sparse=index_dtype == torch.int32).layer(0)
        dense = torch.randn(300, width, device=dev)
        values = None
        if mean:
            values = (1.0 / g.batch.in_count.clamp(min=1).float()).index_select(0, g.dst)
        want = aggregate(g, values, dense)
        got = kernel(g.rowptr, g.col, dense, g.num_dst, mean)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_graphsage_with_the_aggregation_kernel_equals_pyg_on_gpu(layers: int) -> None:
    """Sampled fp32 GraphSAGE on a GPU aggregates with the kernel; exact mode keeps torch's path;
    both equal PyG's layers, and the kernel's answer equals the torch path's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graph, served, seeds = _setup("GraphSAGE", {}, layers, 0)
    dev = torch.device("cuda")
    served.to(dev)
    assert served.fast is not None
    for fanouts in ([3] * layers, [25, 10, 5][:layers], [-1] * layers):
        out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, fanouts, 11)
        args = (graph.x[out.n_id].to(dev), out.n_id.to(dev), out.edge_index.to(dev),
                out.num_sampled_nodes, out.num_sampled_edges, fanouts[0] < 0)
        rows = out.seed_index.to(dev)
        with_kernel = served(*args)[rows]
        served.fast.fused_aggregation = False
        without = served(*args)[rows]
        served.fast.fused_aggregation = True
        torch.testing.assert_close(with_kernel, served.pyg(*args)[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(with_kernel, without, atol=1e-5, rtol=1e-5)
