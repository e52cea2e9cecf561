"""What every bench's run shares besides the daemon (``loadtest/harness.py``) and the load
(``loadtest/gen.py``, ``loadtest/meter.py``): ``--set section.key=value`` config overrides
(validated through the pydantic config, like the daemon's ``QUIVER_SERVE__SECTION__KEY``
environment overrides), a time budget (:class:`Budget`), and the result file: where it goes, its
name, its ``meta`` (:func:`run_meta`: machine, commit, command, date) and its writing
(:func:`write_result`).

Results: ``<bench>_<machine>_<date>[_<variant>].json`` (date in UTC, ``YYYY-MM-DD``), in the
folder of ``$OUT`` when set, else ``bench/results/``; ``--out`` names another file. The machine is
``--machine`` or detected: the GPU's model (``h200``, ``h100``; ``h200x2`` for two of them) or
``cpu<cores>`` without one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiver_serve.config import ServeConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
BENCH_CONFIG = "configs/bench_reddit.yaml"  # the GPU benches' graph: Reddit scale


def doc_parser(prog: str | None, doc: str | None) -> argparse.ArgumentParser:
    """A bench's parser from its module docstring: the first paragraph as the description, the
    rest (usage, output) as the epilog, kept as written."""
    text = doc or ""
    head, _, rest = text.partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=head, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_set_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config field (YAML value), repeatable; e.g. "
                         "--set sampling.route=gpu --set sampling.gpu_mode=uva")


def load_config(path: str, sets: list[str] | None = None) -> ServeConfig:
    """The YAML at ``path`` (relative: from the repository root) with ``--set`` overrides
    (pydantic imported here: the GPU runner imports this module before its wheels are in)."""
    from quiver_serve.config import ServeConfig, resolve_path

    cfg = ServeConfig.from_yaml(resolve_path(path))
    return cfg.with_overrides(sets) if sets else cfg


def default_procs() -> int:
    """Load processes by default: a quarter of the CPUs, 1 to 4 (they share the machine)."""
    return max(1, min(4, (os.cpu_count() or 2) // 4))


def add_run_options(ap: argparse.ArgumentParser, *, budget_s: float, start_timeout_s: float,
                    out_file: bool = True) -> None:
    """The options of every bench that starts daemons and drives them with load processes:
    ``--config``, ``--smoke``, ``--procs``, ``--timeout-s``, ``--budget-s``,
    ``--start-timeout-s``, ``--out`` / ``--out-dir`` (``out_file``), ``--set``, ``--machine``,
    ``--variant``."""
    ap.add_argument("--config", default=BENCH_CONFIG)
    ap.add_argument("--smoke", action="store_true", help="Cora (the embedded default config) on "
                    "the CPU, short steps: a check, not a figure")
    ap.add_argument("--procs", type=int, default=default_procs(),
                    help="load processes (default CPUs / 4, 1 to 4)")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="client timeout of a request")
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help="steps that would start past this (from the start) are skipped")
    ap.add_argument("--start-timeout-s", type=float, default=start_timeout_s)
    if out_file:
        ap.add_argument("--out", help="the JSON file (default: in --out-dir, by name)")
        ap.add_argument("--out-dir", help="folder of the JSON (default $OUT, else bench/results/)")
    add_set_option(ap)
    add_result_options(ap)


def smoke_settings(args: argparse.Namespace, budget_s: float, start_timeout_s: float = 120.0,
                   procs: int = 1) -> None:
    """``--smoke``: the embedded default config (Cora) unless ``--config`` names another, the
    engine on the CPU, one HTTP front-end, ``procs`` load processes, the budget at most
    ``budget_s``."""
    if args.config == BENCH_CONFIG:
        from quiver_serve.config import DEFAULT_CONFIG_PATH

        args.config = str(portable(DEFAULT_CONFIG_PATH))
    args.procs, args.start_timeout_s = procs, start_timeout_s
    args.budget_s = min(args.budget_s, budget_s)
    args.sets = ["inference.device=cpu", "server.http_workers=1", *args.sets]


def add_result_options(ap: argparse.ArgumentParser) -> None:
    """``--machine`` and ``--variant``: the parts of a result's default name."""
    ap.add_argument("--machine", help="machine name in the result's file name (default: "
                    "detected, e.g. h200, h100, h200x2, cpu2)")
    ap.add_argument("--variant", help="suffix of the result's file name (e.g. a setting under test)")


