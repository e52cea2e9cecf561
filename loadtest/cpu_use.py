"""Where a machine's CPU went during a window: cores used by each role of the daemon's
processes (from ``GET /v1/workers`` and the daemon's own pid) and by everything else on the
machine (the load and update generators, the kernel), read from ``/proc``.

    meter = CpuMeter(url, headers, daemon_pid)
    meter.mark()            # at the window's start
    ...
    cores = meter.cores()   # {"engine": 0.93, "frontend": 4.1, "sampler": 0.2, "main": 0.6,
                            #  "other": 3.0, "machine": 8.8, "cpus": 16}
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections import defaultdict
from collections.abc import Mapping

#: clock ticks per second of /proc's CPU times
TICKS_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (its threads included); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_S  # utime, stime (fields 14, 15)


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine spent busy (``/proc/stat``: all but idle and
    iowait)."""
    try:
        with open("/proc/stat", "rb") as f:
            parts = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / TICKS_S


def daemon_roles(url: str, headers: Mapping[str, str], main_pid: int) -> dict[int, str]:
    """pid -> role of every process of the daemon at ``url`` (``main``: the supervising one)."""
    req = urllib.request.Request(url + "/v1/workers", headers=dict(headers))
    with urllib.request.urlopen(req, timeout=10) as r:
        rows = json.loads(r.read())["workers"]
    roles = {int(w["pid"]): str(w["role"]) for w in rows if w.get("pid")}
    roles[main_pid] = "main"
    return roles


class CpuMeter:
    """CPU seconds per role between :meth:`mark` and :meth:`cores`, as cores used."""

    def __init__(self, url: str, headers: Mapping[str, str], main_pid: int) -> None:
        self.url, self.headers, self.main_pid = url, headers, main_pid
        self._t0: float | None = None
        self._start: dict[int, float] = {}
        self._machine0: float | None = None
        self._roles: dict[int, str] = {}

    def mark(self) -> None:
        try:
            self._roles = daemon_roles(self.url, self.headers, self.main_pid)
        except (OSError, ValueError, KeyError):
            self._roles = {self.main_pid: "main"}
        self._start = {pid: s for pid in self._roles if (s := process_cpu_s(pid)) is not None}
        self._machine0 = machine_busy_s()
        self._t0 = time.monotonic()

    def cores(self) -> dict[str, float] | None:
        """Cores used per role since :meth:`mark` (None without one)."""
        if self._t0 is None:
            return None
        wall_s = max(time.monotonic() - self._t0, 1e-9)
        used: dict[str, float] = defaultdict(float)
        for pid, s0 in self._start.items():
            s1 = process_cpu_s(pid)
            if s1 is not None:  # a process that died in the window is left out
                used[self._roles[pid]] += (s1 - s0) / wall_s
        out = {role: round(v, 2) for role, v in sorted(used.items())}
        machine1 = machine_busy_s()
        if self._machine0 is not None and machine1 is not None:
            machine = (machine1 - self._machine0) / wall_s
            out["machine"] = round(machine, 2)
            out["other"] = round(max(machine - sum(used.values()), 0.0), 2)
        out["cpus"] = float(os.cpu_count() or 0)
        return out
