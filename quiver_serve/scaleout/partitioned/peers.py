"""Calls between partition servers, to the named actors of each partition's replicas: over the
project's wire or as Ray actor calls (``links.py``; ``partitioned.transport``, decision 0045),
each with a timeout, a transport delay tests can inject, and counts of calls, bytes and latency
per hop and partition.

A partition server finds its peers by name (``server_name``), not by handles given at start: Ray
restarts a killed server under the same name, and a restarted server reaches its peers the same
way. A call that times out or finds the actor gone tries the partition's next replica once, then
raises :class:`PartitionUnavailable` (the request is answered 503 with Retry-After, never with a
partial subgraph).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quiver_serve.scaleout.partitioned.links import LinkError, RayLink, WireLink

#: the latency histogram's upper bounds (seconds) of remote calls
CALL_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0)
#: the hop label of feature calls (sampling calls carry their hop number)
FEATURES = "features"
#: the hop label of the exact table's calls for the layer rows of peers
TABLE = "table"


def server_name(app: str, part: int, replica: int) -> str:
    """The Ray actor name of partition ``part``'s replica ``replica``."""
    return f"{app}-part{part}-r{replica}"


class Replicas:
    """Which replicas of a partition to try, in order: round robin over those that did not fail
    within ``down_s``, then the ones that did (a replica Ray is restarting fails each call only
    after about a second, so a failed one is tried last until the window ends)."""

    def __init__(self, count: int, down_s: float) -> None:
        self.count, self.down_s = count, down_s
        self._next = itertools.count()
        self._down_until: dict[tuple[int, int], float] = {}

    def order(self, part: int) -> list[int]:
        first = next(self._next) % self.count
        rotated = [(first + i) % self.count for i in range(self.count)]
        now = time.monotonic()
        return sorted(rotated, key=lambda r: self._down_until.get((part, r), 0.0) > now)

    def failed(self, part: int, replica: int) -> None:
        self._down_until[(part, replica)] = time.monotonic() + self.down_s


class PartitionUnavailable(Exception):
    """A partition this request needs did not answer (gone, restarting, or past the timeout)."""

    def __init__(self, part: int, reason: str) -> None:
        super().__init__(f"partition {part} is unavailable ({reason}); retry later")
        self.part = part


@dataclass
class CallStats:
    """Remote calls of one (peer partition, hop) pair: counts, bytes each way, latency."""

    calls: int = 0
    failures: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    latency_sum_s: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(CALL_BUCKETS_S) + 1))

    def observe(self, sent_bytes: int, received_bytes: int, latency_s: float) -> None:
        self.calls += 1
        self.sent_bytes += sent_bytes
        self.received_bytes += received_bytes
        self.latency_sum_s += latency_s
        i = next((i for i, b in enumerate(CALL_BUCKETS_S) if latency_s <= b), len(CALL_BUCKETS_S))
        self.latency_buckets[i] += 1


@dataclass(frozen=True, kw_only=True)
class PeerSettings:
    """How a partition server reaches its peers."""

    app: str
    num_parts: int
    replicas: int
    timeout_s: float
    delay_s: float = 0.0  # injected before each call: a slower network in tests
    transport: str = "wire"  # "wire" (ZeroMQ) or "ray" (actor calls)
    down_s: float = 1.0  # after every replica of a partition failed: refuse calls for this long


