"""The GPU suites: what each runs, with which time limit, log and result name.

Each builder takes the parsed options (``a``: the suite's flags, ``a.extra``: options for the
suite's main bench, ``a.out_dir``, ``a.machine``) and returns its steps. Results are named
``<bench>_<machine>_<date>[_<variant>].json`` in the output folder (``loadtest/results.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench.gpu.runner import Step
from loadtest.results import ROOT, result_name

BENCH_CONFIG = "configs/bench_reddit.yaml"
#: console filters (the logs keep every line): log records, progress bars, blank lines
QUIET = r" INFO |WARNING"
QUIET_PIPELINE = r" INFO |proc/s|^\s*$"
QUIET_EXACT = r" INFO |proc/s|chunk/s|^\s*$"
QUIET_FEATURES = r" INFO |WARNING|^\s*$"
QUIET_MODEL = r" INFO |WARNING|weights is null|adj = |invariant"
QUIET_ROUTING = r" INFO |node/s|size/s|proc/s|^\s*$"
#: the engine core's, CUDA graphs', fast model's and overlap's GPU tests (the shared fixtures)
CORE_GPU_TESTS = ["tests/engine/core/test_engine_core.py", "tests/models/test_graphed.py",
                  "tests/models/test_fast_model.py", "tests/engine/core/test_overlap.py"]
ROUTING_DAEMON_ARGS = [
    "--memory", "uva", "device", "--callers", "32", "128", "256", "384", "--seconds", "0.8",
    "--warmup", "0.4", "--procs", "6", "--budget-s", "400", "--set", "sampling.num_cpu_workers=8",
    "--modes", "cpu", "gpu", "auto", "quiver", "auto:sampling.pool_overlap=serial@uva",
    "auto:sampling.pool_overlap=off@uva"]
#: the typed GPU core's tests (GPU-marked; they read the shared test modules: conftest on)
TYPED_GPU_TESTS = ["tests/sampling/test_typed_sampler_gpu.py",
                   "tests/engine/core/test_typed_gpu_core.py"]
#: what the daemon's queue API needs (the typed bench runs no HTTP front-end)
TYPED_IMPORTS = "import pydantic, zmq, msgspec, orjson"
HEADLINE_IMPORTS = "import fastapi, uvicorn, pydantic, zmq, msgspec, orjson, hpack, aiohttp, matplotlib, grpc"
LOAD_CLIENTS = ("from loadtest.clients import find_tool as f; import sys; "
                "t = [(n, f(n)) for n in ('wrk', 'h2load')]; v = [(n, x and x.version()) for n, x "
                "in t]; print(v); sys.exit(any(x is None or x.startswith('unknown') for _, x in v))")
CPP_BUILD = ("from quiver_serve.sampling.cpu import cpp_sampler_available as a; "
             "print('C++ sampler', a())")


def gpu_test_files() -> list[str]:
    """Every ``tests/**/test_*gpu*.py`` (they run with --noconftest: dependency-free imports)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*gpu*.py"))


def result(a: argparse.Namespace, bench: str, variant: str | None = None) -> Path:
    parts = [v for v in (variant, a.variant) if v]
    return a.out_dir / result_name(bench, a.machine, "_".join(parts) or None)


def pytest_step(name: str, files: list[str], timeout_s: float, log: str, tail_lines: int,
                conftest: bool = False, marker: str | None = "gpu", select: str | None = None,
                kill_after_s: float = 10.0) -> Step:
    argv = ["{python}", "-m", "pytest", *([] if conftest else ["--noconftest"]),
            "-p", "no:cacheprovider", *(["-m", marker] if marker else []), "-q", "-rs", *files,
            *(["-k", select] if select else [])]
    return Step(name, argv, timeout_s, log, kill_after_s, tail_lines=tail_lines)


def bench_step(name: str, module: str, args: list[str], timeout_s: float, log: str,
               res: Path | None, drop: str | None = None, tail_lines: int = 0,
               kill_after_s: float = 10.0) -> Step:
    return Step(name, ["{python}", "-m", module, *args], timeout_s, log, kill_after_s, drop,
                tail_lines, result=res)


