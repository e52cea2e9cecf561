"""The adjacency cache's layouts and its read model (CPU twins of what the UVA kernel reads).

Bit-packed lists decode to the host's entries at every width; budgets hold; the read model
replays exactly the sampler's reads (its per-hop read counts are the sampler's edge counts) and
counts what a cache serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import Tensor

from quiver_serve.config import GraphConfig
from quiver_serve.graph.synthetic import generate_synthetic
from quiver_serve.sampling.graph_cache import elias_fano
from quiver_serve.sampling.graph_cache.adjacency import (
    EF_BITS,
    EXTRA_BYTES,
    FIXED_BYTES_PER_NODE,
    AdjacencyCache,
    build_adjacency_cache,
    cached_neighbours,
    expansion_scores,
    expansion_sectors,
    id_bits,
    pack_lists,
    plan_adjacency_cache,
    unpack_entries,
)
from quiver_serve.sampling.graph_cache.reads import node_sectors, served_shares, trace_reads
from quiver_serve.sampling.reference import ReferenceSampler

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def graph():
    # ~1,165 nodes, ~573 k edges: Reddit's degree profile at a tiny scale
    return generate_synthetic(GraphConfig(format="synthetic", synthetic_preset="reddit",
                                          synthetic_scale=0.005))


def random_csc(num_nodes: int, max_deg: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_deg, (num_nodes,), generator=g)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(deg, 0)
    indices = torch.randint(0, num_nodes, (int(indptr[-1]),), generator=g)
    indices[: min(3, indices.numel())] = num_nodes - 1  # the widest id occurs
    return indptr, indices


def test_id_bits() -> None:
    assert [id_bits(n) for n in (1, 2, 3, 4, 5, 232_965, 2**31)] == [1, 1, 2, 2, 3, 18, 31]


@pytest.mark.parametrize(("num_nodes", "bits"), [(2, 1), (7, 3), (5000, 13), (5000, 17),
                                                 (70_000, 17), (70_000, 32), (70_000, 64)])
def test_packed_lists_decode_to_the_host_entries(num_nodes: int, bits: int) -> None:
    indptr, indices = random_csc(num_nodes, 30)
    nodes = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(1))[: num_nodes // 2]
    offsets, packed = pack_lists(indptr, indices, nodes, bits)
    assert packed.dtype == (torch.int64 if bits == 64 else torch.int32)
    cache = AdjacencyCache(indptr, offsets, packed, int(nodes.numel()), bits)
    want = torch.cat([indices[indptr[v]:indptr[v + 1]] for v in nodes.tolist()])
    assert torch.equal(unpack_entries(cache, 0, want.numel()), want)
    assert bool((offsets[nodes] >= 0).all()) and int((offsets >= 0).sum()) == nodes.numel()


@pytest.mark.parametrize("index_bits", [None, 24, 32, 64])
def test_budget_holds_and_narrower_entries_cache_more_lists(graph, index_bits) -> None:
    scores = expansion_scores(graph.indptr, graph.indices, [25, 10], 256)
    csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
    budget = int(0.2 * csc_bytes)
    cache = build_adjacency_cache(graph.indptr, graph.indices, scores, budget, CPU, index_bits)
    assert cache is not None and cache.nbytes <= budget
    wide = plan_adjacency_cache(graph.indptr, scores, budget, 64)
    if cache.index_bits < 64:  # the same order, a longer prefix
        assert cache.num_cached > wide.numel()
        assert bool((cache.offsets[wide] >= 0).all())
    assert cache.index_bits == (id_bits(graph.num_nodes) if index_bits is None else index_bits)


def test_bad_index_bits_are_refused(graph) -> None:
    scores = torch.ones(graph.num_nodes)
    for bits in (-1, id_bits(graph.num_nodes) - 1, 33, 48):  # 0: Elias-Fano
        with pytest.raises(ValueError, match="index_bits"):
            build_adjacency_cache(graph.indptr, graph.indices, scores, 1 << 30, CPU, bits)
    with pytest.raises(ValueError, match="cost"):
        expansion_scores(graph.indptr, graph.indices, [5], 8, cost="bytes")


def test_expansion_sectors_model() -> None:
    deg = torch.tensor([0.0, 1.0, 4.0, 8.0, 25.0, 1000.0])
    full = expansion_sectors(deg, -1)
    assert full.tolist() == pytest.approx([0.0, 1.0, 1.75, 2.75, 7.0, 250.75])
    part = expansion_sectors(deg, 10)
    assert part[:4].tolist() == full[:4].tolist()  # deg <= k: the whole list
    assert 9.0 < float(part[-1]) <= 10.0  # 10 draws of 1,000 entries: nearly 10 sectors
    assert float(part[4]) < 7.0


def test_node_sectors_counts_distinct_sectors_per_node() -> None:
    # node 0 reads entries 0..3 (one int64 sector) and 8; node 1 reads 4 and 5 (one sector)
    pos = torch.tensor([0, 1, 2, 3, 8, 4, 5])
    assert node_sectors(pos, torch.tensor([5, 2])).tolist() == [2, 1]
    assert node_sectors(pos, torch.tensor([5, 2]), index_bytes=4).tolist() == [2, 1]
    assert node_sectors(torch.tensor([0, 9]), torch.tensor([2]), index_bytes=4).tolist() == [2]


def test_read_trace_replays_the_sampler(graph) -> None:
    seeds = torch.randint(0, graph.num_nodes, (200,), generator=torch.Generator().manual_seed(3))
    fanouts = [25, 10]
    out = ReferenceSampler(graph.indptr, graph.indices).sample(seeds, fanouts, 7)
    none = trace_reads(graph.indptr, graph.indices, seeds, fanouts, 7, None)
    assert [h["reads"] for h in none] == out.num_sampled_edges
    assert [h["lists"] for h in none] == out.num_sampled_nodes[:-1]
    assert all(h["reads_cached"] == h["sectors_cached"] == h["indptr_reads_cached"] == 0
               for h in none)
    assert all(0 < h["sectors"] <= h["reads"] for h in none)
    every = torch.ones(graph.num_nodes, dtype=torch.bool)
    full = trace_reads(graph.indptr, graph.indices, seeds, fanouts, 7, every)
    assert all(h["sectors_cached"] == h["sectors"] and h["lists_cached"] == h["lists"]
               and h["indptr_reads_cached"] == h["indptr_reads"] for h in full)


def test_packed_cache_serves_more_of_the_reads(graph) -> None:
    """At 20% of the int64 CSC bytes, the fewest-bits layout absorbs more bus sectors than the
    int64 one (the reason for the layout), and a bigger budget never serves less."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, graph.num_nodes, (256,), generator=g) for _ in range(2)]
    scores = expansion_scores(graph.indptr, graph.indices, [25, 10], 256)
    csc_bytes = (graph.indptr.numel() + graph.indices.numel()) * 8
    shares = {}
    for bits, frac in ((64, 0.2), (None, 0.2), (None, 0.4)):
        cache = build_adjacency_cache(graph.indptr, graph.indices, scores,
                                      int(frac * csc_bytes), CPU, bits)
        served = served_shares(graph.indptr, graph.indices, batches, [25, 10],
                               cache.offsets >= 0)
        shares[(bits, frac)] = served["sectors_served"]
        assert served["indptr_reads_served"] == 1.0
        assert sum(served["hop_sector_share"]) == pytest.approx(1.0)
    assert shares[(None, 0.2)] > shares[(64, 0.2)] + 0.1
    assert shares[(None, 0.4)] >= shares[(None, 0.2)]
    fixed = FIXED_BYTES_PER_NODE * graph.num_nodes + EXTRA_BYTES
    empty = build_adjacency_cache(graph.indptr, graph.indices, scores, fixed, CPU)
    assert empty is not None and empty.num_cached == 0


