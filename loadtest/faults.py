"""Fault drill: kill -9 every worker role under load; every request must be answered and every
role must come back.

    python -m loadtest.faults [--rate 200] [--seconds 30] [--roles frontend engine sampler]

Starts the real daemon (``loadtest/harness.py``) on a free loopback port with two HTTP
front-end processes (``--http-workers``: with one, the front-end is the main process and a kill
stops the daemon), runs open-loop HTTP JSON load from the load generator's driver
(``loadtest/driver.py``), and kill -9s one process of each role of ``GET /v1/workers`` in turn,
at evenly spaced times of the run (or as soon as the last one is back), waiting after each for
the role to come back (a new pid, alive and ready). A role the daemon does not list fails the drill at once, naming the roles it has.

Every request must be answered: 200, or an error status (503 when the daemon's own retry also
failed); none may be lost (no answer before the client timeout). A request whose connection was
cut by the front-end kill is sent again on a new connection (up to twice), as a client behind a
balancer would; those are counted as ``retried_after_cut``. Exit status 1 when a request was
lost or unsent, or a role did not come back in ``--restart-timeout-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from loadtest.harness import REPO_ROOT, Daemon

ROLES = ("engine", "sampler", "frontend")
RETRY_CUT = 2  # sends again of a request whose connection a front-end kill cut


def workers(daemon: Daemon) -> list[dict[str, Any]]:
    """``GET /v1/workers``, asked again while a killed front-end's connection fails."""
    end = time.monotonic() + 10.0
    while True:
        try:
            return daemon.get_json("/v1/workers", timeout_s=5.0)["workers"]
        except (OSError, urllib.error.URLError, ValueError):
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def check_roles(daemon: Daemon, roles: list[str]) -> None:
    """Every role to kill is listed, and not the daemon's main process: else exit loudly."""
    rows = workers(daemon)
    listed = sorted({w["role"] for w in rows})
    missing = [r for r in roles if r not in listed]
    if missing:
        raise SystemExit(f"fault drill: role(s) {missing} not in /v1/workers (it lists {listed}); "
                         "the drill kills every role the daemon has")
    main_pid = [w["role"] for w in rows if w["pid"] == daemon.pid and w["role"] in roles]
    if main_pid:
        raise SystemExit(f"fault drill: role {main_pid[0]} runs in the daemon's main process "
                         "(server.http_workers 1?): a kill would stop the daemon; use "
                         "--http-workers 2")


def kill_role(daemon: Daemon, role: str, restart_timeout_s: float) -> dict[str, Any]:
    """kill -9 the first process of ``role``; wait until that (role, index) has a new pid that
    is alive (``restarted_after_s``) and reports ready again (``ready_after_s``)."""
    victim = next(w for w in workers(daemon) if w["role"] == role)
    t0 = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    out: dict[str, Any] = {"role": role, "index": victim["index"], "old_pid": victim["pid"],
                           "killed_wall_s": time.time(), "restarted_after_s": None,
                           "ready_after_s": None}
    while time.monotonic() - t0 < restart_timeout_s:
        w = {(w["role"], w["index"]): w for w in workers(daemon)}.get((role, victim["index"]))
        if w is not None and w["pid"] != victim["pid"] and w["alive"]:
            if out["restarted_after_s"] is None:
                out.update(new_pid=w["pid"], restarted_after_s=round(time.monotonic() - t0, 2))
            if w.get("ready", True):
                out["ready_after_s"] = round(time.monotonic() - t0, 2)
                return out
        time.sleep(0.05)
    return out


