"""The compiled load clients of the front-door bench: finding ``wrk`` and ``h2load``, running
them with a time limit, and reading what they print.

A client is found through its environment variable (``QUIVER_SERVE_WRK``,
``QUIVER_SERVE_H2LOAD``: a path), else in ``.tools/bin/`` under the repository root (then its
libraries, ``.tools/lib/``, go first on the child's ``LD_LIBRARY_PATH``), else on ``PATH``.
bench/README.md says how to fill ``.tools/`` on a Debian/Ubuntu box.

gRPC through h2load: h2load POSTs one body file over HTTP/2 (h2c) to
``/inference.GRPCInferenceService/ModelInfer`` with ``content-type: application/grpc`` and
``te: trailers``; the body is a gRPC frame: a flag byte (0, not compressed), the message's length
(4 bytes, big-endian), then a serialized ``ModelInferRequest``. h2load does not read trailers,
so a gRPC error would still count as HTTP 200: the bench checks the same body once with a real
gRPC client, and each point's bytes received per request against the answer's size.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.results import ROOT, portable

TOOLS_DIR = ROOT / ".tools"
ENV_VARS = {"wrk": "QUIVER_SERVE_WRK", "h2load": "QUIVER_SERVE_H2LOAD"}
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
CLIENT_TIMEOUT_S = 10  # one request's limit in the clients (the daemon's request_timeout_s)
RUN_SLACK_S = 60.0  # a client run's subprocess limit beyond its duration


@dataclass
class Tool:
    """One client binary and the library folder it needs (None: the system's)."""

    name: str
    path: Path
    lib: Path | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.lib is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                filter(None, [str(self.lib), env.get("LD_LIBRARY_PATH")]))
        return env

    def describe(self) -> str:
        """Where it was found, as the result records it (no machine paths)."""
        return str(portable(self.path))

    def version(self) -> str:
        flag = "-v" if self.name == "wrk" else "--version"
        try:
            out = subprocess.run([str(self.path), flag], capture_output=True, text=True,
                                 env=self.env(), timeout=10)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown ({type(exc).__name__})"
        first = (out.stdout or out.stderr).strip().splitlines()
        if out.returncode == 127:  # the loader: a library missing
            return f"unknown (does not run: {first[-1] if first else 'exit 127'})"
        return first[0] if first else "unknown"


def find_tool(name: str, root: Path = ROOT) -> Tool | None:
    """``name`` from its environment variable, ``.tools/bin/``, or ``PATH`` (in that order)."""
    given = os.environ.get(ENV_VARS.get(name, ""), "")
    if given:
        path = Path(given)
        return Tool(name, path) if path.is_file() and os.access(path, os.X_OK) else None
    local = root / ".tools" / "bin" / name
    if local.is_file() and os.access(local, os.X_OK):
        lib = root / ".tools" / "lib"
        return Tool(name, local, lib if lib.is_dir() else None)
    found = shutil.which(name)
    return Tool(name, Path(found)) if found else None


def threads_for(connections: int, cpus: int | None = None) -> int:
    """Client threads: a quarter of the CPUs, 1 to 4 (the load client shares the machine with
    the daemon), never more than the connections."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(4, cpus // 4, connections))


def raise_open_files(wanted: int = 65536) -> tuple[int, int]:
    """Lift this process's soft limit on open files toward ``wanted`` (at most the hard limit),
    so that wrk, h2load and the daemon it starts (children inherit it) can hold a sweep's
    connections: a common soft limit of 1,024 is below 1,024 connections plus the client's own
    files. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return soft, target
    return soft, soft


def run_client(argv: Sequence[str], tool: Tool, limit_s: float) -> tuple[str, float]:
    """Run one client to its end: (stdout, its CPU seconds, user + system, from the children's
    resource usage: the only child reaped meanwhile is this one)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([str(tool.path), *argv], capture_output=True, text=True,
                          env=tool.env(), timeout=limit_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool.name} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()[-600:]}")
    return proc.stdout, cpu_s


def wrk_argv(url: str, script: Path, connections: int, seconds: int, threads: int) -> list[str]:
    return ["-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--timeout",
            f"{CLIENT_TIMEOUT_S}s", "-s", str(script), url]


def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message: not compressed (0), length big-endian, the bytes."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def model_infer_request(model: str, ids: np.ndarray) -> bytes:
    """A serialized KServe v2 ``ModelInferRequest``: input ``node_ids`` INT64 [n], the ids as
    raw little-endian int64 (``raw_input_contents``), as ``loadtest.grpc_callers.GrpcCaller``."""
    from quiver_serve.frontend.grpc.proto import message

    req_cls = message("ModelInferRequest")
    inp = message("ModelInferRequest.InferInputTensor")(name="node_ids", datatype="INT64",
                                                         shape=[int(ids.size)])
    raw = np.ascontiguousarray(ids, "<i8").tobytes()
    return req_cls(model_name=model, inputs=[inp], raw_input_contents=[raw]).SerializeToString()


def grpc_check(target: str, request: bytes, timeout_s: float = 10.0) -> dict[str, Any]:
    """One ``ModelInfer`` call with a real gRPC client (grpc-status 0, else it raises): the
    answer's output shape and serialized size."""
    import grpc

    from quiver_serve.frontend.grpc.proto import message

    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(GRPC_METHOD)
        try:
            answer = call(request, timeout=timeout_s)
        except grpc.RpcError as exc:  # a status other than OK
            raise RuntimeError(f"gRPC ModelInfer on {target}: {exc.code().name}: "  # type: ignore[attr-defined]
                               f"{exc.details()}") from exc  # type: ignore[attr-defined]
    res = message("ModelInferResponse").FromString(answer)
    shape = [list(o.shape) for o in res.outputs]
    return {"grpc_status": 0, "answer_bytes": len(answer), "output_shapes": shape}


