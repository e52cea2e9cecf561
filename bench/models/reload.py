#!/usr/bin/env python
"""Reloading a model under load (docs/architecture.md, "Models and versions"): a new GraphSAGE
version loaded while the daemon serves.

One daemon (``server.py``, the graph of --config saved once as an .npz) serving a model repository
in a temporary folder: model ``sage``, the class and kwargs of --config's model section
(in_channels from the graph), ``version_policy: {latest: 1}``, only version 1 on disk at start.
Workload (a) (48 ids from the 1,500-node hot set, half low- and half high-degree) over HTTP npy:

1. capacity: closed-loop callers doubling (the load generator's processes, ``loadtest/``) until
   p99 passes --stop-p99-ms; capacity = the most req/s at p99 <= --capacity-bound-ms (0: the
   most req/s of any point);
2. steady: open loop (Poisson) at --load-fraction of it for --steady-s: p50 / p99 / p99.9;
3. reload: the same load; --before-s into the window, version 2 (the same class, other random
   weights: seeds 1 and 2) lands in the repository and ``POST /v2/repository/models/sage/load``
   is called. Measured: the call's wall time; the time from the call to the first answer naming
   version 2 (``x-model-version``); failed requests (any non-200, warm-up included) over the
   whole run; p50 / p99 / p99.9 of the requests sent before the call, during the swap (from the
   call until --swap-s after both the first version-2 answer and the call's answer: the old
   version's drain and unload included) and after it; p99 swap / steady; each engine core's load
   times (build, CUDA graphs, warm-up: its log line) and the repository index after.

The open-loop runs go through ``loadtest/recorder.py`` (the load generator's schedule,
requests and bodies; every request's completion time and answering version kept). Targets (the
issue): 0 failed requests, the first version-2 answer <= 2 s after the call, p99 during the swap
<= 2x steady. Budgeted (--budget-s): a step that would start past it is skipped and named. The
JSON goes to --out, else --out-dir (default $OUT, else bench/results/) as
reload_<machine>_<date>[_<variant>].json; a table is printed last.

    python -m bench.models.reload                    # Reddit-scale, configs/bench_reddit.yaml
    python -m bench.models.reload --smoke            # Cora on a CPU box, under a minute
    python -m bench.gpu reload                       # the GPU runner's suite
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.graph.updates import measure_capacity
from bench.models.reload_report import (
    NEW,
    OLD,
    print_summary,
    reload_figures,
    reload_line,
    row_line,
    serving_lines,
    targets,
)
from loadtest import watch
from loadtest.gen import Generator, add_capacity_options
from loadtest.harness import Daemon, Session, save_graph, serve_config
from loadtest.recorder import NO_VERSION, VERSION_HEADER, RecorderPool
from loadtest.results import (
    Budget,
    add_run_options,
    doc_parser,
    exit_on_sigterm,
    load_config,
    print_head,
    result_path,
    run_meta,
    smoke_settings,
    write_result,
)
from loadtest.stats import capacity_text

MODEL = "sage"
LOAD_PATH = f"/v2/repository/models/{MODEL}/load"
INDEX_PATH = "/v2/repository/index"
SERVER_GRACE_S = 8.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser("python -m bench.models.reload", __doc__)
    add_run_options(ap, budget_s=500.0, start_timeout_s=600.0)
    add_capacity_options(ap, [16, 32, 64, 128, 256])
    ap.add_argument("--steady-s", type=float, default=20.0, help="measured window of the steady run")
    ap.add_argument("--before-s", type=float, default=5.0,
                    help="reload run: measured seconds before the load call")
    ap.add_argument("--reload-window-s", type=float, default=20.0,
                    help="reload run: measured seconds from the load call on (the swap and after)")
    ap.add_argument("--swap-s", type=float, default=2.0,
                    help="the swap window ends this long after the first new-version answer "
                         "and the load call's answer")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--load-config", help="JSON of the load call's parameters.config "
                    "(version_policy, traffic); default: none (the repository's config.yaml)")
    ap.add_argument("--first-answer-target-s", type=float, default=2.0)
    ap.add_argument("--p99-ratio-target", type=float, default=2.0)
    ap.add_argument("--admin-token", help="server.admin_token, sent as the bearer token")
    ap.add_argument("--load-timeout-s", type=float, default=300.0,
                    help="longest the load call is waited for")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke(args)
    return args


def smoke(args: argparse.Namespace) -> None:
    """Cora, short windows, low load; the pure-torch sampler (no C++ build in the time)."""
    smoke_settings(args, budget_s=75.0)
    args.capacity_callers, args.capacity_seconds, args.warmup = [1, 2, 4], 0.8, 0.3
    args.steady_s, args.before_s, args.reload_window_s = 1.5, 1.0, 4.0
    args.swap_s = min(args.swap_s, 1.0)
    args.load_fraction = min(args.load_fraction, 0.5)  # a 2-core box runs daemon and load alike


class Run(Budget):
    """The run's state: budget, daemon, load processes, the repository, results."""

    def __init__(self, args: argparse.Namespace, daemon: Daemon, gen: Generator,
                 rec: RecorderPool, facts: dict, t0: float) -> None:
        super().__init__(args.budget_s, t0)
        self.args, self.daemon, self.url = args, daemon, daemon.url
        self.gen, self.rec, self.facts = gen, rec, facts
        self.headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
        self.spec = {"workload": "a", "hot": facts["hot"], "num_nodes": facts["num_nodes"],
                     "seed": 0, "ids_per_request": args.ids_per_request}
        self.target = {"protocol": "http-npy", "url": self.url, "model": MODEL,
                       "timeout_s": args.timeout_s, "http_client": "aiohttp"}
        self.capacity: dict[str, Any] = {}
        self.steady: dict[str, Any] | None = None
        self.reload: dict[str, Any] | None = None

    def run_cost_s(self, seconds: float) -> float:
        return seconds + self.args.warmup + 3.0

    def rate(self) -> float:
        return self.args.load_fraction * self.capacity["req_per_s"]


