"""The front-door bench with compiled load clients (``bench.frontdoor.wrk_bench``): Lua body
escaping, the request bodies (KServe binary, gRPC frames), reading wrk's and h2load's output,
best points and ratios, CPU by process role, finding the clients, the GPU suite's step, and a
smoke run against the real daemon on Cora (skipped without wrk)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loadtest import clients as lc
from loadtest import cpu as proc_cpu
from loadtest import report as wrk_report
from loadtest import wrk_lua
from loadtest.results import scrub

REPO_ROOT = Path(__file__).resolve().parents[2]
LUA_SIMPLE = {"n": b"\n", "t": b"\t", "r": b"\r", "\\": b"\\", '"': b'"', "'": b"'", "a": b"\a",
              "b": b"\b", "f": b"\f", "v": b"\v"}


def lua_decode(literal: str) -> bytes:
    """A double-quoted Lua 5.1 string literal's bytes (``\\ddd``: up to three decimal digits)."""
    assert literal[0] == literal[-1] == '"'
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        assert c not in '"\n', f"unescaped {c!r} at {i}"
        if c != "\\":
            out += c.encode("latin-1")
            i += 1
            continue
        digits = re.match(r"\d{1,3}", body[i + 1:])
        if digits:
            assert int(digits.group()) < 256
            out.append(int(digits.group()))
            i += 1 + len(digits.group())
        else:
            out += LUA_SIMPLE[body[i + 1]]
            i += 2
    return bytes(out)


def test_lua_strings_round_trip_every_byte() -> None:
    rng = np.random.default_rng(0)
    cases = [bytes(range(256)), b'"\\\n\r\x00', b"\x01" + b"7" * 5, b"\x0912", b"",
             rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
             np.arange(48, dtype="<i8").tobytes()]
    for data in cases:
        lit = wrk_lua.lua_string(data)
        assert lua_decode(lit) == data
        assert "\n" not in lit and all(32 <= ord(ch) < 127 for ch in lit)


def test_the_script_holds_every_body_with_its_headers() -> None:
    reqs = [np.array([1, 2, 3]), np.array([7, 8, 9])]
    text = wrk_lua.script("kserve-binary", "m", reqs)
    bodies_block = text.split("local bodies = {\n", 1)[1].split("\n}\n", 1)[0]
    literals = bodies_block.split(",\n")
    expected, headers = wrk_lua.encoded_bodies("kserve-binary", reqs)
    assert [lua_decode(s) for s in literals] == expected
    assert '"/v2/models/m/infer"' in text and "Inference-Header-Content-Length" in text
    assert headers["Content-Type"] == "application/octet-stream"
    assert "function response" not in text and wrk_lua.MARKER in text
    assert "function response" in wrk_lua.script("http-json", "m", reqs, statuses=True)
    npy = wrk_lua.script("http-npy", "m", reqs)
    assert '"/v1/embed"' in npy and "application/x-npy" in npy


def test_kserve_binary_body_is_a_json_header_then_raw_int64_ids() -> None:
    ids = np.array([5, 2**40, 0], np.int64)
    [body], headers = wrk_lua.encoded_bodies("kserve-binary", [ids])
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    inp = head["inputs"][0]
    assert inp["datatype"] == "INT64" and inp["shape"] == [3]
    assert inp["parameters"]["binary_data_size"] == 24 == len(body) - n
    assert head["outputs"][0]["parameters"]["binary_data"] is True
    assert np.array_equal(np.frombuffer(body[n:], "<i8"), ids)


def test_bodies_of_different_header_sets_are_refused() -> None:
    with pytest.raises(ValueError, match="headers differ"):
        wrk_lua.encoded_bodies("kserve-binary", [np.arange(3), np.arange(300)])


def test_grpc_frame_and_request_round_trip() -> None:
    from quiver_serve.frontend.grpc.proto import message

    assert lc.grpc_frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
    ids = np.array([3, 1, 4, 1, 5], np.int64)
    raw = lc.model_infer_request("cora-graphsage", ids)
    framed = lc.grpc_frame(raw)
    assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == len(raw)
    msg = message("ModelInferRequest").FromString(framed[5:])
    assert msg.model_name == "cora-graphsage" and list(msg.inputs[0].shape) == [5]
    assert msg.inputs[0].datatype == "INT64"
    assert np.array_equal(np.frombuffer(msg.raw_input_contents[0], "<i8"), ids)