def info(argv: list[str], log: str, on_fail: str | None = None) -> Step:
    """A command whose output is information only (its failure does not fail the suite)."""
    return Step(" ".join(argv), argv, 60.0, log, counts=False, on_fail=on_fail)


def gate(a: argparse.Namespace) -> list[Step]:
    """GPU tests, GPU sampler bench, engine stage profile, model compute, engine vs daemon."""
    test_s, bench_s = a.test_timeout_s or 600.0, a.bench_timeout_s or 900.0
    pipeline = result(a, "pipeline", "gate")
    return [
        pytest_step("GPU tests", gpu_test_files(), test_s, "gpu_tests.log", 25),
        pytest_step("engine core GPU tests", CORE_GPU_TESTS, test_s, "gpu_core_tests.log", 5,
                    conftest=True),
        bench_step("GPU sampler bench", "bench.sampling.gpu_sampler",
                   ["--json", str(result(a, "gpu_sampler")), *a.extra], bench_s, "bench_gpu.log",
                   result(a, "gpu_sampler")),
        bench_step("engine core per stage (eager vs CUDA graphs)", "bench.engine.profile_engine",
                   ["--config", BENCH_CONFIG, "--out", str(result(a, "profile_engine"))], bench_s,
                   "profile_engine.log", result(a, "profile_engine"), QUIET),
        bench_step("model compute per batch (PyG vs fast path)", "bench.engine.model",
                   ["--config", BENCH_CONFIG, "--out", str(result(a, "model"))], bench_s,
                   "bench_model.log", result(a, "model"), QUIET_MODEL),
        bench_step("engine core vs daemon (queue API)", "bench.engine.pipeline",
                   ["--config", BENCH_CONFIG, "--out", str(pipeline), *a.pipeline_args], bench_s,
                   "pipeline_gpu.log", pipeline, QUIET_PIPELINE),
    ]


def pipeline(a: argparse.Namespace) -> list[Step]:
    """Engine core vs daemon, workloads a b c, one engine core per GPU."""
    res = result(a, "pipeline")
    args = ["--config", BENCH_CONFIG, "--workloads", "a", "b", "c", "--seconds", "4", "--warmup",
            "1", "--engine-seconds", "2", "--callers", "16", "64", "256", "1024", "--callers-c",
            "1", "16", "64", "--out", str(res), *a.extra]
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log"),
            bench_step("engine core vs daemon", "bench.engine.pipeline", args,
                       a.bench_timeout_s or 470.0, "pipeline.log", res, QUIET_PIPELINE)]


def features(a: argparse.Namespace) -> list[Step]:
    """Gather kernel, adjacency cache, samplers and engine core tests; the feature bench."""
    res = result(a, "features")
    return [
        info(["nvidia-smi", "-L"], "nvidia_smi.log"),
        pytest_step("GPU tests: gather, adjacency cache, samplers",
                    ["tests/features/test_features_gpu.py", "tests/sampling/test_sampler_gpu.py"],
                    a.test_timeout_s or 120.0, "features_gpu_tests.log", 8),
        pytest_step("engine core GPU tests (through the store)", CORE_GPU_TESTS[:2],
                    a.test_timeout_s or 100.0, "features_core_tests.log", 5, conftest=True),
        bench_step("feature store bench", "bench.features.features",
                   ["--out", str(res), *a.extra], a.bench_timeout_s or 330.0,
                   "features_bench.log", res, QUIET_FEATURES),
    ]


def features2(a: argparse.Namespace) -> list[Step]:
    """Replicate vs partition on two GPUs; the two-GPU gather test."""
    res = result(a, "features_2gpu")
    return [
        info(["nvidia-smi", "-L"], "nvidia_smi.log"),
        info(["nvidia-smi", "topo", "-m"], "nvidia_topo.log"),
        pytest_step("two-GPU gather tests", ["tests/features/test_features_gpu.py"],
                    a.test_timeout_s or 120.0, "features2_tests.log", 5,
                    select="two_gpus or cuda_graph"),
        bench_step("feature store on two GPUs", "bench.features.features_2gpu",
                   ["--out", str(res), *a.extra], a.bench_timeout_s or 400.0,
                   "features2_bench.log", res, QUIET_FEATURES),
    ]


