"""The typed contract's bench (``bench.typed.serve_mag``) as a smoke on the CPU at a tiny scale:
the engine core driven directly and the daemon's queue API in one run, and the JSON it writes
(no figure is checked: the box is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_smoke_on_the_cpu_writes_both_halves(tmp_path: Path) -> None:
    out = tmp_path / "typed_mag_smoke.json"
    done = subprocess.run([sys.executable, "-m", "bench.typed.serve_mag", "--scale", "0.001",
                           "--device", "cpu", "--smoke", "--hidden", "32", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    core, queue = result["engine_core"], result["queue_api"]
    assert core["batches"] == 5 and core["seeds_per_s"] > 0
    assert core["sampled_nodes_per_seed"] > 1 and core["sampled_edges_per_seed"] > 0
    assert [p["callers"] for p in queue["points"]] == [1, 2]
    assert all(p["requests"] > 0 and set(p["status"]) == {"200"} for p in queue["points"])
    assert queue["single_id"]["requests"] > 0 and queue["single_id_p50_ms"] > 0
    assert "queue_over_core" in result and result["meta"]["scale"] == 0.001