# The kernel's ``ListReader`` (csrc/gpu_sampler.cu) compiled for the CPU: the CUDA keywords and
# intrinsics it uses, as host C++.
_HARNESS_HEAD = r"""
#include <cstdio>
#include <vector>
typedef long long i64; typedef unsigned int u32; typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __popc __builtin_popcount
#define __ffs __builtin_ffs
#define EF_DEG_BITS 27
#define EF_DEG_MASK ((1u << EF_DEG_BITS) - 1u)
%s
"""


def compile_list_reader(tmp_path: Path, harness: str) -> Path:
    """``harness`` (with ``%s`` for the struct) around the kernel's ``ListReader``, built with g++."""
    source = (Path(__file__).resolve().parents[2] / "quiver_serve" / "csrc" / "gpu_sampler.cu").read_text()
    reader = re.search(r"^struct ListReader \{.*?^\};", source, re.S | re.M)
    assert reader is not None, "struct ListReader not found in csrc/gpu_sampler.cu"
    (tmp_path / "reader.cpp").write_text(harness % reader.group(0))
    exe = tmp_path / "reader"
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(tmp_path / "reader.cpp")],
                   check=True, capture_output=True, timeout=120)
    return exe


_LIST_READER_HARNESS = _HARNESS_HEAD + r"""
int main() {  // stdin: bits, #words, #entries, the words, the expected entries
    unsigned bits; long nw, ne;
    if (scanf("%%u %%ld %%ld", &bits, &nw, &ne) != 3) return 2;
    std::vector<int> w(nw); std::vector<i64> want(ne);
    for (auto& x : w) if (scanf("%%d", &x) != 1) return 2;
    for (auto& x : want) if (scanf("%%lld", &x) != 1) return 2;
    const ListReader r{(const void*)w.data(), bits, 0u};
    long bad = 0;
    for (long q = 0; q < ne; ++q) bad += r[q] != want[q];
    printf("%%ld\n", bad);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_kernels_list_reader_decodes_packed_lists(tmp_path) -> None:
    """The kernel's own ``ListReader`` (csrc/gpu_sampler.cu, compiled for the CPU) reads every
    entry of ``pack_lists``' output at every width: the device half of the bit-identity."""
    exe = compile_list_reader(tmp_path, _LIST_READER_HARNESS)
    for num_nodes, bits in ((2, 1), (7, 3), (5000, 13), (232_965, 18), (3_000_000, 22),
                            (70_000, 32), (70_000, 64)):
        indptr, indices = random_csc(min(num_nodes, 2000), 40)
        indices = torch.randint(0, num_nodes, indices.shape, generator=torch.Generator())
        indices[:3] = num_nodes - 1
        nodes = torch.arange(0, indptr.numel() - 1, 2)
        _, packed = pack_lists(indptr, indices, nodes, bits)
        words = packed.view(torch.int32) if bits == 64 else packed
        want = torch.cat([indices[indptr[v]:indptr[v + 1]] for v in nodes.tolist()])
        stdin = (f"{bits} {words.numel()} {want.numel()}\n{' '.join(map(str, words.tolist()))}\n"
                 f"{' '.join(map(str, want.tolist()))}\n")
        run = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=60,
                             check=True)
        assert run.stdout.strip() == "0", f"{bits} bits: {run.stdout.strip()} entries differ"