def features_e2e(a: argparse.Namespace) -> list[Step]:
    """Adjacency cache tests (every layout); UVA + cache vs device; the daemon at 20% features."""
    res = result(a, "features_e2e")
    return [
        info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
        Step("C++ sampler build (beside the tests)", ["{python}", "-c", CPP_BUILD], 600.0,
             "cpp_build.log", tail_lines=1, counts=False, background=True),
        pytest_step("adjacency cache bit for bit, read model",
                    ["tests/sampling/test_adjacency_cache.py", "tests/features/test_features_gpu.py"
                     "::test_sampling_with_the_adjacency_cache_is_bit_identical"],
                    a.test_timeout_s or 70.0, "features_e2e_tests.log", 6, marker=None),
        bench_step("adjacency cache and the daemon with 20% of the features",
                   "bench.features.features_e2e", ["--out", str(res), *a.extra],
                   a.bench_timeout_s or 390.0, "features_e2e_bench.log", res,
                   r" INFO |WARNING|proc/s|^\s*$"),
    ]


def routing(a: argparse.Namespace) -> list[Step]:
    """Routing modes x mixes x GPU memory: engine direct, or (--daemon) the real daemon."""
    name = "routing_daemon" if a.daemon else "routing"
    res = result(a, name)
    fixed = ROUTING_DAEMON_ARGS if a.daemon else ["--callers", "4", "16", "64", "--seconds", "2",
                                                  "--samplers", "8"]
    args = ["--config", BENCH_CONFIG, *fixed, "--out", str(res), *a.extra]
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log"),
            bench_step(f"routing modes ({'daemon' if a.daemon else 'engine direct'})",
                       f"bench.routing.{name}", args, a.bench_timeout_s or 470.0, f"{name}.log",
                       res, QUIET_ROUTING)]


def headline(a: argparse.Namespace) -> list[Step]:
    """quiver-serve (routes, every protocol, the queue API) against the PyG-style baseline."""
    variant = "single-id" if "--single-only" in a.extra else "smoke" if "--smoke" in a.extra \
        else None
    args = ["--out", str(a.out_dir), "--machine", a.machine, "--budget-s", "460",
            *(["--variant", "_".join(v for v in (variant, a.variant) if v)]
              if a.variant else []), *a.extra]
    return [
        Step("server packages", ["{python}", "-c", HEADLINE_IMPORTS], 120.0, "imports.log",
             required=True, on_fail="missing Python packages: carry them as wheels in .whl/ "
                                    "(bench/README.md, the GPU runner)"),
        Step("uvloop, httptools", ["{python}", "-c", "import uvloop, httptools"], 60.0,
             "imports_fast.log", counts=False,
             on_fail="WARNING: uvloop or httptools missing: uvicorn runs on asyncio/h11, every "
                     "HTTP request costs more CPU (carry their wheels in .whl/)"),
        info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no nvidia-smi: CPU only"),
        bench_step("headline", "bench.frontdoor.headline", args, a.bench_timeout_s or 520.0,
                   "headline.log", result(a, "headline", variant), QUIET_PIPELINE,
                   kill_after_s=30.0),
    ]


def trace(a: argparse.Namespace) -> list[Step]:
    """One small request stage by stage per route; the single-id point from load processes."""
    scale = ["--scale", a.scale] if a.scale else []
    timeout_s = a.bench_timeout_s or 200.0
    steps = [bench_step(f"route {route}", "bench.engine.trace_latency",
                        ["--config", BENCH_CONFIG, "--route", route, "--requests",
                         str(a.requests), *scale, "--out",
                         str(result(a, "trace_latency", route)), *a.extra],
                        timeout_s, f"trace_{route}.log", result(a, "trace_latency", route),
                        QUIET, tail_lines=26)
             for route in a.routes]
    single = result(a, "pipeline", "single-id")
    steps.append(bench_step(
        "single id from load processes (workload c, 1 caller)", "bench.engine.pipeline",
        ["--config", BENCH_CONFIG, "--workloads", "c", "--callers-c", "1", "--batch-sizes-c", "1",
         "--seconds", "3", "--warmup", "1", *scale, "--out", str(single)],
        timeout_s, "single_id.log", single, QUIET_PIPELINE, tail_lines=6))
    return steps


