"""The model repository through the pipeline in real processes (docs/architecture.md, "Models and
versions"): versions pinned and split, loads while serving, failed loads, unloads, several models
over one graph, and an engine core restarted after a load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve import Pipeline, ServeError
from quiver_serve.graph.csc import GraphData
from tests.conftest import small_config
from tests.model_repo import add_gat, cora_repository, sage_state, write_model

pytestmark = pytest.mark.e2e
IDS = [0, 5, 2707, 1200]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = cora_repository(tmp_path_factory.mktemp("repo"), policy={"latest": 1})
    return root


@pytest.fixture(scope="module")
def pipeline(cora: GraphData, repo: Path) -> Iterator[Pipeline]:
    cfg = small_config(models__repository=str(repo), exact__materialize="off")
    p = Pipeline(cfg, graph=cora).start()
    yield p
    p.stop()


def full_output(model: torch.nn.Module, cora: GraphData) -> torch.Tensor:
    with torch.no_grad():
        return model(cora.x, cora.edge_index())


def sage(scale: float, cora: GraphData) -> torch.nn.Module:
    from torch_geometric.nn import models as pyg_models

    model = pyg_models.GraphSAGE(cora.num_features, 128, 2, 64).eval()
    model.load_state_dict(sage_state(scale))
    return model


def test_the_policy_serves_the_newest_version_and_answers_name_it(pipeline: Pipeline,
                                                                  cora: GraphData) -> None:
    rows = [row for row in pipeline.model_index() if row["name"] == "sage"]
    assert {(r["version"], r["state"]) for r in rows} == {(1, "UNAVAILABLE"), (2, "READY")}
    result = pipeline.submit(pipeline.new_request(IDS, exact=True)).result(30)
    assert (result.model, result.version) == ("sage", 2)
    want = full_output(sage(1.5, cora), cora)[IDS]
    torch.testing.assert_close(result.embeddings, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ServeError) as err:
        pipeline.embed(IDS, version=1)
    assert err.value.info.status == 404 and "version 1" in err.value.info.message


def test_load_splits_traffic_and_pinned_versions_answer_their_own_rows(
        pipeline: Pipeline, cora: GraphData) -> None:
    out = pipeline.load_model("sage", {"version_policy": {"all": True},
                                       "traffic": {"1": 0.9, "2": 0.1}})
    assert out["versions"]["1"]["state"] == "READY" and out["traffic"] == {"1": 0.9, "2": 0.1}
    v1 = pipeline.embed(IDS, exact=True, version=1)
    v2 = pipeline.embed(IDS, exact=True, version=2)
    torch.testing.assert_close(v1, full_output(sage(1.0, cora), cora)[IDS], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v2, full_output(sage(1.5, cora), cora)[IDS], atol=1e-4, rtol=1e-4)

    async def many(n: int, at_once: int = 1000) -> list[int]:
        versions: list[int] = []
        for start in range(0, n, at_once):  # within server.max_pending_requests
            results = await asyncio.gather(*(pipeline.submit_async(
                pipeline.new_request([i % 2000])) for i in range(start, start + at_once)))
            versions += [r.version for r in results]
        return versions

    versions = asyncio.run(many(10_000))
    share = versions.count(1) / len(versions)
    assert abs(share - 0.9) <= 0.02, share


def test_a_failed_load_keeps_the_old_versions_serving(pipeline: Pipeline, repo: Path) -> None:
    bad = sage_state()
    bad["convs.0.lin_l.weight"][0, 0] = float("nan")
    write_model(repo, "sage", yaml_config(repo / "sage"), {3: bad})
    try:
        with pytest.raises(ServeError) as err:
            pipeline.load_model("sage", {"version_policy": {"latest": 1}})
        assert err.value.info.status == 400 and "version 3" in err.value.info.message \
            and "NaN" in err.value.info.message
        assert str(repo) not in err.value.info.message  # no server path reaches a client
        states = {r["version"]: r["state"] for r in pipeline.model_index() if r["name"] == "sage"}
        assert states[3] == "UNAVAILABLE" and states[2] == "READY"
        assert pipeline.embed(IDS, version=2).shape == (4, 64)
    finally:
        import shutil

        shutil.rmtree(repo / "sage" / "3")


def yaml_config(folder: Path) -> dict:
    import yaml

    return yaml.safe_load((folder / "config.yaml").read_text())


def test_load_refuses_definitions_from_the_call(pipeline: Pipeline) -> None:
    with pytest.raises(ServeError) as err:
        pipeline.load_model("sage", {"class": "os:system"})
    assert err.value.info.status == 400
    with pytest.raises(ServeError) as err:
        pipeline.load_model("nope")
    assert err.value.info.status == 404


def test_two_models_over_one_graph_and_unload(pipeline: Pipeline, repo: Path,
                                              cora: GraphData) -> None:
    gat = add_gat(repo, cora.num_features, seed=7)
    pipeline.load_model("gat")
    got = pipeline.embed(IDS, exact=True, model="gat")
    torch.testing.assert_close(got, full_output(gat, cora)[IDS], atol=1e-4, rtol=1e-4)
    assert pipeline.models_state["models"]["gat"]["versions"]["1"]["dim"] == 32
    pipeline.unload_model("gat")
    with pytest.raises(ServeError) as err:
        pipeline.embed(IDS, model="gat")
    assert err.value.info.status == 404
    assert pipeline.embed(IDS).shape == (4, 64)  # the default model never stopped


def test_a_restarted_engine_core_serves_the_versions_loaded_since_start(
        pipeline: Pipeline) -> None:
    pipeline.load_model("sage", {"version_policy": {"all": True}, "traffic": {"1": 1.0}})
    engine = pipeline.supervisor.engines[0]
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    answer = None
    while time.monotonic() < deadline:
        try:
            res = pipeline.submit(pipeline.new_request(IDS)).result(30)
            if res.ok and res.version == 1 and engine.ready:
                answer = res
                break
        except ServeError:
            pass
        time.sleep(0.2)
    assert answer is not None, "after the restart, unpinned requests never reached version 1"
    assert pipeline.embed(IDS, version=1).shape == (4, 64)
    assert np.isfinite(pipeline.embed(IDS, version=2).numpy()).all()
