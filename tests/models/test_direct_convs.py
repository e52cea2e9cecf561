"""Convs run without ``propagate`` (``models/direct_convs.py``) give the conv's own output, and
convs the direct form does not know are left to PyG."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import GATConv, SAGEConv

from quiver_serve.models.direct_convs import direct_conv


def _graph(num_src: int, num_dst: int, num_edges: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, max(1, num_dst - 3), (num_edges,), generator=g)  # last 3: no in-edges
    return torch.stack([src, dst]), g


@pytest.mark.parametrize("kwargs", [{}, {"normalize": True}, {"root_weight": False},
                                    {"bias": False}])
def test_sage_mean_equals_the_conv_bipartite_and_same_type(kwargs: dict) -> None:
    torch.manual_seed(0)
    conv = SAGEConv((12, 7), 9, **kwargs).eval()
    ei, g = _graph(40, 25, 300, 1)
    x_src, x_dst = torch.randn(40, 12, generator=g), torch.randn(25, 7, generator=g)
    direct = direct_conv(conv)
    assert direct is not None
    with torch.no_grad():
        assert torch.allclose(direct((x_src, x_dst), ei), conv((x_src, x_dst), ei), atol=1e-6)
        same = SAGEConv(12, 9, **kwargs).eval()
        x = torch.randn(40, 12, generator=g)
        ei_same, _ = _graph(40, 40, 200, 2)
        assert torch.allclose(direct_conv(same)(x, ei_same), same(x, ei_same), atol=1e-6)
        # no edges at all: the root term alone (or zeros), as the conv gives
        empty = torch.empty((2, 0), dtype=torch.int64)
        assert torch.allclose(direct((x_src, x_dst), empty), conv((x_src, x_dst), empty))


def test_other_convs_and_hooked_or_other_aggregations_stay_with_pyg() -> None:
    assert direct_conv(GATConv(4, 4)) is None
    assert direct_conv(SAGEConv(4, 4, aggr="max")) is None
    assert direct_conv(SAGEConv(4, 4, project=True)) is None
    hooked = SAGEConv(4, 4)
    hooked.register_forward_hook(lambda *a: None)
    assert direct_conv(hooked) is None

    class Mine(SAGEConv):  # a subclass may change what forward does
        pass

    assert direct_conv(Mine(4, 4)) is None


def test_sage_sum_is_the_convs_one_by_one_and_follows_a_replaced_weight() -> None:
    from quiver_serve.models.direct_convs import sage_group

    torch.manual_seed(1)
    convs = [SAGEConv((12, 7), 9).eval(), SAGEConv((3, 7), 9, bias=False).eval(),
             SAGEConv((7, 7), 9, root_weight=False).eval()]
    g = torch.Generator().manual_seed(3)
    x_dst = torch.randn(25, 7, generator=g)
    sources = [(torch.randn(40, 12, generator=g), _graph(40, 25, 300, 4)[0]),
               (torch.randn(5, 3, generator=g), _graph(5, 25, 30, 5)[0]),
               (x_dst, _graph(25, 25, 60, 6)[0])]
    group = sage_group(convs)
    assert group is not None

    def one_by_one() -> torch.Tensor:
        return sum(c((xs, x_dst), ei) for c, (xs, ei) in zip(convs, sources, strict=True))

    with torch.no_grad():
        assert torch.allclose(group(sources, x_dst), one_by_one(), atol=1e-5)
        # a replaced parameter: the stacked weights follow
        convs[0].lin_l.weight = torch.nn.Parameter(convs[0].lin_l.weight * 2.0)
        assert torch.allclose(group(sources, x_dst), one_by_one(), atol=1e-5)
    assert sage_group([SAGEConv(4, 4, normalize=True)]) is None
    assert sage_group([SAGEConv(4, 4), GATConv(4, 4)]) is None