def gpu_names() -> list[str]:
    """The CUDA devices' names: from torch when it is already imported, else nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine_name(gpus: list[str] | None = None, cores: int | None = None) -> str:
    """``h200`` / ``h100`` (the GPU model), ``h200x2`` for two, ``cpu<cores>`` without a GPU."""
    gpus = gpu_names() if gpus is None else gpus
    if not gpus:
        return f"cpu{cores or os.cpu_count() or 1}"
    words = re.sub(r"(?i)\bnvidia\b|\bgeforce\b|\btesla\b", " ", gpus[0]).split()
    model = re.sub(r"[^a-z0-9]", "", words[0].lower()) if words else "gpu"
    return model + (f"x{len(gpus)}" if len(gpus) > 1 else "")


def result_name(bench: str, machine: str | None = None, variant: str | None = None,
                date: str | None = None) -> str:
    """``<bench>_<machine>_<date>[_<variant>].json``."""
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    parts = [bench, machine or machine_name(), date] + ([slug(variant)] if variant else [])
    return "_".join(parts) + ".json"


def slug(text: str) -> str:
    """A variant as a file-name part: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9.%]+", "-", text.lower()).strip("-")


def results_dir() -> Path:
    """``$OUT`` when set, else ``bench/results/``."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS_DIR


def result_path(bench: str, args: argparse.Namespace | None = None,
                variant: str | None = None) -> Path:
    """Where a bench writes its JSON: ``args.out`` when given (a bare file name goes in the
    results folder, like the default), else the default name (with ``args.machine`` and
    ``args.variant``, or ``variant``, when set); the results folder is ``args.out_dir`` or
    :func:`results_dir`."""
    folder = getattr(args, "out_dir", None)
    where = Path(folder) if folder else results_dir()
    out = getattr(args, "out", None) or getattr(args, "json", None)
    if out:
        return where / out if Path(out).name == str(out) else Path(out)
    machine = getattr(args, "machine", None)
    variant = getattr(args, "variant", None) or variant
    return where / result_name(bench, machine, variant)


def portable(path: str | Path | None) -> str | None:
    """A path as recorded in the JSON: relative to the repository, else only its name."""
    if path is None:
        return None
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return p.name


def git_head() -> str | None:
    """HEAD of the checkout this ran from, "+dirty" when tracked files differ from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def afford(skipped: list[str], what: str, cost_s: float, left_s: float) -> bool:
    """Whether a step that takes ``cost_s`` fits the ``left_s`` of a budget; if not, it is named
    in ``skipped`` and printed."""
    if left_s >= cost_s:
        return True
    skipped.append(f"{what} (needs ~{cost_s:.0f} s, {max(0.0, left_s):.0f} s left)")
    print(f"SKIPPED {skipped[-1]}", flush=True)
    return False