WRK_STDOUT = """Running 3s test @ http://127.0.0.1:8000
  4 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     5.11ms    1.20ms  40.00ms   90.00%
  30000 requests in 3.00s, 300.00MB read
  Non-2xx or 3xx responses: 12
Requests/sec:  10000.00
QS_WRK_JSON {"requests":30000,"duration_us":3000000,"bytes":314572800,"connect":0,"read":2,\
"write":0,"status":12,"timeout":1,"min_us":900,"max_us":40000,"mean_us":5110.0,"p50_us":5000,\
"p90_us":6500,"p99_us":9000,"p999_us":17000}
Transfer/sec:    100.00MB
"""


def test_wrk_output_is_read_from_its_json_line() -> None:
    res = wrk_lua.parse_output(WRK_STDOUT)
    p = wrk_lua.point_of(res, 48)
    assert p["ok"] == 30000 - 12 and p["requests"] == 30000 + 2 + 1
    assert p["errors"] == {"status": 12, "read": 2, "timeout": 1}
    assert p["req_per_s"] == pytest.approx((30000 - 12) / 3.0)
    assert p["seed_nodes_per_s"] == pytest.approx(p["req_per_s"] * 48)
    assert (p["p50_ms"], p["p99_ms"], p["p999_ms"], p["max_ms"]) == (5.0, 9.0, 17.0, 40.0)
    assert p["error_fraction"] == pytest.approx(15 / 30003)
    by_code = wrk_lua.point_of({**res, "statuses": {"200": 29988, "503": 12}}, 48)
    assert by_code["errors"] == {"503": 12, "read": 2, "timeout": 1}
    with pytest.raises(ValueError, match="no result line"):
        wrk_lua.parse_output("unable to connect to 127.0.0.1:1 Connection refused\n")


H2LOAD_STDOUT = """starting benchmark...
spawning thread #0: 4 total client(s). Timing-based test with 0s of warm-up time and 2s of main \
duration for measurements.
finished in 2.00s, 528.50 req/s, 6.25MB/s
requests: 1057 total, 1061 started, 1057 done, 1055 succeeded, 2 failed, 1 errored, 0 timeout
status codes: 1055 2xx, 0 3xx, 0 4xx, 1 5xx
traffic: 12.50MB (13104941) total, 4.83KB (4947) headers (space savings 96.06%), 12.48MB \
(13100000) data
                     min         max         mean         sd        +/- sd
time for request:     5.33ms     14.55ms      7.52ms       947us    74.08%
"""


def test_h2load_summary_and_log_make_a_point(tmp_path: Path) -> None:
    counts = lc.parse_h2load(H2LOAD_STDOUT)
    assert counts["done"] == 1057 and counts["failed"] == 2 and counts["5xx"] == 1
    assert counts["bytes"] == 13104941
    log = tmp_path / "h2.log"
    rows = [f"17955528788{i:05d}\t200\t{1000 + i}" for i in range(1000)]
    log.write_text("\n".join(rows + ["1795552878899999\t503\t800", "1795552878899999\t-1\t5"])
                   + "\n")
    status, dur = lc.read_h2load_log(log)
    assert status.size == 1002 and dur[0] == 1000
    p = lc.h2load_point(counts, status, dur, 2.0, 48)
    assert p["ok"] == 1000 and p["requests"] == 1057
    assert p["errors"] == {"503": 1, "failed": 1}
    assert p["p50_ms"] == pytest.approx(np.percentile(np.arange(1000, 2000), 50) / 1e3)
    assert p["max_ms"] == pytest.approx(1.999) and p["req_per_s"] == 500.0
    assert p["bytes_per_request"] == pytest.approx(13104941 / 1057)
    # h2load appends to its log: a log that still holds an earlier run's requests is refused
    # (it made later points' throughput, percentiles and bytes per request wrong)
    with log.open("a") as f:
        f.write("".join(f"17955528799{i:05d}\t200\t{900 + i}\n" for i in range(1000)))
    status, dur = lc.read_h2load_log(log)
    with pytest.raises(ValueError, match="earlier run"):
        lc.h2load_point(counts, status, dur, 2.0, 48)


