"""The hot route's bodies without per-id Python work: ``/v1/embed`` in, ``.npy`` out.

A well-formed ``/v1/embed`` body is decoded and type-checked in one C pass by msgspec (strict:
a bool or float is not an int, unknown fields are refused) and its ids become an int64 array in
one NumPy call. Anything msgspec refuses is decoded again by the pydantic model
(:class:`~quiver_serve.frontend.schemas.EmbedBody`, also the OpenAPI schema) only to word the 422:
errors cost more, valid requests less.

``new_nodes`` (inductive requests) come out as lists here; their checks need the graph's width
and size, so they happen where the request is served (``engine/client/checks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from pydantic import ValidationError

from quiver_serve import errors
from quiver_serve.engine.client.checks import MAX_VERSION, check_rows
from quiver_serve.frontend.model_view import parse_version
from quiver_serve.frontend.schemas import EmbedBody


class _NewNode(msgspec.Struct, forbid_unknown_fields=True):
    features: list[float]
    in_neighbors: list[int] | dict[str, list[int]] = []


class _Embed(msgspec.Struct, forbid_unknown_fields=True):
    node_ids: list[int] = []
    exact: bool = False
    seed: int | None = None
    timeout_ms: float | None = None
    min_version: int = 0
    new_nodes: list[_NewNode] | None = None
    model: str = ""
    version: int | str | None = None
    node_type: str = ""


_DECODER = msgspec.json.Decoder(_Embed)
#: the 422 of a body with no node ids and no new nodes
NOTHING_TO_EMBED = "node_ids: Field required (it may be omitted or empty only when new_nodes " \
    "are given)"


@dataclass
class EmbedArgs:
    node_ids: np.ndarray  # int64 [n]
    exact: bool
    seed: int | None
    timeout_ms: float | None
    min_version: int = 0
    #: inductive nodes, unchecked: per node its feature row and its in-neighbours
    new_features: list[Any] | None = None
    new_neighbors: list[Any] | None = None
    #: the model asked for ("": the default) and its version (0: by the traffic split)
    model: str = ""
    version: int = 0
    #: the node type of ``node_ids`` (typed graphs; "": the only type)
    node_type: str = ""


def body_version(value: int | str | None) -> int | None:
    """The version a body names (0: none), or None when it names no valid one: a positive
    integer, or a string of its digits."""
    if value is None:
        return 0
    try:
        return parse_version(value)
    except errors.ServeError:
        return None


def parse_embed(raw: bytes, max_nodes: int) -> EmbedArgs:
    """The request of one ``/v1/embed`` body, or a ServeError: 422 malformed, 413 too many ids,
    400 an id beyond int64 (the graph's range is checked once the server is ready)."""
    try:
        body: _Embed | EmbedBody = _DECODER.decode(raw)
    except msgspec.DecodeError:
        body = _slow(raw)
    else:
        if not errors.seed_ok(body.seed) or (
                body.timeout_ms is not None and not body.timeout_ms > 0) or \
                not 0 <= body.min_version <= MAX_VERSION or body_version(body.version) is None \
                or len(body.node_type) > 128:
            body = _slow(raw)  # names every field that is wrong
        elif not body.node_ids and not body.new_nodes:
            raise errors.ServeError("invalid_request", NOTHING_TO_EMBED, 422)
    ids = body.node_ids
    new = body.new_nodes or []
    if len(ids) + len(new) > max_nodes:
        if new:
            check_rows(len(ids), len(new), max_nodes)
        raise errors.too_large(len(ids), max_nodes)
    try:
        arr = np.array(ids, dtype=np.int64)
    except OverflowError:  # Python ints: a huge id is named exactly
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise errors.invalid(f"node id {bad} is out of range (beyond int64)") from None
    args = EmbedArgs(arr, body.exact, body.seed, body.timeout_ms, body.min_version,
                     model=body.model or "", version=body_version(body.version) or 0,
                     node_type=body.node_type)
    if new:
        args.new_features = [n.features for n in new]
        args.new_neighbors = [n.in_neighbors for n in new]
    return args


def _slow(raw: bytes) -> EmbedBody:
    """What msgspec refused, decoded by the pydantic model: its errors word the 422 (and
    anything it accepts that msgspec's strict decoding does not is served as before)."""
    try:
        return EmbedBody.model_validate_json(raw)
    except ValidationError as exc:
        raise errors.ServeError("invalid_request", validation_message(exc.errors()), 422) from None


def validation_message(errs: list) -> str:  # type: ignore[type-arg]
    """One line naming each of the first five problems (field path: what is wrong)."""
    parts = []
    for err in errs[:5]:
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body: {detail}".rstrip(": "))
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header of a float32, little-endian, C-order array of ``shape``, as
    ``np.save`` writes it (the data that follows starts 64-byte aligned)."""
    head = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    head += " " * (63 - (10 + len(head)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head.encode("latin1")


def npy_bytes(rows: np.ndarray) -> bytes:
    """``rows`` as a ``.npy`` file (float32, little-endian, C order), as ``np.save`` writes it."""
    a = np.ascontiguousarray(rows, dtype="<f4")
    return npy_header(a.shape) + a.tobytes()
