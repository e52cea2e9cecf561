"""The update log and base snapshots (graph/records.py, graph/log_reader.py, graph/update_log.py):
the record format, replay, torn tails, corruption, the writer's lock, group commit, crashes at every
step of compaction and of an append, kill -9 of a writing process, and followers."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from quiver_serve.graph import update_log as ul
from quiver_serve.graph.log_reader import list_segments
from quiver_serve.graph.records import HEADER_BYTES, SegmentSeal
from quiver_serve.graph.update_log import (
    EdgeRecord,
    FeatureRecord,
    LogCompactedError,
    LogFollower,
    LogLockedError,
    NodeRecord,
    UpdateLog,
    UpdateLogError,
    decode,
    default_log_dir,
    encode,
    load_base,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
WIDTH = 4  # feature width of the records made here


class Crash(BaseException):
    """Raised by the crash hook: not an Exception, so no handler of the log mistakes it for one."""


def make_record(version: int, seed: int = 0, rows: int | None = None):
    """A record of each kind in turn, sizes drawn from (version, seed); some arrays empty."""
    rng = np.random.default_rng(version * 7919 + seed)
    n = int(rng.integers(0, 4)) if rows is None else rows
    kind = version % 3
    if kind == 0:
        return EdgeRecord(version, 1000.0 + version, rng.integers(0, 50, (n, 2)),
                          rng.integers(0, 50, (int(rng.integers(0, 3)), 2)))
    if kind == 1:
        return NodeRecord(version, 1000.0 + version, rng.standard_normal((n, WIDTH), np.float32))
    return FeatureRecord(version, 1000.0 + version, rng.integers(0, 50, n),
                         rng.standard_normal((n, WIDTH), np.float32))


def append_range(log: UpdateLog, first: int, last: int) -> list:
    records = [make_record(v) for v in range(first, last + 1)]
    for r in records:
        log.append(r)
    return records


@pytest.fixture
def log(tmp_path: Path) -> Iterator[UpdateLog]:
    with UpdateLog(tmp_path / "log") as opened:
        yield opened


@pytest.fixture
def crash_hook(monkeypatch: pytest.MonkeyPatch):
    def install(hook):
        monkeypatch.setattr(ul, "_crash_hook", hook)
    return install


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of process crashes (simulated in-process): the page cache outlives them, so
    syncing only makes such tests slow (hundreds of opens on a busy disk)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def only_segment(directory: Path) -> Path:
    (segment,) = list_segments(directory)
    return segment[1]


# ---- records ----------------------------------------------------------------------------------
@pytest.mark.parametrize("record", [
    EdgeRecord(1, 1.5, [[0, 1], [2, 3]], [[4, 5]]),
    EdgeRecord(2, 0.0, np.zeros((0, 2), np.int64), []),
    NodeRecord(3, 2.5, np.arange(12, dtype=np.float32).reshape(3, 4)),
    NodeRecord(4, 2.5, np.zeros((0, 7), np.float32)),
    FeatureRecord(5, 3.5, [9, 1], np.ones((2, 3), np.float32)),
    FeatureRecord(6, 3.5, np.zeros(0, np.int64), np.zeros((0, 3), np.float32)),
    SegmentSeal(7, 4.5),
])
def test_encode_decode_round_trip(record) -> None:
    data = encode(record)
    assert len(data) % 8 == 0 and len(data) >= HEADER_BYTES
    got, end = decode(b"junk" + data + b"more", 4)
    assert got == record and end == 4 + len(data)
    assert got.arrays() == () or got.arrays()[-1].shape == record.arrays()[-1].shape  # F kept
    for cut in range(len(data)):  # every prefix is incomplete
        assert decode(data[:cut]) is None
    for at in (0, 9, 30, len(data) - 1):  # a flipped bit anywhere fails a checksum
        bad = bytearray(data)
        bad[at] ^= 0x10
        assert decode(bytes(bad)) is None


def test_records_refuse_wrong_types_and_shapes() -> None:
    with pytest.raises(TypeError, match="add must be int64"):
        EdgeRecord(1, 0.0, np.zeros((1, 2), np.float32), [])
    with pytest.raises(ValueError, match=r"remove must have shape \[n, 2\]"):
        EdgeRecord(1, 0.0, [], [[1, 2, 3]])
    with pytest.raises(TypeError, match="features must be float32"):
        NodeRecord(1, 0.0, np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="2 node_ids but 1 feature rows"):
        FeatureRecord(1, 0.0, [1, 2], np.zeros((1, 2), np.float32))


# ---- append, replay, torn tails, corruption, the lock -------------------------------------------
def test_version_gap_is_refused(log: UpdateLog) -> None:
    with pytest.raises(ValueError, match="must be 1"):
        log.append(make_record(2))
    log.append(make_record(1))
    with pytest.raises(ValueError, match="does not follow the log's last version 1"):
        log.append(make_record(1))
    assert log.last_version == log.durable_version == 1


def test_replay_equals_appended(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory) as log:
        assert log.last_version == 0 and list(log.records_after(0)) == []
        records = append_range(log, 1, 30)
    log = UpdateLog(directory)
    assert log.open() == 30
    assert list(log.records_after(0)) == records
    assert list(log.records_after(17)) == records[17:]
    assert list(log.records_after(30)) == []
    log.append(make_record(31))
    log.close()


def test_torn_tail_is_truncated_at_every_offset(tmp_path: Path, no_fsync: None) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory) as log:
        records = append_range(log, 1, 4)
        start = only_segment(directory).stat().st_size
        log.append(make_record(5, rows=2))
    whole = only_segment(directory).read_bytes()
    tails = [whole[:cut] for cut in range(start, len(whole))]
    tails.append(whole[:start] + b"\0" * 300)  # a crash may also leave zeroed pages
    for torn in tails:
        shutil.rmtree(directory)
        directory.mkdir()
        ul.segment_path(directory, 1).write_bytes(torn)
        log = UpdateLog(directory)
        assert log.open() == 4, len(torn)
        assert ul.segment_path(directory, 1).stat().st_size == start
        assert list(log.records_after(0)) == records
        log.append(make_record(5))  # the torn version is free again: it was never acknowledged
        log.close()


def test_corrupt_middle_record_names_file_and_offset(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory) as log:
        append_range(log, 1, 2)
        offset = only_segment(directory).stat().st_size
        append_range(log, 3, 5)
    path = only_segment(directory)
    data = bytearray(path.read_bytes())
    data[offset + HEADER_BYTES - 1] ^= 0xFF  # record 3's checksum
    path.write_bytes(bytes(data))
    with pytest.raises(UpdateLogError, match=f"{path}: corrupt record at offset {offset}"):
        UpdateLog(directory).open()


def test_damage_in_a_sealed_segment_is_an_error(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory) as log:
        append_range(log, 1, 3)
        log.write_base(1, {"x": np.zeros(1)}, {})
        append_range(log, 4, 5)
    old = ul.segment_path(directory, 1)
    os.truncate(old, old.stat().st_size - 3)  # its seal torn: not the log's end, so not a tail
    with pytest.raises(UpdateLogError, match=f"{old}: corrupt record at offset"):
        UpdateLog(directory).open()


def test_second_writer_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory):
        with pytest.raises(LogLockedError, match=f"update log {directory} is held by another "
                                                 f"writer \\(pid {os.getpid()}\\)"):
            UpdateLog(directory).open()
    with UpdateLog(directory) as log:  # released on close
        assert log.last_version == 0


# ---- group commit -----------------------------------------------------------------------------
def test_group_commit_shares_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = UpdateLog(tmp_path / "log", fsync="group", group_commit_ms=2.0)
    log.open()
    real_fsync, synced = os.fsync, []

    def counting_fsync(fd: int) -> None:
        covers = log.last_version  # written before the fsync starts, so covered by it
        real_fsync(fd)
        synced.append(covers)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    threads_n, per_thread = 8, 25
    returned, errors = [], []

    def appender(i: int) -> None:
        try:
            for v in range(i + 1, threads_n * per_thread + 1, threads_n):
                while log.last_version != v - 1:  # versions in order: wait for this one's turn
                    time.sleep(0.0001)
                log.append(make_record(v))
                assert max(synced) >= v, "append returned before an fsync covered it"
                returned.append(v)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=appender, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    total = threads_n * per_thread
    assert not errors and sorted(returned) == list(range(1, total + 1))
    assert len(synced) < total / 2, f"{len(synced)} fsyncs for {total} appends"
    assert [r.version for r in log.records_after(0)] == list(range(1, total + 1))
    log.close()


def test_compaction_while_appending(tmp_path: Path) -> None:
    """Appends from 4 threads (group commit) go on while another thread compacts; a follower
    sees every record once, in order, and base + replay after reopening is every record."""
    directory, total = tmp_path / "log", 400
    log = UpdateLog(directory, fsync="group", group_commit_ms=0.5)
    log.open()
    follower, followed = LogFollower(directory, 0), []
    order, errors = threading.Lock(), []

    def appender() -> None:
        try:
            while True:
                with order:  # versions assigned in order, durability awaited outside the lock
                    v = log.last_version + 1
                    if v > total:
                        return
                    log.write(make_record(v))
                log.wait_durable(v)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)

    def compactor() -> None:
        try:
            while log.durable_version < total:
                v = log.durable_version
                if v > (log.base_version or 0):
                    log.write_base(v, base_arrays(v), {"version": v})
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=appender) for _ in range(4)]
    threads.append(threading.Thread(target=compactor))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        followed += follower.poll()
    followed += follower.poll()
    assert not errors
    assert followed == [make_record(v) for v in range(1, total + 1)]
    log.close()
    with UpdateLog(directory) as log:
        version, arrays, _ = log.load_base()
        assert version > 0 and np.array_equal(arrays["applied"], np.arange(1, version + 1))
        assert [r.version for r in log.records_after(version)] == list(range(version + 1,
                                                                             total + 1))


# ---- crashes ----------------------------------------------------------------------------------
def base_arrays(version: int) -> dict[str, np.ndarray]:
    """A base 'graph at version v': the versions applied, a second array to write, and one
    every version shares (a later base links it instead of writing it)."""
    return {"applied": np.arange(1, version + 1, dtype=np.int64), "rows": np.ones((version, 2)),
            "same": np.arange(6, dtype=np.int32)}


def compaction_scenario(directory: Path, crash_at: tuple[str, int] | None, install) -> list:
    """Records 1..12, a base at 3 (so records 4..6 sit in a sealed segment), then a base at 9
    that crashes at ``crash_at`` (the n-th time that crash point is reached). Returns the names
    of the crash points reached."""
    with UpdateLog(directory) as log:
        records = append_range(log, 1, 6)
        log.write_base(3, base_arrays(3), {"version": 3})
        records += append_range(log, 7, 12)
        seen: list[str] = []

        def hook(name: str) -> None:
            seen.append(name)
            if crash_at is not None and (name, seen.count(name)) == crash_at:
                raise Crash(name)

        install(hook)
        try:
            log.write_base(9, base_arrays(9), {"version": 9})
        except Crash:
            pass
        finally:
            install(None)
    return seen


def check_recovered(directory: Path, last: int) -> int:
    """Base + replay is every record 1..last exactly once; returns the base's version."""
    log = UpdateLog(directory)
    assert log.open() == last
    version, arrays, meta = log.load_base()
    assert meta == {"version": version} and version in (3, 9)
    assert np.array_equal(arrays["applied"], np.arange(1, version + 1))
    assert np.array_equal(arrays["same"], np.arange(6))
    replayed = list(log.records_after(version))
    assert replayed == [make_record(v) for v in range(version + 1, last + 1)]
    leftovers = [p.name for p in directory.iterdir()
                 if p.name.endswith(".tmp") or (p.name.startswith("base-")
                                                and p.name != f"base-{version:020d}")]
    assert leftovers == []
    log.append(make_record(last + 1))  # the log goes on: append, compact, replay
    log.write_base(last + 1, base_arrays(last + 1), {"version": last + 1})
    log.close()
    with UpdateLog(directory) as log:
        assert log.load_base()[0] == last + 1 and list(log.records_after(last + 1)) == []
        assert len(list_segments(directory)) == 1
    return version


