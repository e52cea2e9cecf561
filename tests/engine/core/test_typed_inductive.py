"""Typed inductive requests (graph/typed_virtual.py, the typed core's ``_run_inductive``): new
nodes named with in-neighbours per relation are embedded as if they were added (their reverse
relations too), exact rows equal PyG's full-graph forward on the graph with them added, seeded
rows the core's on that graph for the seed, the graph is unchanged after, and a wrong relation,
source, width or a relation with edge features is refused by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from quiver_serve.engine.client.checks import typed_inductive_nodes
from quiver_serve.engine.core.typed_core import build_typed_core
from quiver_serve.graph.typed_living import TypedLiveGraph
from tests.engine.core.test_typed_core import _answer, _mb
from tests.engine.core.test_typed_gpu_core import DEVICES, shop_config
from tests.models.test_typed_models import TYPED_MODELS, full_graph, shop_graph, spec

TOL = 1e-5
NEW_ITEMS = [({"buys": [1, 2]}, []), ({"user__buys__item": [3, 3]}, [])]
NEW_USERS = [({"knows": [4], "rev_buys": [0, 7]}, [0.5] * 6)]


def inductive_mb(seq: int, ids: list[int], node_type: str, new: list, exact: bool = True,
                 seed: int = -1):  # noqa: ANN201
    mb = _mb(seq, ids, node_type, exact=exact, seed=seed)
    nodes = typed_inductive_nodes([f for _, f in new], [n for n, _ in new])
    assert nodes is not None
    mb.new_features, mb.new_offsets, mb.new_neighbors = nodes[:3]
    mb.new_relations = nodes.relations
    return mb


def table_core(graph, name: str):  # noqa: ANN001, ANN201
    """A typed core with the exact table and reverse relations over ``graph``, model ``name``."""
    pyg_class, kwargs, to_hetero = TYPED_MODELS[name]
    torch.manual_seed(0)
    cfg = shop_config(0, materialize="on")
    cfg.graph.add_reverse_edges = True
    return build_typed_core(cfg, graph, spec=spec(pyg_class, kwargs, to_hetero))


def added(graph, node_type: str, new: list):  # noqa: ANN001, ANN201
    """A copy of ``graph`` with the new nodes added for real (``TypedLiveGraph``)."""
    other = copy.deepcopy(graph)
    live = TypedLiveGraph(other, add_reverse_edges=True)
    width = other.feature_width(node_type)
    rows = np.array([f for _, f in new], np.float32).reshape(len(new), width)
    first = live.add_nodes(node_type, rows)
    for (names, _), nid in zip(new, first, strict=True):
        for name, srcs in names.items():
            et = next(e for e in other.edge_types if e[2] == node_type and
                      (e[1] == name or "__".join(e) == name))
            pairs = torch.tensor([[s, nid] for s in srcs])
            if et in live.derived:  # an update names the relation a rev_ one derives from
                et, pairs = live.derived[et], pairs.flip(1)
            live.apply_edges(et, pairs, torch.zeros((0, 2), dtype=torch.int64))
    return other, first


@pytest.mark.parametrize("name", ["to_hetero_sage_sum", "rgcn", "hgt"])
@pytest.mark.parametrize(("node_type", "new"), [("item", NEW_ITEMS), ("user", NEW_USERS)])
def test_exact_rows_equal_pyg_on_the_graph_with_the_nodes_added(name: str, node_type: str,
                                                                new: list) -> None:
    graph = shop_graph(seed=11, edge_dim=None)
    core = table_core(graph, name)
    before = {et: rel.indices.clone() for et, rel in graph.relations.items()}
    counts = dict(graph.num_nodes)
    other, first = added(graph, node_type, new)
    want = full_graph(core.served, other)[node_type]
    reply = _answer(core, inductive_mb(1, [0, 5], node_type, new))
    assert not reply.done.errors, reply.done.errors
    np.testing.assert_allclose(reply.rows, want[[0, 5, *first]].numpy(), rtol=0, atol=TOL)
    # nothing was added: the relations and counts are the graph's, the table answers as before
    assert graph.num_nodes == counts
    assert all(torch.equal(rel.indices, before[et]) for et, rel in graph.relations.items())
    plain = _answer(core, _mb(2, [0, 5], node_type, exact=True))
    np.testing.assert_allclose(plain.rows, full_graph(core.served, graph)[node_type][[0, 5]]
                               .numpy(), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", ["to_hetero_sage_sum", "hgt"])
@pytest.mark.parametrize(("node_type", "new"), [("item", NEW_ITEMS), ("user", NEW_USERS)])
def test_exact_rows_of_every_node_come_from_the_table_and_equal_pyg(
        name: str, node_type: str, new: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node of the type asked beside the new nodes: the rows the new nodes' edges (and
    their reverses) change two layers out are recomputed, the rest read from the table, and the
    table answers (decision 0064)."""
    from quiver_serve.engine.core import typed_core

    graph = shop_graph(seed=12, edge_dim=None)
    core = table_core(graph, name)
    other, first = added(graph, node_type, new)
    want = full_graph(core.served, other)[node_type]
    answered = []
    real = typed_core.inductive_rows
    monkeypatch.setattr(typed_core, "inductive_rows",
                        lambda *a: answered.append(real(*a)) or answered[-1])
    every = list(range(graph.num_nodes[node_type]))
    reply = _answer(core, inductive_mb(1, every, node_type, new))
    assert not reply.done.errors, reply.done.errors
    assert answered and answered[0] is not None, "the table answered"
    np.testing.assert_allclose(reply.rows, want[[*every, *first]].numpy(), rtol=0, atol=TOL)


