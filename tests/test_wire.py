"""The wire's ZeroMQ helpers: a disconnect monitor opens whatever sockets came before it."""

from __future__ import annotations

import errno
import time

import zmq

from quiver_serve.wire import disconnect_monitor

OPENS = 20_000


def test_monitors_open_while_closed_sockets_descriptors_are_reused() -> None:
    # pyzmq's own monitor name (the socket's descriptor) collided 5 to 2,437 times in 20,000 such
    # opens on one context: a 500 on the front door when a client's monitor hit one (CI)
    ctx = zmq.Context()
    collisions = 0
    for i in range(OPENS):
        try:
            sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError:  # the context's 1,023 sockets: closed ones wait for the reaper
            time.sleep(0.001)
            continue
        sock.setsockopt(zmq.LINGER, 0)
        try:
            monitor = disconnect_monitor(sock)
        except zmq.ZMQError as e:
            collisions += e.errno == errno.EADDRINUSE
            sock.close(linger=0)
            continue
        sock.connect(f"ipc:///tmp/quiver-serve-no-peer-{i % 3}.sock")
        sock.close(linger=0)
        monitor.close(linger=0)
    ctx.term()
    assert collisions == 0, f"{collisions} of {OPENS} monitor names were in use"


def test_a_monitor_reports_the_dropped_connection(tmp_path) -> None:
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/peer.sock"
    server = ctx.socket(zmq.ROUTER)
    server.bind(address)
    client = ctx.socket(zmq.DEALER)
    monitor = disconnect_monitor(client)
    client.connect(address)
    client.send(b"hello")
    assert server.poll(5_000), "the peer never got the client's message"
    server.recv_multipart()
    server.close(linger=0)
    assert monitor.poll(5_000), "no event after the peer closed"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    for sock in (client, monitor):
        sock.close(linger=0)
    ctx.term()