class Budget:
    """A run's time budget (``budget_s`` from ``t0``), less ``reserve_s`` held back for a later
    phase, and what the run skipped or lost (``skipped``: one line each, kept in the result)."""

    def __init__(self, budget_s: float, t0: float | None = None) -> None:
        self.budget_s = budget_s
        self.t0 = time.perf_counter() if t0 is None else t0
        self.reserve_s = 0.0
        self.skipped: list[str] = []

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s() - self.reserve_s

    def afford(self, what: str, cost_s: float) -> bool:
        return afford(self.skipped, what, cost_s, self.left_s())

    @contextlib.contextmanager
    def serving(self, srv: Any, what: str, timeout_s: float | None = None,
                headers: dict[str, str] | None = None) -> Iterator[float | None]:
        """``srv`` (a ``loadtest.harness.Daemon``) ready for the body, stopped after; the body
        gets its start-up seconds, or None when it did not start. A failed start, or a daemon
        that dies or times out during the body, is named in ``skipped`` and the run goes on."""
        try:
            try:
                ready_s: float | None = srv.wait_ready(timeout_s, headers)
                print(f"\n{srv.name} ready in {ready_s:.1f} s", flush=True)
            except (RuntimeError, TimeoutError) as exc:
                self.skipped.append(f"{what}: {str(exc).splitlines()[0]}")
                print(f"FAILED {what}:\n{exc}", flush=True)
                ready_s = None
            try:
                yield ready_s
            except (RuntimeError, TimeoutError) as exc:
                self.failed(what, exc)
        finally:
            srv.stop()

    def failed(self, what: str, exc: BaseException) -> None:
        """A step that raised: named in ``skipped`` (first line), its traceback's tail printed."""
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.skipped.append(f"{what}: {type(exc).__name__}: {first}")
        print(f"FAILED {what}:\n" + "".join(traceback.format_exception(exc))[-3000:], flush=True)


def print_head(result: dict, info: dict, workload: str) -> None:
    """The first lines of a bench's closing summary: wall time, what was skipped, the graph,
    the device and ``workload``."""
    print(f"wall {result['wall_s']:.0f} s")
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]))
    print(f"\n{info.get('graph')}, {info.get('device')}, workload {workload}")


def exit_on_sigterm() -> None:
    """SIGTERM (a runner's time limit) unwinds like ``sys.exit(143)``: ``finally`` blocks stop
    the servers and load processes and write what was measured."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as ``python -m <module> <args>`` (paths made portable)."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]) if argv else Path("?")
    try:
        if head.suffix != ".py":
            raise ValueError(head)
        rel = head.resolve().relative_to(ROOT).with_suffix("")
        prog = "python -m " + ".".join(p for p in rel.parts if p != "__main__")
    except ValueError:
        prog = f"python {head.name}"
    rest = [str(portable(a)) if os.path.isabs(a) else a for a in argv[1:]]
    return " ".join([prog, *rest])


def run_meta(parsed: argparse.Namespace | None = None, cfg: Any = None, **extra: Any) -> dict:
    """The ``meta`` of every result file: date (UTC), commit, machine, command, software and
    device; with ``cfg`` the model and fanouts, with ``parsed`` (the bench's arguments) its
    config and ``--set``s; then ``extra``."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_available()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_head": git_head(),
        "machine": getattr(parsed, "machine", None) or machine_name(), "command": command_line(),
        "python": platform.python_version(), "torch": getattr(torch, "__version__", None),
        "cpus": os.cpu_count(), "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if parsed is not None and getattr(parsed, "config", None):
        out.update(config=portable(parsed.config), sets=getattr(parsed, "sets", []))
    if cfg is not None:
        out.update(model=f"{cfg.model.pyg_class} {cfg.model.kwargs}",
                   fanouts=cfg.sampling.fanouts)
    out.update(extra)
    return out


def jsonable(obj: Any) -> Any:
    """``obj`` as JSON can hold it: numpy scalars as numbers, tuples as lists, keys as text; the
    raw latency arrays (``latencies_ms``, ``lat``) left out."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items() if k not in ("latencies_ms", "lat")}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a numpy scalar
        return obj.item()
    return obj


def scrub(text: str, folder: Path | str | None = None) -> str:
    """No machine paths in a result: the run's temporary ``folder``, the checkout, the home."""
    pairs = [(str(folder), "<run folder>")] if folder else []
    for path, name in [*pairs, (str(ROOT), "."), (os.path.expanduser("~"), "~")]:
        if len(path) > 1:
            text = text.replace(path, name)
    return text


def write_result(path: Path | str, result: dict, folder: Path | str | None = None) -> Path:
    """``result`` as indented JSON at ``path`` (its folder made), machine paths scrubbed
    (``folder``: the run's temporary one); prints where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scrub(json.dumps(jsonable(result), indent=1, default=str), folder) + "\n")
    print(f"wrote {portable(path)}", flush=True)
    return path
