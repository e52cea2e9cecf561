"""The GPU suites' runner (``python -m bench.gpu``): every suite's steps name files and modules
that exist; a step past its limit is cut (exit 124) with its whole process group; the console
filter and tail; the summary fails the run when a counted step failed."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from bench.gpu import runner
from bench.gpu.__main__ import main, parse_args
from bench.gpu.suites import SUITES, gpu_test_files

REPO_ROOT = Path(__file__).resolve().parents[2]


def steps_of(argv: list[str], tmp_path: Path) -> list[runner.Step]:
    a = parse_args([*argv, "--out-dir", str(tmp_path), "--machine", "h200"])
    a.out_dir = tmp_path
    return SUITES[a.suite](a)


@pytest.mark.parametrize("argv", [["gate"], ["pipeline"], ["features"], ["features2"],
                                  ["features_e2e"], ["routing"], ["routing", "--daemon"],
                                  ["headline", "--smoke"], ["trace", "--scale", "0.01"],
                                  ["front_door", "."], ["typed"]])
def test_every_suite_names_existing_tests_and_modules(argv: list[str], tmp_path: Path) -> None:
    steps = steps_of(argv, tmp_path)
    assert steps
    for step in steps:
        cmd = step.argv
        if cmd[:2] == ["{python}", "-m"] and cmd[2] != "pytest":
            assert importlib.util.find_spec(cmd[2]), cmd
        if cmd[2:3] == ["pytest"]:
            files = [c.split("::")[0] for c in cmd if c.startswith("tests/")]
            assert files and all((REPO_ROOT / f).exists() for f in files), cmd
        if step.result is not None:
            assert step.result.parent == tmp_path and "_h200_" in step.result.name


def test_gpu_tests_are_found_in_the_test_folders() -> None:
    files = gpu_test_files()
    assert "tests/sampling/test_sampler_gpu.py" in files
    assert "tests/features/test_features_gpu.py" in files
    assert "tests/engine/client/test_gpu_pipeline.py" in files


def test_extra_options_go_to_the_main_bench(tmp_path: Path) -> None:
    steps = steps_of(["features", "--products-scale", "0.5", "--smoke"], tmp_path)
    bench = steps[-1].argv
    assert bench[2] == "bench.features.features" and bench[-3:] == ["--products-scale", "0.5",
                                                                     "--smoke"]
    gate = steps_of(["gate", "--pipeline-args", "--seconds 2"], tmp_path)
    assert gate[-1].argv[-2:] == ["--seconds", "2"]


def py_step(name: str, code: str, timeout_s: float = 30.0, **kw: object) -> runner.Step:
    return runner.Step(name, ["{python}", "-c", code], timeout_s, f"{name}.log", **kw)  # type: ignore[arg-type]


def test_a_step_past_its_limit_is_cut_with_its_children(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    child = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print('child', p.pid, flush=True); time.sleep(60)")
    t0 = time.monotonic()
    [out] = runner.run_steps([py_step("hang", child, timeout_s=1.5, kill_after_s=1.0)],
                             sys.executable, tmp_path)
    assert out.rc == runner.TIMEOUT_EXIT and time.monotonic() - t0 < 20
    pid = int((tmp_path / "hang.log").read_text().split()[1])
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_console_filter_tail_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = "print('keep 1'); print('x INFO y'); print('bar\\rkeep 2'); print('keep 3')"
    steps = [py_step("shown", code, drop=r" INFO |^bar$"),
             py_step("tail", code, tail_lines=1),
             py_step("fails", "raise SystemExit(3)"),
             py_step("info", "raise SystemExit(1)", counts=False, on_fail="just information")]
    outcomes = runner.run_steps(steps, sys.executable, tmp_path)
    assert [o.rc for o in outcomes] == [0, 0, 3, 1]
    printed = capsys.readouterr().out
    assert "keep 1" in printed and "x INFO y" not in printed and "just information" in printed
    assert printed.count("keep 3") == 2 and printed.count("keep 1") == 1  # the tail: last line
    assert "bar" in (tmp_path / "shown.log").read_text()  # the log keeps every line
    assert runner.summary("s", outcomes, tmp_path) == 1
    assert runner.summary("s", [outcomes[0], outcomes[3]], tmp_path) == 0
    assert "| fails | 3 |" in capsys.readouterr().out


def test_a_required_step_stops_the_suite(tmp_path: Path) -> None:
    steps = [py_step("imports", "import no_such_module_here", required=True),
             py_step("never", "print('ran')")]
    outcomes = runner.run_steps(steps, sys.executable, tmp_path)
    assert [o.step.name for o in outcomes] == ["imports"]


def test_dry_run_prints_the_steps(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["trace", "--routes", "auto", "--dry-run", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bench.engine.trace_latency" in out and "--route auto" in out


def test_help_lists_every_suite(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUITES)
