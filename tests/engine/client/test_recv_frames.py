"""``wire.recv_frames``: an asyncio receive that re-checks its socket. A receive that waits past
its re-check is cancelled before it takes a message: every message arrives once, in order, whether
it came before the wait, during one re-check period or after several."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from quiver_serve.wire import RECHECK_S, recv_frames


def test_messages_arrive_once_in_order_across_rechecks() -> None:
    async def run() -> list[bytes]:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.connect(f"tcp://127.0.0.1:{port}")
            await push.send(b"0")  # there before the wait
            got = [(await recv_frames(pull))[0]]

            async def later() -> None:
                for i, pause_s in enumerate((0.0, RECHECK_S * 2.5, RECHECK_S * 0.4, 0.0), 1):
                    await asyncio.sleep(pause_s)
                    await push.send_multipart([str(i).encode(), b"tail"])

            sender = asyncio.ensure_future(later())
            for _ in range(4):
                frames = await asyncio.wait_for(recv_frames(pull, copy=False), 10.0)
                assert len(frames) == 2 and frames[1].bytes == b"tail"
                got.append(frames[0].bytes)
            await sender
            return got
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()

    assert asyncio.run(run()) == [b"0", b"1", b"2", b"3", b"4"]


def test_a_cancelled_receive_takes_nothing() -> None:
    async def run() -> bytes:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.connect(f"tcp://127.0.0.1:{port}")
            waiting = asyncio.ensure_future(recv_frames(pull))
            await asyncio.sleep(RECHECK_S * 1.5)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await push.send(b"kept")
            return (await asyncio.wait_for(recv_frames(pull), 10.0))[0]
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()

    assert asyncio.run(run()) == b"kept"