def test_short_grpc_answers_count_as_errors() -> None:
    from loadtest.meter import short_answers

    good = {"requests": 10, "ok": 10, "bytes_per_request": 12400.0, "errors": {},
            "error_fraction": 0.0, "req_per_s": 5.0, "seed_nodes_per_s": 240.0}
    short_answers(good, 12334)
    assert good["ok"] == 10 and not good["errors"]
    bad = dict(good, bytes_per_request=60.0, errors={})
    short_answers(bad, 12334)
    assert bad["ok"] == 0 and bad["errors"] == {"short_answers": 10} and bad["error_fraction"] == 1


def point(level: int, seeds: float, p99: float, p999: float, err: float = 0.0) -> dict:
    return {"level": level, "seed_nodes_per_s": seeds, "req_per_s": seeds / 48, "p50_ms": 1.0,
            "p99_ms": p99, "p999_ms": p999, "max_ms": p999, "errors": {}, "ok": 100,
            "error_fraction": err, "daemon_cores": 1.0, "client_cores": 0.1,
            "cpu_ms_per_request": {"main": 0.1, "daemon": 0.5, "client": 0.05}, "path": "x"}


def fake_run(series: dict[str, list[dict]]) -> SimpleNamespace:
    return SimpleNamespace(args=SimpleNamespace(bound_ms=10.0), single={}, series={
        name: {"points": pts, "workload": name.split("/")[0], "label": name}
        for name, pts in series.items()})


def test_best_point_under_the_bound_and_the_ratio_to_the_queue_api() -> None:
    run = fake_run({
        "a/http-npy": [point(16, 1000, 3, 4), point(32, 2000, 8, 20), point(64, 3000, 9, 10, 0.02),
                       point(128, 4000, 12, 13)],
        "a/queue": [point(16, 4000, 2, 3), point(64, 8000, 9, 9.5)],
        "b/http-npy": [point(16, 500, 11, 12)]})
    rows = {r["series"]: r for r in wrk_report.best_rows(run)}
    npy = rows["a/http-npy"]
    assert npy["best"]["level"] == 32  # 64: too many errors; 128: p99 over the bound
    assert npy["over_queue_api"] == pytest.approx(2000 / 8000)
    assert npy["p999_over_p99"] == pytest.approx(2.5) and not npy["p999_within_2x_p99"]
    assert rows["a/queue"]["over_queue_api"] == 1.0 and rows["a/queue"]["p999_within_2x_p99"]
    assert rows["b/http-npy"]["best"] is None and rows["b/http-npy"]["lowest_p99_ms"] == 11
    table = "\n".join(wrk_report.best_table(run, list(rows.values())))
    assert "none (lowest p99 11.0 ms)" in table and "2.50 (> 2x)" in table
    cpu = wrk_report.cpu_rows(run)
    assert [r["row"] for r in cpu] == ["a/http-npy @32", "a/queue @64", "b/http-npy @16"]


def test_result_text_names_no_machine_paths(tmp_path: Path) -> None:
    text = json.dumps({"a": f"{tmp_path}/wrk_a.lua failed", "b": str(REPO_ROOT / "x.yaml")})
    out = scrub(text, tmp_path)
    assert str(tmp_path) not in out and str(REPO_ROOT) not in out
    assert "<run folder>/wrk_a.lua" in out and '"./x.yaml"' in out


def test_stat_lines_with_odd_command_names_are_read() -> None:
    fields = ["S", "7", "7"] + ["0"] * 8 + ["150", "25"] + ["0"] * 30
    line = "42 (python (x) y) " + " ".join(fields)
    assert proc_cpu.parse_stat(line) == (7, 175)


