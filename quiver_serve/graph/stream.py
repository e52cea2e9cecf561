"""A replayable update stream for the living graph (docs/architecture.md, "The living graph"):
held-out edges replayed as inserts, mixed with removals of present edges, appended nodes (and later
edges into and out of them) and feature overwrites, so that the graph after every op is known
exactly.

:func:`hold_out` removes a random fraction of a graph's edges (a multiset of ``edge_index``
columns) to make the base; the returned :class:`UpdateStream` is an ordered list of ops, each a
dict shaped exactly like the HTTP body of its call plus ``"op"`` (``edges``, ``nodes`` or
``features``; :func:`request_of` gives method, path and body). The same graph, fraction, seed and
mix give the same stream. :func:`apply_reference` is a plain-torch implementation of the update
semantics, the ground truth tests compare the daemon (and the stream's own bookkeeping) with:

* ``edges`` ``{"add": [[src, dst], ...], "remove": [...]}``: removals first, then adds; ``add``
  appends a column (a repeat is a second copy); ``remove`` deletes every copy of the pair; a remove
  row whose pair is not present counts in ``missing``. Result ``{"added", "removed", "missing"}``
  (``removed``: copies deleted).
* ``nodes`` ``{"features": [[...], ...]}``: rows appended, ids ``num_nodes, num_nodes + 1, ...``.
  Result ``{"node_ids": [...]}``.
* ``features`` ``{"node_ids": [...], "features": [[...], ...]}``: rows overwritten. Result ``{}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.graph.csc import GraphData

OPS = ("edges", "nodes", "features")
ROUTES = {"edges": ("POST", "/v1/graph/edges"), "nodes": ("POST", "/v1/graph/nodes"),
          "features": ("PUT", "/v1/graph/features")}
#: pair key = (src << KEY_SHIFT) | dst: one int64 per pair, for node ids below 2**31
KEY_SHIFT = 32
#: tries at drawing present edges to remove before an op settles for fewer
REMOVAL_DRAWS = 4


@dataclass(frozen=True)
class StreamMix:
    """Proportions of the stream: how many of each kind of update, per edge call."""

    edges_per_call: int = 256  # held-out inserts per edges op
    remove_ratio: float = 0.1  # removal pairs per held-out insert (of edges present then)
    remove_from_stream: float = 0.5  # share of removals hitting edges the stream added (else base)
    nodes_every: int = 8  # a nodes op after every this many edges ops (0: never)
    nodes_per_call: int = 4
    new_node_edge_share: float = 0.05  # extra adds into or out of appended nodes, per insert
    features_every: int = 8  # a features op after every this many edges ops (0: never)
    features_per_call: int = 4
    missing_every: int = 0  # an edges op removing absent pairs after every this many (0: never)
    feature_noise: float = 0.1  # new rows: an existing row plus this times the features' std

    def __post_init__(self) -> None:
        if self.edges_per_call < 1:
            raise ValueError(f"edges_per_call must be >= 1, got {self.edges_per_call}")
        for name in ("remove_ratio", "remove_from_stream", "new_node_edge_share"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def pair_keys(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """One int64 per (src, dst) pair."""
    return (np.asarray(src, np.int64) << KEY_SHIFT) | np.asarray(dst, np.int64)


def request_of(op: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(HTTP method, path, JSON body) of an op: the body is the op without its ``"op"`` key."""
    method, path = ROUTES[op["op"]]
    return method, path, {k: v for k, v in op.items() if k != "op"}


