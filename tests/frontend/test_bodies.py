"""The hot route's body handling (``frontend/bodies.py``) without a server."""

from __future__ import annotations

import io

import numpy as np
import pytest

from quiver_serve import errors
from quiver_serve.frontend.bodies import npy_bytes, parse_embed


@pytest.mark.parametrize("shape", [(3, 64), (48, 64), (1, 1), (0, 64), (1000, 602)])
def test_npy_bytes_is_what_np_save_writes(shape: tuple[int, int]) -> None:
    rows = np.random.default_rng(0).random(shape, dtype=np.float32)
    buf = io.BytesIO()
    np.save(buf, rows)
    assert npy_bytes(rows) == buf.getvalue()
    np.testing.assert_array_equal(np.load(io.BytesIO(npy_bytes(rows)), allow_pickle=False), rows)


def test_valid_body_becomes_int64_array() -> None:
    body = parse_embed(b'{"node_ids": [5, 1, 5], "exact": true, "seed": 7, "timeout_ms": 20}', 10)
    assert body.node_ids.dtype == np.int64 and body.node_ids.tolist() == [5, 1, 5]
    assert (body.exact, body.seed, body.timeout_ms) == (True, 7, 20.0)


@pytest.mark.parametrize("raw", [
    b'{"new_nodes": [{"features": [0.5, 1], "in_neighbors": [3]}]}',
    b'{"node_ids": [], "new_nodes": [{"features": [0.5, 1], "in_neighbors": [3]}]}',
])
def test_new_nodes_alone_need_no_node_ids(raw: bytes) -> None:
    body = parse_embed(raw, 10)
    assert body.node_ids.dtype == np.int64 and body.node_ids.size == 0
    assert body.new_features == [[0.5, 1]] and body.new_neighbors == [[3]]


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (b'{"node_ids": [1, true]}', 422, "node_ids.1"),       # a bool is not an id (numpy would take it)
    (b'{"node_ids": [1.5]}', 422, "node_ids.0"),
    (b'{"node_ids": []}', 422, "node_ids: Field required"),
    (b'{}', 422, "node_ids: Field required"),
    (b'{"new_nodes": []}', 422, "node_ids: Field required"),
    (b'{"node_ids": [], "new_nodes": null}', 422, "node_ids: Field required"),
    (b'{"nodes": [1]}', 422, "nodes"),
    (b'{"node_ids": [1], "seed": -1}', 422, "seed"),
    (b'{"node_ids": [1], "seed": 18446744073709551615}', 422, "seed"),
    (b'{"node_ids": [1], "timeout_ms": 0}', 422, "timeout_ms"),
    (b'{"node_ids": [1,', 422, "malformed JSON"),
    (b"", 422, "malformed JSON"),
    (b"[1]", 422, "object"),
    (b'{"node_ids": [1180591620717411303424]}', 400, "1180591620717411303424"),
    (b'{"node_ids": [-18446744073709551616]}', 400, "-18446744073709551616"),
    (b'{"node_ids": [1, 2, 3, 4]}', 413, "3"),
])
def test_bad_bodies_are_named(raw: bytes, status: int, needle: str) -> None:
    with pytest.raises(errors.ServeError) as info:
        parse_embed(raw, 3)
    assert info.value.info.status == status and needle in info.value.info.message
