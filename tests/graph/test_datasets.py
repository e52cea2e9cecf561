"""Dataset loaders (.npz, saved PyG Data, Planetoid), the synthetic generator, and the shipped model."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import DEFAULTS_DIR, GraphConfig, ModelConfig
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.datasets import load_graph, load_npz, load_planetoid_raw, load_pyg_data
from quiver_serve.graph.planetoid import read_planetoid
from quiver_serve.graph.synthetic import PRESETS, generate_synthetic

REPO_ROOT = Path(__file__).resolve().parents[2]
CORA_RAW = DEFAULTS_DIR / "planetoid" / "cora" / "raw"
# Real heterophilous graphs, when a shared data folder sits beside the checkout: extra coverage
# only; the contracts are checked on a generated file of the same layout (heterophilous_npz).
HETEROPHILOUS = REPO_ROOT / ".." / "shared" / "data" / "heterophilous"
SHARED_PLANETOID = REPO_ROOT / ".." / "shared" / "data" / "planetoid"


def assert_csc_invariants(graph: GraphData) -> None:
    """indptr starts at 0 and never decreases; indices in range and sorted within each node."""
    indptr, indices = graph.indptr, graph.indices
    assert indptr.dtype == indices.dtype == torch.int64
    assert graph.x.dtype == torch.float32
    assert int(indptr[0]) == 0 and int(indptr[-1]) == indices.numel()
    assert bool((indptr.diff() >= 0).all())
    if indices.numel():
        assert 0 <= int(indices.min()) and int(indices.max()) < graph.num_nodes
    dst = torch.repeat_interleave(torch.arange(graph.num_nodes), graph.degree())
    same_node = dst[1:] == dst[:-1]
    assert bool((indices[1:][same_node] >= indices[:-1][same_node]).all())


def edge_set(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    return torch.sort(edge_index[0] * num_nodes + edge_index[1]).values


def random_graph(num_nodes: int = 50, num_edges: int = 300, seed: int = 0) -> GraphData:
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=g)
    x = torch.randn(num_nodes, 8, generator=g)
    y = torch.randint(0, 3, (num_nodes,), generator=g)
    return GraphData.from_edge_index(edge_index, x, name="rand", y=y)


def assert_same_graph(a: GraphData, b: GraphData) -> None:
    assert torch.equal(a.indptr, b.indptr)
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.x, b.x)
    assert (a.y is None) == (b.y is None)
    if a.y is not None:
        assert torch.equal(a.y, b.y)


# --- .npz --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature_key", ["x", "features", "node_features"])
def test_npz_csc_round_trip(tmp_path: Path, feature_key: str) -> None:
    graph = random_graph()
    path = tmp_path / "g.npz"
    np.savez(
        path,
        indptr=graph.indptr.numpy(),
        indices=graph.indices.numpy().astype(np.int32),
        **{feature_key: graph.x.numpy().astype(np.float64)},
        labels=graph.y.numpy(),
    )
    loaded = load_npz(path, "rand")
    assert_csc_invariants(loaded)
    assert_same_graph(loaded, graph)


def test_npz_csc_unsorted_neighbours_are_sorted(tmp_path: Path) -> None:
    graph = random_graph()
    indices = graph.indices.clone()
    for v in range(graph.num_nodes):  # reverse every node's neighbour list
        lo, hi = int(graph.indptr[v]), int(graph.indptr[v + 1])
        indices[lo:hi] = indices[lo:hi].flip(0)
    np.savez(
        tmp_path / "g.npz", indptr=graph.indptr.numpy(), indices=indices.numpy(), x=graph.x.numpy()
    )
    loaded = load_npz(tmp_path / "g.npz", "rand")
    assert_csc_invariants(loaded)
    assert torch.equal(loaded.indices, graph.indices)


def test_npz_edge_index_round_trip_keeps_direction_and_duplicates(tmp_path: Path) -> None:
    edge_index = np.array([[0, 0, 2, 3, 3], [1, 1, 1, 0, 2]])  # 0->1 twice, no reverse edges
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.savez(tmp_path / "g.npz", edge_index=edge_index, x=x, y=np.array([0, 1, 0, 1]))
    loaded = load_npz(tmp_path / "g.npz", "tiny")
    assert_csc_invariants(loaded)
    assert loaded.num_edges == 5
    assert torch.equal(edge_set(loaded.edge_index(), 4), edge_set(torch.from_numpy(edge_index), 4))
    assert loaded.y.dtype == torch.int64


def test_npz_edges_list_is_made_undirected(tmp_path: Path) -> None:
    edges = np.array([[0, 1], [1, 0], [1, 2], [3, 3]])  # [E, 2]; 0-1 both ways already
    np.savez(
        tmp_path / "g.npz",
        edges=edges,
        node_features=np.ones((4, 2), np.float32),
        node_labels=np.zeros(4, np.int64),
    )
    loaded = load_npz(tmp_path / "g.npz", "tiny")
    expected = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 1, 3]])  # coalesced, as PyG's to_undirected
    assert torch.equal(edge_set(loaded.edge_index(), 4), edge_set(expected, 4))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"indptr": np.array([0, 1]), "indices": np.array([0])}, "no node features"),
        ({"x": np.ones((2, 2)), "indptr": np.array([0, 1, 1])}, "'indices' is missing"),
        ({"x": np.ones((2, 2)), "indptr": np.array([0, 1]), "indices": np.array([0])}, "'indptr'"),
        (
            {"x": np.ones((2, 2)), "indptr": np.array([0, 2, 1]), "indices": np.array([0])},
            "never decrease",
        ),
        (
            {"x": np.ones((2, 2)), "indptr": np.array([0, 1, 1]), "indices": np.array([5])},
            "'indices'",
        ),
        ({"x": np.ones((2, 2)), "edge_index": np.array([[0, 1, 1], [1, 0, 0]]).T}, "[2, E]"),
        ({"x": np.ones((2, 2)), "edges": np.array([[0, 2]])}, "'edges'"),
        ({"x": np.ones((2, 2)), "edge_index": np.array([[0.0], [1.0]])}, "integers"),
        ({"x": np.ones((2, 2)), "y": np.zeros(3), "edges": np.array([[0, 1]])}, "'y'"),
        ({"x": np.ones((2, 2))}, "no graph found"),
    ],
)
def test_npz_errors_name_file_and_key(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError) as info:
        load_npz(path, "bad")
    assert str(path) in str(info.value) and message in str(info.value)


def test_npz_object_arrays_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "pickled.npz"
    features = np.empty((2, 1), dtype=object)
    features[:] = 1.0
    np.savez(path, x=features, edge_index=np.array([[0], [1]]))
    with pytest.raises(ValueError, match="without pickle"):
        load_npz(path, "pickled")


def test_load_graph_reads_npz_from_config(tmp_path: Path) -> None:
    graph = random_graph()
    np.savez(tmp_path / "g.npz", edge_index=graph.edge_index().numpy(), x=graph.x.numpy())
    loaded = load_graph(GraphConfig(format="npz", path=str(tmp_path / "g.npz"), name="rand"))
    assert torch.equal(loaded.indices, graph.indices) and loaded.name == "rand"


def write_heterophilous_npz(path: Path, num_nodes: int = 30, seed: int = 0) -> None:
    """A file in the yandex-research heterophilous-graphs layout (as chameleon.npz and
    tolokers.npz): ``edges`` [E, 2] int64 listing some edges one way only, some both ways, some
    twice, and self loops; ``node_features``, ``node_labels``; masks [10, N] for ten splits."""
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, num_nodes - 3, size=(80, 2))  # the last three nodes stay isolated
    edges = np.concatenate([edges, edges[:10, ::-1], edges[10:15], [[4, 4], [7, 7], [7, 7]]])
    masks = rng.random((3, 10, num_nodes)) < 0.4
    np.savez(path, edges=edges.astype(np.int64),
             node_features=rng.standard_normal((num_nodes, 5)).astype(np.float32),
             node_labels=rng.integers(0, 3, num_nodes).astype(np.int64),
             train_masks=masks[0], val_masks=masks[1], test_masks=masks[2])


def pyg_heterophilous(npz: Path, root: Path):
    """What PyG's HeterophilousGraphDataset builds from ``npz``.

    PyG's class accepts only its own five names and reads the file and nothing else (no download
    when the raw file is present), so any file of the format is checked under the Tolokers name.
    """
    from torch_geometric.datasets import HeterophilousGraphDataset

    (root / "tolokers" / "raw").mkdir(parents=True)
    shutil.copy(npz, root / "tolokers" / "raw" / "tolokers.npz")
    return HeterophilousGraphDataset(str(root), "Tolokers")[0]


def assert_matches_pyg_heterophilous(loaded: GraphData, npz: Path, root: Path) -> None:
    from torch_geometric.utils import to_undirected

    expected = pyg_heterophilous(npz, root)
    assert_csc_invariants(loaded)
    n = loaded.num_nodes
    with np.load(npz) as raw:  # PyG's own conversion, called directly
        undirected = to_undirected(torch.from_numpy(raw["edges"]).t().contiguous(), num_nodes=n)
    assert loaded.num_edges == expected.num_edges == undirected.size(1)
    assert torch.equal(edge_set(loaded.edge_index(), n), edge_set(expected.edge_index, n))
    assert torch.equal(edge_set(loaded.edge_index(), n), edge_set(undirected, n))
    assert torch.equal(loaded.x, expected.x) and torch.equal(loaded.y, expected.y)


def test_heterophilous_npz_matches_pyg(tmp_path: Path) -> None:
    npz = tmp_path / "hetero.npz"
    write_heterophilous_npz(npz)
    loaded = load_npz(npz, "hetero")
    assert_matches_pyg_heterophilous(loaded, npz, tmp_path / "pyg")
    # What the fixture is for: one-way edges gain their reverse, duplicates go, loops stay once.
    keys = edge_set(loaded.edge_index(), loaded.num_nodes).tolist()
    assert len(keys) == len(set(keys))
    with np.load(npz) as raw:
        edges = raw["edges"]
    n = loaded.num_nodes
    assert {int(s) * n + int(d) for s, d in edges} | {int(d) * n + int(s) for s, d in edges} \
        == set(keys)
    assert {4 * n + 4, 7 * n + 7} <= set(keys)
    assert int(loaded.degree()[-3:].sum()) == 0


@pytest.mark.parametrize("name", ["chameleon", "tolokers"])
def test_real_heterophilous_npz_matches_pyg(tmp_path: Path, name: str) -> None:
    """Extra coverage on the real files when a shared data folder is present."""
    npz = HETEROPHILOUS / f"{name}.npz"
    if not npz.exists():
        pytest.skip(f"{npz} not present (optional extra coverage)")
    assert_matches_pyg_heterophilous(load_npz(npz, name), npz, tmp_path)


# --- saved PyG Data ----------------------------------------------------------------------------------


def _pyg_data(graph: GraphData):
    from torch_geometric.data import Data

    return Data(
        x=graph.x,
        edge_index=graph.edge_index(),
        y=graph.y,
        train_mask=torch.zeros(graph.num_nodes, dtype=torch.bool),
    )


@pytest.mark.parametrize("as_dict", [False, True])
def test_pyg_data_round_trip(tmp_path: Path, as_dict: bool) -> None:
    graph = random_graph()
    data = _pyg_data(graph)
    torch.save(data.to_dict() if as_dict else data, tmp_path / "g.pt")
    loaded = load_pyg_data(tmp_path / "g.pt", "rand")
    assert_csc_invariants(loaded)
    assert_same_graph(loaded, graph)


class _RunsCodeOnLoad:
    """Unpickling this would run a command (what weights_only=True exists to stop)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pyg_file_with_foreign_objects_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    data = _pyg_data(random_graph()).to_dict()
    data["extra"] = _RunsCodeOnLoad(marker)
    torch.save(data, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refused"):
        load_pyg_data(tmp_path / "evil.pt", "evil")
    assert not marker.exists()


def test_pyg_file_errors(tmp_path: Path) -> None:
    torch.save({"x": torch.ones(3, 2)}, tmp_path / "no_edges.pt")
    with pytest.raises(ValueError, match="'edge_index'"):
        load_pyg_data(tmp_path / "no_edges.pt", "g")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="torch.save"):
        load_pyg_data(tmp_path / "junk.pt", "g")


