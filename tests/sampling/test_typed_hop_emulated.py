"""The typed GPU sampler's kernels (``csrc/typed_hop.cu``) compiled for the CPU (a thread per CUDA
thread, warps meeting at barriers for their shuffles and votes) and launched by
``TypedGpuSampler`` in place of the compiled ones: the kernels' own code samples bit for bit what
the torch reference samples, on a machine without a GPU (``test_typed_sampler_gpu.py`` runs the
same on CUDA)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from quiver_serve.sampling.typed import TypedReferenceSampler
from quiver_serve.sampling.typed_gpu import KERNEL_SOURCE, TypedGpuSampler, TypedHopKernels
from quiver_serve.sampling.typed_gpu_batch import STATE_EMPTY
from tests.sampling.test_typed_sampler import small_typed

# The CUDA features typed_hop.cu uses, as host C++.
EMU_HEAD = r"""
#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>
struct EmuDim { unsigned x = 0, y = 1, z = 1; };
thread_local EmuDim threadIdx, blockIdx;
EmuDim blockDim, gridDim;
struct EmuWarp { std::barrier<> bar{32}; long long vals[32]; };
thread_local EmuWarp* emu_warp;
#define __device__
#define __global__
#define __forceinline__ inline
inline void __syncwarp(unsigned = 0) { emu_warp->bar.arrive_and_wait(); }
template <class T> T __shfl_sync(unsigned, T x, int s) {
  emu_warp->vals[threadIdx.x & 31] = (long long)x;
  emu_warp->bar.arrive_and_wait();
  const T r = (T)emu_warp->vals[s & 31];
  emu_warp->bar.arrive_and_wait();
  return r;
}
inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {}
  return old;
}
inline unsigned __ballot_sync(unsigned, bool pred) {
  emu_warp->vals[threadIdx.x & 31] = pred;
  emu_warp->bar.arrive_and_wait();
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane) bits |= (emu_warp->vals[lane] ? 1u : 0u) << lane;
  emu_warp->bar.arrive_and_wait();
  return bits;
}
"""
EMU_TAIL = r"""
template <class F> void emu_grid(int blocks, int threads, F body) {
  gridDim.x = blocks;
  blockDim.x = threads;
  std::vector<std::unique_ptr<EmuWarp[]>> warps;
  for (int b = 0; b < blocks; ++b) warps.emplace_back(new EmuWarp[threads / 32]);
  std::vector<std::thread> all;
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t)
      all.emplace_back([&warps, b, t, body] {
        threadIdx.x = t; blockIdx.x = b; emu_warp = &warps[b][t / 32];
        body();
      });
  for (auto& th : all) th.join();
}
#define EMU_KERNEL(name, ...)                                                 \
  extern "C" void emu_##name(int blocks, int threads, const long long* a) {   \
    emu_grid(blocks, threads, [a] { name(__VA_ARGS__); });                    \
  }
