"""The fast data path of a partition server (decision 0054): local hops drawn on the GPU and in a
thread for large frontiers, own and replicated rows found by a dense map and gathered on the GPU,
and the wire failing a call at once when its peer dies. Every GPU path is compared with the CPU
path, itself compared with the whole graph."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver_serve.sampling.reference import ReferenceSampler
from quiver_serve.scaleout.partitioned.features import PartitionFeatures
from quiver_serve.scaleout.partitioned.links import LinkError, WireLink
from quiver_serve.scaleout.partitioned.sampling import (
    OFF_LOOP_MIN_IDS,
    LocalGraph,
    PartitionSampler,
    local_hop,
)
from tests.scaleout.test_partitioned_sampling import random_graph, split

NUM_NODES, DIM = 3000, 16


def partitioned(num_parts: int = 2) -> tuple[torch.Tensor, torch.Tensor, np.ndarray,
                                             list[LocalGraph]]:
    indptr, indices = random_graph(NUM_NODES, 40000, seed=3)
    owner = np.random.default_rng(5).integers(0, num_parts, NUM_NODES)
    return indptr, indices, owner, split(indptr, indices, owner)


def samplers(graphs: list[LocalGraph]) -> list[PartitionSampler]:
    async def remote(q: int, ids: np.ndarray, k: int, hop: int, base: int):
        nbr, cnt = local_hop(graphs[q], torch.from_numpy(ids), k, hop, base)
        return nbr.numpy(), cnt.numpy()

    return [PartitionSampler(g, len(graphs), remote) for g in graphs]


def same_subgraph(got, want) -> None:
    assert torch.equal(got.n_id, want.n_id)
    assert torch.equal(got.edge_index, want.edge_index)
    assert torch.equal(got.seed_index, want.seed_index)
    assert got.num_sampled_nodes == want.num_sampled_nodes
    assert got.num_sampled_edges == want.num_sampled_edges


def features(owner: np.ndarray, x: torch.Tensor, hot_share: float) -> list[PartitionFeatures]:
    """Each partition's feature source over ``x``, a random ``hot_share`` of the other
    partitions' rows replicated, remote rows asked of the owner's source."""
    num_parts = int(owner.max()) + 1
    rng = np.random.default_rng(11)
    local = np.zeros(owner.size, np.int64)
    for p in range(num_parts):
        local[owner == p] = np.arange(int((owner == p).sum()))
    owner_t, local_t = torch.from_numpy(owner.astype(np.int32)), torch.from_numpy(local)
    sources: list[PartitionFeatures] = []

    async def remote(q: int, ids: np.ndarray) -> np.ndarray:
        return sources[q].own_rows(ids)

    for p in range(num_parts):
        others = np.flatnonzero(owner != p)
        hot = np.sort(rng.choice(others, int(others.size * hot_share), replace=False))
        sources.append(PartitionFeatures(
            p, owner_t, local_t, x[torch.from_numpy(np.flatnonzero(owner == p))],
            torch.from_numpy(hot), x[torch.from_numpy(hot)], num_parts, remote))
    return sources


def test_a_large_frontier_drawn_in_a_thread_is_the_whole_graphs_subgraph() -> None:
    indptr, indices, _, graphs = partitioned()
    seeds = torch.from_numpy(np.random.default_rng(1).integers(0, NUM_NODES, OFF_LOOP_MIN_IDS))
    want = ReferenceSampler(indptr, indices).sample(seeds, [4, 3], 9)
    for sampler in samplers(graphs):
        same_subgraph(asyncio.run(sampler.sample(seeds, [4, 3], 9)), want)


def test_rows_gathered_through_the_hot_map_are_the_graphs_rows() -> None:
    _, _, owner, _ = partitioned()
    x = torch.randn(NUM_NODES, DIM)
    sources = features(owner, x, hot_share=0.3)
    n_id = torch.from_numpy(np.random.default_rng(2).integers(0, NUM_NODES, 700))
    got = asyncio.run(sources[0].gather(n_id))
    assert torch.equal(got, x[n_id])
    counts = sources[0].counts
    assert counts.local == int((torch.from_numpy(owner)[n_id] == 0).sum())
    assert counts.hot > 0 and counts.remote > 0
    hot_before, remote_before = counts.hot, counts.remote
    held = int((sources[0].hot_slot >= 0).sum())
    assert sources[0].drop_hot(np.flatnonzero(owner != 0)) == held > 0
    again = asyncio.run(sources[0].gather(n_id))
    assert torch.equal(again, x[n_id])
    assert counts.hot == hot_before, "dropped copies are no longer answered here"
    assert counts.remote - remote_before == int((torch.from_numpy(owner)[n_id] != 0).sum())


def test_dropping_copies_counts_the_ones_held() -> None:
    _, _, owner, _ = partitioned()
    x = torch.randn(NUM_NODES, DIM)
    source = features(owner, x, hot_share=0.5)[0]
    held = torch.nonzero(source.hot_slot >= 0).flatten().numpy()
    mine = np.flatnonzero(owner == 0)[:5]
    assert source.drop_hot(np.concatenate([held[:7], mine, [-1, NUM_NODES + 3]])) == 7
    assert source.drop_hot(held[:7]) == 0
    assert int((source.hot_slot >= 0).sum()) == held.size - 7


@pytest.mark.gpu
def test_local_hops_on_the_gpu_draw_the_cpus_subgraph() -> None:
    indptr, indices, _, graphs = partitioned(3)
    on_gpu = [LocalGraph(g.part, g.owner, g.local, g.indptr, g.indices) for g in graphs]
    for g in on_gpu:
        assert g.place(torch.device("cuda"), 1 << 30) > 0
    seeds = torch.from_numpy(np.random.default_rng(4).integers(0, NUM_NODES, 300))
    for fanouts in ([5, 3], [-1, -1], [25, 10]):
        want = ReferenceSampler(indptr, indices).sample(seeds, fanouts, 17)
        for cpu, gpu in zip(samplers(graphs), samplers(on_gpu), strict=True):
            same_subgraph(asyncio.run(cpu.sample(seeds, fanouts, 17)), want)
            same_subgraph(asyncio.run(gpu.sample(seeds, fanouts, 17)), want)


@pytest.mark.gpu
def test_rows_gathered_on_the_gpu_are_the_cpus_rows() -> None:
    _, _, owner, _ = partitioned()
    x = torch.randn(NUM_NODES, DIM)
    sources = features(owner, x, hot_share=0.3)
    n_id = torch.from_numpy(np.random.default_rng(6).integers(0, NUM_NODES, 900))
    want = asyncio.run(sources[0].gather(n_id))
    cuda = torch.device("cuda")
    assert sources[0].place(cuda, 1 << 30) > 0 and sources[0].device.type == "cuda"
    got = asyncio.run(sources[0].gather(n_id))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    assert sources[1].place(cuda, 1) == 0 and sources[1].device.type == "cpu"


SERVER = r'''
import asyncio
from quiver_serve.scaleout.partitioned.links import WireService
async def main():
    async def never(method, ids, args):
        await asyncio.sleep(120)
    service = WireService(lambda method, ids, args: ids * 2 if method == "rows" else
                          never(method, ids, args))
    print(service.start("127.0.0.1"), flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
'''


def diagnosis(proc: subprocess.Popen, address: str) -> str:
    """What a hung first call saw (a rare hang in CI is being chased)."""
    import os
    import socket

    import zmq.asyncio

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            reach = "the port accepts connections"
    except OSError as exc:
        reach = f"the port refuses: {exc}"
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([msgspec.msgpack.encode([7, "rows", []]), np.arange(2)])
    fresh = "a fresh synchronous context is answered" if sock.poll(3000) else \
        "a fresh synchronous context is not answered either"
    sock.close(0)
    ctx.term()
    shared = zmq.asyncio.Context.instance()
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        state = "; ".join(line for line in status if line.startswith(("State", "Threads")))
    except OSError as exc:
        state = str(exc)
    mine = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}
    sockets = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == int(port):
                sockets.append(f"{cols[1]} st {cols[3]} {'here' if f'socket:[{cols[9]}]' in mine else 'elsewhere'}")
    state += f"; sockets on the port: {sockets}"
    return (f"server exit code {proc.poll()} ({state}), {reach}, {fresh}, "
            f"{len(os.listdir('/proc/self/fd'))} open fds here, shared context closed: "
            f"{shared.closed}")


def test_a_call_to_a_peer_that_dies_fails_at_once() -> None:
    async def run() -> float:
        proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            address = proc.stdout.readline().strip()
            asked: list[str] = []

            async def address_of(part: int, replica: int) -> str:
                asked.append(address)
                return address

            link = WireLink(address_of)
            try:  # the link's first call (a rare hang of it in CI is being chased: a deployed
                # caller bounds every call and asks the address again after one that failed)
                first = await asyncio.wait_for(link.call(0, 0, "rows", np.arange(4)), 10.0)
            except asyncio.TimeoutError:
                print(f"the first call hung 10 s: {diagnosis(proc, address)}; a fresh link")
                link.close()
                link = WireLink(address_of)
                try:
                    first = await asyncio.wait_for(link.call(0, 0, "rows", np.arange(4)), 30.0)
                except asyncio.TimeoutError:
                    pytest.fail(f"no answer from a live peer: {diagnosis(proc, address)}")
                asked.pop()
            assert first.tolist() == [0, 2, 4, 6]
            waiting = asyncio.ensure_future(link.call(0, 0, "embed", np.arange(4), False, None,
                                                      None))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            t0 = time.perf_counter()
            proc.kill()
            with pytest.raises(LinkError):
                await asyncio.wait_for(waiting, 20.0)
            took_s = time.perf_counter() - t0
            # the next call asks the address again (a restarted peer binds a new port)
            address = "tcp://127.0.0.1:1"
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(link.call(0, 0, "rows", np.arange(2)), 0.5)
            assert len(asked) == 2 and asked[-1] == address
            assert link.moved(0, 0, None) and not link.moved(0, 0, None)
            link.close()
            return took_s
        finally:
            proc.kill()
            proc.wait(10)

    assert asyncio.run(run()) < 5.0, "the caller waited for its timeout, not the dropped link"