_EF_READER_HARNESS = _HARNESS_HEAD + r"""
int main() {  // stdin: #words, the words, #lists, then per list: word offset, l, deg, entries
    long nw, nl;
    if (scanf("%%ld", &nw) != 1) return 2;
    std::vector<int> w(nw);
    for (auto& x : w) if (scanf("%%d", &x) != 1) return 2;
    if (scanf("%%ld", &nl) != 1) return 2;
    long bad = 0;
    for (long i = 0; i < nl; ++i) {
        long off; unsigned l, d;
        if (scanf("%%ld %%u %%u", &off, &l, &d) != 3) return 2;
        const ListReader r{(const void*)(w.data() + off), 0u, d | (l << EF_DEG_BITS)};
        for (unsigned q = 0; q < d; ++q) {
            i64 want;
            if (scanf("%%lld", &want) != 1) return 2;
            bad += r[q] != want;
        }
    }
    printf("%%ld\n", bad);
    return 0;
}
"""


def sorted_csc(num_lists: int, num_nodes: int, max_deg: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_deg + 1, (num_lists,), generator=g)
    deg[:3] = torch.tensor([0, 1, min(2 * num_nodes, 3 * max_deg)])  # empty, one, > U entries
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(deg, 0)])
    indices = torch.randint(0, num_nodes, (int(deg.sum()),), generator=g)
    indices[:3] = num_nodes - 1
    for v in range(num_lists):  # sorted by id within each list, as graph/csc.py keeps them
        a, b = int(indptr[v]), int(indptr[v + 1])
        indices[a:b] = indices[a:b].sort().values
    return indptr, indices