def front_door(a: argparse.Namespace) -> list[Step]:
    """Another checkout's daemon (A) and this one's (B) in turn, each measured by the front-door
    bench (one keep-alive client, single requests)."""
    other = Path(a.other or "").resolve()
    if not a.other or not (other / "server.py").exists():
        raise SystemExit(f"front_door: name another checkout of the project (A), a folder with "
                         f"server.py (got {a.other!r})")
    steps = []
    for r in range(1, a.rounds + 1):
        for checkout, label, cache in ((other, f"{a.label_a}_{r}", a.cache_a),
                                       (ROOT, f"{a.label_b}_{r}", a.cache_b)):
            env = {"QUIVER_SERVE__SERVER__HTTP_WORKERS": str(a.http_workers)}
            if cache:
                env["QUIVER_SERVE_CACHE"] = cache
            res = result(a, "front_door", label)
            steps.append(Step(
                f"front door {label}", ["{python}", "-m", "bench.frontdoor.front_door", "--url",
                                        "{url}", "--label", label, "--out", str(res), *a.extra],
                a.bench_timeout_s or 900.0, f"front_door_{label}.log", result=res,
                daemon={"cwd": checkout, "args": ["--log-level", "warning"], "env": env,
                        "name": f"server {label}", "ready_timeout_s": 120.0,
                        "python": a.python}))
    return steps


def updates(a: argparse.Namespace) -> list[Step]:
    """Serving under graph updates: capacity for (b), 80% of it without and with edge updates
    stepped up, staleness, a forced compaction."""
    res = result(a, "updates", "smoke" if "--smoke" in a.extra else None)
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
            bench_step("serving under graph updates", "bench.graph.updates",
                       ["--out", str(res), "--machine", a.machine, *a.extra],
                       a.bench_timeout_s or 560.0, "updates.log", res, QUIET_PIPELINE,
                       kill_after_s=30.0)]


def exact(a: argparse.Namespace) -> list[Step]:
    """The exact table vs exact embeddings on the fly (HTTP npy and the queue API), sampled
    requests beside, the table's build (and a products-scale one), its refresh under updates."""
    res = result(a, "exact_table", "smoke" if "--smoke" in a.extra else None)
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
            bench_step("exact table vs on the fly", "bench.graph.exact_table",
                       ["--out", str(res), "--machine", a.machine, *a.extra],
                       a.bench_timeout_s or 560.0, "exact_table.log", res, QUIET_EXACT,
                       kill_after_s=30.0)]


def reload(a: argparse.Namespace) -> list[Step]:
    """A new model version loaded under load: capacity for (a), 80% of it steady, then the
    load call: time to the new version's first answer, p99 during the swap, failed requests."""
    res = result(a, "reload", "smoke" if "--smoke" in a.extra else None)
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
            bench_step("model reload under load", "bench.models.reload",
                       ["--out", str(res), "--machine", a.machine, *a.extra],
                       a.bench_timeout_s or 560.0, "reload.log", res, QUIET_PIPELINE,
                       kill_after_s=30.0)]


#: the change bench's settings of the issue: group commit, a large overlay, 2,000 pairs a call
CHANGE_ARGS = ["--set", "graph.fsync=group", "--set", "graph.overlay_capacity_edges=268435456",
               "--edges-per-call", "2000", "--budget-s", "400"]


def change(a: argparse.Namespace) -> list[Step]:
    """Serving through change: capacity for (b), 80% of it steady, then edge updates at 10 k /
    50 k / 100 k per s, a model load, a forced compaction, kill -9 of an engine core (about 8
    minutes; a later --budget-s in the bench's options replaces 400)."""
    res = result(a, "change", "smoke" if "--smoke" in a.extra else None)
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
            bench_step("serving through change", "bench.graph.change",
                       ["--out", str(res), "--machine", a.machine, *CHANGE_ARGS, *a.extra],
                       a.bench_timeout_s or 480.0, "change.log", res, QUIET_PIPELINE,
                       kill_after_s=30.0)]