def test_rows_marked_stale_in_the_table_are_never_read() -> None:
    """A row the table marked (its refresh not done) is not read for an inductive answer: every
    marked row is overwritten with garbage, and the answer still equals PyG's."""
    from quiver_serve.graph.typed_living import TypedChanges

    graph = shop_graph(seed=13, edge_dim=None)
    core = table_core(graph, "to_hetero_sage_sum")
    buys = graph.relations[("user", "buys", "item")]
    buyer = int(buys.indices[buys.indptr[0]])  # a user who bought item 0
    changes = TypedChanges()
    changes.add(changes.inputs, "user", torch.tensor([buyer]))
    assert core.table.mark(changes) > 0
    for i in range(core.table.num_layers):
        for t, rows in core.table.layer(i).items():
            rows[~core.table.clean_at(i, t, torch.arange(rows.size(0)))] = 1e3
    other, first = added(graph, "item", NEW_ITEMS)
    want = full_graph(core.served, other)["item"]
    every = list(range(graph.num_nodes["item"]))
    reply = _answer(core, inductive_mb(1, every, "item", NEW_ITEMS))
    np.testing.assert_allclose(reply.rows, want[[*every, *first]].numpy(), rtol=0, atol=TOL)


def test_seeded_rows_are_the_cores_on_the_graph_with_the_nodes_added() -> None:
    graph = shop_graph(seed=12, edge_dim=None)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    cfg = shop_config(0)
    cfg.graph.add_reverse_edges = True
    torch.manual_seed(0)
    core = build_typed_core(cfg, graph, spec=spec(pyg_class, kwargs, to_hetero))
    other, first = added(graph, "user", NEW_USERS)
    torch.manual_seed(0)
    twin = build_typed_core(cfg, other, spec=spec(pyg_class, kwargs, to_hetero))
    twin.served.model.load_state_dict(core.served.model.state_dict())
    reply = _answer(core, inductive_mb(1, [2], "user", NEW_USERS, exact=False, seed=9))
    want = twin.rows("user", torch.tensor([2, *first]), False, 9)
    np.testing.assert_allclose(reply.rows, want, rtol=0, atol=TOL)