# --- Planetoid ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cora_pyg(tmp_path_factory: pytest.TempPathFactory):
    from torch_geometric.datasets import Planetoid

    root = tmp_path_factory.mktemp("planetoid")
    shutil.copytree(CORA_RAW, root / "Cora" / "raw")
    return Planetoid(str(root), "Cora")[0]


def test_planetoid_loader_matches_pyg(cora_pyg) -> None:
    loaded = load_planetoid_raw(CORA_RAW, "cora")
    assert_csc_invariants(loaded)
    assert (loaded.num_nodes, loaded.num_edges) == (2708, 10556)
    assert torch.equal(loaded.x, cora_pyg.x) and torch.equal(loaded.y, cora_pyg.y)
    assert torch.equal(edge_set(loaded.edge_index(), 2708), edge_set(cora_pyg.edge_index, 2708))


def assert_same_as_pyg_reader(raw_dir: Path, prefix: str) -> None:
    """The safe reader's tensors equal PyG's (pickle-based) reader's, bit for bit and in order.
    Calling PyG's reader is fine here: the files are trusted."""
    from torch_geometric.io import read_planetoid_data

    x, edge_index, y = read_planetoid(raw_dir, prefix)
    expected = read_planetoid_data(str(raw_dir), prefix)
    assert torch.equal(x, expected.x) and x.dtype == expected.x.dtype
    assert torch.equal(y, expected.y)
    assert torch.equal(edge_index, expected.edge_index.as_subclass(torch.Tensor))


