"""The host overlay against a plain list-of-lists model of the update semantics in
docs/architecture.md, "The living graph"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.device_overlay import DeviceOverlay
from quiver_serve.graph.overlay import Overlay, OverlayFull
from quiver_serve.graph.overlay_view import REPLACED


def random_graph(rng: np.random.Generator, n: int, e: int) -> GraphData:
    ei = torch.from_numpy(rng.integers(0, n, (2, e)))
    return GraphData.from_edge_index(ei, torch.zeros(n, 1), "g")


def model_lists(g: GraphData) -> list[list[int]]:
    return [g.indices[g.indptr[v]:g.indptr[v + 1]].tolist() for v in range(g.num_nodes)]


def model_apply(lists: list[list[int]], add: np.ndarray, remove: np.ndarray) -> tuple[int, int]:
    gone = {(int(s), int(d)) for s, d in remove}
    present = {(u, d) for d, lst in enumerate(lists) for u in lst}
    missing = sum((int(s), int(d)) not in present for s, d in remove)
    removed = 0
    for d in {d for _, d in gone}:
        keep = [u for u in lists[d] if (u, d) not in gone]
        removed += len(lists[d]) - len(keep)
        lists[d] = keep
    for s, d in add:
        lists[int(d)].append(int(s))
    return removed, missing


def overlay_lists(ov: Overlay) -> list[list[int]]:
    indptr, indices = ov.to_csc()
    return [indices[indptr[v]:indptr[v + 1]].tolist() for v in range(ov.num_nodes)]


def as_multisets(lists: list[list[int]]) -> list[list[int]]:
    """Each in-list as a multiset (a removal fills its place from the list's end)."""
    return [sorted(lst) for lst in lists]


@pytest.mark.parametrize(("seed", "edges", "takes", "frozen"),
                         [(s, 160, 6, False) for s in range(6)]
                         + [(s, 1600, 40, s % 2 == 1) for s in range(6, 12)])
def test_random_updates_match_the_list_model(seed: int, edges: int, takes: int,
                                             frozen: bool) -> None:
    """Random adds and removals (dense graphs: cuts that grow, fill from pairs and turn into
    whole copies; some while a frozen copy is being read) keep every list, count and degree."""
    rng = np.random.default_rng(seed)
    g = random_graph(rng, 40, edges)
    ov = Overlay(g.indptr, g.indices, node_capacity=60, edge_capacity=200_000,
                 cut_base=seed % 2 == 0)
    lists = model_lists(g)
    for step in range(40):
        if step % 7 == 3:
            ids = ov.add_nodes(int(rng.integers(1, 3)))
            lists += [[] for _ in ids]
        if frozen and step % 10 == 0:
            copy, before = ov.freeze(), overlay_lists(ov)
        n = ov.num_nodes
        add = rng.integers(0, n, (int(rng.integers(0, 30)), 2))
        present = [(u, d) for d, lst in enumerate(lists) for u in lst]
        take = rng.integers(0, len(present), int(rng.integers(0, takes))) if present else []
        remove = np.array([present[i] for i in take] + [[int(rng.integers(0, n)), 0]],
                          np.int64).reshape(-1, 2)
        removed, missing = model_apply(lists, add, remove)
        result, _ = ov.apply_edges(add, remove)
        assert (result.added, result.removed, result.missing) == (len(add), removed, missing)
        assert as_multisets(overlay_lists(ov)) == as_multisets(lists)
        assert ov.num_edges == sum(map(len, lists))
        if frozen and step % 10 == 9:
            assert overlay_lists(copy) == before  # what the frozen copy read stayed intact
            ov.thaw()
    nodes = np.arange(ov.num_nodes)
    assert ov.degree(nodes).tolist() == [len(x) for x in lists]
    assert ov.self_loops(nodes).tolist() == [x.count(v) for v, x in enumerate(lists)]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


def _patch_and_compare(ov: Overlay, dev: DeviceOverlay, rng: np.random.Generator, rounds: int,
                       each: bool) -> None:
    """``rounds`` updates (adds, and removals of present edges) applied to ``ov`` and their
    patches to ``dev``; the copy compared with the host after each round or after the last."""
    for i in range(rounds):
        present = ov.to_csc()
        src = present[1][:3].numpy()
        dst = np.searchsorted(present[0].numpy(), np.arange(3), side="right") - 1
        _, patch = ov.apply_edges(rng.integers(0, 30, (15, 2)), np.stack([src, dst], 1))
        dev.apply(patch)
        if each or i == rounds - 1:
            host, view = ov.view(), dev.view()
            assert host is not None
            assert torch.equal(view.start.cpu(), host.start)
            assert torch.equal(view.length.cpu(), host.length)
            assert torch.equal(view.tail[:ov.top].cpu(), host.tail[:ov.top])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_device_copy_follows_the_patches(device: str) -> None:
    """On a GPU the patches travel from page-locked buffers without waiting for the host: many
    in a row, none synchronised, still leave the copy equal to the host overlay."""
    rng = np.random.default_rng(1)
    g = random_graph(rng, 30, 90)
    ov = Overlay(g.indptr, g.indices, node_capacity=40, edge_capacity=5_000)
    ov.apply_edges(rng.integers(0, 30, (10, 2)), np.empty((0, 2), np.int64))
    dev = DeviceOverlay(ov, torch.device(device))
    _patch_and_compare(ov, dev, rng, 30, each=False)
    _patch_and_compare(ov, dev, rng, 10, each=True)


def test_a_full_overlay_refuses_and_changes_nothing() -> None:
    rng = np.random.default_rng(2)
    g = random_graph(rng, 20, 40)
    ov = Overlay(g.indptr, g.indices, node_capacity=22, edge_capacity=64)
    before = overlay_lists(ov)
    with pytest.raises(OverlayFull):
        ov.apply_edges(rng.integers(0, 20, (200, 2)), np.empty((0, 2), np.int64))
    assert overlay_lists(ov) == before and ov.num_edges == 40
    ov.add_nodes(2)
    with pytest.raises(OverlayFull, match="node capacity"):
        ov.add_nodes(1)


def star(n: int) -> GraphData:
    """Node 0 with in-edges from 1 .. n (a hub)."""
    src = torch.arange(1, n + 1)
    return GraphData.from_edge_index(torch.stack([src, torch.zeros(n, dtype=torch.int64)]),
                                     torch.zeros(n + 1, 1), "star")


def test_a_base_removal_writes_what_it_removed_not_the_degree() -> None:
    """A hub that loses base entries keeps its base list and takes a cut: each call writes the
    node's pairs (two entries per entry removed since the base) and its tail, never its degree."""
    g = star(5000)
    ov = Overlay(g.indptr, g.indices, node_capacity=5001, edge_capacity=100_000, cut_base=True)
    _, first = ov.apply_edges(np.empty((0, 2), np.int64), np.array([[1, 0]]))
    assert first.tail_pos.size == 2  # one pair: place 0 takes the list's last entry
    removed = 1
    for batch in ([[17, 0]], [[4000, 0], [5000, 0]], [[u, 0] for u in range(100, 140)]):
        _, patch = ov.apply_edges(np.array([[7, 0]]), np.array(batch))
        removed += len(batch)
        tail = int(ov.degree(np.array([0]))[0]) - (5000 - removed)
        assert patch.tail_pos.size <= 2 * removed + tail
    assert ov.top < 500
    assert sorted(overlay_lists(ov)[0]) == sorted(
        [u for u in range(2, 5001) if u not in (17, 4000, 5000) and not 100 <= u < 140] + [7] * 3)


def test_a_list_whose_pairs_would_outgrow_half_of_it_is_copied_once() -> None:
    """Past half its base list a node's surviving list is copied into a tail once; later
    removals rewrite that tail in place, costing what they remove."""
    g = star(40)
    ov = Overlay(g.indptr, g.indices, node_capacity=41, edge_capacity=10_000, cut_base=True)
    for u in range(1, 21):  # 20 of 40: the pairs still fit half the list
        ov.apply_edges(np.empty((0, 2), np.int64), np.array([[u, 0]]))
        view = ov.view()
        assert view is not None and int(view.length[0]) & REPLACED == 0
    _, patch = ov.apply_edges(np.empty((0, 2), np.int64), np.array([[21, 0]]))
    view = ov.view()
    assert view is not None and int(view.length[0]) & REPLACED and patch.tail_pos.size == 19
    top = ov.top
    for u in range(22, 30):
        _, patch = ov.apply_edges(np.empty((0, 2), np.int64), np.array([[u, 0]]))
        assert patch.tail_pos.size <= 1
    assert ov.top == top
    assert sorted(overlay_lists(ov)[0]) == list(range(30, 41))


def test_unsorted_base_lists_still_lose_every_copy() -> None:
    """Removal finds base entries by binary search only when base lists are sorted; a base
    built unsorted is matched whole (same answers)."""
    indptr = torch.tensor([0, 4, 6])
    indices = torch.tensor([1, 0, 1, 0, 1, 0])  # node 0's list is not sorted
    ov = Overlay(indptr, indices, node_capacity=2, edge_capacity=100)
    result, _ = ov.apply_edges(np.empty((0, 2), np.int64), np.array([[0, 0], [1, 1]]))
    assert (result.removed, result.missing) == (3, 0)
    assert overlay_lists(ov) == [[1, 1], [0]]


@pytest.mark.parametrize("edges_per_chunk", [1, 7, 64, 1 << 20])
def test_a_fold_in_chunks_equals_the_lists_and_sorts_them_as_one_call(edges_per_chunk: int) -> None:
    """A compaction folds the overlay a few entries per NumPy call (so the writer's other
    threads are not stalled by one whole-graph call): any chunk size gives every list in
    overlay order, and sorting the touched lists chunk by chunk gives the sorted lists."""
    from quiver_serve.graph.writer import sort_lists

    rng = np.random.default_rng(5)
    g = random_graph(rng, 60, 400)
    ov = Overlay(g.indptr, g.indices, 80, 2000)
    lists = model_lists(g)
    for _ in range(8):
        add = rng.integers(0, 60, (30, 2))
        remove = np.concatenate([add[:3], rng.integers(0, 60, (5, 2))])
        ov.apply_edges(add, remove)
        model_apply(lists, add, remove)
    indptr, indices = (t.numpy() for t in ov.to_csc(edges_per_chunk))
    one_ptr, one_idx = (t.numpy() for t in ov.to_csc(1 << 30))
    assert np.array_equal(indptr, one_ptr) and np.array_equal(indices, one_idx)
    got = [indices[indptr[v]:indptr[v + 1]].tolist() for v in range(60)]
    assert as_multisets(got) == as_multisets(lists[:60])
    touched = ov.changed_nodes()
    indices = indices.copy()
    sort_lists(indptr, indices, touched, edges_per_chunk)
    for v in range(60):
        want = sorted(got[v]) if v in set(touched.tolist()) else got[v]
        assert indices[indptr[v]:indptr[v + 1]].tolist() == want
