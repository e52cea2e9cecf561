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

The calls go over the servers' link (the wire, or Ray calls: ``partitioned.transport``). A call
that fails is tried again as a Ray actor call: a server that died needs nothing (Ray restarts
it, and a started server's table is stale everywhere until its refresh recomputes it); one that
is alive but does not answer that either could serve a row the update made stale, so it is
restarted (``ray.kill`` with restarts allowed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: the shortest wait of the Ray fallback's call: Ray answers a call to an actor it is
#: restarting with ``ActorUnavailableError`` about 2 s after the call (measured, ray 2.60), and
#: only that answer tells a restarting server (left alone) from a live one that does not answer
#: (restarted); a shorter wait would restart a server that is still starting, again and again
FALLBACK_MIN_S = 5.0

#: (layer, changed global ids or None: every node, global ids whose in-lists changed) ->
#: {"layers", "ids", "all"} (``PartitionServer.table_mark``'s answer as a dict)
MarkCall = Callable[[int, np.ndarray | None, np.ndarray], Awaitable[dict[str, Any]]]
#: the same after the first call failed (its exception last): the answer, or None when the
#: server died or was restarted (``restarted`` says which)
Fallback = Callable[[int, np.ndarray | None, np.ndarray, BaseException],
                    Awaitable[dict[str, Any] | None]]


@dataclass(frozen=True)
class MarkTarget:
    """One server to mark: its call, and what to do when the call fails (None: this server
    itself, whose failure fails the update)."""

    name: str
    part: int
    mark: MarkCall
    fallback: Fallback | None = None


def as_answer(ids: np.ndarray, meta: np.ndarray) -> dict[str, Any]:
    """``table_mark``'s arrays (marked ids; [layers, every row marked]) as a dict."""
    return {"ids": np.asarray(ids, np.int64), "layers": int(meta[0]), "all": bool(meta[1])}


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
        args = (layer, None if every else changed, lists if layer == 0 else lists[:0])
        answers = await asyncio.gather(*(_one(t, args, timeout_s, done) for t in targets))
        ok = [a is not None and "restarted" not in a for a in answers]
        got = [a for a, k in zip(answers, ok, strict=True) if k and a is not None]
        layers = max([layers or 0, *(int(a["layers"]) for a in got)])
        if not layers:
            return done
        # a partition none of whose servers answered: what it would have marked is unknown,
        # so the next layers mark every row (its own table starts stale anyway)
        answered = {t.part for t, k in zip(targets, ok, strict=True) if k}
        every = any(a["all"] for a in got) or any(t.part not in answered for t in targets)
        marked = [np.asarray(a["ids"], np.int64) for a in got]
        done["rows"] += sum(int(m.size) for m in marked)
        changed = np.unique(np.concatenate(marked)) if marked else changed[:0]
        layer += 1
        done["layers"] = layer
    return done


async def _one(target: MarkTarget, args: tuple[int, np.ndarray | None, np.ndarray],
               timeout_s: float, done: dict[str, int]) -> dict[str, Any] | None:
    try:
        return await asyncio.wait_for(target.mark(*args), timeout_s)
    except Exception as exc:  # noqa: BLE001 - the fallback decides; this server's own re-raised
        if target.fallback is None:
            raise
        log.warning("the exact table of %s could not be marked (%s): asking through Ray",
                    target.name, type(exc).__name__)
        answer = await target.fallback(*args, exc)
        if answer is not None:
            done["restarted"] += int(answer.get("restarted", 0))
        return answer


def link_targets(peers: Any, me: tuple[int, int], own_mark: MarkCall,
                 timeout_s: float) -> list[MarkTarget]:
    """Every replica of every partition as a target, called over ``peers``' link (``Peers``);
    this server, ``me`` (partition, replica), in place."""
    settings = peers.settings
    targets = []
    for part in range(settings.num_parts):
        for replica in range(settings.replicas):
            name = f"partition {part} replica {replica}"
            if (part, replica) == me:
                targets.append(MarkTarget(name, part, own_mark))
                continue
            targets.append(MarkTarget(name, part, _link_mark(peers, part, replica),
                                      _ray_fallback(peers, part, replica, timeout_s)))
    return targets


def _link_mark(peers: Any, part: int, replica: int) -> MarkCall:
    async def mark(layer: int, changed: np.ndarray | None, lists: np.ndarray) -> dict[str, Any]:
        ids = np.empty(0, np.int64) if changed is None else changed
        out = await peers.link.call(part, replica, "table_mark", ids, layer, changed is None,
                                    np.asarray(lists, np.int64).tolist())
        if isinstance(out, dict):
            raise RuntimeError(f"{out.get('code')}: {out.get('message')}")
        return as_answer(*out)

    return mark


def _ray_fallback(peers: Any, part: int, replica: int, timeout_s: float) -> Fallback:
    """The mark as a Ray actor call; None when the server died, is restarting or is not there
    (Ray reports it so: a started server's table starts stale); ``{"restarted": 1}`` after it
    was restarted because that failed too (``ray.kill`` with restarts allowed). A server Ray
    cannot reach is taken as restarting, not killed: killing one that is restarting would start
    it again, and under a stream of updates it would never come back."""
    async def fallback(layer: int, changed: np.ndarray | None, lists: np.ndarray,
                       first: BaseException) -> dict[str, Any] | None:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        peers.link.forget(part, replica)
        peers.forget_handle(part, replica)
        ids = np.empty(0, np.int64) if changed is None else changed
        try:
            handle = peers.handle(part, replica)
            out = await asyncio.wait_for(handle.table_mark.remote(
                ids, layer, changed is None, np.asarray(lists, np.int64).tolist()),
                max(timeout_s, FALLBACK_MIN_S))
            if not isinstance(out, dict):
                return as_answer(*out)
            why: BaseException = RuntimeError(f"{out.get('code')}: {out.get('message')}")
        except (ActorDiedError, ActorUnavailableError, ValueError):  # ValueError: no actor
            return None
        except Exception as exc:  # noqa: BLE001 - restarted below
            why = exc
        log.warning("restarting partition %d replica %d (%s, then %s): a started server's "
                    "table is stale until recomputed", part, replica, type(first).__name__,
                    type(why).__name__)
        try:
            ray.kill(peers.handle(part, replica), no_restart=False)
        except Exception:  # noqa: BLE001 - gone already: Ray restarts it or it is dead
            log.exception("restarting a server that could not be marked failed")
        return {"restarted": 1}

    return fallback


class MarkGroups:
    """The marks of a primary's updates, grouped as a log groups its commits: updates that
    arrive while a marking is under way are marked together, by one ``mark`` of the union of
    their rows, once it ends; each waits for the marking that covers it. So the calls to the
    other servers grow with the markings, not with the updates."""

    def __init__(self, run: Callable[[np.ndarray, np.ndarray], Awaitable[dict[str, int]]]) -> None:
        self.run = run
        self._next: tuple[list[np.ndarray], list[np.ndarray], asyncio.Future[Any]] | None = None
        self._running: asyncio.Future[None] | None = None
        self.groups = 0  # markings run

    async def mark(self, changed: np.ndarray, lists: np.ndarray) -> dict[str, int]:
        """Mark every table for these rows (with whatever else is waiting); ``run``'s answer."""
        if self._next is None:
            self._next = ([], [], asyncio.get_running_loop().create_future())
        group_changed, group_lists, done = self._next
        group_changed.append(np.asarray(changed, np.int64).reshape(-1))
        group_lists.append(np.asarray(lists, np.int64).reshape(-1))
        if self._running is None:
            self._start()
        answer: dict[str, int] = await asyncio.shield(done)
        return answer

    def _start(self) -> None:
        assert self._next is not None
        changed, lists, done = self._next
        self._next = None
        self.groups += 1
        self._running = asyncio.ensure_future(self._go(np.concatenate(changed),
                                                       np.concatenate(lists), done))

    async def _go(self, changed: np.ndarray, lists: np.ndarray, done: asyncio.Future[Any]) -> None:
        try:
            done.set_result(await self.run(changed, lists))
        except Exception as exc:  # noqa: BLE001 - every update of the group hears it
            done.set_exception(exc)
        finally:
            self._running = None
            if self._next is not None:
                self._start()
