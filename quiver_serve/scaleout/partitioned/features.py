"""Feature rows of a sampled batch on a partition server: its own rows, then the hot rows of other
partitions replicated here (chosen offline by FAP, ``quiver_serve/partition/``), then one batched
call per partition for the rest (docs/architecture.md, "Partitioned serving")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from quiver_serve.scaleout.partitioned.sampling import as_tensor

#: (partition, global ids it owns) -> float32 rows [len(ids), F]
RemoteRows = Callable[[int, np.ndarray], Awaitable[np.ndarray]]
#: local rows -> (which were written since the base: bool mask, their float32 rows)
WrittenRows = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass
class RowCounts:
    """Rows gathered so far, by where they came from (the replicated-row hit rate's inputs)."""

    local: int = 0
    hot: int = 0
    remote: int = 0
    #: of ``remote``: rows that rode with the hop answers or were asked for during the last
    #: hop (``RidingRows``), and the calls the gather itself had to make after the sampling
    riding: int = 0
    late_calls: int = 0

    def hot_hit_rate(self) -> float:
        """Of the rows owned elsewhere, the share a replicated hot row answered (1.0: none)."""
        elsewhere = self.hot + self.remote
        return self.hot / elsewhere if elsewhere else 1.0


def resolved(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` alone names the current device; tensors on it report
    ``cuda:N``, so an unindexed device never equals theirs)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class PartitionFeatures:
    """``gather(n_id)`` over one partition's rows (see the module docstring). Which rows are
    replicated here is a dense map (global id -> hot row, -1: none; 4 bytes per node), so a
    batch's rows are found by one index, not a search. ``place`` moves the hot rows and the
    own rows to the GPU while they fit; ``gather`` answers on the device of the own rows."""

    def __init__(self, part: int, owner: Tensor, local: Tensor, features: Tensor,
                 hot_ids: Tensor, hot_features: Tensor, num_parts: int,
                 remote: RemoteRows) -> None:
        self.part, self.owner, self.local, self.num_parts = part, owner, local, num_parts
        self.remote = remote
        #: the own rows and the rows written since their base (``live.PartitionLive.written``,
        #: when live), one attribute so a move to a new base swaps both at once
        self._own_state: tuple[Tensor, WrittenRows | None] = (features, None)
        self.hot_rows = hot_features
        self.hot_slot = torch.full((owner.numel(),), -1, dtype=torch.int32)
        self.hot_slot[hot_ids.to(torch.int64)] = torch.arange(hot_ids.numel(), dtype=torch.int32)
        self.counts = RowCounts()

    @property
    def features(self) -> Tensor:
        return self._own_state[0]

    @property
    def written(self) -> WrittenRows | None:
        return self._own_state[1]

    @written.setter
    def written(self, written: WrittenRows | None) -> None:
        self._own_state = (self._own_state[0], written)

    def rebase(self, features: Tensor, written: WrittenRows | None) -> None:
        """Serve ``features`` as the own rows and ``written`` as the rows written since them
        (a move to a new base), both at once."""
        self._own_state = (features, written)

    @property
    def device(self) -> torch.device:
        return self.features.device

    def place(self, device: torch.device, budget_bytes: int) -> int:
        """Copy the hot rows, then the own rows, to ``device`` while each fits in what is left
        of ``budget_bytes``; the bytes placed. The own rows go only with the hot rows, so a
        gather never mixes devices beyond the remote rows."""
        placed = 0
        if device.type == "cpu":
            return placed
        device = resolved(device)
        hot_bytes = self.hot_rows.numel() * self.hot_rows.element_size()
        if hot_bytes > budget_bytes:
            return placed
        self.hot_rows, placed = self.hot_rows.to(device), hot_bytes
        own, own_bytes = self.own_rows_on(self.features, device, budget_bytes - placed)
        self._own_state = (own, self.written)
        return placed + own_bytes

    @property
    def hot_bytes(self) -> int:
        """Bytes of the hot rows on a device (0 while they are in host memory)."""
        if self.hot_rows.device.type == "cpu":
            return 0
        return self.hot_rows.numel() * self.hot_rows.element_size()

    def own_rows_on(self, rows: Tensor, device: torch.device,
                    budget_bytes: int) -> tuple[Tensor, int]:
        """``rows`` (own rows) on ``device`` when the hot rows are there and they fit in
        ``budget_bytes``, else as they are; and the bytes placed."""
        nbytes = rows.numel() * rows.element_size()
        device = resolved(device)
        if device.type == "cpu" or self.hot_rows.device != device or nbytes > budget_bytes:
            return rows, 0
        return rows.to(device), nbytes

    def grow(self, owner: Tensor, local: Tensor) -> None:
        """The book grew (new nodes, ``live.PartitionLive``): its owner and local rows from
        now on; the new nodes have no replicated copies here."""
        extra = int(owner.numel()) - int(self.hot_slot.numel())
        if extra > 0:
            self.hot_slot = torch.cat([self.hot_slot,
                                       torch.full((extra,), -1, dtype=torch.int32)])
        self.owner, self.local = owner, local

    def drop_hot(self, ids: np.ndarray) -> int:
        """Stop answering the replicated copies of global ``ids`` (their owner answers them
        from now on); returns how many copies were dropped."""
        t = torch.from_numpy(np.ascontiguousarray(ids, np.int64))
        t = t[(t >= 0) & (t < self.hot_slot.numel())]
        dropped = int((self.hot_slot[t] >= 0).sum())
        self.hot_slot[t] = -1
        return dropped

    def _own(self, rows_local: Tensor) -> Tensor:
        """float32 rows of this partition's local rows on the own rows' device, written rows
        included (a node added since the snapshot, past the mapped rows, has only a written
        row)."""
        features, written = self._own_state
        n_mapped, device = int(features.size(0)), features.device
        idx = rows_local.to(device)
        if rows_local.numel() and int(rows_local.max()) >= n_mapped:
            out = torch.zeros((rows_local.numel(), self.dim), dtype=torch.float32, device=device)
            mapped = idx < n_mapped
            out[mapped] = features.index_select(0, idx[mapped]).to(torch.float32)
        else:
            out = features.index_select(0, idx).to(torch.float32)
        if written is not None:
            mask, rows = written(rows_local)
            if bool(mask.any()):
                out[mask.to(device)] = rows.to(device)
        return out

    @property
    def dim(self) -> int:
        return int(self.features.size(1))

    def own_rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 rows of global ``ids`` this partition owns; ValueError naming the first it
        does not own."""
        t = torch.from_numpy(np.ascontiguousarray(ids, np.int64))
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.owner.numel()):
            raise ValueError(f"node ids must be in [0, {self.owner.numel()})")
        mine = self.owner[t] == self.part
        if not bool(mine.all()):
            bad = int(t[~mine][0])
            raise ValueError(f"node {bad} is owned by partition {int(self.owner[bad])}, not "
                             f"{self.part}")
        return self._own(self.local[t]).cpu().numpy()

    async def gather(self, n_id: Tensor, riding: RidingRows | None = None) -> Tensor:
        """float32 [len(n_id), F] on :attr:`device`: the rows of global ids ``n_id``, in order.
        Rows that rode with the hop answers (``riding``) are taken first; the remote calls for
        the rest go next, and own and hot rows are gathered while they travel."""
        n_id = n_id.to(torch.int64)
        owners = self.owner[n_id].to(torch.int64)
        slot = self.hot_slot[n_id]
        mine = owners == self.part
        hot = (slot >= 0) & ~mine
        dev = self.device
        out = torch.empty((n_id.numel(), self.dim), dtype=torch.float32, device=dev)
        arrived = ~(mine | hot)
        if riding is not None:
            arrived &= self._take_riding(n_id, await riding.settle(), out)
        else:
            arrived[:] = False
        calls = []
        for q in range(self.num_parts):
            pos = ((owners == q) & ~hot & ~arrived).nonzero().flatten() \
                if q != self.part else None
            if pos is not None and pos.numel():
                calls.append((pos, asyncio.ensure_future(self.remote(q, n_id[pos].numpy()))))
        mine_pos, hot_pos = mine.nonzero().flatten(), hot.nonzero().flatten()
        if mine_pos.numel():
            out.index_copy_(0, mine_pos.to(dev), self._own(self.local[n_id[mine_pos]]))
        if hot_pos.numel():
            got = self.hot_rows.index_select(0, slot[hot_pos].to(self.hot_rows.device, torch.int64))
            out.index_copy_(0, hot_pos.to(dev), got.to(dev, torch.float32))
        try:
            rows = await asyncio.gather(*(fut for _, fut in calls))
        except BaseException:
            for _, fut in calls:
                fut.cancel()
            raise
        remote = 0
        for (pos, _), got in zip(calls, rows, strict=True):
            out.index_copy_(0, pos.to(dev), as_tensor(np.asarray(got, np.float32)).to(dev))
            remote += int(pos.numel())
        self.counts.local += int(mine_pos.numel())
        self.counts.hot += int(hot_pos.numel())
        self.counts.remote += remote + int(arrived.sum())
        self.counts.riding += int(arrived.sum())
        self.counts.late_calls += len(calls)
        return out

    def _take_riding(self, n_id: Tensor, got: tuple[np.ndarray, np.ndarray],
                     out: Tensor) -> Tensor:
        """Write the rows of ``n_id`` that rode with the hop answers (``got``: sorted ids,
        rows) into ``out``; which positions they filled."""
        ids, rows = got
        if not ids.size:
            return torch.zeros(n_id.numel(), dtype=torch.bool)
        at = np.minimum(np.searchsorted(ids, n_id.numpy()), ids.size - 1)
        found = ids[at] == n_id.numpy()
        pos = torch.from_numpy(np.flatnonzero(found))
        if pos.numel():
            out.index_copy_(0, pos.to(out.device),
                            torch.from_numpy(rows[at[found]]).to(out.device))
        return torch.from_numpy(found)


class RidingRows:
    """Feature rows of one batch that reach this server before its gather (decision 0070):
    sent by the peers with their hop answers (the rows of the ids they were asked to draw
    from, and at the last hop of the neighbours they drew that they own), or asked for as soon
    as a last hop's draws name rows no answer brings. ``PartitionFeatures.gather`` takes what
    arrived and calls only for the rest, so the rows round mostly overlaps the last hop."""

    def __init__(self, features: PartitionFeatures) -> None:
        self.features = features
        self._ids: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []
        self._calls: list[tuple[np.ndarray, asyncio.Future[Any]]] = []

    @property
    def part(self) -> int:
        return self.features.part

    def arrived(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows of global ``ids`` a peer sent with its hop answer."""
        if np.size(ids):
            self._ids.append(np.asarray(ids, np.int64))
            self._rows.append(np.asarray(rows, np.float32))

    def drawn(self, nbr: Tensor, answered_by: int | None) -> None:
        """A last hop's neighbours (drawn here, or by partition ``answered_by``, which sent the
        rows it owns): ask each other owner for the rows of its ids that are not replicated
        here, at once."""
        f = self.features
        nbr = nbr[nbr < f.owner.numel()].to(torch.int64)  # a request's new nodes have no owner
        owners = f.owner[nbr].to(torch.int64)
        need = (owners != f.part) & (f.hot_slot[nbr] < 0)
        if answered_by is not None:
            need &= owners != answered_by
        for q in torch.unique(owners[need]).tolist():
            ids = torch.unique(nbr[need & (owners == q)]).numpy()
            self._calls.append((ids, asyncio.ensure_future(f.remote(int(q), ids))))

    def close(self) -> None:
        """Cancel the calls still under way (the batch failed before its gather)."""
        for _, fut in self._calls:
            fut.cancel()

    async def settle(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row that arrived or was asked for: (sorted unique global ids, their rows)."""
        try:
            got = await asyncio.gather(*(fut for _, fut in self._calls))
        except BaseException:
            for _, fut in self._calls:
                fut.cancel()
            raise
        ids = self._ids + [i for i, _ in self._calls]
        rows = self._rows + [np.asarray(r, np.float32) for r in got]
        if not ids:
            return np.empty(0, np.int64), np.empty((0, self.features.dim), np.float32)
        all_ids, first = np.unique(np.concatenate(ids), return_index=True)
        return all_ids, np.concatenate(rows)[first]
