"""``bench/frontdoor/grpc_endpoint.py``: the ratios it prints, and a one-second run of both
servers under h2load (skipped where h2load is not found, as in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.frontdoor import grpc_endpoint
from loadtest.clients import find_tool


def test_ratios_pair_each_point_with_the_baseline() -> None:
    rows = [{"server": "own", "connections": 4, "streams": 1, "server_cpu_us_per_call": 30.0,
             "req_per_s": 300.0},
            {"server": "grpcio", "connections": 4, "streams": 1, "server_cpu_us_per_call": 150.0,
             "req_per_s": 100.0},
            {"server": "own", "connections": 8, "streams": 1, "server_cpu_us_per_call": 1.0,
             "req_per_s": 1.0}]  # no baseline at 8: no ratio
    assert grpc_endpoint.ratios(rows) == [{"connections": 4, "streams": 1, "cpu_per_call": 0.2,
                                           "calls_per_s": 3.0}]


@pytest.mark.e2e
@pytest.mark.skipif(find_tool("h2load") is None, reason="h2load not found (bench/README.md)")
def test_one_second_run_of_both_servers(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    grpc_endpoint.main(["--seconds", "1", "--connections", "2", "--streams", "1",
                        "--out", str(out)])
    result = json.loads(out.read_text())
    assert {r["server"] for r in result["rows"]} == {"own", "grpcio"}
    for row in result["rows"]:
        assert row["ok"] > 0 and not row["errors"] and row["server_cpu_us_per_call"] > 0
        assert row["check"]["output_shapes"] == [[48, 64]]
    assert len(result["ratios"]) == 1
