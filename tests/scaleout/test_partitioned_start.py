"""Pieces of a partitioned deployment's start and status that need no Ray cluster: the folder's
partition count checked against ``--partitions``, a GCN's whole-graph degrees summed from the
partitions, and the Prometheus text of the servers' counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ray.serve")

from quiver_serve.graph.csc import GraphData  # noqa: E402
from quiver_serve.metrics.partitioned import IngressCounts, exposition  # noqa: E402
from quiver_serve.partition.data import partition_graph, save_partitions  # noqa: E402
from quiver_serve.scaleout.partitioned.deploy import degree_arrays, prepare_partitions  # noqa: E402
from quiver_serve.scaleout.partitioned.peers import CALL_BUCKETS_S  # noqa: E402
from quiver_serve.scaleout.ray_start import StartError  # noqa: E402


def small_graph() -> GraphData:
    rng = np.random.default_rng(0)
    n = 120
    dst, src = rng.integers(0, n, 700), rng.integers(0, n, 700)
    src[:10] = dst[:10]  # a few self loops
    pairs = np.unique(np.stack([dst, src], 1), axis=0)
    indptr = np.zeros(n + 1, np.int64)
    np.add.at(indptr, pairs[:, 0] + 1, 1)
    return GraphData("small", torch.from_numpy(np.cumsum(indptr)),
                     torch.from_numpy(pairs[:, 1].copy()), torch.randn(n, 4))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[GraphData, Path]:
    graph = small_graph()
    out = tmp_path_factory.mktemp("parts") / "p"
    save_partitions(out, *partition_graph(graph, 3, "hash"), graph.name)
    return graph, out


def test_a_folder_of_another_partition_count_is_refused_naming_both(
        folder: tuple[GraphData, Path]) -> None:
    _, out = folder
    assert prepare_partitions(None, 3, str(out)) == out
    with pytest.raises(StartError, match="holds 3 partitions; --partitions asks for 2"):
        prepare_partitions(None, 2, str(out))
    with pytest.raises(StartError, match="--partition-dir .*nowhere.*book.npz does not exist"):
        prepare_partitions(None, 2, str(out.parent / "nowhere"))


def test_degrees_summed_from_the_partitions_are_the_whole_graphs(
        folder: tuple[GraphData, Path]) -> None:
    graph, out = folder
    got = degree_arrays(out, 3)
    np.testing.assert_array_equal(got["in_degree"], graph.degree().numpy())
    np.testing.assert_array_equal(got["self_loops"], graph.self_loop_count().numpy())


def test_metrics_text_has_every_peer_and_hop_and_marks_a_silent_server_down() -> None:
    buckets = [0] * (len(CALL_BUCKETS_S) + 1)
    buckets[2], buckets[-1] = 3, 1  # three calls of <= 2 ms, one past the last bound
    server = {"partition": 0, "replica": 0, "rows": {"local": 10, "hot": 3, "remote": 1},
              "hot_hit_rate": 0.75, "requests": 4, "refused": 1,
              "calls": [{"peer": 1, "hop": "1", "calls": 4, "failures": 1, "sent_bytes": 64,
                         "received_bytes": 640, "latency_sum_s": 3.0,
                         "latency_buckets": buckets}]}
    ingress = IngressCounts()
    ingress.observe(200, 0.004)
    ingress.observe(503, 0.001)
    server.update({"version": 9, "base_version": 6, "compaction": {"compactions": 2},
                   "overlay": {"entries_used": 256, "entries_capacity": 1024}})
    follower = {**server, "replica": 1, "version": 7, "calls": []}
    text = exposition([server, follower, {"partition": 1, "replica": 0, "down": True}], ingress,
                      CALL_BUCKETS_S).decode()
    lines = set(text.splitlines())
    assert 'quiver_serve_partition_up{partition="1",replica="0"} 0.0' in lines
    assert 'quiver_serve_partition_up{partition="0",replica="0"} 1.0' in lines
    assert 'quiver_serve_partition_remote_calls_total{hop="1",partition="0",peer="1"} 4.0' in lines
    assert ('quiver_serve_partition_remote_call_seconds_bucket{hop="1",le="0.002",partition="0",'
            'peer="1"} 3.0') in lines
    assert ('quiver_serve_partition_remote_call_seconds_bucket{hop="1",le="+Inf",partition="0",'
            'peer="1"} 4.0') in lines
    assert 'quiver_serve_partition_hot_hit_ratio{partition="0"} 0.75' in lines
    assert 'quiver_serve_partitioned_requests_total{status="503"} 1.0' in lines
    assert not any('partition="1"' in line for line in lines if "_rows_total" in line)
    assert 'quiver_serve_partition_graph_version{partition="0",replica="1"} 7.0' in lines
    assert 'quiver_serve_partition_version_lag{partition="0",replica="1"} 2.0' in lines
    assert 'quiver_serve_partition_version_lag{partition="0",replica="0"} 0.0' in lines
    assert 'quiver_serve_partition_base_version{partition="0",replica="0"} 6.0' in lines
    assert 'quiver_serve_partition_overlay_fill_ratio{partition="0",replica="0"} 0.25' in lines
    assert 'quiver_serve_partition_compactions_total{partition="0",replica="0"} 2.0' in lines


def test_ingress_replicas_share_what_the_servers_leave_or_the_start_says_what_is_missing() -> None:
    from quiver_serve.scaleout.partitioned.deploy import ingress_share
    from quiver_serve.scaleout.ray_start import size_replicas

    roomy = size_replicas({"CPU": 32.0}, 2)
    assert ingress_share(32.0, roomy, 2, 4) == roomy.ingress_cpus  # room for the full share
    small = size_replicas({"CPU": 2.0}, 2)  # two servers and one ingress fill 2 CPUs
    assert 0.1 <= ingress_share(2.0, small, 2, 2) < small.ingress_cpus
    with pytest.raises(StartError, match=r"need at least .* CPUs; the Ray cluster has 2"):
        ingress_share(2.0, small, 2, 8)
