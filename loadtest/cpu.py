"""Where a request's CPU goes: CPU time per process of a daemon's tree, labelled by role.

A snapshot reads ``utime + stime`` (every thread of the process, in clock ticks) from
``/proc/<pid>/stat`` for the root process and all its descendants (found through their parent
ids, so a child that left the process group still counts). Two snapshots around a measured
window give each process's CPU time in it; divided by the requests answered in the window, the
CPU-ms per request of each role.

Roles come from the daemon's ``GET /v1/workers`` (role, index, pid of every front-end, engine
core and CPU sampler) and the command lines: the root is ``main`` (it also hosts the in-process
front-end and the gRPC server), a ``multiprocessing`` child not in the worker list is a
``standby`` (a warm spare), the resource tracker is ``resource tracker``, anything else
``other``. Linux only; elsewhere the snapshots are empty.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")
#: /v1/workers role -> label prefix
ROLE_NAMES = {"frontend": "frontend", "engine": "engine core", "sampler": "sampler"}
#: the role classes of the CPU table, in its column order
ROLE_CLASSES = ("main", "frontend", "engine core", "sampler", "standby", "other")


def read_stat(pid: int, proc: Path = PROC) -> tuple[int, int] | None:
    """(parent pid, utime + stime in ticks) of ``pid``; None when it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return parse_stat(text)


def parse_stat(text: str) -> tuple[int, int]:
    """(ppid, utime + stime) from one ``/proc/<pid>/stat`` line (the command name, in
    parentheses, may hold spaces and parentheses: the fields start after the last ``)``)."""
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is state (field 3 of proc(5)); ppid is field 4, utime 14, stime 15
    return int(fields[1]), int(fields[11]) + int(fields[12])


def cmdline(pid: int, proc: Path = PROC) -> str:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def tree_ticks(root_pid: int, proc: Path = PROC) -> dict[int, int]:
    """CPU ticks of ``root_pid`` and every descendant alive now."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            st = read_stat(int(entry.name), proc)
            if st is not None:
                stats[int(entry.name)] = st
    if root_pid not in stats:
        return {}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        out[pid] = stats[pid][1]
        todo.extend(children.get(pid, ()))
    return out


def label(pid: int, main_pid: int, workers: Iterable[Mapping[str, Any]], command: str) -> str:
    """The role of one process of the tree (see the module's docstring)."""
    if pid == main_pid:
        return "main"
    for w in workers:
        if w.get("pid") == pid:
            role = str(w.get("role"))
            return f"{ROLE_NAMES.get(role, role)} {w.get('index', 0)}"
    if "resource_tracker" in command:
        return "resource tracker"
    if "multiprocessing" in command:
        return "standby"
    return "other"


def role_class(name: str) -> str:
    """A label without its index (``frontend 2`` -> ``frontend``); unknown ones are ``other``."""
    base = re.sub(r"\s+\d+$", "", name)
    return base if base in ROLE_CLASSES else "other"


@dataclass
class Snapshot:
    ticks: dict[int, int]


class TreeCpu:
    """CPU of one process tree over windows: ``before = snap()`` ... ``usage(before, snap())``.

    ``exclude``: pids left out (the load processes, when the tree is this bench's own process);
    ``workers``: the /v1/workers rows (refresh with :meth:`set_workers` after a restart).
    """

    def __init__(self, root_pid: int, workers: Iterable[Mapping[str, Any]] = (),
                 exclude: Iterable[int] = (), proc: Path = PROC) -> None:
        self.root_pid, self.proc = root_pid, proc
        self.exclude = set(exclude)
        self.workers: list[Mapping[str, Any]] = list(workers)
        self.labels: dict[int, str] = {}

    def set_workers(self, workers: Iterable[Mapping[str, Any]]) -> None:
        self.workers = list(workers)
        self.labels.clear()

    def snap(self) -> Snapshot:
        ticks = tree_ticks(self.root_pid, self.proc)
        return Snapshot({p: t for p, t in ticks.items() if p not in self.exclude})

    def label_of(self, pid: int) -> str:
        if pid not in self.labels:
            self.labels[pid] = label(pid, self.root_pid, self.workers, cmdline(pid, self.proc))
        return self.labels[pid]

    def usage(self, before: Snapshot, after: Snapshot) -> dict[str, float]:
        """CPU-ms per labelled process between the snapshots (a process started in between
        counts from zero; one that ended is lost). Two processes of one label (a restart) add."""
        out: dict[str, float] = {}
        for pid, t1 in after.ticks.items():
            ms = (t1 - before.ticks.get(pid, 0)) * 1e3 / CLK_TCK
            name = self.label_of(pid)
            out[name] = out.get(name, 0.0) + ms
        return dict(sorted(out.items()))


def net_counters(proc: Path = PROC) -> dict[str, int]:
    """Machine-wide counters that tell a lost packet or a stolen CPU from a slow server: TCP
    segments retransmitted (``/proc/net/snmp``; Linux's shortest retransmission timeout is
    200 ms), packets dropped because a CPU's input backlog was full (``/proc/net/softnet_stat``,
    where loopback traffic queues), and the milliseconds the hypervisor ran something else on
    this machine's virtual CPUs (``steal`` in ``/proc/stat``, all CPUs summed: a stalled vCPU
    stalls whatever runs on it, which no run queue of the guest shows). Missing files give no
    keys."""
    out: dict[str, int] = {}
    try:
        fields = (proc / "stat").read_text().split("\n", 1)[0].split()
        if fields[0] == "cpu" and len(fields) > 8:
            out["cpu_steal_ms"] = int(fields[8]) * 1000 // CLK_TCK
    except (OSError, ValueError, IndexError):
        pass
    try:
        rows = [line.split() for line in (proc / "net" / "snmp").read_text().splitlines()
                if line.startswith("Tcp:")]
        if len(rows) >= 2 and "RetransSegs" in rows[0]:
            out["tcp_retrans_segs"] = int(rows[1][rows[0].index("RetransSegs")])
    except (OSError, ValueError, IndexError):
        pass
    try:
        lines = (proc / "net" / "softnet_stat").read_text().split("\n")
        out["backlog_drops"] = sum(int(line.split()[1], 16) for line in lines if line.strip())
    except (OSError, ValueError, IndexError):
        pass
    return out


def net_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` for the counters read both times."""
    return {k: after[k] - before[k] for k in after if k in before}


def per_request(cpu_ms: Mapping[str, float], requests: int, client_ms: float | None,
                seconds: float) -> dict[str, Any]:
    """A point's CPU figures: CPU-ms per request by role class (``client``: the load client),
    the daemon's total, and the cores it kept busy over ``seconds``. The total leaves out the
    standbys: a spare process does no request's work, and one spawned during the point (after a
    start or a restart) spends seconds importing torch."""
    by_class = dict.fromkeys(ROLE_CLASSES, 0.0)
    for name, ms in cpu_ms.items():
        by_class[role_class(name)] += ms
    total = sum(v for k, v in by_class.items() if k != "standby")
    n = max(requests, 1)
    return {"cpu_ms": {k: round(v, 1) for k, v in cpu_ms.items()},
            "cpu_ms_per_request": {**{k: v / n for k, v in by_class.items()},
                                   "daemon": total / n,
                                   "client": None if client_ms is None else client_ms / n},
            "daemon_cores": total / 1e3 / seconds if seconds > 0 else None,
            "client_cores": None if client_ms is None or seconds <= 0 else client_ms / 1e3 / seconds}
