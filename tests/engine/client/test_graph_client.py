"""Graph calls from a front-end process: GraphClient (asyncio DEALER) against GraphService
(the main process's ROUTER), with a stand-in writer; and the wire additions they and the
inductive requests use. No daemon: the sockets live in this process."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from quiver_serve import errors
from quiver_serve.engine.client.checks import check_ids_at_door, inductive_nodes
from quiver_serve.engine.client.graph_client import GraphClient
from quiver_serve.engine.procs.graph_service import GraphService
from quiver_serve.wire import (
    Decoders,
    GraphCall,
    InductiveNodes,
    decode_inductive,
    encode,
    graph_arrays,
)


class FakeWriter:
    """What the service calls, with answers and refusals of each kind."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s, self.version, self.compaction_requested = delay_s, 7, False
        self.calls: list[tuple[str, Any]] = []
        self.release = threading.Event()
        self.release.set()

    def add_edges(self, add: np.ndarray, remove: np.ndarray) -> dict[str, Any]:
        self.release.wait(5)
        time.sleep(self.delay_s)
        self.calls.append(("add_edges", (add.copy(), remove.copy())))
        return {"version": np.int64(8), "added": np.int64(len(add)), "removed": 0,
                "missing": np.int64(len(remove))}

    def add_nodes(self, features: np.ndarray) -> dict[str, Any]:
        err = errors.ServeError("overlay_full", "node capacity reached; retry after compaction",
                                503)
        err.retry_after_s = 3  # type: ignore[attr-defined]
        raise err

    def put_features(self, node_ids: np.ndarray, features: np.ndarray) -> dict[str, Any]:
        raise RuntimeError("disk at /secret/path failed")

    def info(self, num_engines: int) -> dict[str, Any]:
        return {"version": self.version, "engines": [{"engine": i} for i in range(num_engines)]}

    def request_compaction(self, explicit: bool = False) -> None:
        self.compaction_requested = True


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/graph.sock"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_calls_round_trip_with_the_writers_answers_and_refusals(address: str) -> None:
    writer = FakeWriter()
    service = GraphService(writer, address, num_engines=2).start()

    async def calls() -> None:
        client = GraphClient(address, timeout_s=5.0)
        add = np.array([[0, 1], [2, 3]])
        got = await client.call("add_edges", [add, np.empty((0, 2), np.int64)])
        assert got == {"version": 8, "added": 2, "removed": 0, "missing": 0}
        np.testing.assert_array_equal(writer.calls[0][1][0], add)
        assert (await client.call("info", []))["engines"] == [{"engine": 0}, {"engine": 1}]
        with pytest.raises(errors.ServeError) as full:
            await client.call("add_nodes", [np.zeros((1, 4), np.float32)])
        assert full.value.info.status == 503 and full.value.retry_after_s == 3  # type: ignore[attr-defined]
        with pytest.raises(errors.ServeError) as broken:
            await client.call("put_features", [np.array([1]), np.zeros((1, 4), np.float32)])
        assert broken.value.info.status == 500 and "secret" not in broken.value.info.message
        assert await client.call("compact", []) == {"version": 7, "compacted": False,
                                                     "requested": True}
        assert writer.compaction_requested
        client.close()

    try:
        run(calls())
    finally:
        service.stop()


def test_a_slow_writer_is_504_and_the_queue_is_bounded(address: str) -> None:
    writer = FakeWriter()
    writer.release.clear()  # every update waits until released
    service = GraphService(writer, address, num_engines=1, max_queued=1).start()
    edges = [np.array([[0, 1]]), np.empty((0, 2), np.int64)]

    async def calls() -> None:
        client = GraphClient(address, timeout_s=0.3)
        first = asyncio.ensure_future(client.call("add_edges", edges))
        await asyncio.sleep(0.05)
        with pytest.raises(errors.ServeError) as refused:
            await client.call("add_edges", edges)
        assert refused.value.info.status == 503  # one call admitted at once
        with pytest.raises(errors.ServeError) as late:
            await first
        assert late.value.info.status == 504 and "may still be applied" in late.value.info.message
        writer.release.set()
        await asyncio.sleep(0.1)
        assert (await client.call("add_edges", edges))["added"] == 1
        client.close()

    try:
        run(calls())
    finally:
        writer.release.set()
        service.stop()


