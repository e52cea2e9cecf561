"""FeatureStore: one engine core's view of the placed feature rows, and the gather
(docs/architecture.md, "Feature store").

``gather(n_id)`` returns the rows of ``n_id`` on the compute device, in the stored precision:
hits from GPU memory (this GPU's shard, or a peer's under ``partition``), misses from pinned host
memory. On a GPU it is one kernel (``gather.py``) that reads host rows zero-copy and counts hits
and misses on the device, with no host synchronisation, so it can run inside a CUDA graph; the
pure-torch twin (:meth:`gather_torch`) is the reference in tests and the path on a CPU-only box,
where "GPU shards" may be simulated by CPU tensors.

Re-placement (:meth:`build` then :meth:`commit`) builds the new layout beside the old one (a
background thread may do it while the engine serves) and switches with one small copy of the
kernel's table on the serving stream; the old layout is freed once that copy has run.

Rows are writable in place (:meth:`write_rows`, docs/architecture.md, "The living graph": feature
rows overwritten, nodes appended): the matrix may hold capacity rows beyond the nodes that exist yet
(zero until their node is added); a write reaches every tier that holds the row, in the same
storage, so CUDA graphs captured over the gather read the new values. A layout being built while
rows are written gets those writes replayed at :meth:`commit` (each build keeps a journal of them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from quiver_serve.features.placement import Placement, unpack

log = logging.getLogger(__name__)

#: rows copied per step while placing (bounds the host-side temporary)
ROWS_PER_CHUNK = 1 << 18
#: most tiers in the kernel's table: GPU shards + host shards
MAX_TIERS = 60
_TABLE_HEADER = 4


@dataclass
class Layout:
    """One placement made real: its tiers (GPU shards, then host tiers) and location map."""

    placement: Placement
    tiers: list[Tensor]
    num_gpu_tiers: int
    loc: Tensor | None  # int64 per node on the compute device; None: every row in plain_tier
    plain_tier: int
    table_host: Tensor | None = None  # the kernel's table (pinned), when the kernel is used
    keep: list[Any] = field(default_factory=list)  # pinned host regions
    #: (ids, rows) written since this layout's build began, replayed into it at commit
    journal: list[tuple[Tensor, Tensor]] | None = None

    def gpu_bytes(self) -> dict[str, int]:
        """Bytes on each GPU: its shard, plus the map on the compute device."""
        out: dict[str, int] = {}
        for t in self.tiers[:self.num_gpu_tiers]:
            out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
        if self.loc is not None and self.loc.device.type == "cuda":
            key = str(self.loc.device)
            out[key] = out.get(key, 0) + self.loc.numel() * self.loc.element_size()
        return out


class FeatureStore:
    """Placed feature rows for one compute device; see the module docstring."""

    def __init__(self, x: Tensor, device: torch.device, *, dtype: torch.dtype | None = None,
                 shard_devices: list[torch.device] | None = None,
                 use_kernel: bool | None = None, numa_cpus: list[list[int]] | None = None,
                 progress: bool = True) -> None:
        if x.dim() != 2:
            raise ValueError(f"features must be [num_nodes, dim], got {tuple(x.shape)}")
        self.device = device
        self.host = (x if dtype is None or dtype == x.dtype else x.to(dtype)).contiguous()
        self.dtype = self.host.dtype
        self.num_nodes, self.dim = int(x.size(0)), int(x.size(1))
        self.row_bytes = self.dim * self.host.element_size()
        self.shard_devices = shard_devices if shard_devices is not None else (
            [device] if device.type == "cuda" else [])
        self.numa_cpus = numa_cpus or []
        self.progress = progress
        if use_kernel is None:
            use_kernel = device.type == "cuda" and _cupy_ok()
        self.kernel = None
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # hits, misses
        self._host_regions: list[Any] = []
        self.pin_s = 0.0  # seconds to page-lock the host matrix (the kernel reads it in place)
        if use_kernel:
            from quiver_serve.features.gather import enable_peer_access, kernel_for, word_bytes

            self.kernel = kernel_for(device.index)
            enable_peer_access(device, [d for d in self.shard_devices if d.type == "cuda"])
            t0 = time.perf_counter()
            self._host_regions = [_pin(self.host, device)]
            self.pin_s = time.perf_counter() - t0
            self.word = word_bytes(self.row_bytes, [self._host_regions[0].device_ptr])
            self._table = torch.zeros(_TABLE_HEADER + MAX_TIERS, dtype=torch.int64, device=device)
        self.layout: Layout | None = None
        self._zero_hit = False
        self._retired: list[tuple[Any, Layout]] = []
        # journals of the layouts built but not yet committed; the lock orders a build's start
        # (it registers its journal, then reads self.host) against write_rows
        self._journals: list[list[tuple[Tensor, Tensor]]] = []
        self._journal_lock = threading.Lock()

    @property
    def capturable(self) -> bool:
        """The gather may run inside a CUDA graph (the kernel path has no host sync)."""
        return self.kernel is not None

    @property
    def placement(self) -> Placement | None:
        return self.layout.placement if self.layout is not None else None

    # ---- placing ---------------------------------------------------------------------------------
    def place(self, placement: Placement) -> None:
        """Build and switch to ``placement`` (start-up, or re-placement from the engine thread)."""
        self.commit(self.build(placement))

    def build(self, placement: Placement) -> Layout:
        """Materialise ``placement`` beside the current layout (any thread; GPU copies on a side
        stream, finished before this returns). Rows written from now until the layout is
        committed are journalled and replayed into it by :meth:`commit`."""
        if placement.num_nodes != self.num_nodes or placement.row_bytes != self.row_bytes:
            raise ValueError("placement made for another feature matrix")
        if len(placement.gpu_nodes) > len(self.shard_devices):
            raise ValueError(f"placement has {len(placement.gpu_nodes)} GPU shards, store has "
                             f"{len(self.shard_devices)} shard devices")
        journal: list[tuple[Tensor, Tensor]] = []
        with self._journal_lock:  # before any host row is read: no write can be missed
            self._journals.append(journal)
        try:
            layout = self._materialise(placement)
        except BaseException:
            self._take_journal(journal)
            raise
        layout.journal = journal
        return layout

    def _materialise(self, placement: Placement) -> Layout:
        gpu_nodes = placement.gpu_nodes
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        total = placement.num_gpu_rows + sum(int(t.numel()) for t in placement.host_nodes)
        bar = _progress(total, not self.progress or total < ROWS_PER_CHUNK)
        with bar, torch.cuda.stream(side) if side is not None else _nullcontext():
            tiers = [self._copy_rows(nodes, dev, bar) for nodes, dev
                     in zip(gpu_nodes, self.shard_devices, strict=False)]
            keep: list[Any] = []
            if placement.host_in_place:
                tiers.append(self.host)
            for s, nodes in enumerate(placement.host_nodes):
                tiers.append(self._host_shard(nodes, s, bar, keep))
            loc = placement.locations().to(self.device) if placement.needs_map else None
        if side is not None:
            side.synchronize()
        plain = 0 if placement.all_on_gpu else len(gpu_nodes)
        layout = Layout(placement, tiers, len(gpu_nodes), loc, plain, keep=keep)
        if self.kernel is not None:
            layout.table_host = self._table_for(layout)
        return layout

    def _copy_rows(self, nodes: Tensor, dev: torch.device, bar: Any) -> Tensor:
        """Rows ``nodes`` of the host matrix into a new shard on ``dev``. On a GPU, chunk by
        chunk through two pinned buffers: a chunk's rows are gathered in ascending row order
        (the matrix's pages read forwards) on torch's intra-op threads while the chunk before
        it crosses to the device, where its rows are put in placement order."""
        n = int(nodes.numel())
        shard = torch.empty((n, self.dim), dtype=self.dtype, device=dev)
        if dev.type != "cuda" or n == 0:
            for lo in range(0, n, ROWS_PER_CHUNK):
                part = nodes[lo:lo + ROWS_PER_CHUNK]
                shard[lo:lo + part.numel()].copy_(self.host.index_select(0, part))
                bar.update(int(part.numel()))
            return shard
        width = min(n, ROWS_PER_CHUNK)
        staging = [torch.empty((width, self.dim), dtype=self.host.dtype, pin_memory=True)
                   for _ in range(2)]
        freed: list[torch.cuda.Event | None] = [None, None]
        for i, lo in enumerate(range(0, n, ROWS_PER_CHUNK)):
            part = nodes[lo:lo + ROWS_PER_CHUNK]
            order = torch.argsort(part)
            buf = staging[i % 2][:part.numel()]
            if freed[i % 2] is not None:
                freed[i % 2].synchronize()  # its last chunk has left for the device
            torch.index_select(self.host, 0, part[order], out=buf)
            rows = buf.to(dev, non_blocking=True)
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record()
            shard.index_copy_(0, (order + lo).to(dev, non_blocking=True), rows.to(self.dtype))
            bar.update(int(part.numel()))
        torch.cuda.current_stream(dev).synchronize()
        return shard

    def _host_shard(self, nodes: Tensor, s: int, bar: Any, keep: list[Any]) -> Tensor:
        """Rows of host shard ``s``, first touched by threads of NUMA node ``s`` (so the pages
        live there), then pinned in place when the GPU reads them."""
        from quiver_serve.features.host import on_cpus

        with on_cpus(self.numa_cpus[s] if s < len(self.numa_cpus) else None):
            shard = torch.empty((int(nodes.numel()), self.dim), dtype=self.dtype)
            shard.numpy().view("u1").fill(0)  # first touch by this thread (torch's pool is not pinned)
            for lo in range(0, int(nodes.numel()), ROWS_PER_CHUNK):
                part = nodes[lo:lo + ROWS_PER_CHUNK]
                torch.index_select(self.host, 0, part, out=shard[lo:lo + part.numel()])
                bar.update(int(part.numel()))
        if self.kernel is not None:
            keep.append(_pin(shard, self.device))
        return shard

    def _table_for(self, layout: Layout) -> Tensor:
        if len(layout.tiers) > MAX_TIERS:
            raise ValueError(f"{len(layout.tiers)} tiers: at most {MAX_TIERS}")
        table = torch.zeros(_TABLE_HEADER + MAX_TIERS, dtype=torch.int64, pin_memory=True)
        table[0] = layout.loc.data_ptr() if layout.loc is not None else 0
        table[1], table[2], table[3] = layout.num_gpu_tiers, layout.plain_tier, len(layout.tiers)
        regions = {r.tensor.data_ptr(): r.device_ptr for r in self._host_regions + layout.keep}
        for i, t in enumerate(layout.tiers):
            ptr = t.data_ptr()
            table[_TABLE_HEADER + i] = regions.get(ptr, ptr) if t.device.type == "cpu" else ptr
        return table

    def commit(self, layout: Layout) -> None:
        """Serve from ``layout`` from now on (call on the thread and stream that gather, with no
        :meth:`write_rows` running)."""
        old = self.layout
        if layout.journal is not None:  # rows written while it was built: into it before serving
            self._replay(layout, self._take_journal(layout.journal))
            layout.journal = None
        if self.kernel is not None:
            assert layout.table_host is not None
            self._table.copy_(layout.table_host, non_blocking=True)
        self.layout = layout
        p = layout.placement
        self._zero_hit = p.all_on_gpu or any(bool((g == 0).any()) for g in p.gpu_nodes)
        self._collect()
        if old is not None:
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                self._retired.append((event, old))
            # on a CPU the old tensors are freed when the last gather using them returns

    def discard(self, layout: Layout) -> None:
        """Drop a layout built but never committed (stops journalling writes for it)."""
        if layout.journal is not None:
            self._take_journal(layout.journal)
            layout.journal = None
        for region in layout.keep:
            region.release()
        layout.keep = []

    def _collect(self) -> None:
        self._retired = [(e, lay) for e, lay in self._retired if not e.query()]

    # ---- writing ---------------------------------------------------------------------------------
    def write_rows(self, node_ids: Tensor, rows: Tensor) -> None:
        """Overwrite the rows of ``node_ids`` (int64 [n], each < ``num_nodes``, capacity rows
        included) with ``rows`` ([n, dim], any float dtype, any device; stored in the store's
        dtype). A repeated id takes its last row.

        Contract: the caller has drained this store first: no gather of it is queued or running
        on any stream or thread while this runs (the engine writes between batches), and no
        :meth:`commit` runs concurrently (a :meth:`build` in another thread may). The rows go
        into every tier that holds them (the host matrix, NUMA host shards, this store's GPU
        shards, a peer GPU's shard under ``partition``), in place: no tier is reallocated, so
        CUDA graphs captured over :meth:`gather` read the new rows. It returns once the GPU
        copies have completed, so a gather issued afterwards on any stream reads the new rows.
        A layout built but not yet committed gets the writes at :meth:`commit`.

        The host matrix is the ``x`` this store was built over when no conversion was needed
        (same dtype, contiguous): a write lands in that tensor too. Where ``x`` is shared with
        other processes that must not see the write yet, build the store over a private copy.
        """
        ids, rows = self._checked_rows(node_ids, rows)
        if ids.numel() == 0:
            return
        with self._journal_lock:
            self.host.index_copy_(0, ids, rows)
            if self._journals:
                entry = (ids, rows.clone())  # the caller may reuse its tensor
                for journal in self._journals:
                    journal.append(entry)
        if self.layout is not None:
            self._replay(self.layout, [(ids, rows)])

    def _checked_rows(self, node_ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """CPU int64 ids without repeats (last row wins) and their rows in the stored dtype."""
        ids = node_ids.reshape(-1).to("cpu", torch.int64)
        if rows.dim() != 2 or rows.size(0) != ids.numel() or rows.size(1) != self.dim:
            raise ValueError(f"rows must be [{ids.numel()}, {self.dim}], got {tuple(rows.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_nodes):
            raise IndexError(f"node ids must lie in [0, {self.num_nodes}) (the store's capacity)")
        rows = rows.to("cpu", self.dtype).contiguous()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        if uniq.numel() < ids.numel():  # index_copy_ leaves a repeated id's row unspecified
            last = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce_(
                0, inverse, torch.arange(ids.numel()), "amax")
            ids, rows = uniq, rows.index_select(0, last)
        return ids, rows

    def _replay(self, layout: Layout, writes: list[tuple[Tensor, Tensor]]) -> None:
        """Apply ``writes`` (in order) to ``layout``'s tiers other than the host matrix (already
        written), then wait for the GPU copies."""
        devices: set[torch.device] = set()
        for ids, rows in writes:
            if layout.loc is None:  # every row in the plain tier, at its id
                devices |= self._write_tier(layout.tiers[layout.plain_tier], ids, rows)
                continue
            tier, row = unpack(layout.loc.index_select(0, ids.to(layout.loc.device)).cpu())
            for t, dst in enumerate(layout.tiers):
                pos = (tier == t).nonzero().view(-1)
                if pos.numel():
                    devices |= self._write_tier(dst, row.index_select(0, pos),
                                                rows.index_select(0, pos))
        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()

    def _write_tier(self, dst: Tensor, at: Tensor, rows: Tensor) -> set[torch.device]:
        if dst is self.host:
            return set()
        dst.index_copy_(0, at.to(dst.device), rows.to(dst.device))
        return {dst.device} if dst.device.type == "cuda" else set()

    def _take_journal(self, journal: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Stop journalling into ``journal`` and return what it holds."""
        with self._journal_lock:
            self._journals = [j for j in self._journals if j is not journal]
            return list(journal)

    # ---- gathering -------------------------------------------------------------------------------
    def gather(self, n_id: Tensor) -> Tensor:
        """Rows of ``n_id`` (int64, any device) on the compute device, stored precision."""
        if self.kernel is None:
            return self.gather_torch(n_id)
        n_id = n_id.to(self.device, torch.int64, non_blocking=True).reshape(-1)
        out = torch.empty((n_id.numel(), self.dim), dtype=self.dtype, device=self.device)
        self.kernel.launch(n_id, self._table, out, self.counts, self.word)
        return out

    def gather_torch(self, n_id: Tensor) -> Tensor:
        """The pure-torch twin of the kernel: same rows, same counts."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("feature store used before a placement was made")
        ids = n_id.reshape(-1).to(torch.int64)
        if layout.loc is None:
            src = layout.tiers[layout.plain_tier]
            rows = src.index_select(0, ids.to(src.device)).to(self.device, non_blocking=True)
            hit = int(layout.plain_tier < layout.num_gpu_tiers) * ids.numel()
            self._count(hit, ids.numel() - hit)
            return rows
        tier, row = unpack(layout.loc.index_select(0, ids.to(layout.loc.device)))
        out = torch.empty((ids.numel(), self.dim), dtype=self.dtype, device=self.device)
        for t, src in enumerate(layout.tiers):
            pos = (tier == t).nonzero().view(-1)
            if pos.numel():
                got = src.index_select(0, row.index_select(0, pos).to(src.device))
                out.index_copy_(0, pos.to(self.device), got.to(self.device))
        hits = (tier < layout.num_gpu_tiers).sum()
        self.counts[0] += hits.to(self.device)
        self.counts[1] += (ids.numel() - hits).to(self.device)
        return out

    def is_hit(self, node: int) -> bool:
        """Whether ``node``'s row is in GPU memory (node 0 only: what padding slots read)."""
        if node != 0:
            raise ValueError("only node 0's placement is kept on the host")
        return self._zero_hit

    def _count(self, hits: int, misses: int) -> None:
        self.counts[0] += hits
        self.counts[1] += misses

    def read_counts(self) -> tuple[int, int]:
        """(hits, misses) so far (a host sync on a GPU: off the hot path)."""
        hits, misses = self.counts.tolist()
        return int(hits), int(misses)

    def reset_counts(self) -> None:
        self.counts.zero_()  # in place: captured graphs keep the address

    def close(self) -> None:
        """Unpin the host memory this store pinned (the store must not gather afterwards)."""
        layouts = [self.layout] + [lay for _, lay in self._retired]
        for region in self._host_regions + [r for lay in layouts if lay for r in lay.keep]:
            region.release()
        self._host_regions = []
        self.layout, self._retired = None, []
        with self._journal_lock:
            self._journals = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CuPy may already be gone
            pass

    def gpu_bytes(self) -> dict[str, int]:
        return self.layout.gpu_bytes() if self.layout is not None else {}

    def describe(self) -> dict[str, Any]:
        """What an engine reports when ready: rows and bytes on the GPU, how rows are ranked."""
        p = self.placement
        return {"feature_rows_on_gpu": p.num_gpu_rows if p is not None else 0,
                "feature_gpu_bytes": sum(self.gpu_bytes().values()),
                "feature_placement": p.scores_name if p is not None else None,
                "feature_dtype": str(self.dtype).removeprefix("torch."),
                "feature_gather": "kernel" if self.kernel is not None else "torch"}


def _progress(total: int, disable: bool) -> Any:
    """A tqdm bar over rows placed (a silent stand-in where tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        disable = True
    if disable:
        return _NoBar()
    return tqdm(total=total, unit="row", unit_scale=True, desc="placing feature rows")


class _NoBar:
    def update(self, n: int) -> None:
        return None

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _cupy_ok() -> bool:
    from quiver_serve.sampling.gpu import gpu_sampler_available

    return gpu_sampler_available()


def _pin(t: Tensor, device: torch.device) -> Any:
    """``t``'s memory page-locked in place and mapped for ``device`` (the UVA sampler's way)."""
    from quiver_serve.ops.cuda import PinnedRegion

    return PinnedRegion(t.contiguous(), device)
