"""Sampling the living graph (docs/architecture.md, "The living graph"): every CPU sampler over base
CSC + overlay equals the reference sampler over the plain CSC of the same lists, bit for bit.

Overlays are built by hand (``graph/overlay_view.py``'s layout) from small random graphs:
duplicate edges, self loops, isolated nodes, nodes added beyond the base, replaced base lists and
tails placed with slack (not packed, not in node order). The ``check_*`` scenarios take a sampler
factory and run unchanged on the CUDA samplers (``test_overlay_sampling_gpu.py``) and, here, on
the CUDA kernel itself compiled for the CPU (``emulated``: one thread per CUDA thread).
"""

from __future__ import annotations

import ctypes
import itertools
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import (
    CUT_MASK,
    CUT_SHIFT,
    LENGTH_MASK,
    REPLACED,
    SPENT_POS,
    OverlayView,
    cut_of,
)
from quiver_serve.sampling import cpu as cpu_mod
from quiver_serve.sampling.base import BaseSampler, SamplerOutput, seed_base
from quiver_serve.sampling.graph_cache import elias_fano
from quiver_serve.sampling.graph_cache.adjacency import (
    EF_BITS,
    EXTRA_BYTES,
    FIXED_BYTES_PER_NODE,
    build_adjacency_cache,
    id_bits,
)
from quiver_serve.sampling.reference import ReferenceSampler, hop_edge_positions, read_positions

#: builds a sampler over a base CSC (host tensors); the scenarios set the overlay themselves
Make = Callable[[Tensor, Tensor], BaseSampler]
#: the GPU samplers' modes: CSC in device memory, UVA, UVA with each adjacency-cache layout
GPU_MODES = ["cuda", "uva", "uva+packed", "uva+elias_fano"]

FANOUTS = [[3, 2], [1], [-1, -1], [5, -1], [40], [2, 2, 2], [0, 3]]
BATCH_SEEDS = [0, 7, 2**63 - 1]
#: chi-square(11) upper 1e-3 quantile (scipy.stats.chi2.ppf(0.999, 11)); the draws are a pure
#: function of the seed, so the test passes or fails deterministically
CHI2_CRIT_DOF11 = 31.264


# ---- building living graphs by hand ------------------------------------------------------------