def restart(a: argparse.Namespace) -> list[Step]:
    """A first start (the synthetic graph generated and snapshotted, every cache computed) and
    a start again after kill -9 of the whole daemon, at papers100M x 0.2 (decision 0039; a
    later --scale in the bench's options replaces it)."""
    res = result(a, "restart", None)
    return [info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: CPU run"),
            bench_step("first start and restart after kill -9", "bench.graph.restart",
                       ["--out", str(res), "--machine", a.machine, "--scale", "0.2", *a.extra],
                       a.bench_timeout_s or 580.0, "restart.log", res, QUIET_PIPELINE,
                       kill_after_s=30.0)]


def frontdoor(a: argparse.Namespace) -> list[Step]:
    """The front door with compiled load clients (wrk for HTTP, h2load for gRPC) beside the
    project's generator and the queue API, CPU per request by process role (~7 minutes)."""
    res = result(a, "wrk_bench", "smoke" if "--smoke" in a.extra else None)
    return [
        Step("server packages", ["{python}", "-c", HEADLINE_IMPORTS], 120.0, "imports.log",
             required=True, on_fail="missing Python packages: carry them as wheels in .whl/ "
                                    "(bench/README.md, the GPU runner)"),
        Step("wrk, h2load", ["{python}", "-c", LOAD_CLIENTS], 60.0, "wrk_h2load.log",
             counts=False, on_fail="WARNING: a load client is missing or does not run: its "
                                   "paths are skipped (carry .tools/: bench/README.md)"),
        info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no nvidia-smi: CPU only"),
        bench_step("front door, compiled clients", "bench.frontdoor.wrk_bench",
                   ["--out", str(res), "--machine", a.machine, "--budget-s", "400", *a.extra],
                   a.bench_timeout_s or 470.0, "wrk_bench.log", res, QUIET_PIPELINE,
                   kill_after_s=30.0),
    ]


def typed(a: argparse.Namespace) -> list[Step]:
    """The typed graph on the GPU: its GPU tests (kernels against the reference, the GPU core
    against the CPU core and PyG's full graph), then the typed contract on the ogbn-mag-shaped
    synthetic graph (engine core driven directly and the queue API, one run)."""
    res = result(a, "typed_mag", "smoke" if "--smoke" in a.extra else None)
    return [
        Step("server packages", ["{python}", "-c", TYPED_IMPORTS], 120.0, "imports.log",
             required=True, on_fail="missing Python packages: carry them as wheels in .whl/ "
                                    "(bench/README.md, the GPU runner)"),
        info(["nvidia-smi", "-L"], "nvidia_smi.log", on_fail="no GPU: smoke run"),
        pytest_step("typed GPU tests", TYPED_GPU_TESTS, a.test_timeout_s or 600.0,
                    "typed_gpu_tests.log", 10, conftest=True),
        bench_step("typed mag contract", "bench.typed.serve_mag",
                   ["--out", str(res), "--machine", a.machine, *a.extra],
                   a.bench_timeout_s or 900.0, "typed_mag.log", res, QUIET_PIPELINE,
                   kill_after_s=30.0),
    ]


#: the bench each suite hands the options it does not know (routing --daemon: routing_daemon)
MAIN_BENCH = {
    "gate": "bench.sampling.gpu_sampler", "pipeline": "bench.engine.pipeline",
    "features": "bench.features.features", "features2": "bench.features.features_2gpu",
    "features_e2e": "bench.features.features_e2e", "routing": "bench.routing.routing",
    "headline": "bench.frontdoor.headline", "trace": "bench.engine.trace_latency",
    "front_door": "bench.frontdoor.front_door", "updates": "bench.graph.updates",
    "exact": "bench.graph.exact_table", "reload": "bench.models.reload",
    "frontdoor": "bench.frontdoor.wrk_bench", "change": "bench.graph.change",
    "restart": "bench.graph.restart", "typed": "bench.typed.serve_mag",
}

SUITES: dict[str, Callable[[argparse.Namespace], list[Step]]] = {
    "gate": gate, "pipeline": pipeline, "features": features, "features2": features2,
    "features_e2e": features_e2e, "routing": routing, "headline": headline, "trace": trace,
    "front_door": front_door, "updates": updates, "exact": exact, "reload": reload,
    "frontdoor": frontdoor, "change": change, "restart": restart, "typed": typed,
}