EMU_KERNEL(typed_count, a[0], a[1], a[2], a[3])
EMU_KERNEL(typed_draw, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10])
EMU_KERNEL(typed_propose, a[0], a[1], a[2])
EMU_KERNEL(typed_mark, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])
EMU_KERNEL(typed_assign, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])
EMU_KERNEL(typed_relabel, a[0], a[1], a[2], a[3])
EMU_KERNEL(typed_reset, a[0], a[1], a[2])
EMU_KERNEL(typed_gather_segments, a[0], a[1], a[2])
EMU_KERNEL(typed_claim, a[0], a[1], a[2])
"""


class EmulatedHopKernels:
    """``TypedHopKernels.launch`` run by the CPU build of the kernels (small grids: the
    grid-stride loops cover every item)."""

    blocks, threads = 2, 64

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        for name in TypedHopKernels.NAMES:
            getattr(self._lib, f"emu_{name}").argtypes = [ctypes.c_int, ctypes.c_int,
                                                          ctypes.c_void_p]

    def launch(self, name: str, items: int, args: tuple[int, ...]) -> None:
        block = (ctypes.c_longlong * len(args))(*args)
        getattr(self._lib, f"emu_{name}")(self.blocks, self.threads, block)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> EmulatedHopKernels:
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    folder = tmp_path_factory.mktemp("typed_hop")
    (folder / "kernel.cpp").write_text(EMU_HEAD + KERNEL_SOURCE.read_text() + EMU_TAIL)
    library = folder / "kernel.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-o",
                    str(library), str(folder / "kernel.cpp")], check=True, capture_output=True,
                   timeout=300)
    return EmulatedHopKernels(library)


def assert_same(got, want) -> None:  # noqa: ANN001
    assert got.num_sampled_nodes == want.num_sampled_nodes
    assert got.num_sampled_edges == want.num_sampled_edges
    for t in want.node:
        assert torch.equal(got.node[t], want.node[t]), t
    for et in want.edge_index:
        assert torch.equal(got.edge_index[et], want.edge_index[et]), et
        assert torch.equal(got.e_id[et], want.e_id[et]), et
    assert torch.equal(got.seed_index, want.seed_index)


@pytest.mark.parametrize("mode", ["device", "uva"])
@pytest.mark.parametrize("fanouts", [[3, 2], [40, 5], [-1, -1]])
def test_the_kernels_sample_the_references_subgraph(emulated, mode: str,
                                                    fanouts: list[int]) -> None:
    graph = small_typed(seed=3)
    ref = TypedReferenceSampler(graph)
    sampler = TypedGpuSampler(graph, torch.device("cpu"), mode, hop_kernels=emulated)
    assert sampler.kernels is emulated
    for seed, ids in ((0, [0, 5, 5, 59]), (7, list(range(60))), (2**40 + 3, [11])):
        seeds = torch.tensor(ids)
        assert_same(sampler.sample("paper", seeds, fanouts, seed),
                    ref.sample("paper", seeds, fanouts, seed))
        assert_same(sampler.sample("venue", seeds[seeds < 5], fanouts, seed),
                    ref.sample("venue", seeds[seeds < 5], fanouts, seed))
    # every batch puts back the per-node state it used (the next batch starts clean)
    assert bool((sampler._batch.state == STATE_EMPTY).all())


def test_long_lists_draw_past_a_warp(emulated) -> None:
    """Lists of about 2,000 entries: k = 70 (three rounds of Floyd's warp votes), k = 1000,
    whole lists; the identity edge ids (a relation built without ``edge_id``)."""
    from torch_geometric.data import HeteroData

    from quiver_serve.graph.typed import Relation, TypedGraph

    g = torch.Generator().manual_seed(0)
    data = HeteroData()
    data["a"].x = torch.randn(300, 2, generator=g)
    data["b"].x = torch.randn(4, 2, generator=g)
    src = torch.randint(0, 300, (9000,), generator=g)
    dst = torch.randint(0, 4, (9000,), generator=g)
    data["a", "to", "b"].edge_index = torch.stack([src, dst])
    data["b", "back", "a"].edge_index = torch.stack([dst, src])
    graph = TypedGraph.from_hetero_data(data, "dense")
    et = ("a", "to", "b")
    rel = graph.relations[et]
    graph.relations[et] = Relation(et, rel.indptr, rel.indices)  # edge ids: CSC positions
    ref = TypedReferenceSampler(graph)
    sampler = TypedGpuSampler(graph, torch.device("cpu"), hop_kernels=emulated)
    for fanouts in ([70, 3], [-1, 2], [1000, 1]):
        seeds = torch.tensor([0, 1, 2, 3])
        assert_same(sampler.sample("b", seeds, fanouts, 5), ref.sample("b", seeds, fanouts, 5))


def test_seeds_on_the_device_and_in_host_memory_get_the_same_rows(emulated) -> None:
    """Hop 0 by the kernels (seeds already on the device) and by the host (seeds in host
    memory, no sync): the same unique seeds, rows and state."""
    graph = small_typed(seed=3)
    batch = TypedGpuSampler(graph, torch.device("cpu"), hop_kernels=emulated)._batch
    for ids in ([4, 4, 1, 9, 1, 0], [7], list(range(30)) * 2):
        seeds = torch.tensor(ids)
        by_kernels, rows_k, n_k = batch.seed_hop("paper", seeds)
        state_k = batch.state.clone()
        batch.reset(by_kernels)
        by_host, rows_h, n_h = batch.seed_hop_host("paper", seeds)
        assert n_k == n_h == len(dict.fromkeys(ids))
        assert torch.equal(by_kernels.frontier["paper"], by_host.frontier["paper"])
        assert torch.equal(rows_k, rows_h) and torch.equal(batch.state, state_k)
        batch.reset(by_host)
        assert bool((batch.state == STATE_EMPTY).all())