def test_planetoid_safe_reader_equals_pyg_reader() -> None:
    assert_same_as_pyg_reader(CORA_RAW, "cora")


def test_planetoid_citeseer_equals_pyg_reader() -> None:
    """Extra coverage (CiteSeer's isolated test nodes) when a shared data folder is present."""
    raw = SHARED_PLANETOID / "citeseer" / "raw"
    if not raw.exists():
        pytest.skip(f"{raw} not present (optional extra coverage)")
    assert_same_as_pyg_reader(raw, "citeseer")
    assert load_planetoid_raw(raw, "citeseer").num_nodes == 3327


class _Calls:
    """Pickles as a call of ``func(*args)`` on load: what a crafted Planetoid file would do."""

    def __init__(self, func, *args) -> None:  # type: ignore[no-untyped-def]
        self.call = (func, args)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return self.call


@pytest.mark.parametrize("attack", ["os.system", "builtins.eval"])
def test_planetoid_pickle_naming_other_globals_is_refused(tmp_path: Path, attack: str) -> None:
    import os

    raw = tmp_path / "raw"
    shutil.copytree(CORA_RAW, raw)
    marker = tmp_path / "code-ran"
    payload = (_Calls(os.system, f"touch {marker}") if attack == "os.system"
               else _Calls(eval, f"open({str(marker)!r}, 'w')"))
    evil = raw / "ind.cora.x"
    evil.write_bytes(pickle.dumps(payload, protocol=2))
    # As pickled: os.system is posix.system, and protocol 2 writes builtins as __builtin__.
    refused = f"{os.system.__module__}.system" if attack == "os.system" else "__builtin__.eval"
    with pytest.raises(ValueError, match="refused") as info:
        load_planetoid_raw(raw, "cora")
    assert str(evil) in str(info.value) and refused in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(("content", "message"), [
    (b"not a pickle", "not a readable Planetoid pickle"),
    (pickle.dumps([1, 2, 3], protocol=2), "expected a 2-D array"),
])
def test_planetoid_malformed_files_name_the_file(tmp_path: Path, content: bytes,
                                                 message: str) -> None:
    raw = tmp_path / "raw"
    shutil.copytree(CORA_RAW, raw)
    (raw / "ind.cora.tx").write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        load_planetoid_raw(raw, "cora")
    assert str(raw / "ind.cora.tx") in str(info.value)