@pytest.mark.parametrize("num_nodes", [300, 1000, 232_965, 3_000_000])
def test_elias_fano_lists_decode_to_the_host_entries(num_nodes: int) -> None:
    """Elias-Fano blocks (``index_bits=0``) decode to every list exactly: empty lists, one
    entry, lists longer than the id range (l = 0), and every width of low bits."""
    indptr, indices = sorted_csc(300, num_nodes, 300, num_nodes)
    nodes = torch.arange(0, 300)
    full = torch.cat([indptr, indptr[-1].repeat(num_nodes - 300)])  # ids up to num_nodes
    offsets, words = elias_fano.pack(full, indices, nodes, num_nodes)
    assert elias_fano.is_sorted(full, indices, nodes)
    for v in range(300):
        want = indices[int(indptr[v]):int(indptr[v + 1])]
        got = elias_fano.decode_list(words, int(offsets[v]), want.numel(), num_nodes)
        assert torch.equal(got, want), v
    deg = indptr[1:] - indptr[:-1]
    assert int(words.numel()) * 32 <= int(elias_fano.list_bits(deg, num_nodes).sum()) + 32


def test_elias_fano_needs_sorted_lists_and_saves_bits(graph) -> None:
    """A cache asked for Elias-Fano on unsorted lists falls back to packed entries; on sorted
    ones it holds more lists than the packed layout in the same budget."""
    scores = expansion_scores(graph.indptr, graph.indices, [5, 3], 64)
    budget = FIXED_BYTES_PER_NODE * graph.num_nodes + EXTRA_BYTES + graph.num_edges
    ef = build_adjacency_cache(graph.indptr, graph.indices, scores, budget, CPU, EF_BITS)
    packed = build_adjacency_cache(graph.indptr, graph.indices, scores, budget, CPU)
    assert ef.index_bits == EF_BITS and ef.num_cached > packed.num_cached
    assert ef.nbytes <= budget
    for v in torch.nonzero(ef.offsets >= 0).view(-1)[:200].tolist():
        want = graph.indices[int(graph.indptr[v]):int(graph.indptr[v + 1])]
        assert torch.equal(cached_neighbours(ef, graph.indices, v), want)
    shuffled = graph.indices.clone()
    a, b = int(graph.indptr[int(ef.offsets.argmax())]), int(graph.indptr[int(ef.offsets.argmax()) + 1])
    shuffled[a:b] = shuffled[a:b].flip(0)
    if b - a > 1 and not torch.equal(shuffled[a:b], graph.indices[a:b]):
        fallback = build_adjacency_cache(graph.indptr, shuffled, scores, budget, CPU, EF_BITS)
        assert fallback.index_bits == id_bits(graph.num_nodes)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_kernels_list_reader_decodes_elias_fano_lists(tmp_path) -> None:
    """The kernel's ``ListReader`` (compiled for the CPU) selects every entry of every
    Elias-Fano list ``elias_fano.pack`` writes: the device half of the bit-identity."""
    exe = compile_list_reader(tmp_path, _EF_READER_HARNESS)
    for num_nodes in (300, 5000, 232_965, 3_000_000):
        indptr, indices = sorted_csc(300, num_nodes, 400, num_nodes + 1)
        full = torch.cat([indptr, indptr[-1].repeat(num_nodes - 300)])
        nodes = torch.arange(0, 300, 2)
        offsets, words = elias_fano.pack(full, indices, nodes, num_nodes)
        lines = [f"{words.numel()}", " ".join(map(str, words.tolist())), f"{nodes.numel()}"]
        for v in nodes.tolist():
            code = int(offsets[v])
            want = indices[int(indptr[v]):int(indptr[v + 1])]
            lines.append(f"{code & elias_fano.OFFSET_MASK} {code >> elias_fano.L_SHIFT} "
                         f"{want.numel()} {' '.join(map(str, want.tolist()))}")
        run = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                             text=True, timeout=60, check=True)
        assert run.stdout.strip() == "0", f"{num_nodes} nodes: {run.stdout.strip()} differ"


def test_elias_fano_sortedness_check_reads_in_chunks(monkeypatch) -> None:
    """``is_sorted`` looks only at the lists it is given, chunk boundaries included."""
    monkeypatch.setattr(elias_fano, "ENTRIES_PER_CHUNK", 7)
    indptr, indices = sorted_csc(200, 1000, 20, 3)
    nodes = torch.randperm(200, generator=torch.Generator().manual_seed(3))
    assert elias_fano.is_sorted(indptr, indices, nodes)
    deg = indptr[1:] - indptr[:-1]
    v = int(torch.nonzero(deg > 3)[5])
    a, b = int(indptr[v]), int(indptr[v + 1])
    bad = indices.clone()
    bad[a:b] = torch.arange(b - a, 0, -1)  # strictly decreasing
    assert not elias_fano.is_sorted(indptr, bad, nodes)
    assert elias_fano.is_sorted(indptr, bad, nodes[nodes != v])
