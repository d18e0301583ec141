"""LoopPipeWriter (the API process's commands to the engine core): written by the event loop without
blocking it, in order, whole; a full pipe buffers, a gone reader is noticed, close() flushes."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time

from cllm.engine.core_protocol import decode
from cllm.engine.pipe_writer import LoopPipeWriter

BIG = 300_000  # bytes: several times a pipe's 64 kB, so a send cannot go out whole at once


def _messages() -> list[bytes]:
    return [bytes([i % 251]) * (BIG if i % 7 == 0 else 1 + 37 * i) for i in range(60)]


def _read_all(conn, n: int, delay_s: float, out: list[bytes]) -> None:
    for _ in range(n):
        time.sleep(delay_s)  # a slow reader: the pipe fills
        out.append(conn.recv_bytes())


def _read_while_closing(reader, writer, n: int) -> list[bytes]:
    """What the reader gets while ``writer.close()`` sends what waits."""
    received: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(reader, n, 0.0, received))
    thread.start()
    writer.close(timeout_s=10)
    thread.join(10)
    return received


def test_a_full_pipe_buffers_without_blocking_and_keeps_order() -> None:
    reader, writer_end = mp.Pipe(duplex=False)
    writer = LoopPipeWriter(writer_end)
    received: list[bytes] = []
    messages = _messages()
    thread = threading.Thread(target=_read_all, args=(reader, len(messages), 0.002, received))
    thread.start()

    async def send_all() -> tuple[int, int]:
        most = 0
        for m in messages:
            writer.send_encoded(m)
            most = max(most, writer.backlog())
        read_by_then = len(received)
        while writer.backlog():
            await asyncio.sleep(0.001)
        return read_by_then, most

    read_by_then, most = asyncio.run(send_all())
    thread.join(10)
    writer.close()
    assert received == messages
    assert most > 0  # the pipe was full: the rest waited in the buffer
    # The sends never waited for the reader (2 ms a message): a blocking writer returns from its last send
    # only once all but a pipe's worth (64 kB) has been read.
    assert read_by_then < len(messages) // 2


def test_sends_from_another_thread_go_through_the_loop() -> None:
    reader, writer_end = mp.Pipe(duplex=False)
    writer = LoopPipeWriter(writer_end)

    async def run() -> None:
        writer.send({"first": 1})  # binds the loop
        await asyncio.get_running_loop().run_in_executor(None, writer.send, {"from": "a thread"})
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert [decode(reader.recv_bytes()) for _ in range(2)] == [{"first": 1}, {"from": "a thread"}]
    writer.close()


def test_a_reader_that_is_gone_marks_the_writer_broken() -> None:
    reader, writer_end = mp.Pipe(duplex=False)
    writer = LoopPipeWriter(writer_end)
    reader.close()

    async def run() -> None:
        writer.send_encoded(b"x" * BIG)
        writer.send_encoded(b"after")  # dropped quietly: nobody can read it

    asyncio.run(run())
    assert writer.broken and writer.backlog() == 0
    writer.close()


def test_close_flushes_what_is_buffered() -> None:
    reader, writer_end = mp.Pipe(duplex=False)
    writer = LoopPipeWriter(writer_end)
    messages = _messages()[:10]

    async def run() -> int:
        for m in messages:
            writer.send_encoded(m)
        return writer.backlog()

    backlog = asyncio.run(run())
    assert backlog > 0 and _read_while_closing(reader, writer, len(messages)) == messages


def test_the_cores_sender_never_blocks_a_step_and_keeps_order() -> None:
    """engine_core.Sender: a message goes out in the call while the pipe has room; the rest waits for its
    thread, in order, whole; close() sends what waits."""
    from cllm.engine.engine_core import Sender

    reader, writer_end = mp.Pipe(duplex=False)
    sender = Sender(writer_end)
    messages = _messages()
    most = 0
    for m in messages:  # nobody reads yet: the first 64 kB go at once, the rest waits
        sender.send_encoded(m)
        most = max(most, sender.backlog())
    assert most > 0 and _read_while_closing(reader, sender, len(messages)) == messages


def test_the_cores_sender_notices_a_reader_that_is_gone() -> None:
    from cllm.engine.engine_core import Sender

    reader, writer_end = mp.Pipe(duplex=False)
    sender = Sender(writer_end)
    reader.close()
    sender.send_encoded(b"x" * BIG)
    sender.send_encoded(b"after")
    sender.close(timeout_s=5)
    assert sender.broken and sender.backlog() == 0