def test_crash_at_every_write_base_step(tmp_path: Path, crash_hook, no_fsync: None) -> None:
    points = compaction_scenario(tmp_path / "reference", None, crash_hook)
    steps = sorted({(name, points[:i + 1].count(name)) for i, name in enumerate(points)},
                   key=lambda s: points.index(s[0]))
    assert {"base.array", "current.renamed", "rotate.sealed", "drop.segment", "drop.base"} \
        <= set(points)
    bases = set()
    for step in steps:
        directory = tmp_path / f"{step[0]}-{step[1]}"
        compaction_scenario(directory, step, crash_hook)
        bases.add(check_recovered(directory, 12))
    assert bases == {3, 9}  # crashes before and after the switch of CURRENT


@pytest.mark.parametrize("point", ["append.encoded", "append.torn", "append.written",
                                   "append.synced"])
def test_crash_at_every_append_step(tmp_path: Path, crash_hook, point: str) -> None:
    directory = tmp_path / "log"
    with UpdateLog(directory) as log:
        records = append_range(log, 1, 3)
        crash_hook(lambda name: (_ for _ in ()).throw(Crash(name)) if name == point else None)
        with pytest.raises(Crash):
            log.append(make_record(4, rows=3))
        crash_hook(None)
    with UpdateLog(directory) as log:
        got = list(log.records_after(0))
        whole = point in ("append.written", "append.synced")  # written, never acknowledged
        assert got == records + ([make_record(4, rows=3)] if whole else [])


