"""The partitioned ingress marks what an update can change in every server's exact table
before it acknowledges the update (docs/architecture.md, "The exact table across partitions";
decision 0065).

Layer ``i`` of a node reads layer ``i - 1`` of itself and of its in-neighbours, and those may be
owned by any partition; out-edges of a node are held by the partitions that own their targets.
So marking goes layer by layer across partitions: round 0 gives every server the written feature
rows and the nodes whose in-lists changed; each marks its own rows among them and their own
out-neighbours, and answers the ids it marked; the union is the next round's input. Every
replica of every partition is called (each holds a table), all at once per round.

A server that cannot be marked because it is dead needs nothing: Ray restarts it, and a started
server's table is stale everywhere until its refresh recomputes it. One that is alive but does
not answer in time (or Ray cannot reach for now) could serve a row the update made stale, so it
is restarted (``ray.kill`` with restarts allowed). The update is acknowledged after that, since
it is durable in its owner's log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


async def mark_tables(servers: list[list[Any]], changed: np.ndarray, lists: np.ndarray,
                      timeout_s: float) -> dict[str, int]:
    """Mark every server's table for an update that wrote the feature rows of ``changed`` and
    changed the in-lists of ``lists`` (global ids); what was done: layers, rows marked
    (summed over replicas), servers restarted."""
    done = {"layers": 0, "rows": 0, "restarted": 0}
    every, layer, layers = False, 0, None
    changed = np.unique(np.asarray(changed, np.int64))
    lists = np.unique(np.asarray(lists, np.int64))
    while layers is None or layer < layers:
        if not every and changed.size == 0 and (layer > 0 or lists.size == 0):
            break
        handles = [s for reps in servers for s in reps]
        calls = [asyncio.wait_for(s.table_mark.remote(layer, None if every else changed,
                                                      lists if layer == 0 else lists[:0]),
                                  timeout_s) for s in handles]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        marked: list[np.ndarray] = []
        every = False
        for handle, got in zip(handles, answers, strict=True):
            if isinstance(got, BaseException) or "code" in got:
                done["restarted"] += _restart(handle, got)
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


def _restart(handle: Any, why: BaseException | dict[str, Any]) -> int:
    """Restart a server that could not be marked, unless it died (Ray restarts it); 1 when
    asked to."""
    import ray
    from ray.exceptions import ActorDiedError

    if isinstance(why, ActorDiedError):
        return 0

    log.warning("an exact table could not be marked (%s): restarting its server",
                why if isinstance(why, dict) else type(why).__name__)
    try:
        ray.kill(handle, no_restart=False)
    except Exception:  # noqa: BLE001 - gone already: Ray restarts it or it is dead
        log.exception("restarting a server that could not be marked failed")
    return 1