def test_shipped_model_loads_weights_only_and_is_accurate(cora_pyg) -> None:
    from torch_geometric.nn.models import GraphSAGE

    kwargs = ModelConfig().kwargs  # what the server builds by default
    assert kwargs == {"hidden_channels": 128, "num_layers": 2, "out_channels": 64}
    trunk = GraphSAGE(in_channels=1433, **kwargs)
    trunk.load_state_dict(torch.load(DEFAULTS_DIR / "cora_graphsage.pt", weights_only=True))
    head = torch.nn.Linear(64, 7)
    head.load_state_dict(
        torch.load(DEFAULTS_DIR / "cora_graphsage_head.pt", weights_only=True)
    )
    graph = load_planetoid_raw(CORA_RAW, "cora")  # the graph the server serves
    trunk.eval()
    with torch.no_grad():
        pred = head(trunk(graph.x, graph.edge_index())).argmax(dim=1)
    mask = cora_pyg.test_mask
    assert int(mask.sum()) == 1000
    assert float((pred[mask] == graph.y[mask]).float().mean()) >= 0.70


# --- synthetic ---------------------------------------------------------------------------------------


def _synthetic(preset: str = "reddit", scale: float = 0.01, seed: int = 0, **extra) -> GraphData:
    return generate_synthetic(
        GraphConfig(
            format="synthetic",
            synthetic_preset=preset,
            synthetic_scale=scale,
            synthetic_seed=seed,
            **extra,
        )
    )