CHILD = """
import sys, numpy as np
from quiver_serve.graph.update_log import UpdateLog, NodeRecord
log = UpdateLog(sys.argv[1], fsync="always")
v = log.open()
rng = np.random.default_rng(int(sys.argv[2]))
while True:
    v += 1
    log.append(NodeRecord(v, float(v), rng.standard_normal((int(rng.integers(0, 2000)), 16),
                                                          np.float32)))
    print(v, flush=True)
"""


def test_kill9_of_a_writer_loses_no_acknowledged_record(tmp_path: Path) -> None:
    directory, rng, acked = tmp_path / "log", random.Random(7), 0
    for round_ in range(3):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(round_)],
                                 cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        first = child.stdout.readline()  # writing has begun
        time.sleep(rng.uniform(0.01, 0.3))
        child.send_signal(signal.SIGKILL)
        printed = [int(line) for line in [first, *child.stdout] if line.strip()]
        child.wait()
        assert printed and printed[0] == acked + 1
        with UpdateLog(directory) as log:
            assert log.last_version >= printed[-1]
            assert [r.version for r in log.records_after(0)] == list(range(1, log.last_version
                                                                           + 1))
            acked = log.last_version


# ---- followers --------------------------------------------------------------------------------
def test_follower_sees_new_records_across_rotation(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "log"
    follower = LogFollower(directory, 0)
    assert follower.poll() == []  # before the writer made the folder
    with UpdateLog(directory) as log:
        assert follower.poll() == []
        records = append_range(log, 1, 5)
        assert follower.poll(max_records=2) == records[:2]
        assert follower.poll() == records[2:]

        real_pread, preads = os.pread, []
        monkeypatch.setattr(os, "pread", lambda *a: preads.append(a) or real_pread(*a))
        assert [follower.poll() for _ in range(100)] == [[]] * 100
        assert preads == []  # nothing new: one fstat per poll, nothing read
        monkeypatch.setattr(os, "pread", real_pread)

        log.write_base(3, base_arrays(3), {})  # seals the segment of 1..5, starts one at 6
        records += append_range(log, 6, 8)
        assert follower.poll() == records[5:]
        log.write_base(8, base_arrays(8), {})  # deletes both segments, the follower's included
        records += append_range(log, 9, 10)
        assert follower.poll() == records[8:]

        with pytest.raises(LogCompactedError, match="load the base"):
            LogFollower(directory, 0).poll()
        assert LogFollower(directory, 8).poll() == records[8:]
        follower.close()


def test_follower_never_returns_a_partial_record(log: UpdateLog, crash_hook) -> None:
    follower = LogFollower(log.directory, 0)
    records = append_range(log, 1, 2)
    assert follower.poll() == records
    seen_mid_write = []

    def between_halves(name: str) -> None:
        if name == "append.torn":  # half of the record is in the file
            seen_mid_write.append(follower.poll())
            time.sleep(0.05)
            seen_mid_write.append(follower.poll())

    crash_hook(between_halves)
    big = make_record(3, rows=5000)
    log.append(big)
    crash_hook(None)
    assert seen_mid_write == [[], []]
    assert follower.poll() == [big]


# ---- bases and paths --------------------------------------------------------------------------
def test_write_base_checks_and_load(log: UpdateLog) -> None:
    append_range(log, 1, 4)
    with pytest.raises(ValueError, match="not acknowledged"):
        log.write_base(5, {}, {})
    with pytest.raises(ValueError, match="names a file"):
        log.write_base(2, {"../x": np.zeros(1)}, {})
    with pytest.raises(ValueError, match="pickle"):
        log.write_base(2, {"x": np.array([object()])}, {})
    log.write_base(2, {"x": np.arange(6).reshape(2, 3), "empty": np.zeros((0, 3))}, {"k": [1]})
    with pytest.raises(ValueError, match="must exceed the base in force"):
        log.write_base(2, {}, {})
    version, arrays, meta = load_base(log.directory)
    assert (version, meta) == (2, {"k": [1]}) and arrays["empty"].shape == (0, 3)
    assert isinstance(arrays["x"], np.memmap) and not arrays["x"].flags.writeable
    assert np.array_equal(arrays["x"], np.arange(6).reshape(2, 3))
    assert [r.version for r in log.records_after(2)] == [3, 4]


def test_default_log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_log_dir(tmp_path, "cora-1a2b") == tmp_path / "updates" / "cora-1a2b"
    monkeypatch.setenv("QUIVER_SERVE_CACHE", str(tmp_path / "c"))
    assert default_log_dir(None, "k") == tmp_path / "c" / "updates" / "k"
    for bad in ("../x", "a/b", ".."):
        with pytest.raises(ValueError, match="one file name"):
            default_log_dir(tmp_path, bad)


def test_a_typed_dataset_gets_its_own_default_folder(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Cora and Cora served as papers and words keep their logs apart (the second start used
    to find the other's base and refuse); a typed log already in the folder of the key without
    the typed settings stays where it is."""
    from quiver_serve.config import GraphConfig
    from quiver_serve.graph.living import log_dir

    monkeypatch.setenv("QUIVER_SERVE_GRAPH_STATE", str(tmp_path))
    plain = GraphConfig()
    typed = GraphConfig(words_as_nodes=True, add_reverse_edges=True)
    assert log_dir(plain) != log_dir(typed)
    assert log_dir(plain).parent == log_dir(typed).parent == tmp_path
    assert log_dir(plain) == log_dir(GraphConfig())  # the key of an untyped graph is unchanged
    # an untyped base in the legacy folder: the typed graph takes its own
    with UpdateLog(log_dir(plain)) as log:
        log.write_base(0, {"x": np.zeros(2)}, {"kind": "untyped"})
    own = log_dir(typed)
    assert own != log_dir(plain)
    # a typed base there (written before the typed settings were keyed): it stays there
    shutil.rmtree(log_dir(plain))
    with UpdateLog(log_dir(plain)) as log:
        log.write_base(0, {"x": np.zeros(2)}, {"kind": "typed"})
    assert log_dir(typed) == log_dir(plain)
    own.mkdir(parents=True)  # ... unless its own folder exists already
    assert log_dir(typed) == own