def apply_reference(edge_index: Tensor, x: Tensor, op: dict[str, Any],
                    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """One op applied to a plain ``edge_index`` [2, E] and ``x`` [N, F] (new tensors; the inputs
    are not changed): ``(edge_index, x, result)``, result as the daemon's answer without its
    version. Raises ValueError for what the daemon answers with a 4xx."""
    kind, n = op["op"], x.size(0)
    if kind == "edges":
        add, rem = _pairs(op.get("add"), n, "add"), _pairs(op.get("remove"), n, "remove")
        keys = edge_index[1] * n + edge_index[0]
        rem_keys = rem[:, 1] * n + rem[:, 0]
        hit = torch.isin(keys, rem_keys)
        missing = int((~torch.isin(rem_keys, keys)).sum())
        out = torch.cat([edge_index[:, ~hit], add.t().to(edge_index.dtype)], dim=1)
        return out, x, {"added": int(add.size(0)), "removed": int(hit.sum()), "missing": missing}
    if kind == "nodes":
        rows = _rows(op.get("features"), x.size(1), "features")
        ids = list(range(n, n + rows.size(0)))
        return edge_index, torch.cat([x, rows]), {"node_ids": ids}
    if kind == "features":
        ids = torch.as_tensor(op.get("node_ids", []), dtype=torch.int64).reshape(-1)
        rows = _rows(op.get("features"), x.size(1), "features")
        if ids.numel() != rows.size(0):
            raise ValueError(f"{ids.numel()} node ids but {rows.size(0)} feature rows")
        _check_range(ids, n, "node_ids")
        out = x.clone()
        for i, row in zip(ids.tolist(), rows, strict=True):  # in order: a repeated id's last row wins
            out[i] = row
        return edge_index, out, {}
    raise ValueError(f"unknown op {kind!r}; one of {OPS}")


def _pairs(value: Any, n: int, field: str) -> Tensor:
    t = torch.as_tensor(value if value is not None else [], dtype=torch.int64)
    if t.numel() == 0:
        return torch.empty((0, 2), dtype=torch.int64)
    if t.dim() != 2 or t.size(1) != 2:
        raise ValueError(f"{field} must be a list of [src, dst] pairs, got shape {tuple(t.shape)}")
    _check_range(t, n, field)
    return t


def _rows(value: Any, width: int, field: str) -> Tensor:
    t = torch.as_tensor(value if value is not None else [], dtype=torch.float32)
    if t.dim() != 2 or t.size(0) == 0 or t.size(1) != width:
        raise ValueError(f"{field} must be a non-empty list of rows of {width} values, "
                         f"got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{field} has a NaN or infinite value")
    return t


def _check_range(ids: Tensor, n: int, field: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ValueError(f"{field}: node id out of range: valid ids are 0..{n - 1}")


@dataclass
class UpdateStream:
    """The ops after a base graph, in order, and what each must answer (see the module docstring).

    ``expected[i]``: op i's result fields (``apply_reference``'s); ``probes``: indices of the
    edges ops that remove absent pairs on purpose (``missing`` > 0); every other removal hits a
    present edge.
    """

    base: GraphData
    held: np.ndarray  # int64 [2, H]: the held-out columns, in replay order
    mix: StreamMix
    seed: int
    ops: list[dict[str, Any]]
    expected: list[dict[str, Any]]
    probes: frozenset[int]
    _final_edges: Tensor  # int64 [2, E]

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.ops)

    def batches(self, edges_per_call: int) -> UpdateStream:
        """The same held-out edges replayed in calls of ``edges_per_call`` inserts (the same seed:
        deterministic; the other proportions per call as before)."""
        return _build(self.base, self.held, replace(self.mix, edges_per_call=edges_per_call),
                      self.seed)

    def final_edge_index(self) -> Tensor:
        """``edge_index`` [2, E] of the graph after every op (base columns, then the stream's
        surviving adds in order)."""
        return self._final_edges

    def final_x(self) -> Tensor:
        """Node features after every op: the base's, appended rows, overwrites applied."""
        added = sum(len(op["features"]) for op in self.ops if op["op"] == "nodes")
        x = torch.empty((self.base.num_nodes + added, self.base.num_features), dtype=torch.float32)
        x[:self.base.num_nodes] = self.base.x
        n = self.base.num_nodes
        for op in self.ops:
            if op["op"] == "nodes":
                rows = torch.tensor(op["features"], dtype=torch.float32)
                x[n:n + rows.size(0)] = rows
                n += rows.size(0)
            elif op["op"] == "features":
                x[torch.tensor(op["node_ids"])] = torch.tensor(op["features"], dtype=torch.float32)
        return x

    def final_num_nodes(self) -> int:
        return self.base.num_nodes + sum(len(op["features"]) for op in self.ops
                                         if op["op"] == "nodes")

    def counts(self) -> dict[str, int]:
        """Ops by kind, and edge pairs added and removed over the stream."""
        out = {k: sum(op["op"] == k for op in self.ops) for k in OPS}
        out["pairs_added"] = sum(len(op.get("add", ())) for op in self.ops if op["op"] == "edges")
        out["pairs_removed"] = sum(e.get("removed", 0) for e in self.expected)
        return out


def hold_out(graph: GraphData, fraction: float, seed: int,
             mix: StreamMix | None = None) -> tuple[GraphData, UpdateStream]:
    """(base, stream): a random ``fraction`` of ``graph``'s edge columns removed to make the base
    (duplicates are separate columns); the stream inserts them again, mixed per ``mix``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if graph.num_nodes >= 1 << (KEY_SHIFT - 1):
        raise ValueError(f"{graph.num_nodes:,} nodes: pair keys need ids below 2**31")
    edge_index = graph.edge_index().numpy()
    order = np.random.default_rng([seed, 0]).permutation(edge_index.shape[1])
    n_held = int(round(fraction * edge_index.shape[1]))
    held = np.ascontiguousarray(edge_index[:, order[:n_held]])
    kept = np.sort(order[n_held:])  # the base keeps the graph's own column order
    base = GraphData.from_edge_index(torch.from_numpy(edge_index[:, kept]), graph.x,
                                     f"{graph.name}-base", graph.y)
    stream = _build(base, held, mix or StreamMix(), seed)
    return base, stream


def _build(base: GraphData, held: np.ndarray, mix: StreamMix, seed: int) -> UpdateStream:
    b = _Builder(base, mix, seed)
    edge_ops = 0
    for lo in range(0, held.shape[1], mix.edges_per_call):
        b.edges_op(held[:, lo:lo + mix.edges_per_call].T)
        edge_ops += 1
        if mix.nodes_every and edge_ops % mix.nodes_every == 0:
            b.nodes_op(mix.nodes_per_call)
        if mix.features_every and edge_ops % mix.features_every == 0:
            b.features_op(mix.features_per_call)
        if mix.missing_every and edge_ops % mix.missing_every == 0:
            b.missing_probe()
    return UpdateStream(base, held, mix, seed, b.ops, b.expected, frozenset(b.probes),
                        b.final_edges())


class _Builder:
    """Generates the ops and tracks, per pair the stream touched, how many copies are present.

    A pair the stream never touched has its base multiplicity; presence of any pair is therefore
    known from a sorted array of the base's keys plus a dict of the touched ones, without
    materialising the graph per op.
    """

    def __init__(self, base: GraphData, mix: StreamMix, seed: int) -> None:
        self.mix, self.rng = mix, np.random.default_rng([seed, 1])
        ei = base.edge_index().numpy()
        self.base_src, self.base_dst = ei[0], ei[1]
        self.base_keys = np.sort(pair_keys(ei[0], ei[1]))
        self.x = base.x.numpy()
        self.row_std = float(self.x.std()) if self.x.size else 1.0
        self.num_nodes = base.num_nodes
        self.new_nodes: list[int] = []
        self.copies: dict[int, int] = {}  # touched pair -> copies present now
        self.last_removed: dict[int, int] = {}  # pair -> index of the op that last removed it
        self.added_keys: list[int] = []  # every pair the stream added, in order (maybe removed since)
        self.added_cols: list[np.ndarray] = []  # [k, 2] per edges op
        self.added_op: list[int] = []
        self.ops: list[dict[str, Any]] = []
        self.expected: list[dict[str, Any]] = []
        self.probes: list[int] = []

    # ---- presence --------------------------------------------------------------------------------
    def base_copies(self, keys: np.ndarray) -> np.ndarray:
        return (np.searchsorted(self.base_keys, keys, "right")
                - np.searchsorted(self.base_keys, keys, "left"))

    def copies_now(self, keys: np.ndarray) -> np.ndarray:
        out = self.base_copies(keys)
        for i, k in enumerate(keys.tolist()):
            if k in self.copies:
                out[i] = self.copies[k]
        return out

    # ---- ops -------------------------------------------------------------------------------------
    def edges_op(self, inserts: np.ndarray) -> None:
        adds = np.concatenate([inserts, self.new_node_edges(len(inserts))])
        removes = self.pick_removals(int(round(self.mix.remove_ratio * len(inserts))))
        self.record_edges(adds, removes)

    def record_edges(self, adds: np.ndarray, removes: np.ndarray) -> None:
        """Append the op and its expected result; update the copies (removals first)."""
        i = len(self.ops)
        rem_keys = pair_keys(removes[:, 0], removes[:, 1])
        uniq = np.unique(rem_keys)
        have = self.copies_now(uniq)
        missing = int((self.copies_now(rem_keys) == 0).sum())
        for k in uniq[have > 0].tolist():
            self.copies[k] = 0
            self.last_removed[k] = i
        add_keys = pair_keys(adds[:, 0], adds[:, 1])
        now = self.copies_now(add_keys)  # before this op's adds
        for k, c in zip(add_keys.tolist(), now.tolist(), strict=True):
            self.copies[k] = self.copies.get(k, c) + 1
        self.added_keys += add_keys.tolist()
        self.added_cols.append(adds)
        self.added_op.append(i)
        self.ops.append({"op": "edges", "add": adds.tolist(), "remove": removes.tolist()})
        self.expected.append({"added": len(adds), "removed": int(have.sum()), "missing": missing})

    def new_node_edges(self, inserts: int) -> np.ndarray:
        """Edges into or out of nodes appended earlier, each with a random node as the other end."""
        k = int(round(self.mix.new_node_edge_share * inserts))
        if not self.new_nodes or k == 0:
            return np.empty((0, 2), np.int64)
        new = np.asarray(self.new_nodes, np.int64)[self.rng.integers(0, len(self.new_nodes), k)]
        other = self.rng.integers(0, self.num_nodes, k)
        into = self.rng.random(k) < 0.5
        return np.stack([np.where(into, other, new), np.where(into, new, other)], axis=1)

    def pick_removals(self, count: int) -> np.ndarray:
        """Up to ``count`` distinct pairs present now: a share from the stream's own adds, the rest
        from the base's columns."""
        want_stream = int(round(count * self.mix.remove_from_stream)) if self.added_keys else 0
        picked: dict[int, None] = {}
        for pool, want in (("stream", want_stream), ("base", count - want_stream)):
            target = len(picked) + want
            for _ in range(REMOVAL_DRAWS):
                if len(picked) >= target:
                    break
                keys = self.draw_keys(pool, 2 * (target - len(picked)))
                for k, c in zip(keys.tolist(), self.copies_now(keys).tolist(), strict=True):
                    if c > 0 and len(picked) < target:
                        picked.setdefault(k, None)
        keys = np.fromiter(picked, np.int64, len(picked))
        return np.stack([keys >> KEY_SHIFT, keys & ((1 << KEY_SHIFT) - 1)], axis=1)

    def draw_keys(self, pool: str, n: int) -> np.ndarray:
        if pool == "stream":
            idx = self.rng.integers(0, len(self.added_keys), n)
            return np.asarray(self.added_keys, np.int64)[idx]
        if self.base_src.size == 0:
            return np.empty(0, np.int64)
        idx = self.rng.integers(0, self.base_src.size, n)
        return pair_keys(self.base_src[idx], self.base_dst[idx])

    def nodes_op(self, count: int) -> None:
        ids = list(range(self.num_nodes, self.num_nodes + count))
        self.ops.append({"op": "nodes", "features": self.feature_rows(count).tolist()})
        self.expected.append({"node_ids": ids})
        self.num_nodes += count
        self.new_nodes += ids

    def features_op(self, count: int) -> None:
        count = min(count, self.num_nodes)
        ids = np.sort(self.rng.choice(self.num_nodes, count, replace=False))
        self.ops.append({"op": "features", "node_ids": ids.tolist(),
                         "features": self.feature_rows(count).tolist()})
        self.expected.append({})

    def feature_rows(self, count: int) -> np.ndarray:
        """Copies of random base rows with Gaussian noise: finite rows of the graph's width."""
        rows = self.x[self.rng.integers(0, self.x.shape[0], count)]
        noise = self.rng.standard_normal(rows.shape) * self.mix.feature_noise * self.row_std
        return (rows + noise).astype(np.float32)

    def missing_probe(self) -> None:
        """An edges op removing pairs that are absent now (nothing added): ``missing`` = rows."""
        keys: list[int] = []
        for _ in range(REMOVAL_DRAWS * 8):
            if len(keys) >= 2:
                break
            cand = pair_keys(self.rng.integers(0, self.num_nodes, 8),
                             self.rng.integers(0, self.num_nodes, 8))
            keys += [k for k, c in zip(cand.tolist(), self.copies_now(cand).tolist(), strict=True)
                     if c == 0 and k not in keys]
        if not keys:  # a graph with every pair present: no probe
            return
        arr = np.asarray(keys[:2], np.int64)
        self.probes.append(len(self.ops))
        self.record_edges(np.empty((0, 2), np.int64),
                          np.stack([arr >> KEY_SHIFT, arr & ((1 << KEY_SHIFT) - 1)], axis=1))

    # ---- the result ------------------------------------------------------------------------------
    def final_edges(self) -> Tensor:
        """Base columns whose pair was never removed, then each add not removed by a later op (an
        op removes before it adds, so its own adds survive its removals)."""
        removed = np.fromiter(self.last_removed, np.int64, len(self.last_removed))
        when = np.fromiter(self.last_removed.values(), np.int64, len(self.last_removed))
        order = np.argsort(removed)
        removed, when = removed[order], when[order]
        base_keys = pair_keys(self.base_src, self.base_dst)
        keep = ~np.isin(base_keys, removed)
        cols = [np.stack([self.base_src[keep], self.base_dst[keep]])]
        for adds, i in zip(self.added_cols, self.added_op, strict=True):
            if len(adds) == 0:
                continue
            keys = pair_keys(adds[:, 0], adds[:, 1])
            pos = np.minimum(np.searchsorted(removed, keys), max(removed.size - 1, 0))
            last = np.where((removed.size > 0) & (removed[pos] == keys), when[pos], -1) \
                if removed.size else np.full(keys.size, -1)
            cols.append(adds[last <= i].T)
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(cols, axis=1)))


def sorted_columns(edge_index: Tensor) -> Tensor:
    """``edge_index`` with its columns sorted by (dst, src): equal tensors = equal multisets."""
    keys = edge_index[1] * (1 << KEY_SHIFT) + edge_index[0]
    return edge_index[:, torch.argsort(keys, stable=True)]
