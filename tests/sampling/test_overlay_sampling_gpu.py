"""The CUDA samplers on the living graph (base CSC + overlay), bit for bit against the reference
sampler over the plain CSC of the same lists: device mode, UVA, and UVA with the adjacency cache
in both layouts (packed, Elias-Fano).

Every test is ``gpu``-marked and skips without CUDA and CuPy. The graphs, views and scenarios are
``test_overlay_sampling.py``'s (the same ones run there on the CPU samplers and on the kernel
compiled for the CPU); nothing here needs the server's dependencies.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from quiver_serve.graph.overlay_view import OverlayView
from quiver_serve.sampling.base import BaseSampler
from quiver_serve.sampling.gpu import gpu_sampler_available
from quiver_serve.sampling.reference import ReferenceSampler
from tests.sampling.test_overlay_sampling import (
    GPU_MODES,
    SCENARIOS,
    Make,
    assert_same,
    check_matches_plain,
    effective_csc,
    gpu_sampler,
    random_living_graph,
    view_on,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_sampler_available(), reason="needs a CUDA device and CuPy"),
]

DEVICE = "cuda:0"


def make(mode: str, items_per_block: int = 2048) -> Make:
    def build(indptr: Tensor, indices: Tensor) -> BaseSampler:
        return gpu_sampler(mode, indptr, indices, DEVICE, items_per_block=items_per_block)

    return build


@pytest.mark.parametrize("items_per_block", [2048, 8])
@pytest.mark.parametrize("trial", range(4))
@pytest.mark.parametrize("mode", GPU_MODES)
def test_gpu_samplers_match_the_plain_csc(mode: str, trial: int, items_per_block: int) -> None:
    check_matches_plain(make(mode, items_per_block), DEVICE, trial)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", GPU_MODES)
def test_gpu_samplers_on_the_living_graph(mode: str, scenario) -> None:
    scenario(make(mode), DEVICE)


@pytest.mark.parametrize("mode", GPU_MODES)
def test_larger_batches_match(mode: str) -> None:
    """Thousands of nodes and seeds: multi-block grids, fanouts above one warp's 32 draws."""
    gen = torch.Generator().manual_seed(21)
    indptr, indices, view = random_living_graph(3000, 90_000, 400, gen)
    plain = ReferenceSampler(*effective_csc(indptr, indices, view))
    sampler = make(mode)(indptr, indices)
    sampler.set_overlay(view_on(view, DEVICE))
    for batch, fanouts in ((2048, [25, 10]), (512, [40, -1]), (3400, [-1])):
        seeds = torch.randint(0, view.num_nodes, (batch,), generator=gen)
        assert_same(sampler.sample(seeds, fanouts, batch), plain.sample(seeds, fanouts, batch))


@pytest.mark.parametrize("mode", ["cuda", "uva+packed"])
def test_buffers_regrow_when_a_hop_exceeds_the_guess(mode: str) -> None:
    indptr, indices, view = random_living_graph(150, 900, 20, torch.Generator().manual_seed(3))
    plain = ReferenceSampler(*effective_csc(indptr, indices, view))
    sampler = make(mode)(indptr, indices)
    sampler.set_overlay(view_on(view, DEVICE))
    sampler.hop_edges_guess = 16  # every -1 hop overflows once, then the batch is re-run
    seeds = torch.arange(0, 170, 3)
    assert_same(sampler.sample(seeds, [-1, -1], 9), plain.sample(seeds, [-1, -1], 9))
    assert sampler.hop_edges_guess > 16


def test_the_view_is_read_where_it_lies() -> None:
    """A view on the host is refused; the per-node scratch grows once, to the node capacity."""
    indptr, indices, view = random_living_graph(60, 200, 6, torch.Generator().manual_seed(4))
    sampler = make("uva")(indptr, indices)
    with pytest.raises(ValueError, match="cuda"):
        sampler.set_overlay(view)
    on_gpu = view_on(view, DEVICE)
    sampler.set_overlay(on_gpu)
    state = sampler._work.state
    assert state.numel() == view.node_capacity
    sampler.set_overlay(OverlayView(60, 66, on_gpu.start, on_gpu.length, on_gpu.tail))
    assert sampler._work.state.data_ptr() == state.data_ptr()
    assert sampler.num_nodes == 66
