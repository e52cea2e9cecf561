"""The GPU suites' one runner: ``python -m bench.gpu <suite> [options] [bench options]``.

Suites (bench/README.md): gate (GPU tests, GPU sampler bench, engine stage profile, model compute,
engine vs daemon), pipeline (engine vs daemon, workloads a b c), features, features2 (two GPUs),
features_e2e, routing (--daemon: through the real daemon), headline, trace, updates, exact, reload, front_door (two
checkouts' daemons in turn), frontdoor (compiled load clients: wrk, h2load), typed (the typed
GPU tests and the ogbn-mag-shaped typed contract). Options the runner
does not know go to the suite's main bench.

First the wheels carried in .whl/ (git-ignored; fastapi, pydantic, pyzmq, msgspec... that GPU
boxes may lack) are installed into a fresh folder outside the system packages and put first on
PYTHONPATH with the repository (NO_WHEELS=1 or --no-wheels: a box with its own environment).
Logs and JSON go to $OUT (else a fresh temporary folder, named at the end); a summary table is
printed last; the exit status is 1 when a step failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.gpu import runner
from bench.gpu.suites import MAIN_BENCH, SUITES
from loadtest.results import machine_name


def env_list(name: str, default: str) -> list[str]:
    return (os.environ.get(name) or default).split()


def common_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--out-dir", type=Path, help="logs and JSON (default $OUT, else a temp dir)")
    sp.add_argument("--machine", help="machine in the result names (default: detected)")
    sp.add_argument("--variant", help="suffix of every result name of the run")
    sp.add_argument("--no-wheels", action="store_true", default=bool(os.environ.get("NO_WHEELS")),
                    help="do not install .whl/ (also NO_WHEELS=1)")
    sp.add_argument("--python", default=runner.python_default(),
                    help="interpreter of every step (default $PYTHON, else this one)")
    sp.add_argument("--test-timeout-s", type=float, default=_env_float("GPU_TEST_TIMEOUT_S"),
                    help="limit of each pytest step (default: the suite's)")
    sp.add_argument("--bench-timeout-s", type=float, default=_env_float("GPU_BENCH_TIMEOUT_S"),
                    help="limit of each bench step (default: the suite's)")
    sp.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")


def _env_float(name: str) -> float | None:
    return float(os.environ[name]) if os.environ.get(name) else None


def suite_options(name: str, sp: argparse.ArgumentParser) -> None:
    if name == "gate":
        sp.add_argument("--pipeline-args", default=os.environ.get("PIPELINE_ARGS", ""),
                        help="options of the engine-vs-daemon step (one string)")
    elif name == "routing":
        sp.add_argument("--daemon", action="store_true",
                        help="the real daemon (bench.routing.routing_daemon), not the engine core")
    elif name == "trace":
        sp.add_argument("--routes", nargs="+", default=env_list("ROUTES", "auto local gpu"))
        sp.add_argument("--requests", type=int, default=int(os.environ.get("REQUESTS", 2000)))
        sp.add_argument("--scale", default=os.environ.get("SCALE"),
                        help="graph.synthetic_scale (a smoke run on a dev box: 0.005)")
    elif name == "front_door":
        sp.add_argument("other", nargs="?", help="the other checkout (A), e.g. made by git archive")
        sp.add_argument("--rounds", type=int, default=2, help="A, B, A, B, ...")
        sp.add_argument("--http-workers", type=int, default=int(os.environ.get("HTTP_WORKERS", 1)),
                        help="server.http_workers of both daemons (1: the in-process front-end)")
        sp.add_argument("--label-a", default=os.environ.get("LABEL_A", "A"))
        sp.add_argument("--label-b", default=os.environ.get("LABEL_B", "B"))
        sp.add_argument("--cache-a", default=os.environ.get("CACHE_A"),
                        help="QUIVER_SERVE_CACHE of A (default: the usual cache)")
        sp.add_argument("--cache-b", default=os.environ.get("CACHE_B"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=doc.split("\n\n")[0],
                                 epilog=doc.split("\n\n", 1)[1], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, build in SUITES.items():
        sp = sub.add_parser(name, help=(build.__doc__ or "").split("\n")[0].replace("%", "%%"),
                            allow_abbrev=False,
                            description=build.__doc__, add_help=False,
                            epilog=f"Other options go to python -m {MAIN_BENCH[name]} (its "
                                   "options follow this help).")
        sp.add_argument("-h", "--help", action="store_true", help="this help and the bench's")
        common_options(sp)
        suite_options(name, sp)
    args, extra = ap.parse_known_args(argv)
    if args.help:
        print_help(sub.choices[args.suite], args)
    args.extra = extra
    args.pipeline_args = getattr(args, "pipeline_args", "").split()
    return args


def print_help(sp: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The suite's help, then its main bench's (the options it forwards); exits."""
    import subprocess

    sp.print_help()
    modules = [MAIN_BENCH[args.suite]]
    if args.suite == "routing":  # --daemon: the daemon bench; without: both (the help says)
        daemon = "bench.routing.routing_daemon"
        modules = [daemon] if args.daemon else [*modules, daemon]
    for module in modules:
        print(f"\n--- options forwarded to python -m {module} ---", flush=True)
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                             text=True, timeout=300)
        print(out.stdout or out.stderr, flush=True)
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = a.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else
                        Path(tempfile.mkdtemp(prefix=f"quiver_serve_{a.suite}.")))
    a.out_dir = out.resolve()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    a.machine = a.machine or machine_name()
    steps = SUITES[a.suite](a)
    if a.dry_run:
        for s in steps:
            print(f"{s.name}: {' '.join(s.argv)}  (limit {s.timeout_s:.0f} s, log {s.log})")
        return 0
    try:
        site = runner.install_wheels(a.python, a.no_wheels)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    runner.prologue_env(site, a.out_dir)
    print(f"suite {a.suite} on {a.machine}: {len(steps)} steps; logs and JSON in {a.out_dir}",
          flush=True)
    return runner.summary(a.suite, runner.run_steps(steps, a.python, a.out_dir), a.out_dir)


if __name__ == "__main__":
    sys.exit(main())
