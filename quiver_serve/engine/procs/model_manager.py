"""The model repository's calls, in the main process (docs/architecture.md, "Models and versions"):
which versions of which models every engine core serves, and the state the front-ends publish.

* ``load(name, config)``: the versions the model's policy names (``config`` may change only
  ``version_policy`` and ``traffic``) that are not loaded yet are built in every engine core
  beside the serving versions (``engine/core/model_load.py``). When every core has them, the
  traffic split moves to the new weights in each core at its next batch boundary, then versions
  the policy no longer names are unloaded (drained first). If any core fails to build a version,
  the cores that built it drop it again, the old versions keep serving, and the call answers 400
  ``model_load_failed`` naming the version, the core and the cause.
* ``unload(name)``: every version drains and is released.
* ``index()``: every model and version in the repository with its state (READY, LOADING,
  UNLOADING, UNAVAILABLE) and why.

One call per model at a time (another gets 503); calls of different models run together. The
engine cores are reached on their admin sockets (``wire.ModelCall``); a core that restarts comes
up with the start-up plan and is brought to the current versions and splits when it reports
ready (:meth:`ModelManager.engine_ready`): each model's versions under that model's lock (so a
load in progress ends first and its new version is not missed), again until the plan held still
through a whole pass. Until then the core is not up (:meth:`ModelManager.settled`: calls skip it,
readiness does not count it); a call waiting on a core that dies answers for it at once (the core
is brought to the plan when it is back). Every call that changes something is logged with what it
changed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from quiver_serve import errors
from quiver_serve.config import ServeConfig, resolve_path
from quiver_serve.models.served import weights_label
from quiver_serve.models.spec import ModelSpec
from quiver_serve.models.startup import ModelPlan, StartPlan, save_plan
from quiver_serve.wire import Decoders, ModelCall, ModelReply, RunAddresses, encode

log = logging.getLogger(__name__)

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
#: the serving plan in the run directory, read by engine cores when they (re)start
PLAN_FILE = "models-plan.json"
#: a call that only reads or sets weights waits this long for an engine core
QUICK_CALL_S = 10.0
#: passes of a restarted core's reconcile before it is given up (logged; the core stays not up)
RECONCILE_PASSES = 5
#: a call's wait for replies checks this often whether a core it waits on died
GONE_CHECK_S = 0.1


@dataclass
class VersionState:
    spec: ModelSpec
    state: str
    reason: str = ""
    dim: int = 0


@dataclass
class ModelState:
    versions: dict[int, VersionState] = field(default_factory=dict)
    traffic: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ModelManager:
    """See the module docstring. ``alive(i)``: engine core ``i`` is up and ready (and
:meth:`settled`); ``pid_of(i)``: the pid of its live process, None while it is dead."""

    def __init__(self, cfg: ServeConfig, addrs: RunAddresses, num_engines: int, plan: StartPlan,
                 num_features: int, alive: Callable[[int], bool],
                 pid_of: Callable[[int], int | None] | None = None) -> None:
        self.cfg, self.addrs, self.num_engines = cfg, addrs, num_engines
        self.num_features, self.alive = num_features, alive
        self.pid_of: Callable[[int], int | None] = pid_of or (lambda i: None)
        #: engine core -> the pid of its process that was brought to the plan
        self._settled: dict[int, int | None] = {}
        #: bumped whenever the plan changes: a restarted core's reconcile repeats until it holds
        self.plan_generation = 0
        self.default = plan.default
        self.repo: Any = None
        if cfg.models.repository is not None:
            from quiver_serve.models.repository import ModelRepository

            self.repo = ModelRepository(resolve_path(cfg.models.repository))
        self.models: dict[str, ModelState] = {}
        for model in plan.models:
            state = self.models[model.name] = ModelState(traffic=dict(model.traffic))
            for spec in model.specs:
                state.versions[spec.version] = VersionState(spec, READY)
        #: what a restarted engine core starts with (``models/startup.current_plan``)
        self.plan_path = Path(addrs.run_dir) / PLAN_FILE
        self.save_plan()
        self._ids = itertools.count()
        self._ctx = zmq.Context()

    def note_dims(self, slots: list[dict[str, Any]]) -> None:
        """Output widths from an engine core's slot list (``ModelCalls.describe``)."""
        for s in slots:
            vs = self.models.get(s["name"], ModelState()).versions.get(int(s["version"]))
            if vs is not None and isinstance(s.get("dim"), int):
                vs.dim = s["dim"]

    def refresh_dims(self) -> None:
        """Ask one engine core for every loaded version's width (after start-up)."""
        for i in range(self.num_engines):
            if self.alive(i):
                self.note_dims(self._one(i, "list", QUICK_CALL_S).result.get("slots", []))
                return

    # ---- the calls ------------------------------------------------------------------------------
    def call(self, op: str, params: dict[str, Any]) -> dict[str, Any]:
        """``model_index`` / ``model_load`` / ``model_unload`` (``wire.GRAPH_OPS``)."""
        if op == "model_index":
            return {"models": self.index(bool(params.get("ready", False)))}
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise errors.ServeError("invalid_request", f"{op} needs a model name", 400)
        if op == "model_load":
            config = params.get("config")
            if config is not None and not isinstance(config, dict):
                raise errors.ServeError("invalid_model_config",
                                        "load config must be a JSON object", 400)
            return self.load(name, config)
        if op == "model_unload":
            return self.unload(name)
        raise errors.ServeError("invalid_request", f"unknown model op {op!r}", 400)

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        seen: set[tuple[str, int | None]] = set()
        for name, state in sorted(dict(self.models).items()):  # copies: calls change them
            for v, vs in sorted(dict(state.versions).items()):
                rows.append({"name": name, "version": v, "state": vs.state, "reason": vs.reason})
                seen.add((name, v))
        if self.repo is not None:
            for row in self.repo.index():
                key = (row["name"], row["version"])
                if key not in seen:
                    rows.append({"name": row["name"], "version": row["version"],
                                 "state": UNAVAILABLE, "reason": "unloaded"})
        rows.sort(key=lambda r: (r["name"], r["version"] or 0))
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    def load(self, name: str, config: dict[str, Any] | None) -> dict[str, Any]:
        specs, traffic = self._plan(name, config)
        state = self.models.setdefault(name, ModelState())
        if not state.lock.acquire(blocking=False):
            raise errors.unavailable("model_busy", f"a load or unload of model {name!r} is "
                                     "in progress; retry when it is done")
        try:
            t0 = time.monotonic()
            new = [s for s in specs if s.version not in state.versions
                   or state.versions[s.version].state != READY]
            self._build_all(name, state, new)
            self._activate(name, traffic)
            state.traffic = dict(traffic)
            keep = {s.version for s in specs}
            dropped = [v for v, vs in state.versions.items()
                       if v not in keep and vs.state == READY]
            self._unload_versions(name, state, dropped)
            self.save_plan()
            log.info("admin: model load %s (config %s): loaded versions %s, unloaded %s, "
                     "traffic %s, %.2f s", name, config, [s.version for s in new], dropped,
                     traffic, time.monotonic() - t0)
            return self._describe(name)
        finally:
            state.lock.release()

    def unload(self, name: str) -> dict[str, Any]:
        if self.repo is None:  # nothing could load it again: the daemon would serve no model
            raise self._fixed_model("unload")
        state = self.models.get(name)
        if state is None or not any(v.state == READY for v in state.versions.values()):
            if self.repo is not None and name in self.repo.names():
                return {"name": name, "versions": {}, "traffic": {}}  # nothing loaded: done
            raise errors.ServeError("model_not_found", f"no model named {name!r}", 404)
        if not state.lock.acquire(blocking=False):
            raise errors.unavailable("model_busy", f"a load or unload of model {name!r} is "
                                     "in progress; retry when it is done")
        try:
            versions = [v for v, vs in state.versions.items() if vs.state == READY]
            self._activate(name, {})
            self._unload_versions(name, state, versions)
            state.traffic = {}
            self.save_plan()
            log.info("admin: model unload %s: versions %s drained and released", name, versions)
            return self._describe(name)
        finally:
            state.lock.release()

    def _plan(self, name: str, config: dict[str, Any] | None) -> tuple[list[ModelSpec],
                                                                         dict[int, float]]:
        if self.repo is None:
            raise self._fixed_model("load")
        from quiver_serve.models.repository import RepositoryError

        if name not in self.repo.names():
            raise errors.ServeError("model_not_found",
                                    f"no model named {name!r} in the repository", 404)
        try:
            specs, traffic = self.repo.specs(name, config)
        except (RepositoryError, ValueError) as exc:
            raise errors.ServeError("invalid_model_config", str(exc), 400) from None
        if not specs:
            raise errors.ServeError("invalid_model_config",
                                    f"model {name!r}: its version policy names no version", 400)
        return specs, {int(v): float(w) for v, w in traffic.items()}

    @staticmethod
    def _fixed_model(op: str) -> errors.ServeError:
        """The refusal of a load or unload on a daemon without a repository (Triton without
        explicit model control refuses both too)."""
        return errors.ServeError(
            "model_control_unavailable",
            f"model {op} refused: this daemon has no model repository (models.repository), so "
            "its model (the config's model: section) is fixed at start-up and is neither "
            "loaded nor unloaded at run time", 400)

    def settle(self, i: int, pid: int | None) -> None:
        """Engine core ``i``'s process ``pid`` serves the plan (it started with it)."""
        self._settled[i] = pid

    def settled(self, i: int, pid: int | None) -> bool:
        """Whether engine core ``i``'s process ``pid`` was brought to the plan."""
        return i in self._settled and self._settled[i] == pid

    def save_plan(self) -> None:
        """The versions and splits serving now, for engine cores that restart."""
        self.plan_generation += 1
        models = []
        for name, state in self.models.items():
            specs = [vs.spec for _, vs in sorted(state.versions.items()) if vs.state == READY]
            if specs:
                models.append(ModelPlan(name, specs, dict(state.traffic)))
        if any(m.name == self.default for m in models):
            save_plan(StartPlan(self.default, models), self.plan_path)
        else:  # the default model was unloaded: restarted cores serve what is loaded
            fallback = models[0].name if models else self.default
            if models:
                save_plan(StartPlan(fallback, models), self.plan_path)

    # ---- engine work ---------------------------------------------------------------------------
    def _build_all(self, name: str, state: ModelState, specs: list[ModelSpec]) -> None:
        """Build every spec in every engine core; on any failure undo the built ones and raise."""
        built: list[tuple[int, int]] = []
        for spec in specs:
            state.versions[spec.version] = VersionState(spec, LOADING)
            replies = self._all("load", timeout_s=self.cfg.models.load_timeout_s,
                                spec=spec.to_dict())
            failed = {i: r for i, r in replies.items() if not r.ok}
            for i, r in replies.items():
                if r.ok:
                    built.append((i, spec.version))
                    state.versions[spec.version].dim = _dim_of(r.result, spec) or \
                        state.versions[spec.version].dim
            if failed:
                i, reply = next(iter(failed.items()))
                for v in {v for _, v in built} | {spec.version}:  # a timed-out build too
                    self._all("unload", self.cfg.models.unload_drain_s + QUICK_CALL_S,
                              name=name, version=v)
                for s in specs:
                    vs = state.versions.get(s.version)
                    if vs is not None and vs.state == LOADING:
                        vs.state = UNAVAILABLE
                        vs.reason = f"load failed: {reply.error}" if s is spec else "not loaded"
                log.warning("admin: model load %s version %d failed on engine %d: %s; the "
                            "versions serving before keep serving", name, spec.version, i,
                            reply.error)
                raise errors.ServeError(
                    "model_load_failed", f"failed to load model {name!r} version "
                    f"{spec.version} (engine {i}): {reply.error}; the versions serving before "
                    "keep serving", 400)
        for spec in specs:
            state.versions[spec.version].state = READY
            state.versions[spec.version].reason = ""

    def _activate(self, name: str, traffic: dict[int, float]) -> None:
        weights = {str(v): w for v, w in traffic.items()}
        self._all("activate", timeout_s=QUICK_CALL_S, name=name, traffic=weights,
                  default=self.default)

    def _unload_versions(self, name: str, state: ModelState, versions: list[int]) -> None:
        for v in versions:
            state.versions[v].state = UNLOADING
        for v in versions:
            self._all("unload", timeout_s=self.cfg.models.unload_drain_s + QUICK_CALL_S,
                      name=name, version=v)
            state.versions[v].state, state.versions[v].reason = UNAVAILABLE, "unloaded"

    def _all(self, op: str, timeout_s: float, **fields: Any) -> dict[int, ModelReply]:
        """One call to every live engine core, answered or timed out (a timeout is a failed
        reply naming it)."""
        return self._calls([i for i in range(self.num_engines) if self.alive(i)], op,
                           timeout_s, fields)

    def _one(self, i: int, op: str, timeout_s: float, **fields: Any) -> ModelReply:
        return self._calls([i], op, timeout_s, fields)[i]

    def _calls(self, engines: list[int], op: str, timeout_s: float,
               fields: dict[str, Any]) -> dict[int, ModelReply]:
        """Sockets of this call's own (calls of different models run in different threads)."""
        socks = {i: self._connect(i) for i in engines}
        pids = {i: self.pid_of(i) for i in engines}
        try:
            ids = {}
            for i, sock in socks.items():
                call_id = next(self._ids)
                ids[call_id] = i
                sock.send(encode(ModelCall(call_id, op, timeout_s=timeout_s, **fields)))
            return _gather(socks, ids, timeout_s, op, lambda i: self.pid_of(i) != pids[i])
        finally:
            for sock in socks.values():
                sock.close(linger=0)

    def _connect(self, i: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addrs.engine_admin(i))
        return sock

    # ---- a restarted engine core ------------------------------------------------------------------
    def engine_ready(self, i: int) -> None:
        """Bring a (re)started engine core to the versions and splits of the plan (it started
        with the plan file, which lacks a load in progress); in a thread, so supervision goes
        on. The core is up (:meth:`settled`) only once that is done."""
        pid = self.pid_of(i)
        threading.Thread(target=self._reconcile, args=(i, pid), daemon=True,
                         name=f"quiver-models-engine-{i}").start()

    def _reconcile(self, i: int, pid: int | None) -> None:
        try:
            for _ in range(RECONCILE_PASSES):
                generation = self.plan_generation
                if not self._reconcile_pass(i) or self.pid_of(i) != pid:
                    continue
                if generation == self.plan_generation:
                    self._settled[i] = pid
                    log.info("engine %d (pid %s) serves the plan: %s", i, pid,
                             {n: sorted(v for v, vs in st.versions.items() if vs.state == READY)
                              for n, st in self.models.items()})
                    return
            log.error("engine %d (pid %s): not brought to the plan in %d passes; it is not "
                      "counted ready", i, pid, RECONCILE_PASSES)
        except Exception:  # noqa: BLE001 - logged; the core stays not up
            log.exception("engine %d: bringing its models up to date failed", i)

    def _reconcile_pass(self, i: int) -> bool:
        """One pass over every model, each under its lock; False when a call failed."""
        ok = True
        for name, state in list(self.models.items()):
            if not state.lock.acquire(timeout=self.cfg.models.load_timeout_s + QUICK_CALL_S):
                log.warning("engine %d: model %s stayed busy; retried", i, name)
                return False
            try:
                ok = self._reconcile_model(i, name, state) and ok
            finally:
                state.lock.release()
        have = self._one(i, "list", QUICK_CALL_S)
        wanted = {(n, v) for n, st in self.models.items() for v, vs in st.versions.items()
                  if vs.state == READY}
        for s in have.result.get("slots", []):
            if s["name"] not in self.models and (s["name"], int(s["version"])) not in wanted:
                self._one(i, "unload", self.cfg.models.unload_drain_s + QUICK_CALL_S,
                          name=s["name"], version=int(s["version"]))
        return ok and have.ok

    def _reconcile_model(self, i: int, name: str, state: ModelState) -> bool:
        """Engine core ``i`` holds exactly ``name``'s ready versions, at their traffic split."""
        have = self._one(i, "list", QUICK_CALL_S)
        slots = [s for s in have.result.get("slots", []) if s["name"] == name]
        self.note_dims(slots)
        loaded = {int(s["version"]) for s in slots}
        ok = have.ok
        for v, vs in state.versions.items():
            if vs.state == READY and v not in loaded:
                r = self._one(i, "load", self.cfg.models.load_timeout_s, spec=vs.spec.to_dict())
                if not r.ok:
                    ok = False
                    log.error("engine %d: reloading %s version %d after its restart failed: %s",
                              i, name, v, r.error)
        r = self._one(i, "activate", QUICK_CALL_S, name=name, default=self.default,
                      traffic={str(v): w for v, w in state.traffic.items()})
        ok = ok and r.ok
        for v in loaded:
            vs = state.versions.get(v)
            if vs is None or vs.state != READY:
                self._one(i, "unload", self.cfg.models.unload_drain_s + QUICK_CALL_S,
                          name=name, version=v)
        return ok

    # ---- what the front-ends publish ---------------------------------------------------------------
    def _describe(self, name: str) -> dict[str, Any]:
        state = self.models[name]
        return {"name": name,
                "versions": {str(v): {"state": vs.state, "reason": vs.reason}
                             for v, vs in sorted(state.versions.items())},
                "traffic": {str(v): w for v, w in state.traffic.items()}}

    def published(self) -> dict[str, Any]:
        """Every model and version, as ``FrontDoorState.models`` carries it."""
        out: dict[str, Any] = {}
        for name, state in sorted(dict(self.models).items()):  # copies: calls change them
            versions, traffic = dict(state.versions), dict(state.traffic)
            if not versions:
                continue
            spec = versions[max(versions)].spec
            total = sum(traffic.values()) or 1.0
            out[name] = {
                "platform": "pytorch_geometric", "class": spec.pyg_class,
                "kwargs": dict(spec.kwargs),
                "in_channels": self.num_features,
                "num_layers": spec.num_layers,
                "fanouts": spec.fanouts_or(self.cfg.sampling.fanouts),
                "versions": {str(v): {"state": vs.state, "reason": vs.reason, "dim": vs.dim,
                                      "traffic": traffic.get(v, 0.0) / total,
                                      "state_dict": weights_label(vs.spec)}
                             for v, vs in sorted(versions.items())}}
        return {"default": self.default, "models": out}

    def stop(self) -> None:
        self._ctx.term()