def h2load_argv(url: str, body: Path, connections: int, seconds: int, threads: int,
                log: Path | None) -> list[str]:
    """Closed loop over HTTP/2: ``connections`` clients, one stream in flight each (-m 1)."""
    argv = ["-c", str(connections), "-m", "1", "-t", str(threads), "-D", str(seconds), "-d",
            str(body), "-N", str(CLIENT_TIMEOUT_S)]
    for h in GRPC_HEADERS:
        argv += ["-H", h]
    if log is not None:
        argv += ["--log-file", str(log)]
    return [*argv, url + GRPC_METHOD]


H2_REQUESTS = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                         r"(\d+) failed, (\d+) errored, (\d+) timeout")
H2_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")
H2_TRAFFIC = re.compile(r"traffic: .*?\((\d+)\) total")


def parse_h2load(stdout: str) -> dict[str, int]:
    """Counts from h2load's summary: requests done / succeeded / failed / errored / timeout,
    statuses by class, total bytes received."""
    m = H2_REQUESTS.search(stdout)
    if m is None:
        raise ValueError("h2load printed no request counts: " + stdout[-600:])
    keys = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    out = {k: int(v) for k, v in zip(keys, m.groups(), strict=True)}
    s = H2_STATUS.search(stdout)
    if s:
        out.update({k: int(v) for k, v in zip(("2xx", "3xx", "4xx", "5xx"), s.groups(),
                                              strict=True)})
    t = H2_TRAFFIC.search(stdout)
    out["bytes"] = int(t.group(1)) if t else 0
    return out


def read_h2load_log(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """h2load's ``--log-file``: (HTTP status per request, -1 for a failed stream; duration in
    microseconds) of every request of the measured duration."""
    status, dur = [], []
    for line in path.read_text().splitlines():
        cells = line.split("\t")
        if len(cells) >= 3 and cells[1].lstrip("-").isdigit():
            status.append(int(cells[1]))
            dur.append(int(cells[2]))
    return np.asarray(status, np.int64), np.asarray(dur, np.float64)


def h2load_point(counts: dict[str, int], status: np.ndarray, dur_us: np.ndarray, seconds: float,
                 ids_per_request: int) -> dict[str, Any]:
    """An h2load run as a bench point: percentiles of the 2xx requests' durations; errors:
    non-2xx statuses, failed streams, timeouts. ValueError when the log holds more requests than
    h2load says it did: h2load appends to its ``--log-file``, so a log left by an earlier run
    would mix that run's requests into this point (the caller deletes it before each run)."""
    from loadtest.stats import percentiles_ms

    done = counts.get("done", 0)
    if done and status.size > done * 1.05 + 64:
        raise ValueError(f"h2load's log holds {status.size} requests for a run of {done}: "
                         "entries of an earlier run (h2load appends to --log-file)")
    ok_mask = (status >= 200) & (status < 300)
    ok = int(ok_mask.sum())
    total = max(int(status.size), counts.get("done", 0))
    errors = {str(int(c)): int(n) for c, n in zip(*np.unique(status[~ok_mask],
                                                              return_counts=True), strict=True)}
    errors = {("failed" if k == "-1" else k): v for k, v in errors.items()}
    if counts.get("timeout"):
        errors["timeout"] = counts["timeout"]
    lat_s = dur_us[ok_mask] / 1e6
    return {"requests": total, "ok": ok, "seconds": seconds, "req_per_s": ok / seconds,
            "seed_nodes_per_s": ok * ids_per_request / seconds, **percentiles_ms(lat_s),
            "max_ms": float(lat_s.max() * 1e3) if lat_s.size else None,
            "mean_ms": float(lat_s.mean() * 1e3) if lat_s.size else None,
            "errors": errors, "error_fraction": (total - ok) / total if total else 1.0,
            "bytes": counts.get("bytes", 0),
            "bytes_per_request": counts.get("bytes", 0) / total if total else 0.0}
