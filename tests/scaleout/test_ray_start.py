"""The Ray Serve command's start within bounds: reservations that fit the cluster (or a named
error saying what is missing), and a bounded wait for the application (no Ray cluster needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from quiver_serve.scaleout.ray_start import (
    ENGINE_CPUS,
    INGRESS_CPUS,
    StartError,
    size_replicas,
    wait_running,
)


def test_full_reservations_where_there_is_room() -> None:
    r = size_replicas({"CPU": 16.0}, 2)
    assert (r.engine_cpus, r.engine_gpus, r.ingress_cpus) == (ENGINE_CPUS, 0.0, INGRESS_CPUS)


@pytest.mark.parametrize("cpus,replicas", [(2.0, 2), (1.0, 2), (2.0, 4), (3.0, 3), (0.5, 1)])
def test_a_small_machine_shares_its_cpus_and_everything_fits(cpus: float, replicas: int) -> None:
    r = size_replicas({"CPU": cpus}, replicas)
    assert replicas * r.engine_cpus + r.ingress_cpus <= cpus + 1e-9
    assert r.engine_cpus > 0 and r.ingress_cpus > 0


def test_too_few_cpus_names_what_is_needed() -> None:
    with pytest.raises(StartError, match=r"8 replicas and the ingress need at least 0.9 CPUs.*has 0.5"):
        size_replicas({"CPU": 0.5}, 8)


def test_one_gpu_per_replica_where_the_cluster_has_them() -> None:
    assert size_replicas({"CPU": 32.0, "GPU": 2.0}, 2).engine_gpus == 1.0
    assert size_replicas({"CPU": 32.0, "GPU": 1.0}, 2).engine_gpus == 0.0  # not enough: CPU
    with pytest.raises(StartError, match="need 2 GPUs; the Ray cluster has 1"):
        size_replicas({"CPU": 32.0, "GPU": 1.0}, 2, gpus_per_replica=1.0)


def test_replicas_must_be_positive() -> None:
    with pytest.raises(StartError, match="--replicas"):
        size_replicas({"CPU": 4.0}, 0)


def _app(status: str, message: str = "") -> SimpleNamespace:
    return SimpleNamespace(status=status, message=message)


def test_wait_running_returns_once_running() -> None:
    seen = iter([None, _app("DEPLOYING"), _app("RUNNING")])
    wait_running(lambda: next(seen), timeout_s=5.0, poll_s=0.0)


def test_a_failed_deploy_is_named() -> None:
    with pytest.raises(StartError, match="failed to deploy: replica raised ValueError"):
        wait_running(lambda: _app("DEPLOY_FAILED", "replica raised ValueError"), 5.0, 0.0)


def test_placement_that_never_happens_ends_within_the_bound() -> None:
    with pytest.raises(StartError, match=r"not placed and running within 0.2 s.*DEPLOYING"):
        wait_running(lambda: _app("DEPLOYING", "waiting for resources"), 0.2, 0.01)
