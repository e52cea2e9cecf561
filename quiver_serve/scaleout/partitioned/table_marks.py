"""A partition's primary marks what its update can change in every server's exact table before
it answers the update (docs/architecture.md, "The exact table across partitions"; decision
0065).

Layer ``i`` of a node reads layer ``i - 1`` of itself and of its in-neighbours, and those may be
owned by any partition; the out-edges of a node are held by the partitions that own their
targets. So marking goes layer by layer across partitions: round 0 gives every server the
written feature rows and the nodes whose in-lists changed; each marks its own rows among them
and their own out-neighbours, and answers the ids it marked; the union is the next round's
input. Every replica of every partition is called (each holds a table), all at once per round.

The primary marks, not the ingress: an update it applied is marked even if the ingress that
sent it dies. A primary that starts again marks what its log holds past its base (an update
applied before a crash may not have been marked), and it folds a version into a base only once
the marks of every update up to it are done (``LivingPartition._compact``).

A server that cannot be marked because it died needs nothing: Ray restarts it, and a started
server's table is stale everywhere until its refresh recomputes it. One that is alive but does
not answer in time (or that Ray cannot reach for now) could serve a row the update made stale,
so it is restarted (``ray.kill`` with restarts allowed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: (layer, changed global ids or None: every node, global ids whose in-lists changed) ->
#: {"layers", "ids", "all"} (``PartitionServer.table_mark``)
MarkCall = Callable[[int, np.ndarray | None, np.ndarray], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class MarkTarget:
    """One server to mark: its call, and how to restart it (None: this server itself)."""

    name: str
    mark: MarkCall
    restart: Callable[[BaseException], int] | None = None


async def mark_tables(targets: list[MarkTarget], changed: np.ndarray, lists: np.ndarray,
                      timeout_s: float) -> dict[str, int]:
    """Mark every target's table for an update that wrote the feature rows of ``changed`` and
    changed the in-lists of ``lists`` (global ids); what was done: layers, rows marked (summed
    over servers), servers restarted."""
    done = {"layers": 0, "rows": 0, "restarted": 0}
    every, layer, layers = False, 0, None
    changed = np.unique(np.asarray(changed, np.int64))
    lists = np.unique(np.asarray(lists, np.int64))
    while layers is None or layer < layers:
        if not every and changed.size == 0 and (layer > 0 or lists.size == 0):
            break
        calls = [asyncio.wait_for(t.mark(layer, None if every else changed,
                                         lists if layer == 0 else lists[:0]), timeout_s)
                 for t in targets]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        marked: list[np.ndarray] = []
        every = False
        for target, got in zip(targets, answers, strict=True):
            if isinstance(got, BaseException):
                done["restarted"] += _restart(target, got)
                continue
            layers = max(layers or 0, int(got["layers"]))
            every |= bool(got["all"])
            marked.append(np.asarray(got["ids"], np.int64))
            done["rows"] += int(np.size(got["ids"]))
        if not layers:
            return done
        changed = np.unique(np.concatenate(marked)) if marked else changed[:0]
        layer += 1
        done["layers"] = layer
    return done


def _restart(target: MarkTarget, why: BaseException) -> int:
    log.warning("the exact table of %s could not be marked (%s)", target.name,
                type(why).__name__)
    if target.restart is None:
        raise why
    return target.restart(why)


def ray_targets(peers: Any, me: tuple[int, int], own_mark: MarkCall) -> list[MarkTarget]:
    """Every replica of every partition as a target (``peers``: ``Peers``, whose Ray handles
    find each server by name); this server, ``me`` (partition, replica), is called in place."""
    settings = peers.settings
    targets = []
    for part in range(settings.num_parts):
        for replica in range(settings.replicas):
            name = f"partition {part} replica {replica}"
            if (part, replica) == me:
                targets.append(MarkTarget(name, own_mark))
                continue
            targets.append(MarkTarget(name, _ray_mark(peers, part, replica),
                                      _ray_restart(peers, part, replica)))
    return targets


def _ray_mark(peers: Any, part: int, replica: int) -> MarkCall:
    async def mark(layer: int, changed: np.ndarray | None, lists: np.ndarray) -> dict[str, Any]:
        got: dict[str, Any] = await peers.handle(part, replica).table_mark.remote(
            layer, changed, lists)
        return got

    return mark


def _ray_restart(peers: Any, part: int, replica: int) -> Callable[[BaseException], int]:
    """None for a server that died or is not there (Ray restarts it, or it is starting: its
    table starts stale), else ``ray.kill`` with restarts allowed; 1 when asked."""
    def restart(why: BaseException) -> int:
        import ray
        from ray.exceptions import ActorDiedError

        peers.forget_handle(part, replica)
        if isinstance(why, ActorDiedError | ValueError):  # ValueError: no actor of the name
            return 0
        log.warning("restarting it: a started server's table is stale until recomputed")
        try:
            ray.kill(peers.handle(part, replica), no_restart=False)
        except Exception:  # noqa: BLE001 - gone already: Ray restarts it or it is dead
            log.exception("restarting a server that could not be marked failed")
        return 1

    return restart