def _gather(socks: dict[int, zmq.Socket], ids: dict[int, int], timeout_s: float,
            op: str, gone: Callable[[int], bool] = lambda i: False) -> dict[int, ModelReply]:
    """Each core's reply, or a failed one naming the timeout; a core that died (``gone``) is
    answered for at once, ``restarted`` and ok: it is brought to the plan when it is back."""
    replies: dict[int, ModelReply] = {}
    end = time.monotonic() + timeout_s
    poller = zmq.Poller()
    for sock in socks.values():
        poller.register(sock, zmq.POLLIN)
    while len(replies) < len(ids) and time.monotonic() < end:
        wait_s = min(end - time.monotonic(), GONE_CHECK_S)
        for sock, _ in poller.poll(max(int(wait_s * 1000), 1)):
            reply = Decoders.model_reply.decode(sock.recv())
            if reply.call_id in ids:
                replies[ids[reply.call_id]] = reply
        for call_id, i in ids.items():
            if i not in replies and gone(i):
                log.warning("engine %d died during the %s; it is brought to the plan when it "
                            "is back", i, op)
                replies[i] = ModelReply(call_id, True, {"restarted": True})
    for call_id, i in ids.items():
        if i not in replies:
            replies[i] = ModelReply(call_id, False, {}, f"engine {i} did not answer the "
                                    f"{op} within {timeout_s:.0f} s")
    return replies


def _dim_of(result: dict[str, Any], spec: ModelSpec) -> int:
    dim = result.get("dim")
    return int(dim) if isinstance(dim, int) else 0
