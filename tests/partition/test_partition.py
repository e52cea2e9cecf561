"""Partitioning a graph offline (docs/architecture.md, "Partitioning"): every node owned once,
the partitions' in-edge lists are the graph's CSC exactly, METIS balances within its tolerance,
hot rows are the FAP top rows, the folders map back, bad input is named."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.config import GraphConfig, ServeConfig
from quiver_serve.features.fap import feature_access_probability
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.partition.data import (
    PartitionFolderError,
    graph_of,
    load_book,
    load_partition,
    partition_graph,
    save_partitions,
)
from quiver_serve.partition.hot import seed_probability
from quiver_serve.partition.methods import (
    LDG_SLACK,
    METIS_TOLERANCE,
    balance_weights,
    resolve_method,
)
from quiver_serve.partition.stats import balance
from quiver_serve.sampling.reference import ReferenceSampler

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("metis", "ldg", "range", "hash")


@pytest.fixture(scope="module")
def synthetic() -> GraphData:
    """A power-law graph the repository does not contain (20 k nodes, 200 k edges)."""
    return generate_synthetic(GraphConfig(
        format="synthetic", path=None, name="custom-syn", synthetic_preset="custom",
        synthetic_num_nodes=20_000, synthetic_num_edges=200_000, synthetic_num_features=8,
        synthetic_seed=3))


@pytest.mark.parametrize("method", METHODS)
def test_every_node_owned_once_and_the_lists_are_the_graph(cora: GraphData, method: str) -> None:
    book, parts, stats = partition_graph(cora, 4, method)
    owned = np.concatenate([p.global_ids for p in parts])
    assert np.array_equal(np.sort(owned), np.arange(cora.num_nodes))
    for p in parts:
        assert np.all(book.owners(p.global_ids) == p.part)
        assert np.array_equal(book.locals(p.global_ids), np.arange(p.num_owned))
        assert np.array_equal(p.features, cora.x.numpy()[p.global_ids])
        assert np.array_equal(p.labels, cora.y.numpy()[p.global_ids])
    indptr, indices = graph_of(parts)
    assert torch.equal(indptr, cora.indptr) and torch.equal(indices, cora.indices)
    assert stats.num_parts == 4 and sum(stats.nodes_per_part) == cora.num_nodes
    assert sum(stats.edges_per_part) == cora.num_edges


def test_edge_cut_counts_edges_between_owners(cora: GraphData) -> None:
    book, _, stats = partition_graph(cora, 3, "hash")
    src, dst = cora.edge_index().numpy()
    expected = int((book.owner[src] != book.owner[dst]).sum())
    assert stats.edge_cut == expected
    assert stats.edge_cut_fraction == pytest.approx(expected / cora.num_edges)


def test_metis_balances_nodes_and_edges_within_its_tolerance(synthetic: GraphData) -> None:
    book, _, stats = partition_graph(synthetic, 8, "metis")
    weights = np.bincount(book.owner, weights=balance_weights(synthetic.indptr.numpy()),
                          minlength=8)
    # METIS k-way meets its tolerance on the weight it balances (nodes and in-edges together)
    assert balance(weights) <= METIS_TOLERANCE + 0.005
    assert stats.node_balance <= 1.10 and stats.edge_balance <= 1.10
    # and cuts fewer edges than hashing the ids (measured: 0.68 of the edges against 0.88)
    _, _, hashed = partition_graph(synthetic, 8, "hash")
    assert stats.edge_cut < hashed.edge_cut


def test_hash_and_range_fallbacks(synthetic: GraphData) -> None:
    book, _, stats = partition_graph(synthetic, 5, "hash")
    assert stats.node_balance < 1.05
    again, _, _ = partition_graph(synthetic, 5, "hash")
    assert np.array_equal(book.owner, again.owner)  # a pure function of the id and the seed
    book, _, stats = partition_graph(synthetic, 5, "range")
    assert np.all(np.diff(book.owner) >= 0)  # contiguous id ranges
    weights = np.bincount(book.owner, weights=balance_weights(synthetic.indptr.numpy()),
                          minlength=5)
    heaviest = balance_weights(synthetic.indptr.numpy()).max()
    assert weights.max() - weights.mean() <= heaviest


def test_ldg_streams_to_a_lower_cut_than_hash_near_its_capacity(cora: GraphData,
                                                                synthetic: GraphData) -> None:
    for graph, bound in ((cora, LDG_SLACK + 0.01), (synthetic, 1.2)):
        _, _, stats = partition_graph(graph, 4, "ldg")
        _, _, hashed = partition_graph(graph, 4, "hash")
        assert stats.edge_cut < 0.9 * hashed.edge_cut
        # capacity 1.05 of an equal share of nodes and of in-edges; on a power-law graph one
        # pass fills some partitions' edges before their nodes (measured: up to 1.15)
        assert stats.node_balance <= bound and stats.edge_balance <= bound
    # measured on Cora: ldg 0.33 of the edges, hash 0.76, METIS 0.07 (4 parts)


def test_auto_falls_back_above_the_metis_limit(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_method("auto", 1_000, 10_000, "range") == "metis"
    with caplog.at_level(logging.WARNING, logger="quiver_serve.partition.methods"):
        assert resolve_method("auto", 20_000, 10_000, "hash") == "hash"
    assert "metis_max_edges" in caplog.text
    assert resolve_method("metis", 20_000, 10_000, "hash") == "metis"  # named: honoured
    assert ServeConfig().partition.fallback == "ldg"
    with pytest.raises(ValueError, match="unknown partitioning method 'kl'"):
        resolve_method("auto", 20_000, 10_000, "kl")


def test_hot_rows_are_the_fap_top_rows(cora: GraphData) -> None:
    fanouts, row_bytes, budget_rows = [10, 5], cora.num_features * 4, 60
    book, parts, stats = partition_graph(cora, 3, "metis", hot_budget_bytes=budget_rows * row_bytes,
                                         fap_fanouts=fanouts, fap_batch_size=64)
    for p in parts:
        prob = feature_access_probability(cora.indptr, cora.indices, fanouts,
                                          seed_probability(book.owner, p.part, 64)).numpy()
        remote = np.flatnonzero((book.owner != p.part) & (prob > 0))
        assert p.hot_ids.size == min(budget_rows, remote.size)
        assert np.all(book.owner[p.hot_ids] != p.part)
        assert np.all(np.diff(p.hot_ids) > 0)  # sorted by id
        # no row left out is likelier to be read than one chosen
        left_out = np.setdiff1d(remote, p.hot_ids)
        assert prob[p.hot_ids].min() >= (prob[left_out].max() if left_out.size else 0)
        assert np.array_equal(p.hot_features, cora.x.numpy()[p.hot_ids])
    assert stats.replicated_rows == sum(p.hot_ids.size for p in parts)
    assert stats.replicated_bytes == stats.replicated_rows * row_bytes


def test_hot_rows_match_a_brute_force_count_of_reads(cora: GraphData) -> None:
    """The rows the reference sampler reads most often from one partition's requests are the
    ones replicated there (FAP's independence approximation keeps the top rows)."""
    fanouts, batch, k = [10, 5], 16, 40
    book, parts, _ = partition_graph(cora, 2, "metis", hot_budget_bytes=k * cora.num_features * 4,
                                     fap_fanouts=fanouts, fap_batch_size=batch)
    sampler = ReferenceSampler(cora.indptr, cora.indices)
    mine = parts[0].global_ids
    rng = np.random.default_rng(0)
    reads = np.zeros(cora.num_nodes, dtype=np.int64)
    for i in range(3000):
        seeds = torch.from_numpy(rng.choice(mine, batch, replace=False))
        reads[sampler.sample(seeds, fanouts, seed=i).n_id.numpy()] += 1
    reads[book.owner == 0] = 0
    counted_top = np.argsort(-reads, kind="stable")[:k]
    overlap = np.intersect1d(counted_top, parts[0].hot_ids).size / k
    assert overlap >= 0.8, f"only {overlap:.0%} of the most read rows are replicated"
    # and the replicated rows take most of the remote reads the counting saw
    assert reads[parts[0].hot_ids].sum() >= 0.9 * reads[counted_top].sum()


def test_folders_round_trip_memory_mapped(cora: GraphData, tmp_path: Path) -> None:
    book, parts, stats = partition_graph(cora, 3, "metis", hot_budget_bytes=1 << 20,
                                         fap_fanouts=[25, 10])
    save_partitions(tmp_path / "out", book, parts, stats, "cora")
    loaded_book = load_book(tmp_path / "out")
    assert np.array_equal(loaded_book.owner, book.owner)
    assert np.array_equal(loaded_book.local, book.local)
    assert (loaded_book.num_parts, loaded_book.method) == (3, "metis")
    loaded = [load_partition(tmp_path / "out", p, verify=True) for p in range(3)]
    for a, b in zip(parts, loaded, strict=True):
        assert isinstance(b.indices, np.memmap) and not b.indices.flags.writeable
        for name in ("global_ids", "indptr", "indices", "features", "hot_ids", "hot_features",
                     "labels"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    meta = json.loads((tmp_path / "out" / "part-1" / "meta.json").read_text())
    assert all(len(spec["blake2b"]) == 32 for spec in meta["arrays"].values())
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved["edge_cut"] == stats.edge_cut and saved["num_parts"] == 3


def test_a_damaged_partition_is_refused_with_its_file(cora: GraphData, tmp_path: Path) -> None:
    book, parts, stats = partition_graph(cora, 2, "hash")
    save_partitions(tmp_path, book, parts, stats)
    x = tmp_path / "part-1" / "x.npy"
    data = bytearray(x.read_bytes())
    data[-1] ^= 0xFF
    x.write_bytes(bytes(data))
    load_partition(tmp_path, 1)  # unchecked: maps
    with pytest.raises(PartitionFolderError, match="part-1/x.npy.*content hash"):
        load_partition(tmp_path, 1, verify=True)
    (tmp_path / "part-0" / "indices.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(PartitionFolderError, match="part-0/indices.npy"):
        load_partition(tmp_path, 0)
    with pytest.raises(FileExistsError, match="not an empty folder"):
        save_partitions(tmp_path, book, parts, stats)


@pytest.mark.parametrize("method", METHODS)
def test_every_partition_owns_a_node_even_when_there_are_many(cora: GraphData,
                                                              method: str) -> None:
    book, parts, _ = partition_graph(cora, 1000, method)  # METIS alone leaves 41 empty
    assert book.sizes().min() >= 1
    assert np.array_equal(np.sort(np.concatenate([p.global_ids for p in parts])),
                          np.arange(cora.num_nodes))
    book, _, _ = partition_graph(cora, cora.num_nodes, method)
    assert np.all(book.sizes() == 1)


@pytest.mark.parametrize(("parts", "method", "message"), [
    (0, "metis", "parts must be an integer >= 1"),
    (-2, "hash", "parts must be an integer >= 1"),
    (2709, "hash", "must not exceed the graph's 2708 nodes"),
    (2, "spectral", "unknown partitioning method 'spectral'"),
])
def test_bad_requests_are_named(cora: GraphData, parts: int, method: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_graph(cora, parts, method)


def test_cli_end_to_end_on_the_embedded_default(cora: GraphData, tmp_path: Path) -> None:
    out = tmp_path / "cora-3"
    run = subprocess.run(
        [sys.executable, "-m", "quiver_serve.partition", "--parts", "3", "--out", str(out),
         "--method", "metis", "--hot-budget-mb", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "edge cut:" in run.stdout and "balance (max/mean)" in run.stdout
    book = load_book(out)
    parts = [load_partition(out, p, book=book) for p in range(3)]
    indptr, indices = graph_of(parts)
    assert torch.equal(indptr, cora.indptr) and torch.equal(indices, cora.indices)
    row_bytes = cora.num_features * 4
    assert all(0 < p.hot_ids.size <= 500_000 // row_bytes for p in parts)
    stats = json.loads((out / "stats.json").read_text())
    assert {"load", "assign", "hot_rows", "gather", "write"} <= set(stats["phase_s"])


@pytest.mark.parametrize(("args", "message"), [
    (["--parts", "0"], "--parts must be >= 1"),
    (["--parts", "99999"], "must not exceed the graph's 2708 nodes"),
    (["--parts", "2", "--method", "spectral"], "invalid choice: 'spectral'"),
    (["--parts", "2", "--hot-budget-mb", "-1"], "--hot-budget-mb must be >= 0"),
])
def test_cli_bad_input_is_named(tmp_path: Path, args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, "-m", "quiver_serve.partition", "--out",
                          str(tmp_path / "o"), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 2
    assert message in run.stderr
    assert not (tmp_path / "o").exists()
