"""Feature rows of a sampled batch on a partition server: its own rows, then the hot rows of other
partitions replicated here (chosen offline by FAP, ``quiver_serve/partition/``), then one batched
call per partition for the rest (docs/architecture.md, "Partitioned serving")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from quiver_serve.scaleout.partitioned.sampling import as_tensor

#: (partition, global ids it owns) -> float32 rows [len(ids), F]
RemoteRows = Callable[[int, np.ndarray], Awaitable[np.ndarray]]


@dataclass
class RowCounts:
    """Rows gathered so far, by where they came from (the replicated-row hit rate's inputs)."""

    local: int = 0
    hot: int = 0
    remote: int = 0

    def hot_hit_rate(self) -> float:
        """Of the rows owned elsewhere, the share a replicated hot row answered (1.0: none)."""
        elsewhere = self.hot + self.remote
        return self.hot / elsewhere if elsewhere else 1.0


class PartitionFeatures:
    """``gather(n_id)`` over one partition's rows (see the module docstring)."""

    def __init__(self, part: int, owner: Tensor, local: Tensor, features: Tensor,
                 hot_ids: Tensor, hot_features: Tensor, num_parts: int,
                 remote: RemoteRows) -> None:
        self.part, self.owner, self.local, self.num_parts = part, owner, local, num_parts
        self.features, self.remote = features, remote
        order = torch.argsort(hot_ids)
        self.hot_sorted, self.hot_rows = hot_ids[order], hot_features[order]
        self.counts = RowCounts()
        #: the rows written since the snapshot (``live.PartitionLive.written``), when live
        self.written: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None

    def drop_hot(self, ids: np.ndarray) -> int:
        """Stop answering the replicated copies of global ``ids`` (their owner answers them
        from now on); returns how many copies were dropped."""
        t = torch.from_numpy(np.ascontiguousarray(ids, np.int64))
        keep = ~torch.isin(self.hot_sorted, t)
        dropped = int((~keep).sum())
        if dropped:
            self.hot_sorted, self.hot_rows = self.hot_sorted[keep], self.hot_rows[keep]
        return dropped

    def _own(self, rows_local: Tensor) -> Tensor:
        """float32 rows of this partition's local rows, written rows included (a node added
        since the snapshot, past the mapped rows, has only a written row)."""
        n_mapped = int(self.features.size(0))
        if rows_local.numel() and int(rows_local.max()) >= n_mapped:
            out = torch.zeros((rows_local.numel(), self.dim), dtype=torch.float32)
            mapped = rows_local < n_mapped
            out[mapped] = self.features[rows_local[mapped]].to(torch.float32)
        else:
            out = self.features[rows_local].to(torch.float32)
        if self.written is not None:
            mask, rows = self.written(rows_local)
            if bool(mask.any()):
                out[mask] = rows
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
        return self._own(self.local[t]).numpy()

    def _hot(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Which of ``ids`` have a replicated row here, and its row index (valid where found)."""
        if self.hot_sorted.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        pos = torch.searchsorted(self.hot_sorted, ids).clamp_(max=self.hot_sorted.numel() - 1)
        return self.hot_sorted[pos] == ids, pos

    async def gather(self, n_id: Tensor) -> Tensor:
        """float32 [len(n_id), F]: the rows of global ids ``n_id``, in order."""
        n_id = n_id.to(torch.int64)
        out = torch.empty((n_id.numel(), self.dim), dtype=torch.float32)
        owners = self.owner[n_id].to(torch.int64)
        mine = owners == self.part
        hot, hot_pos = self._hot(n_id)
        hot &= ~mine
        calls = []
        for q in range(self.num_parts):
            pos = ((owners == q) & ~hot).nonzero().flatten() if q != self.part else None
            if pos is not None and pos.numel():
                calls.append((pos, asyncio.ensure_future(self.remote(q, n_id[pos].numpy()))))
        out[mine] = self._own(self.local[n_id[mine]])
        out[hot] = self.hot_rows[hot_pos[hot]].to(torch.float32)
        try:
            rows = await asyncio.gather(*(fut for _, fut in calls))
        except BaseException:
            for _, fut in calls:
                fut.cancel()
            raise
        remote = 0
        for (pos, _), got in zip(calls, rows, strict=True):
            out[pos] = as_tensor(np.asarray(got, np.float32))
            remote += int(pos.numel())
        self.counts.local += int(mine.sum())
        self.counts.hot += int(hot.sum())
        self.counts.remote += remote
        return out