class Drill:
    """The kills, on their own thread from the load's start instant."""

    def __init__(self, daemon: Daemon, roles: list[str], seconds: float,
                 restart_timeout_s: float) -> None:
        self.daemon, self.roles, self.seconds = daemon, roles, seconds
        self.restart_timeout_s = restart_timeout_s
        self.kills: list[dict[str, Any]] = []
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def start(self, t_start: float) -> None:
        self.thread = threading.Thread(target=self._run, args=(t_start,), daemon=True)
        self.thread.start()

    def _run(self, t_start: float) -> None:
        try:
            for i, role in enumerate(self.roles):
                at = t_start + self.seconds * (i + 1) / (len(self.roles) + 1)
                time.sleep(max(0.0, at - time.time()))
                kill = kill_role(self.daemon, role, self.restart_timeout_s)
                killed_wall_s = kill.pop("killed_wall_s")
                kill["killed_at_s"] = round(killed_wall_s - t_start, 2)
                kill["under_load"] = killed_wall_s < t_start + self.seconds
                self.kills.append(kill)
                print(f"killed {role} {kill['index']} (pid {kill['old_pid']}) at "
                      f"{kill['killed_at_s']:g} s: alive again after {kill['restarted_after_s']} s, "
                      f"ready after {kill['ready_after_s']} s", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported in the summary, fails the drill
            self.error = f"{type(exc).__name__}: {exc}"

    def join(self, timeout_s: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)


def run_drill(daemon: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    """The load (open loop, HTTP JSON, ``args.nodes`` uniform ids) with the kills beside it."""
    from loadtest.gen import Generator, probe
    from loadtest.stats import answered_summary

    check_roles(daemon, args.roles)
    _, num_nodes = probe(daemon.url)
    spec = {"workload": "b", "hot": None, "num_nodes": num_nodes, "seed": 0,
            "ids_per_request": args.nodes}
    target = {"protocol": "http-json", "url": daemon.url, "model": "",
              "timeout_s": args.client_timeout_s, "retry_cut": RETRY_CUT}
    drill = Drill(daemon, args.roles, args.seconds, args.restart_timeout_s)
    gen = Generator(procs=args.procs, warm_s=0.0, seconds=args.seconds)
    try:
        point = gen.point(target, spec, "open", args.rate, on_start=drill.start)
    finally:
        gen.close()
    drill.join(timeout_s=args.restart_timeout_s * len(args.roles))
    summary = answered_summary(point) | {"rate_per_s": args.rate, "seconds": args.seconds,
                                         "kills": drill.kills, "drill_error": drill.error}
    summary["workers_after"] = workers(daemon)
    summary["worker_restarts_total"] = restart_lines(daemon)
    summary["failures"] = failures(summary, args.roles)
    summary["warnings"] = extra_restarts(summary["workers_after"], args.roles)
    return summary


def extra_restarts(rows: list[dict[str, Any]], roles: list[str]) -> list[str]:
    """Processes restarted more than the drill's one kill (a restart that died again)."""
    return [f"{w['role']} {w['index']} restarted {w['restarts']} times for one kill"
            for w in rows if w["role"] in roles and w["index"] == 0 and w.get("restarts", 0) > 1]


def restart_lines(daemon: Daemon) -> list[str]:
    """The restart counters of ``/metrics`` (text, not JSON)."""
    import urllib.request

    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as r:  # noqa: S310
        text = r.read().decode()
    return [ln for ln in text.splitlines() if ln.startswith("quiver_serve_worker_restarts_total")]


def failures(summary: dict[str, Any], roles: list[str]) -> list[str]:
    """What failed the drill, in words (empty: passed)."""
    out = []
    if summary["lost"]:
        out.append(f"{summary['lost']} request(s) lost: {summary['lost_by_kind']}")
    if summary["unsent"]:
        out.append(f"{summary['unsent']} request(s) not sent (client over its in-flight limit)")
    if summary["drill_error"]:
        out.append(f"the kill thread failed: {summary['drill_error']}")
    killed = {k["role"]: k for k in summary["kills"]}
    for role in roles:
        k = killed.get(role)
        if k is None:
            out.append(f"role {role} was not killed")
        elif k["ready_after_s"] is None:
            out.append(f"role {role} did not come back (ready) in the restart timeout")
        elif not k["under_load"]:
            out.append(f"role {role} was killed after the load ended (raise --seconds)")
    dead = [f"{w['role']} {w['index']}" for w in summary["workers_after"]
            if not (w["alive"] and w.get("ready", True))]
    if dead:
        out.append(f"not alive and ready at the end: {dead}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.faults", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO_ROOT / "quiver_serve/defaults/default.yaml"))
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second (open loop)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of the load")
    ap.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES,
                    help="roles to kill, in this order")
    ap.add_argument("--nodes", type=int, default=2, help="node ids per request")
    ap.add_argument("--http-workers", type=int, default=2, help="server.http_workers of the daemon")
    ap.add_argument("--procs", type=int, default=1, help="load processes")
    ap.add_argument("--client-timeout-s", type=float, default=30.0,
                    help="a request with no answer by then is lost")
    ap.add_argument("--restart-timeout-s", type=float, default=30.0,
                    help="a killed role must be back within this")
    ap.add_argument("--ready-timeout-s", type=float, default=240.0)
    ap.add_argument("--json", help="also write the summary here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    daemon = Daemon(args.config, overrides={"server.http_workers": args.http_workers},
                    ready_timeout_s=args.ready_timeout_s, name="quiver-serve (fault drill)")
    with daemon:
        print(f"daemon ready in {time.monotonic() - daemon.started_at:.1f} s; load {args.rate:g} "
              f"req/s for {args.seconds:g} s, kills: {' '.join(args.roles)}", file=sys.stderr,
              flush=True)
        summary = run_drill(daemon, args)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    for warning in summary["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if summary["failures"]:
        print("FAULT DRILL FAILED: " + "; ".join(summary["failures"]), file=sys.stderr)
        return 1
    print("fault drill passed: every request answered, every role back", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