def test_a_wrong_relation_source_width_or_edge_features_is_refused_by_name() -> None:
    cfg = shop_config(0)
    cfg.graph.add_reverse_edges = True
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    core = build_typed_core(cfg, shop_graph(seed=13, edge_dim=None),
                            spec=spec(pyg_class, kwargs, to_hetero))
    cases = [("item", [({"sold_by": [1]}, [])], 400, "one of"),
             ("item", [({"buys": [57]}, [])], 400, "out of range"),
             ("user", [({"knows": [1]}, [1.0, 2.0])], 422, "6"),
             ("user", [([1, 2], [0.0] * 6)], 400, "one of")]
    for seq, (node_type, new, status, words) in enumerate(cases):
        err = _answer(core, inductive_mb(seq, [], node_type, new)).done.errors[0]
        assert err.status == status and words in err.message, err
    with_attrs = build_typed_core(cfg, shop_graph(seed=13), spec=spec(
        "GAT", {"hidden_channels": 8, "num_layers": 2, "out_channels": 4, "edge_dim": 3,
                "add_self_loops": False, "heads": 2}, {"aggr": "sum"}))
    err = _answer(with_attrs, inductive_mb(9, [1], "item", NEW_ITEMS)).done.errors[0]
    assert err.status == 422 and "edge features" in err.message


@pytest.mark.parametrize("device", DEVICES)
def test_the_gpu_core_embeds_new_nodes_from_its_placed_rows(device: str) -> None:
    """The typed GPU core (its torch twins on a CPU): feature rows come from the placed store,
    the new nodes' from the request; exact rows equal PyG's on the graph with them added."""
    from quiver_serve.engine.core.typed_gpu import build_typed_gpu_core

    graph = shop_graph(seed=14, edge_dim=None)
    pyg_class, kwargs, to_hetero = TYPED_MODELS["to_hetero_sage_sum"]
    cfg = shop_config(1000)
    cfg.graph.add_reverse_edges = True
    torch.manual_seed(0)
    core = build_typed_gpu_core(cfg, graph, spec=spec(pyg_class, kwargs, to_hetero),
                                device=torch.device(device))
    assert core.served.gather is not None
    other, first = added(graph, "user", NEW_USERS)
    want = full_graph(core.served.to("cpu"), other)["user"]
    core.served.to(device)
    reply = _answer(core, inductive_mb(1, [3, 8], "user", NEW_USERS))
    assert not reply.done.errors, reply.done.errors
    np.testing.assert_allclose(reply.rows, want[[3, 8, *first]].numpy(), rtol=0, atol=TOL)


def test_a_source_an_update_just_added_is_waited_for(tmp_path) -> None:  # noqa: ANN001
    """A new node naming, as in-neighbour, a node an acknowledged update added that the core
    has not applied yet waits for it (as plain ids do), then answers on the updated graph."""
    from quiver_serve.config import ServeConfig
    from quiver_serve.graph.typed_load import load_typed_graph
    from tests.engine.core.test_typed_core import CONFIG, follow_a_log

    cfg = ServeConfig.from_yaml(CONFIG)
    cfg.exact.materialize = "off"
    graph = load_typed_graph(cfg.graph)
    core = build_typed_core(cfg, graph)
    writer, log = follow_a_log(core, cfg, graph, tmp_path)
    width = graph.feature_width("paper")
    assert writer.add_nodes(np.ones((1, width), np.float32), "paper")["node_ids"] == [2708]
    new = [({"cites": [2708, 4]}, [0.0] * width)]
    assert core.add(inductive_mb(1, [4], "paper", new)) is None and len(core.parked) == 1
    replies = []
    while core.parked or core.busy():
        replies += core.step()
    assert len(replies) == 1 and not replies[0].done.errors, replies[0].done.errors
    other, first = added(graph, "paper", new)
    want = full_graph(core.served, other)["paper"][[4, *first]]
    np.testing.assert_allclose(replies[0].rows, want.numpy(), rtol=0, atol=TOL)
    log.close()