class Peers:
    """Calls from partition ``part`` to the others (see the module docstring)."""

    def __init__(self, part: int, settings: PeerSettings) -> None:
        self.part, self.settings = part, settings
        self.stats: dict[tuple[int, str], CallStats] = {}
        self._handles: dict[tuple[int, int], Any] = {}
        self.replicas = Replicas(settings.replicas, settings.down_s)
        self._down_until: dict[int, float] = {}
        self.link: RayLink | WireLink = WireLink(self._address) if settings.transport == "wire" \
            else RayLink(self._handle)

    def handle(self, part: int, replica: int) -> Any:
        """The Ray actor handle of partition ``part``'s replica ``replica`` (cached)."""
        return self._handle(part, replica)

    def forget_handle(self, part: int, replica: int) -> None:
        self._handles.pop((part, replica), None)

    def _handle(self, part: int, replica: int) -> Any:
        key = (part, replica)
        handle = self._handles.get(key)
        if handle is None:
            import ray

            handle = ray.get_actor(server_name(self.settings.app, part, replica))
            self._handles[key] = handle
        return handle

    async def _address(self, part: int, replica: int) -> str:
        """The wire address of a peer, asked of its actor (the peer binds it on first ask)."""
        address: str = await asyncio.wait_for(self._handle(part, replica).wire_address.remote(),
                                              self.settings.timeout_s)
        return address

    async def sample_hop(self, part: int, ids: np.ndarray, k: int, hop: int, base: int,
                         *rows_for: Any) -> tuple[np.ndarray, ...]:
        """Partition ``part``'s draws of hop ``hop`` for the global ``ids`` it owns: (neighbours,
        counts); given ``rows_for`` (this partition, last hop) also the rows riding with them
        (``PartitionServer.sample_hop``)."""
        out: tuple[np.ndarray, ...] = await self._call(part, str(hop), "sample_hop", ids, k, hop,
                                                       base, *rows_for)
        return out

    async def rows(self, part: int, ids: np.ndarray) -> np.ndarray:
        """Partition ``part``'s feature rows of the global ``ids`` it owns."""
        rows: np.ndarray = await self._call(part, FEATURES, "rows", ids)
        return rows

    async def table_rows(self, part: int, layer: int,
                         ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Partition ``part``'s exact-table rows of layer ``layer`` for the global ``ids`` it
        owns, and their stale flags (``table.py``)."""
        rows, stale = await self._call(part, TABLE, "table_rows", ids, layer)
        return rows, stale

    async def _call(self, part: int, hop: str, method: str, ids: np.ndarray, *args: Any) -> Any:
        from ray.exceptions import RayError

        stats = self.stats.setdefault((part, hop), CallStats())
        if time.monotonic() < self._down_until.get(part, 0.0):
            stats.failures += 1
            raise PartitionUnavailable(part, "it failed a call moments ago")
        reason = "no replica"
        for replica in self.replicas.order(part)[:2]:
            t0 = time.perf_counter()
            try:
                if self.settings.delay_s > 0:
                    await asyncio.sleep(self.settings.delay_s)
                out = await asyncio.wait_for(self.link.call(part, replica, method, ids, *args),
                                             self.settings.timeout_s)
            except (RayError, ValueError, LinkError, asyncio.TimeoutError) as exc:
                # ValueError: ray.get_actor finds no actor of that name (not yet restarted)
                stats.failures += 1
                self._handles.pop((part, replica), None)
                self.link.forget(part, replica)
                self.replicas.failed(part, replica)
                reason = type(exc).__name__
                continue
            if isinstance(out, dict):  # the peer refused: a fault of ours or of the data
                raise PartitionUnavailable(part, f"{out.get('code')}: {out.get('message')}")
            received = sum(a.nbytes for a in out) if isinstance(out, tuple) else out.nbytes
            stats.observe(ids.nbytes, int(received), time.perf_counter() - t0)
            return out
        self._down_until[part] = time.monotonic() + self.settings.down_s
        raise PartitionUnavailable(part, reason)

    def snapshot(self) -> list[dict[str, Any]]:
        """The call stats as plain data (the ingress turns them into Prometheus samples)."""
        return [{"peer": part, "hop": hop, "calls": s.calls, "failures": s.failures,
                 "sent_bytes": s.sent_bytes, "received_bytes": s.received_bytes,
                 "latency_sum_s": s.latency_sum_s, "latency_buckets": list(s.latency_buckets)}
                for (part, hop), s in sorted(self.stats.items())]