def test_synthetic_is_deterministic_across_threads() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = _synthetic("products", 0.005, seed=3)
        torch.set_num_threads(max(2, threads))
        b = _synthetic("products", 0.005, seed=3)
    finally:
        torch.set_num_threads(threads)
    assert_same_graph(a, b)
    c = _synthetic("products", 0.005, seed=4)
    assert not torch.equal(a.indices, c.indices)
    assert not torch.equal(a.x, c.x)


@pytest.mark.parametrize(
    ("preset", "scale"), [("reddit", 0.01), ("products", 0.01), ("papers100m", 0.0005)]
)
def test_synthetic_matches_preset_statistics(preset: str, scale: float) -> None:
    graph = _synthetic(preset, scale)
    stats = PRESETS[preset]
    assert_csc_invariants(graph)
    assert graph.num_nodes == pytest.approx(stats.num_nodes * scale, rel=0.01)
    assert graph.num_edges == pytest.approx(stats.num_edges * scale, rel=0.01)
    assert graph.num_edges / graph.num_nodes == pytest.approx(
        stats.num_edges / stats.num_nodes, rel=0.01
    )
    assert graph.num_features == stats.num_features
    assert graph.x.dtype == torch.float32 and graph.y.dtype == torch.int64
    assert 0 <= int(graph.y.min()) and int(graph.y.max()) < stats.num_classes
    # No duplicate edges: neighbour lists are strictly increasing.
    dst = torch.repeat_interleave(torch.arange(graph.num_nodes), graph.degree())
    same_node = dst[1:] == dst[:-1]
    assert bool((graph.indices[1:][same_node] > graph.indices[:-1][same_node]).all())


@pytest.mark.parametrize("preset", ["products", "papers100m"])
def test_synthetic_degrees_are_heavy_tailed(preset: str) -> None:
    graph = _synthetic(preset, 0.01 if preset == "products" else 0.0005)
    in_degree = graph.degree().double()
    out_degree = torch.bincount(graph.indices, minlength=graph.num_nodes).double()
    mean = graph.num_edges / graph.num_nodes
    for degree in (in_degree, out_degree):
        assert float(degree.max()) > 20 * mean
        assert (
            float(degree.median()) < mean
        )  # skewed: most nodes below the mean, a few hubs far above
    # Hubs are scattered over ids, not packed at the front.
    top = torch.topk(in_degree, 20).indices
    assert int(top.max()) > graph.num_nodes // 2


def test_synthetic_custom_preset() -> None:
    graph = _synthetic(
        "custom",
        1.0,
        synthetic_num_nodes=1000,
        synthetic_num_edges=20000,
        synthetic_num_features=16,
    )
    assert (graph.num_nodes, graph.num_edges, graph.num_features) == (1000, 20000, 16)
    assert_csc_invariants(graph)
    half = _synthetic(
        "custom",
        0.5,
        synthetic_num_nodes=1000,
        synthetic_num_edges=20000,
        synthetic_num_features=16,
    )
    assert (half.num_nodes, half.num_edges) == (500, 10000)


def test_synthetic_custom_needs_sizes() -> None:
    with pytest.raises(ValueError, match="synthetic_num_edges"):
        _synthetic("custom", 1.0, synthetic_num_nodes=10, synthetic_num_features=4)


def test_synthetic_too_dense_scale_is_an_error() -> None:
    # Reddit's mean degree (492) exceeds the 233 nodes of scale 0.001.
    with pytest.raises(ValueError, match="larger synthetic_scale"):
        _synthetic("reddit", 0.001)