def test_the_client_reaches_a_service_that_came_back(address: str) -> None:
    first = GraphService(FakeWriter(), address, num_engines=1).start()

    async def calls() -> None:
        client = GraphClient(address, timeout_s=2.0)
        assert (await client.call("info", []))["version"] == 7
        first.stop()
        second = GraphService(FakeWriter(), address, num_engines=3).start()
        try:
            got = await client.call("info", [])
            assert len(got["engines"]) == 3
        finally:
            second.stop()
        client.close()

    run(calls())


def test_a_malformed_call_is_answered_400(address: str) -> None:
    import zmq

    service = GraphService(FakeWriter(), address, num_engines=1).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        head = GraphCall(5, "add_edges", [[3, 2], [0, 2]])
        sock.send_multipart([encode(head), np.zeros(4, np.int64).tobytes(), b""])  # 4 != 3 * 2
        assert sock.poll(5000)
        reply = Decoders.graph_reply.decode(sock.recv_multipart()[0])
        assert reply.call_id == 5 and reply.error is not None and reply.error.status == 400
    finally:
        sock.close(linger=0)
        ctx.term()
        service.stop()


def test_graph_arrays_checks_each_frame_against_its_shape() -> None:
    call = GraphCall(1, "put_features", [[2], [2, 3]])
    ids, rows = graph_arrays(call, [np.array([4, 5]).tobytes(),
                                    np.ones((2, 3), np.float32).tobytes()])
    assert ids.tolist() == [4, 5] and rows.shape == (2, 3)
    with pytest.raises(ValueError):
        graph_arrays(call, [np.array([4]).tobytes(), np.ones((2, 3), np.float32).tobytes()])
    with pytest.raises(ValueError):
        graph_arrays(GraphCall(1, "drop_table", []), [])


def test_inductive_frames_round_trip_behind_the_usual_ones() -> None:
    nodes = InductiveNodes(np.arange(6, dtype=np.float32).reshape(2, 3),
                           np.array([0, 2, 3]), np.array([4, 9, 1]))
    frames = [b"identity", b"header", b"ids", b"lengths", b"deadlines",
              *[f.tobytes() for f in nodes.frames()]]
    got = decode_inductive(frames, 2)
    np.testing.assert_array_equal(got.features, nodes.features)
    assert got.offsets.tolist() == [0, 2, 3] and got.neighbors.tolist() == [4, 9, 1]
    assert decode_inductive(frames).count == 2  # the count is in the offsets
    with pytest.raises(ValueError):
        decode_inductive(frames, 3)
    bad = frames[:-1] + [np.array([4, 9], np.int64).tobytes()]  # offsets end at 3
    with pytest.raises(ValueError):
        decode_inductive(bad)


def test_an_older_senders_micro_batch_header_still_decodes() -> None:
    old = msgspec.msgpack.encode([3, False, -1, 12])  # seq, exact, seed, outstanding_ids
    head = Decoders.micro_batch.decode(old)
    assert (head.seq, head.outstanding_ids, head.min_version, head.new_nodes) == (3, 12, 0, 0)


def test_the_door_refuses_only_ids_that_can_never_exist() -> None:
    check_ids_at_door(np.array([0, 99, 140]), num_nodes=100, node_capacity=150)  # may exist
    for bad in (-1, 150, 2**40):
        with pytest.raises(errors.ServeError) as refused:
            check_ids_at_door(np.array([3, bad]), num_nodes=100, node_capacity=150)
        assert refused.value.info.status == 400
        assert f"node id {bad} is out of range: valid ids are 0..99" in refused.value.info.message


def test_inductive_nodes_are_checked_whole() -> None:
    nodes = inductive_nodes([[1.0, 2.0], [3.0, 4.0]], [[0, 7], []], 2, 10, 12)
    assert nodes is not None and nodes.offsets.tolist() == [0, 2, 2]
    assert nodes.features.dtype == np.float32 and nodes.neighbors.tolist() == [0, 7]
    assert inductive_nodes([], [], 2, 10, 12) is None
    cases = [(([[1.0], [1.0, 2.0]], [[], []]), 422, "new_nodes[0]"),
             (([[1.0, 2.0], [np.inf, 0.0]], [[], []]), 400, "new_nodes[1]"),
             (([[1.0, 2.0]], [[3, 12]]), 400, "new_nodes[0].in_neighbors: node id 12"),
             (([[1.0, 2.0], [1.0, 2.0]], [[], [-1]]), 400, "new_nodes[1]")]
    for (features, neighbors), status, needle in cases:
        with pytest.raises(errors.ServeError) as refused:
            inductive_nodes(features, neighbors, 2, 10, 12)
        assert refused.value.info.status == status and needle in refused.value.info.message