def steady_run(run: Run) -> None:
    """Open loop at the run's rate, version 1 serving, no load call."""
    a = run.args
    print(f"\n== steady: {run.rate():,.0f} req/s open loop, {a.steady_s:g} s ==", flush=True)
    recs = run.rec.run(run.url, run.spec, run.rate(), a.warmup, a.steady_s, a.timeout_s)
    run.steady = {"offered_req_per_s": run.rate(), **recs.window(recs.win0, recs.win1),
                  "failed_run": recs.failed(), "statuses_run": recs.statuses(),
                  "load_cpu_cores": recs.cpu_cores, "conn_errors": recs.conn_errors}
    print(row_line("steady", run.steady), flush=True)
    if str(NO_VERSION) in run.steady["versions"]:
        print(f"WARNING: answers without {VERSION_HEADER}: no version can be told apart",
              flush=True)


def reload_run(run: Run) -> None:
    """Open loop at the run's rate; --before-s into the window, version 2 written and loaded."""
    a = run.args
    call: dict[str, Any] = {}
    threads: list[threading.Thread] = []

    def on_start(t_start: float) -> None:
        at = t_start + a.warmup + a.before_s
        threads.append(threading.Thread(target=load_at, args=(run, at, call), daemon=True))
        threads[0].start()

    print(f"\n== reload: {run.rate():,.0f} req/s open loop; version {NEW} loaded {a.before_s:g} s "
          f"into a {a.before_s + a.reload_window_s:g} s window ==", flush=True)
    recs = run.rec.run(run.url, run.spec, run.rate(), a.warmup, a.before_s + a.reload_window_s,
                       a.timeout_s, on_start)
    for t in threads:
        t.join(timeout=a.load_timeout_s + 10)
    run.reload = {"offered_req_per_s": run.rate(),
                  **reload_figures(recs, call, a.swap_s, run.steady)}
    run.reload["engines"] = serving_lines(run.daemon.log_path)
    try:
        status, index = watch.http_json(run.url + INDEX_PATH, "POST", {}, headers=run.headers)
        run.reload["index_after"] = index if status == 200 else {"status": status,
                                                                 "answer": index}
    except OSError as exc:
        run.reload["index_after"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in ("before", "swap", "after"):
        if run.reload["windows"].get(name):
            print(row_line(name, run.reload["windows"][name]), flush=True)
    print(reload_line(run.reload), flush=True)


def load_at(run: Run, at: float, out: dict[str, Any]) -> None:
    """At ``at`` (wall clock): version 2 into the repository (written aside, then renamed into
    place: the daemon never sees half a version), then the load call, timed."""
    time.sleep(max(0.0, at - time.time()))
    try:
        t0 = time.time()
        write_version(run.facts["repo"], NEW, run.facts["new_state"])
        out["write_s"] = time.time() - t0
        body: dict[str, Any] = {}
        if run.args.load_config:
            body = {"parameters": {"config": run.args.load_config}}
        out["t_call"] = time.time()
        out["status"], out["answer"] = watch.http_json(
            run.url + LOAD_PATH, "POST", body, timeout_s=run.args.load_timeout_s,
            headers=run.headers)
    except OSError as exc:  # no answer (timeout, connection): named in the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["t_answer"] = time.time()


def write_version(repo: Path, version: int, state: dict) -> None:
    """``repo/sage/<version>/model.pt``, written under a name no version has, then renamed."""
    import torch

    folder = repo / MODEL
    tmp = folder / f".incoming-{version}"
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp / "model.pt")
    tmp.rename(folder / str(version))