def fake_proc(root: Path, procs: dict[int, tuple[int, int, str]]) -> None:
    """pid -> (ppid, ticks, command line) as /proc files."""
    for pid, (ppid, ticks, cmd) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        fields = ["S", str(ppid), "1"] + ["0"] * 8 + [str(ticks), "0"] + ["0"] * 30
        (d / "stat").write_text(f"{pid} (python) " + " ".join(fields) + "\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode())


def test_process_roles_and_cpu_per_request(tmp_path: Path) -> None:
    spawn = "python -B -c from multiprocessing.spawn import spawn_main"
    tree = {100: (1, 1000, "python server.py"), 101: (100, 10, spawn), 102: (100, 50, spawn),
            103: (100, 20, "python -c from multiprocessing.resource_tracker import main"),
            104: (100, 5, spawn), 105: (104, 7, "nvcc x"), 200: (1, 999, "unrelated")}
    fake_proc(tmp_path, tree)
    workers = [{"role": "frontend", "index": 0, "pid": 101},
               {"role": "engine", "index": 0, "pid": 102}]
    cpu = proc_cpu.TreeCpu(100, workers, proc=tmp_path)
    before = cpu.snap()
    assert set(before.ticks) == {100, 101, 102, 103, 104, 105}
    fake_proc(tmp_path, {100: (1, 1100, "python server.py"), 102: (100, 250, spawn),
                         106: (100, 30, spawn)})
    usage = cpu.usage(before, cpu.snap())
    tick_ms = 1e3 / proc_cpu.CLK_TCK
    assert usage["main"] == pytest.approx(100 * tick_ms)
    assert usage["engine core 0"] == pytest.approx(200 * tick_ms)
    assert usage["standby"] == pytest.approx(30 * tick_ms)  # 104 idle, 106 new
    assert usage["frontend 0"] == 0 and usage["other"] == 0 and usage["resource tracker"] == 0
    fig = proc_cpu.per_request(usage, 100, client_ms=50.0, seconds=2.0)
    per = fig["cpu_ms_per_request"]
    assert per["engine core"] == pytest.approx(2 * tick_ms) and per["client"] == 0.5
    assert per["daemon"] == pytest.approx(300 * tick_ms / 100)  # standbys left out
    assert per["standby"] == pytest.approx(30 * tick_ms / 100)
    assert fig["client_cores"] == pytest.approx(0.025)
    assert proc_cpu.role_class("sampler 3") == "sampler"
    assert proc_cpu.role_class("resource tracker") == "other"
    assert proc_cpu.TreeCpu(999, proc=tmp_path).snap().ticks == {}


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho fake\n")
    path.chmod(0o755)
    return path


def test_clients_are_found_by_env_then_tools_then_path(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUIVER_SERVE_WRK", raising=False)
    root = tmp_path / "repo"
    on_path = executable(tmp_path / "bin" / "wrk")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert lc.find_tool("wrk", root) == lc.Tool("wrk", on_path)
    local = executable(root / ".tools" / "bin" / "wrk")
    (root / ".tools" / "lib").mkdir()
    found = lc.find_tool("wrk", root)
    assert found is not None and found.path == local and found.lib == root / ".tools" / "lib"
    assert found.env()["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(root / ".tools" / "lib")
    given = executable(tmp_path / "elsewhere" / "wrk4")
    monkeypatch.setenv("QUIVER_SERVE_WRK", str(given))
    assert lc.find_tool("wrk", root) == lc.Tool("wrk", given)
    monkeypatch.setenv("QUIVER_SERVE_WRK", str(tmp_path / "missing"))
    assert lc.find_tool("wrk", root) is None
    assert lc.threads_for(256, cpus=16) == 4 and lc.threads_for(2, cpus=16) == 2
    assert lc.threads_for(64, cpus=2) == 1 and lc.threads_for(64, cpus=64) == 4


def test_options_smoke_defaults_and_the_queue_api_order() -> None:
    from bench.frontdoor import wrk_bench

    full = wrk_bench.parse_args([])
    assert full.connections == [16, 32, 64, 128, 256]
    assert full.connections_c == [16, 32, 64, 128, 256, 512, 1024]  # one id: more in flight
    given = wrk_bench.parse_args(["--connections", "64", "384"])
    assert given.connections_c == [64, 384, 768, 1536]
    assert wrk_bench.parse_args(["--connections-c", "8"]).connections_c == [8]
    assert full.workloads == ["a", "b"] and full.queue_workloads == ["a", "b", "c"]
    assert (full.seconds, full.single_seconds, full.config) == (3, 5, "configs/bench_reddit.yaml")
    smoke = wrk_bench.parse_args(["--smoke", "--connections", "2", "--seconds", "2"])
    assert smoke.connections == [2] and smoke.seconds == 2 and smoke.connections_c == [4, 16]
    assert smoke.config == "quiver_serve/defaults/default.yaml" and smoke.budget_s <= 300
    run = SimpleNamespace(args=wrk_bench.parse_args(["--workloads", "b", "a"]))
    assert wrk_bench.queue_order(run) == (["b", "c"], ["a"])  # type: ignore[arg-type]
    run = SimpleNamespace(args=wrk_bench.parse_args(["--no-single"]))
    assert wrk_bench.queue_order(run) == (["a"], ["b"])  # type: ignore[arg-type]


def test_grpc_unary_is_measured_with_the_workloads_distinct_bodies() -> None:
    """h2load posts one body file: every request the same ids, which the engine core merges into
    one set of seeds per batch (about 3x the queue API's seeds/s on the 2-vCPU box). The contract's
    gRPC unary path goes through the generator; h2load's is opt-in and says what it is."""
    from bench.frontdoor import wrk_bench
    from loadtest.meter import ONE_BODY_PATHS, routes

    tool = lc.Tool("h2load", Path("h2load"))
    r = routes({"wrk": None, "h2load": tool})
    assert r["grpc"].client == "gen" and r["grpc"].protocol == "grpc-h2"
    assert r["grpc"].label == "gRPC unary (loadtest.gen)"
    assert r["grpc-aio"].client == "gen" and r["grpc-aio"].protocol == "grpc"
    assert r["grpc-stream"].protocol == "grpc-stream-h2"
    assert r["grpc-stream-aio"].protocol == "grpc-stream"
    assert r["grpc-one-body"].client == "h2load"
    assert r["grpc-one-body"].label == "gRPC unary, one body repeated (h2load)"
    assert r["http-json"].client == "wrk" and r["gen-npy"].label == "HTTP npy (loadtest.gen)"
    defaults = wrk_bench.parse_args([]).paths
    assert "grpc" in defaults and "grpc-stream" in defaults
    assert not {*ONE_BODY_PATHS, "grpc-aio", "grpc-stream-aio"} & set(defaults)
    assert wrk_bench.parse_args(["--paths", "grpc-one-body"]).paths == ["grpc-one-body"]


def test_the_gpu_suite_runs_the_bench_into_the_output_folder(tmp_path: Path) -> None:
    import importlib.util

    from bench.gpu.__main__ import parse_args
    from bench.gpu.suites import MAIN_BENCH, SUITES

    a = parse_args(["frontdoor", "--workloads", "a", "--out-dir", str(tmp_path), "--machine",
                    "h200"])
    a.out_dir = tmp_path
    steps = SUITES["frontdoor"](a)
    bench = steps[-1]
    assert bench.argv[2] == MAIN_BENCH["frontdoor"] == "bench.frontdoor.wrk_bench"
    assert importlib.util.find_spec(bench.argv[2]) and bench.argv[-2:] == ["--workloads", "a"]
    assert bench.timeout_s <= 480 and "--budget-s" in bench.argv
    assert bench.result is not None and bench.result.parent == tmp_path
    assert bench.result.name.startswith("wrk_bench_h200_")


def test_wrk_reads_the_escaped_bodies_as_python_wrote_them(tmp_path: Path) -> None:
    """The Lua escaping through wrk's own LuaJIT: a script's top-level chunk writes the string
    it holds to a file and exits before any connection."""
    wrk = lc.find_tool("wrk")
    if wrk is None:
        pytest.skip("wrk not found ($QUIVER_SERVE_WRK, .tools/bin/ or PATH)")
    data = bytes(range(256)) + b"\x0012\\\"" + np.arange(48, dtype="<i8").tobytes()
    out = tmp_path / "out.bin"
    script = tmp_path / "dump.lua"
    script.write_text(f'local s = {wrk_lua.lua_string(data)}\nlocal f = io.open("{out}", "wb")\n'
                      "f:write(s)\nf:close()\nos.exit(0)\n")
    subprocess.run([str(wrk.path), "-t", "1", "-c", "1", "-d", "1s", "-s", str(script), "http://127.0.0.1:9"],
                   env=wrk.env(), capture_output=True, timeout=30)
    assert out.read_bytes() == data


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_measures_every_path_on_cora(tmp_path: Path) -> None:
    """``--smoke`` with tiny settings: the real daemon on Cora, wrk (and h2load when found), the
    generator (gRPC unary included) and the queue API; no request fails; the tables and the CPU by role are filled."""
    if lc.find_tool("wrk") is None:
        pytest.skip("wrk not found ($QUIVER_SERVE_WRK, .tools/bin/ or PATH)")
    out = tmp_path / "wrk.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.frontdoor.wrk_bench", "--smoke", "--out", str(out),
         "--connections", "2", "--connections-c", "2", "--single-seconds", "1", "--warmup-s",
         "0", "--bodies", "64", "--paths", "http-npy", "kserve-binary", "grpc", "gen-npy",
         "grpc-one-body", "queue", "--queue-workloads", "a"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    text = out.read_text()
    machine_folders = ["/" + "tmp", "/" + "root"]  # built from parts: the hygiene test reads this file
    assert not [f for f in machine_folders if f in text]
    res = json.loads(text)
    expect = {"a/http-npy", "a/kserve-binary", "a/grpc", "a/gen-npy", "a/queue", "c/http-json",
              "c/http-npy"}
    if lc.find_tool("h2load") is not None:
        expect.add("a/grpc-one-body")
    assert expect <= set(res["series"]), (res["skipped"], proc.stdout[-3000:])
    for name in expect:
        assert res["series"][name]["points"], (name, res["skipped"])
        for p in res["series"][name]["points"]:
            assert p["ok"] > 0 and p["error_fraction"] == 0, (name, p)
            assert p["cpu_ms_per_request"]["daemon"] > 0, (name, p)
    assert set(res["single_id"]) == {"c/http-json", "c/http-npy"}
    assert res["daemon"]["http_workers"] >= 1 and res["cpu_rows"]
    assert "Where a request's CPU goes" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| ")


def test_net_counters_read_retransmits_backlog_drops_and_steal(tmp_path: Path) -> None:
    """A lost packet costs a 200 ms retransmission, a stolen vCPU stalls what runs on it: each
    wrk / h2load point records how many, and how long."""
    net = tmp_path / "net"
    net.mkdir()
    (net / "snmp").write_text(
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm RtoMin ActiveOpens RetransSegs InErrs\nTcp: 1 200 10 37 0\n")
    (net / "softnet_stat").write_text("0000a000 00000002 00000000\n0000b000 0000000a 00000000\n")
    tick_ms = 1000 // proc_cpu.CLK_TCK
    stat = "cpu  100 0 50 9000 5 0 1 {steal} 0 0\ncpu0 50 0 25 4500 2 0 1 {steal} 0 0\n"
    (tmp_path / "stat").write_text(stat.format(steal=3))
    before = proc_cpu.net_counters(tmp_path)
    assert before == {"tcp_retrans_segs": 37, "backlog_drops": 12, "cpu_steal_ms": 3 * tick_ms}
    (net / "snmp").write_text("Tcp: RetransSegs\nTcp: 40\n")
    (tmp_path / "stat").write_text(stat.format(steal=8))  # the hypervisor took 5 more ticks
    assert proc_cpu.net_delta(before, proc_cpu.net_counters(tmp_path)) == {
        "tcp_retrans_segs": 3, "backlog_drops": 0, "cpu_steal_ms": 5 * tick_ms}
    assert proc_cpu.net_counters(tmp_path / "missing") == {}
    assert set(proc_cpu.net_counters()) <= {"tcp_retrans_segs", "backlog_drops", "cpu_steal_ms"}


def test_open_files_limit_is_lifted_for_large_sweeps() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no limit on open files here")
    assert lc.raise_open_files(wanted=16) == (soft, soft)  # never lowered
    before, after = lc.raise_open_files(wanted=4096)
    assert before == soft
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    assert after == max(soft, want) == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
