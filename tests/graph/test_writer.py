"""GraphWriter: validation, durability and compaction, without processes.

A held-out stream is applied through the writer; compaction is crashed at each of its steps
(``update_log._crash_hook``); reopening (base in force + replay of the log) must give exactly the
acknowledged graph and features every time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve import errors
from quiver_serve.config import GraphConfig
from quiver_serve.graph import update_log
from quiver_serve.graph.csc import GraphData
from quiver_serve.graph.stream import StreamMix, hold_out
from quiver_serve.graph.update_log import UpdateLog, load_base
from quiver_serve.graph.writer import GraphWriter

CRASH_POINTS = ["base.mkdir", "base.array", "base.meta", "base.synced", "current.tmp",
                "current.renamed", "current.synced", "rotate.sealed", "rotate.started",
                "drop.segment", "drop.base"]


class Crash(Exception):
    pass


def graph(seed: int = 0) -> GraphData:
    g = torch.Generator().manual_seed(seed)
    ei = torch.cat([torch.randint(0, 60, (2, 300), generator=g), torch.arange(5).expand(2, -1)], 1)
    return GraphData.from_edge_index(ei, torch.randn(64, 4, generator=g), "g")


def open_writer(directory: Path, cfg: GraphConfig) -> GraphWriter:
    """What a daemon does at start: the base in force (or the original), then the log."""
    log = UpdateLog(directory)
    log.open()
    found = load_base(directory)
    if found is None:
        base, version = ORIGINAL[0], 0
    else:
        version, arrays, meta = found
        base = GraphData("g", torch.from_numpy(np.array(arrays["indptr"])),
                         torch.from_numpy(np.array(arrays["indices"])),
                         torch.from_numpy(np.array(arrays["x"])))
    writer = GraphWriter(cfg, base, version, log)
    writer.replay()
    return writer


ORIGINAL: list[GraphData] = []


def edge_multiset(indptr: torch.Tensor, indices: torch.Tensor) -> list[tuple[int, int]]:
    dst = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr.diff())
    return sorted(zip(indices.tolist(), dst.tolist(), strict=True))


def apply(writer: GraphWriter, ops: list[dict]) -> None:
    for op in ops:
        if op["op"] == "edges":
            writer.add_edges(op.get("add", []), op.get("remove", []))
        elif op["op"] == "nodes":
            writer.add_nodes(op["features"])
        else:
            writer.put_features(op["node_ids"], op["features"])


@pytest.mark.parametrize("crash_at", [None, *CRASH_POINTS])
def test_a_crash_anywhere_in_compaction_keeps_the_acknowledged_graph(
        tmp_path: Path, crash_at: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    base, stream = hold_out(graph(), 0.4, seed=1,
                            mix=StreamMix(edges_per_call=20, nodes_every=2, features_every=2))
    ORIGINAL[:] = [base]
    cfg = GraphConfig(max_new_nodes=32)
    half = len(stream.ops) // 2
    writer = open_writer(tmp_path, cfg)
    apply(writer, stream.ops[:half])

    def hook(name: str) -> None:
        if name == crash_at:
            raise Crash(name)

    monkeypatch.setattr(update_log, "_crash_hook", hook)
    try:
        writer.compact()
    except Crash:
        pass
    monkeypatch.setattr(update_log, "_crash_hook", None)
    writer.log.close()
    writer = open_writer(tmp_path, cfg)  # the daemon restarted
    apply(writer, stream.ops[half:])
    writer.compact()
    apply(writer, [])
    writer.log.close()
    final = open_writer(tmp_path, cfg)
    indptr, indices = final.overlay.to_csc()
    want = stream.final_edge_index()
    assert edge_multiset(indptr, indices) == sorted(zip(want[0].tolist(), want[1].tolist(),
                                                        strict=True))
    found = load_base(tmp_path)
    assert found is not None and found[0] == final.acked
    torch.testing.assert_close(torch.from_numpy(np.array(found[1]["x"])), stream.final_x())
    final.log.close()


def test_bad_updates_are_refused_and_change_nothing(tmp_path: Path) -> None:
    ORIGINAL[:] = [graph()]
    writer = open_writer(tmp_path, GraphConfig(max_update_edges=10, max_new_nodes=2))
    cases = [
        (lambda: writer.add_edges([[0, 64]], []), 400, "64 is out of range"),
        (lambda: writer.add_edges([[-1, 3]], []), 400, "-1 is out of range"),
        (lambda: writer.add_edges([[0, 1, 2]], []), 422, "pairs"),
        (lambda: writer.add_edges([[0, 1]] * 11, []), 413, "limit is 10"),
        (lambda: writer.add_nodes([[1.0, 2.0]]), 422, "have 4"),
        (lambda: writer.add_nodes([[1.0, float("nan"), 0.0, 0.0]]), 400, "NaN"),
        (lambda: writer.add_nodes([[0.0] * 4] * 3), 503, "node capacity"),
        (lambda: writer.put_features([1, 2], [[0.0] * 4]), 422, "2 node_ids but 1"),
        (lambda: writer.put_features([99], [[0.0] * 4]), 400, "99 is out of range"),
    ]
    for call, status, text in cases:
        with pytest.raises(errors.ServeError) as info:
            call()
        assert info.value.info.status == status and text in info.value.info.message
    assert writer.acked == 0 and writer.overlay.num_edges == graph().num_edges
    assert writer.add_edges([[1, 2], [1, 2]], [[3, 4]]) == {
        "version": 1, "added": 2, "removed": 0, "missing": 1}
    writer.log.close()


def test_a_type_on_an_untyped_graph_is_its_one_type_or_a_400(tmp_path: Path) -> None:
    """Update calls on a one-type graph take no type or its one type (``node``,
    ``node-to-node``: docs/architecture.md, "Typed graphs"); another is a 400 naming it."""
    from quiver_serve.engine.procs.graph_service import WriterCalls

    ORIGINAL[:] = [graph()]
    calls = WriterCalls(open_writer(tmp_path, GraphConfig()), 1)
    try:
        got = calls.run("add_edges", [[[0, 1]], []], params={"edge_type": ["node", "to", "node"]})
        assert got["added"] == 1 and got["version"] == 1
        got = calls.run("put_features", [[0], [[0.0] * 4]], params={"node_type": "node"})
        assert got["version"] == 2
        with pytest.raises(errors.ServeError) as info:
            calls.run("add_edges", [[[0, 1]], []], params={"edge_type": ["a", "b", "c"]})
        assert info.value.info.status == 400 and "['node', 'to', 'node']" in info.value.info.message
        with pytest.raises(errors.ServeError) as info:
            calls.run("add_nodes", [[[0.0] * 4]], params={"node_type": "paper"})
        assert info.value.info.status == 400 and "'paper'" in info.value.info.message
    finally:
        calls.stop()