def base_csc(n_base: int, num_edges: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A random multigraph CSC: duplicates and self loops; the high ids have no in-edges."""
    dst = torch.randint(0, max(1, (2 * n_base) // 3), (num_edges,), generator=gen)
    src = torch.randint(0, n_base, (num_edges,), generator=gen)
    src[: num_edges // 10] = dst[: num_edges // 10]  # self loops
    order = torch.argsort(dst * n_base + src)
    indptr = torch.zeros(n_base + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=n_base), 0, out=indptr[1:])
    return indptr, src[order].contiguous()


def make_view(n_base: int, num_nodes: int, tails: dict[int, list[int]], replaced: set[int],
              gen: torch.Generator, node_slack: int = 5, edge_slack: int = 3,
              cuts: dict[int, list[tuple[int, int]]] | None = None) -> OverlayView:
    """An overlay whose node ``v`` has tail ``tails[v]`` (an empty list: a tail of length 0), a
    replaced base list when ``v in replaced`` and the cut ``cuts[v]`` (its (position, value)
    pairs, sorted; ``v`` needs a tail entry); blocks lie in random order with random gaps."""
    cuts = cuts or {}
    capacity = num_nodes + node_slack
    start = torch.full((capacity,), -1, dtype=torch.int64)
    length = torch.zeros(capacity, dtype=torch.int64)
    total = sum(len(t) for t in tails.values()) + 2 * sum(len(c) for c in cuts.values())
    tail = torch.full((total + edge_slack * (len(tails) + 1),), -7, dtype=torch.int64)
    at = int(torch.randint(0, edge_slack + 1, (1,), generator=gen))
    for v in torch.randperm(num_nodes, generator=gen).tolist():
        if v not in tails:
            continue
        block = [x for pair in cuts.get(v, []) for x in pair] + tails[v]
        start[v] = at
        length[v] = len(tails[v]) | (len(cuts.get(v, [])) << CUT_SHIFT)
        tail[at : at + len(block)] = torch.tensor(block, dtype=torch.int64)
        at += len(block) + int(torch.randint(0, edge_slack + 1, (1,), generator=gen))
    for v in replaced:
        length[v] |= REPLACED
    return OverlayView(n_base, num_nodes, start, length, tail)


def random_cuts(indptr: Tensor, num_nodes: int, skip: set[int], gen: torch.Generator,
                ) -> dict[int, list[tuple[int, int]]]:
    """Cuts for about a third of the base nodes with two or more in-edges (not in ``skip``):
    up to half the list, pairs at random places (some spent, some fillers)."""
    cuts: dict[int, list[tuple[int, int]]] = {}
    for v in range(indptr.numel() - 1):
        deg = int(indptr[v + 1] - indptr[v])
        if v in skip or deg < 2 or int(torch.randint(0, 3, (1,), generator=gen)) != 0:
            continue
        c = int(torch.randint(1, deg // 2 + 1, (1,), generator=gen))
        places = sorted(torch.randperm(deg, generator=gen)[:c].tolist())
        if c >= 2 and int(torch.randint(0, 2, (1,), generator=gen)):
            places[-1] = SPENT_POS
        values = torch.randint(0, num_nodes, (c,), generator=gen).tolist()
        cuts[v] = list(zip(places, values, strict=True))
    return cuts


def random_living_graph(n_base: int, num_edges: int, added: int, gen: torch.Generator,
                        ) -> tuple[Tensor, Tensor, OverlayView]:
    """(indptr, indices, view): a random base plus an overlay touching about half the nodes
    (tails, replaced base lists and cuts)."""
    indptr, indices = base_csc(n_base, num_edges, gen)
    num_nodes = n_base + added
    tails: dict[int, list[int]] = {}
    for v in range(num_nodes):
        roll = int(torch.randint(0, 6, (1,), generator=gen))
        if roll >= 3:  # 0-2: no tail (isolated when v has no base list either)
            size = int(torch.randint(0 if roll == 3 else 1, 9, (1,), generator=gen))
            values = torch.randint(0, num_nodes, (size,), generator=gen).tolist()
            if size >= 3:
                values[1] = values[0]  # a duplicate edge
                values[2] = v  # a self loop
            tails[v] = values
    replaced = {v for v in range(n_base) if int(torch.randint(0, 5, (1,), generator=gen)) == 0}
    cuts = random_cuts(indptr, num_nodes, replaced, gen)
    for v in cuts:
        tails.setdefault(v, [])
    return indptr, indices, make_view(n_base, num_nodes, tails, replaced, gen, cuts=cuts)


def current_list(indptr: Tensor, indices: Tensor, view: OverlayView, v: int) -> list[int]:
    """Node ``v``'s neighbour list as the overlay's contract defines it (one node, no tricks)."""
    raw = int(view.length[v])
    out: list[int] = []
    cut = 0
    s = int(view.start[v])
    if v < view.n_base and not raw & REPLACED:
        cut = (raw >> CUT_SHIFT) & CUT_MASK
        out += indices[int(indptr[v]) : int(indptr[v + 1]) - cut].tolist()
        for i in range(cut):
            place, value = int(view.tail[s + 2 * i]), int(view.tail[s + 2 * i + 1])
            if place < len(out):
                out[place] = value
    if s >= 0:
        out += view.tail[s + 2 * cut : s + 2 * cut + (raw & LENGTH_MASK)].tolist()
    return out


def effective_csc(indptr: Tensor, indices: Tensor, view: OverlayView) -> tuple[Tensor, Tensor]:
    """The plain CSC of the living graph: every list in overlay order (base, then tail)."""
    view = view_on(view, "cpu")
    lists = [current_list(indptr.cpu(), indices.cpu(), view, v) for v in range(view.num_nodes)]
    plain_indptr = torch.zeros(view.num_nodes + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor([len(x) for x in lists], dtype=torch.int64), 0,
                 out=plain_indptr[1:])
    plain_indices = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    return plain_indptr, plain_indices


def view_on(view: OverlayView, device: torch.device | str) -> OverlayView:
    """A copy of ``view`` on ``device`` (the same tensors when they are there already)."""
    return OverlayView(view.n_base, view.num_nodes, view.start.to(device), view.length.to(device),
                       view.tail.to(device))


def batches(view: OverlayView, gen: torch.Generator) -> list[Tensor]:
    """Seed batches: one node, added nodes only, replaced nodes, every node, random repeats."""
    n = view.num_nodes
    replaced = ((view.length[:n].cpu() & REPLACED) != 0).nonzero().flatten()
    return [torch.tensor([n - 1]), torch.arange(view.n_base, n), replaced[:50],
            torch.arange(n), torch.randint(0, n, (3 * n,), generator=gen)]


def assert_same(a: SamplerOutput, b: SamplerOutput) -> None:
    assert torch.equal(a.n_id.cpu(), b.n_id)
    assert torch.equal(a.edge_index.cpu(), b.edge_index)
    assert torch.equal(a.seed_index.cpu(), b.seed_index)
    assert a.num_sampled_nodes == b.num_sampled_nodes
    assert a.num_sampled_edges == b.num_sampled_edges


def assert_matches_plain(sampler: BaseSampler, plain: ReferenceSampler, seeds_list: list[Tensor],
                         fanouts_list: list[list[int]] = FANOUTS,
                         batch_seeds: list[int] = BATCH_SEEDS) -> None:
    for seeds, fanouts, seed in itertools.product(seeds_list, fanouts_list, batch_seeds):
        if seeds.numel():
            assert_same(sampler.sample(seeds, fanouts, seed), plain.sample(seeds, fanouts, seed))


def mixed_star_graph(centres: int, base_deg: int, tail_deg: int
                     ) -> tuple[Tensor, Tensor, OverlayView]:
    """Centres ``0..centres-1`` each list leaves ``centres .. centres+base_deg-1`` in the base
    and leaves ``centres+base_deg ..`` (``tail_deg`` of them, added nodes) in their tails."""
    n_base = centres + base_deg
    indptr = torch.zeros(n_base + 1, dtype=torch.int64)
    indptr[1 : centres + 1] = torch.arange(1, centres + 1) * base_deg
    indptr[centres + 1 :] = centres * base_deg
    indices = torch.arange(centres, n_base).repeat(centres)
    leaves = list(range(n_base, n_base + tail_deg))
    view = make_view(n_base, n_base + tail_deg, {v: leaves for v in range(centres)}, set(),
                     torch.Generator().manual_seed(0))
    return indptr, indices, view


def star_statistic(out: SamplerOutput, centres: int, first_leaf: int, degree: int, k: int) -> float:
    """Pearson's statistic over how often each of a centre's ``degree`` neighbours was drawn,
    scaled to chi-square(degree - 1) (every draw is ``k`` distinct of ``degree``)."""
    leaf = out.n_id[out.edge_index[0]].view(centres, k).cpu() - first_leaf
    assert (leaf.sort(1).values.diff(dim=1) > 0).all(), "a draw repeated a neighbour"
    hits = torch.bincount(leaf.flatten(), minlength=degree).double()
    expected = centres * k / degree
    pearson = float(((hits - expected) ** 2 / expected).sum())
    return pearson / ((1 - k / degree) * degree / (degree - 1))


def gpu_sampler(mode: str, indptr: Tensor, indices: Tensor, device: torch.device | str,
                launcher: object = None, items_per_block: int = 2048) -> BaseSampler:
    """A GPU sampler of ``mode`` (``GPU_MODES``); a cache holds about half the base lists."""
    from quiver_serve.sampling.gpu import CudaSampler, UvaSampler

    if mode == "cuda":
        sampler = CudaSampler(indptr, indices, device=device, launcher=launcher)
    else:
        cache = None
        if mode != "uva":
            n = indptr.numel() - 1
            bits = EF_BITS if mode == "uva+elias_fano" else None
            budget = cache_budget_bytes(indptr, bits)
            scores = torch.rand(n, generator=torch.Generator().manual_seed(n))
            cache = build_adjacency_cache(indptr, indices, scores, budget, torch.device(device),
                                          bits)
            assert cache is not None and (cache.num_cached > 0 or indices.numel() == 0)
            ef = cache.index_bits == EF_BITS
            assert ef == (mode == "uva+elias_fano") or not cache.num_cached
        sampler = UvaSampler(indptr, indices, device=device, launcher=launcher,
                             adjacency_cache=cache)
    sampler.items_per_block = items_per_block  # small values: many blocks meet at grid barriers
    return sampler


def cache_budget_bytes(indptr: Tensor, bits: int | None) -> int:
    """A cache budget for about half of the lists' entries, and at least the longest list."""
    n = indptr.numel() - 1
    deg = indptr[1:] - indptr[:-1]
    deg = deg[deg > 0]
    cost = elias_fano.list_bits(deg, n) if bits == EF_BITS else deg * id_bits(n)
    room_bits = max(int(cost.sum()) // 2, int(cost.max()) if cost.numel() else 0)
    return FIXED_BYTES_PER_NODE * n + EXTRA_BYTES + (room_bits + 31 + 7) // 8


# ---- scenarios, for any sampler -----------------------------------------------------------------


def check_matches_plain(make: Make, device: str | torch.device, trial: int,
                        fanouts_list: list[list[int]] = FANOUTS,
                        batch_seeds: list[int] = BATCH_SEEDS) -> None:
    """(a) sampled and exact fanouts, several seeds, on a random living graph."""
    gen = torch.Generator().manual_seed(trial)
    n_base = [1, 12, 60, 150][trial % 4]
    indptr, indices, view = random_living_graph(n_base, 4 * n_base, [3, 0, 9, 20][trial % 4], gen)
    plain = ReferenceSampler(*effective_csc(indptr, indices, view))
    sampler = make(indptr, indices)
    sampler.set_overlay(view_on(view, device))
    assert sampler.num_nodes == view.num_nodes
    assert_matches_plain(sampler, plain, batches(view, gen), fanouts_list, batch_seeds)


def check_empty_base(make: Make, device: str | torch.device) -> None:
    """n_base == 0: every node was added, so nothing may read ``indptr`` past its one entry."""
    gen = torch.Generator().manual_seed(5)
    view = make_view(0, 6, {0: [1, 2], 2: [0, 0, 5], 5: []}, set(), gen)
    indptr, indices = torch.zeros(1, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    plain = ReferenceSampler(*effective_csc(indptr, indices, view))
    sampler = make(indptr, indices)
    sampler.set_overlay(view_on(view, device))
    assert_matches_plain(sampler, plain, [torch.arange(6), torch.tensor([5, 5, 0])])


def check_uniform(make: Make, device: str | torch.device) -> None:
    """(b) each centre lists 5 base and 7 tail leaves: 3000 centres make 3000 4-of-12 draws."""
    centres, base_deg, tail_deg, k = 3000, 5, 7, 4
    indptr, indices, view = mixed_star_graph(centres, base_deg, tail_deg)
    sampler = make(indptr, indices)
    sampler.set_overlay(view_on(view, device))
    out = sampler.sample(torch.arange(centres), [k], seed=2024)
    stat = star_statistic(out, centres, centres, base_deg + tail_deg, k)
    assert stat < CHI2_CRIT_DOF11, f"{sampler.name}: statistic {stat:.1f}"


def check_clearing_restores_the_base(make: Make, device: str | torch.device) -> None:
    """(c) set_overlay(None) samples the base again."""
    gen = torch.Generator().manual_seed(8)
    indptr, indices, view = random_living_graph(80, 300, 10, gen)
    base_ref = ReferenceSampler(indptr, indices)
    seeds = torch.randint(0, 80, (60,), generator=gen)
    sampler = make(indptr, indices)
    sampler.set_overlay(view_on(view, device))
    with_overlay = sampler.sample(seeds, [4, 4], 1)
    sampler.set_overlay(None)
    assert sampler.num_nodes == 80
    assert_same(sampler.sample(seeds, [4, 4], 1), base_ref.sample(seeds, [4, 4], 1))
    assert not torch.equal(with_overlay.edge_index.cpu(),
                           base_ref.sample(seeds, [4, 4], 1).edge_index)
    with pytest.raises(IndexError, match="80"):
        sampler.sample(torch.tensor([85]), [2], 0)  # an added node is gone with the view


def check_out_of_range_seeds(make: Make, device: str | torch.device) -> None:
    """(d) ids in [num_nodes, node capacity) exist in memory but not in the graph."""
    indptr, indices, view = random_living_graph(40, 120, 5, torch.Generator().manual_seed(9))
    assert view.node_capacity > view.num_nodes == 45
    sampler = make(indptr, indices)
    sampler.set_overlay(view_on(view, device))
    sampler.sample(torch.tensor([44]), [3], 0)  # the last added node is fine
    for bad in (torch.tensor([45]), torch.tensor([0, view.node_capacity]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="45"):
            sampler.sample(bad, [3], 0)
    ref = ReferenceSampler(indptr, indices)
    seeds = torch.arange(40)
    sampler.set_overlay(None)  # the sampler is clean after the errors
    assert_same(sampler.sample(seeds, [3, 3], 2), ref.sample(seeds, [3, 3], 2))


def append_and_replace(indptr: Tensor, indices: Tensor, view: OverlayView) -> int:
    """Mutate ``view``'s tensors in place as their owner applying a version would: one node
    added (with a tail), node 0's tail grown (moved to fresh room), node 1's base list replaced
    by a new tail. Needs free room at the end of ``view.tail``; returns the new node's id."""
    cpu_view = view_on(view, "cpu")
    span = (cpu_view.length & LENGTH_MASK) + 2 * cut_of(cpu_view.length)
    used = torch.where(cpu_view.start >= 0, cpu_view.start + span, 0)
    top = int(used.max()) + 1
    new = view.num_nodes
    raw0, start0 = int(cpu_view.length[0]), int(cpu_view.start[0])
    span0 = (raw0 & LENGTH_MASK) + 2 * cut_of(raw0)
    old0 = cpu_view.tail[start0 : start0 + span0].tolist() if start0 >= 0 else []
    pairs0 = 2 * cut_of(raw0)  # block entries of node 0 that are its cut's pairs
    writes = [(0, old0 + [new, new, 0], raw0 & ~LENGTH_MASK, pairs0), (1, [new, 1, 1], REPLACED, 0),
              (new, [0, 1], 0, 0)]
    for v, values, flag, pairs in writes:
        view.tail[top : top + len(values)] = torch.tensor(values, device=view.tail.device)
        view.start[v] = top
        view.length[v] = (len(values) - pairs) | flag
        top += len(values) + 1
    view.num_nodes = new + 1
    return new


def check_in_place_updates(make: Make, device: str | torch.device) -> None:
    """(e) the owner rewrites the view's tensors between calls; the next call sees the lists."""
    indptr, indices, view = random_living_graph(30, 100, 3, torch.Generator().manual_seed(11))
    view.tail = torch.cat([view.tail, torch.zeros(64, dtype=torch.int64)])  # room to append
    view = view_on(view, device)
    sampler = make(indptr, indices)
    sampler.set_overlay(view)
    seeds = torch.tensor([0, 1, 2])
    before = sampler.sample(seeds, [-1, -1], 0)
    new = append_and_replace(indptr, indices, view)
    plain = ReferenceSampler(*effective_csc(indptr, indices, view))
    assert plain.sample(torch.tensor([1]), [-1], 0).n_id.tolist() == [1, new]
    assert not torch.equal(sampler.sample(seeds, [-1, -1], 0).n_id.cpu(), before.n_id.cpu())
    assert_matches_plain(sampler, plain, [seeds, torch.arange(new + 1), torch.tensor([new])],
                         [[-1, -1], [2, 2]])


SCENARIOS = [check_empty_base, check_uniform, check_clearing_restores_the_base,
             check_out_of_range_seeds, check_in_place_updates]


# ---- the reference's overlay reads -------------------------------------------------------------


def test_effective_csc_helper_agrees_with_the_layout() -> None:
    indptr = torch.tensor([0, 2, 3, 3])
    indices = torch.tensor([1, 2, 0])
    view = make_view(3, 5, {0: [4], 1: [3, 3], 4: [0, 4]}, {1}, torch.Generator().manual_seed(1))
    plain_indptr, plain_indices = effective_csc(indptr, indices, view)
    assert plain_indptr.tolist() == [0, 3, 5, 5, 5, 7]
    assert plain_indices.tolist() == [1, 2, 4, 3, 3, 0, 4]


def test_hop_positions_encode_tail_entries_after_the_csc() -> None:
    gen = torch.Generator().manual_seed(2)
    indptr, indices, view = random_living_graph(30, 90, 6, gen)
    frontier = torch.arange(view.num_nodes)
    base = seed_base(3)
    for k in (-1, 2):
        edge_pos, count = hop_edge_positions(indptr, frontier, k, 1, base, view)
        got = read_positions(indices, edge_pos, view)
        plain_indptr, plain_indices = effective_csc(indptr, indices, view)
        want_pos, want_count = hop_edge_positions(plain_indptr, frontier, k, 1, base)
        assert torch.equal(count, want_count)
        assert torch.equal(got, plain_indices[want_pos])
        in_tail = edge_pos >= indices.numel()
        assert in_tail.any() and (~in_tail).any()


# ---- the CPU samplers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpp_ok() -> None:
    if not cpu_mod.cpp_sampler_available():
        pytest.skip(f"C++ sampler unavailable: {cpu_mod.cpu_sampler_status()}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def cpu_make(name: str) -> Make:
    return ReferenceSampler if name == "reference" else cpu_mod.CppSampler


@pytest.mark.parametrize("trial", range(4))
@pytest.mark.parametrize("name", ["reference", "cpp"])
def test_cpu_samplers_match_the_plain_csc(cpp_ok, threads, name: str, trial: int) -> None:
    check_matches_plain(cpu_make(name), "cpu", trial)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", ["reference", "cpp"])
def test_cpu_samplers_on_the_living_graph(cpp_ok, threads, name: str, scenario) -> None:
    scenario(cpu_make(name), "cpu")


@pytest.mark.parametrize("name", ["reference", "cpp"])
def test_bad_views_are_refused(cpp_ok, name: str) -> None:
    indptr, indices, view = random_living_graph(20, 60, 2, torch.Generator().manual_seed(10))
    sampler = cpu_make(name)(indptr, indices)
    with pytest.raises(ValueError, match="base of 19"):
        sampler.set_overlay(OverlayView(19, 22, view.start, view.length, view.tail))
    with pytest.raises(TypeError, match="int64"):
        sampler.set_overlay(OverlayView(20, 22, view.start.int(), view.length, view.tail))
    with pytest.raises(ValueError, match="capacity"):
        sampler.set_overlay(OverlayView(20, view.node_capacity + 1, view.start, view.length,
                                        view.tail))
    assert sampler.overlay is None


def test_a_pickled_cpp_sampler_takes_the_overlay_again(cpp_ok) -> None:
    indptr, indices, view = random_living_graph(50, 150, 4, torch.Generator().manual_seed(12))
    sampler = cpu_mod.CppSampler(indptr, indices)
    sampler.set_overlay(view)
    clone = pickle.loads(pickle.dumps(sampler))
    assert clone.overlay is None  # its owner sets it after the rebuild
    clone.set_overlay(view)
    seeds = torch.arange(54)
    assert_same(clone.sample(seeds, [3, 3], 4), sampler.sample(seeds, [3, 3], 4))


# ---- the CUDA kernel, compiled for the CPU ------------------------------------------------------

# The CUDA features csrc/gpu_sampler.cu uses, as host C++ (its SAMPLER_EMU hooks): a thread per
# CUDA thread, every block resident as the cooperative launch guarantees, warps meeting at barriers.
_EMU_HEAD = r"""
#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>
struct EmuDim { unsigned x = 0, y = 1, z = 1; };
thread_local EmuDim threadIdx, blockIdx;
EmuDim blockDim, gridDim;
struct EmuWarp { std::barrier<> bar{32}; long long vals[32]; };
struct EmuBlock {
  explicit EmuBlock(int n) : bar(n), warps(new EmuWarp[n / 32]) {}
  std::barrier<> bar; std::unique_ptr<EmuWarp[]> warps; long long scratch[72], params[256];
};
thread_local EmuBlock* emu_block;
thread_local EmuWarp* emu_warp;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __popc __builtin_popcount
#define __ffs __builtin_ffs
inline long long* block_scratch() { return emu_block->scratch; }
inline long long* block_params() { return emu_block->params; }
inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0) { emu_warp->bar.arrive_and_wait(); }
template <class T> T emu_lane_value(T x, int src, bool own) {
  emu_warp->vals[threadIdx.x & 31] = (long long)x;
  emu_warp->bar.arrive_and_wait();
  const T r = own ? x : (T)emu_warp->vals[src & 31];
  emu_warp->bar.arrive_and_wait();
  return r;
}
template <class T> T __shfl_sync(unsigned, T x, int s) { return emu_lane_value(x, s, false); }
template <class T> T __shfl_up_sync(unsigned, T x, int d) {
  return emu_lane_value(x, (int)(threadIdx.x & 31) - d, (int)(threadIdx.x & 31) < d);
}
template <class T> T __shfl_xor_sync(unsigned, T x, int d) {
  return emu_lane_value(x, (int)(threadIdx.x & 31) ^ d, false);
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  emu_warp->vals[threadIdx.x & 31] = pred;
  emu_warp->bar.arrive_and_wait();
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane) bits |= (emu_warp->vals[lane] ? 1u : 0u) << lane;
  emu_warp->bar.arrive_and_wait();
  return bits;
}
template <class T> T __ldcg(const T* p) { return std::atomic_ref<T>(*const_cast<T*>(p)).load(); }
inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old > v && !a.compare_exchange_weak(old, v)) {}
  return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_or(v);
}
inline unsigned atomic_add_release(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline unsigned load_acquire(const unsigned* p) {
  std::this_thread::yield();
  return std::atomic_ref<unsigned>(*const_cast<unsigned*>(p)).load();
}
"""
_EMU_TAIL = r"""
extern "C" void emu_launch(int blocks, const long long* params) {
  gridDim.x = blocks;
  blockDim.x = SAMPLER_THREADS;
  std::vector<std::unique_ptr<EmuBlock>> ctx;
  for (int b = 0; b < blocks; ++b) ctx.emplace_back(new EmuBlock(SAMPLER_THREADS));
  std::vector<std::thread> threads;
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < SAMPLER_THREADS; ++t)
      threads.emplace_back([&ctx, b, t, params] {
        threadIdx.x = t; blockIdx.x = b;
        emu_block = ctx[b].get(); emu_warp = &ctx[b]->warps[t / 32];
        sample_subgraph(params);
      });
  for (auto& th : threads) th.join();
}
"""


class EmulatedLauncher:
    """The ``Launcher`` of ``sampling/gpu.py`` for samplers on device ``cpu``: runs the kernel
    compiled for the CPU, synchronously."""

    max_blocks = 2

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p]

    def __call__(self, blocks: int, params_ptr: int, stream_ptr: int) -> None:
        self._lib.emu_launch(blocks, params_ptr)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> EmulatedLauncher:
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    kernel = (Path(__file__).resolve().parents[2] / "quiver_serve" / "csrc" / "gpu_sampler.cu").read_text()
    folder = tmp_path_factory.mktemp("emulated_kernel")
    (folder / "kernel.cpp").write_text(_EMU_HEAD + kernel + _EMU_TAIL)
    library = folder / "kernel.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-DSAMPLER_EMU",
                    "-DSAMPLER_THREADS=64", "-o", str(library), str(folder / "kernel.cpp")],
                   check=True, capture_output=True, timeout=300)
    return EmulatedLauncher(library)


@pytest.mark.parametrize("mode", GPU_MODES)
def test_the_kernel_samples_the_living_graph(emulated, mode: str) -> None:
    def make(indptr: Tensor, indices: Tensor) -> BaseSampler:
        return gpu_sampler(mode, indptr, indices, "cpu", emulated, items_per_block=8)

    check_matches_plain(make, "cpu", 2, [[3, 2], [-1, -1], [40]], [7])
    check_in_place_updates(make, "cpu")
    if mode == "cuda":
        check_empty_base(make, "cpu")
        check_clearing_restores_the_base(make, "cpu")