def random_state(cfg: Any, in_channels: int, seed: int) -> dict:
    """A state_dict of --config's model class and kwargs, random weights of ``seed``."""
    import torch
    from torch_geometric.nn import models as pyg_models

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in cfg.model.kwargs.items() if k != "in_channels"}
    model = getattr(pyg_models, cfg.model.pyg_class)(in_channels=in_channels, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_repository(cfg: Any, folder: Path, in_channels: int) -> tuple[Path, dict[str, Any]]:
    """``folder/repository`` holding model ``sage`` (--config's class and kwargs,
    ``version_policy: {latest: 1}``) with version 1 only; its path and its config.yaml."""
    import yaml

    repo = folder / "repository"
    kwargs = {k: v for k, v in cfg.model.kwargs.items() if k != "in_channels"}
    model_cfg = {"class": cfg.model.pyg_class, "kwargs": kwargs,
                 "version_policy": {"latest": 1}}
    (repo / MODEL).mkdir(parents=True)
    (repo / MODEL / "config.yaml").write_text(yaml.safe_dump(model_cfg))
    write_version(repo, OLD, random_state(cfg, in_channels, OLD))
    return repo, model_cfg


def prepare(cfg: Any, folder: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The graph saved as an .npz; the repository with version 1 only (version 2's weights kept
    for the load); the daemon's config serving the repository."""
    import yaml

    from loadtest.workloads import hot_set

    graph, npz = save_graph(cfg, folder)
    repo, model_cfg = make_repository(cfg, folder, graph.num_features)
    fields = {"graph.update_log_dir": str(folder / "graph-state"),
              "models.repository": str(repo), "models.default": MODEL}
    if args.admin_token:
        fields["server.admin_token"] = args.admin_token
    path = serve_config(cfg, npz, folder, fields=fields)
    facts = {"num_nodes": graph.num_nodes, "num_features": graph.num_features,
             "graph": graph.describe(), "hot": hot_set(graph.degree().numpy()), "repo": repo,
             "model_config": model_cfg, "new_state": random_state(cfg, graph.num_features, NEW),
             "serve_config": yaml.safe_load(path.read_text())}
    return path, facts


def meta(args: argparse.Namespace, cfg: Any, facts: dict) -> dict[str, Any]:
    return run_meta(
        args, cfg, graph=facts["graph"],
        model=f"{cfg.model.pyg_class} {cfg.model.kwargs} (versions {OLD} and {NEW}: "
              f"random weights, seeds {OLD} and {NEW})",
        repository_config=facts["model_config"], protocol="http-npy",
        workload=f"a ({args.ids_per_request} ids from the 1,500-node hot set)",
        load_fraction=args.load_fraction, steady_s=args.steady_s, before_s=args.before_s,
        reload_window_s=args.reload_window_s, swap_s=args.swap_s, warmup_s=args.warmup,
        load_procs=args.procs, load_config=args.load_config, config_file=args.config,
        serve_config=facts["serve_config"])


def phases(run: Run) -> None:
    a = run.args
    if not run.afford("capacity", len(a.capacity_callers) * run.run_cost_s(a.capacity_seconds)):
        return
    measure_capacity(run, "(a)")
    if run.afford("steady", run.run_cost_s(a.steady_s)):
        steady_run(run)
    if run.afford("reload", run.run_cost_s(a.before_s + a.reload_window_s)):
        reload_run(run)


def finish(a: argparse.Namespace, run: Run | None, info: dict, out: Path, skipped: list[str],
           t0: float) -> None:
    """The JSON, then the summary and the table printed last."""
    capacity = {k: v for k, v in (run.capacity if run else {}).items() if k != "points"}
    steady, reloaded = (run.steady, run.reload) if run else (None, None)
    result = {"meta": info, "capacity": capacity,
              "capacity_points": (run.capacity.get("points") if run else None) or [],
              "steady": steady, "reload": reloaded,
              "targets": targets(steady, reloaded, a.first_answer_target_s, a.p99_ratio_target),
              "skipped": skipped + (run.skipped if run else []),
              "wall_s": time.perf_counter() - t0}
    write_result(out, result)
    print_head(result, info, "(a) http-npy")
    if run is not None and capacity:
        print(f"{capacity_text(capacity)}; open loop at {a.load_fraction:g} of it "
              f"({run.rate():,.0f} req/s)")
    print_summary(result)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    cfg = load_config(args.config, args.sets)
    out = result_path("reload", args, "smoke" if args.smoke else None)
    run, info, s = None, {}, Session("qs-reload-")
    try:
        with s:
            conf, facts = prepare(cfg, s.folder, args)
            info = meta(args, cfg, facts)
            daemon = s.serve(conf, smoke=args.smoke, ready_timeout_s=args.start_timeout_s,
                             grace_s=SERVER_GRACE_S)
            gen = s.own(Generator(args.procs, args.warmup, args.capacity_seconds))
            rec = s.own(RecorderPool(args.procs))
            print(f"daemon ready in {daemon.wait_ready():.1f} s; {args.procs} load process(es)",
                  flush=True)
            run = Run(args, daemon, gen, rec, facts, s.t0)
            phases(run)
            if run.reload and run.reload["load_call"]["status"] != 200:
                s.code = 1  # the bench did not do what it measures: the result names why
    finally:
        finish(args, run, info, out, s.skipped, s.t0)
    return s.code


if __name__ == "__main__":
    sys.exit(main())
