"""FrameReader reads a multiprocessing connection's messages without blocking, as the API server's event loop reads
an engine process's pipe: whole messages only (one that arrives in parts waits for the rest), every size the
connection can send, the same objects ``recv`` would give, and EOF once the peer has gone and nothing is left."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import struct
import threading

import pytest

from dsinfer.engine.outputs import RequestMetrics
from dsinfer.parallel.messages import CompletionDelta, FrameReader, FrameWriter, RankLoad, RequestDelta, StepReport


def report(step: int) -> StepReport:
    deltas = [RequestDelta(f"req-{i}", [CompletionDelta(0, [step, i], None, False)], False,
                           RequestMetrics(1.0, 2.0, 3.0, None)) for i in range(16)]  # fmt: skip
    return StepReport(0, deltas, [], RankLoad(running=16))


def test_messages_come_whole_and_in_order():
    ours, theirs = multiprocessing.Pipe()
    reader = FrameReader(ours)
    assert reader.read() == []
    for step in range(5):
        theirs.send(report(step))
    got = reader.read()
    assert [m.deltas[3].completions[0].new_token_ids for m in got] == [[s, 3] for s in range(5)]
    assert got[0].load.running == 16 and got[0].deltas[0].metrics.first_token_time == 3.0
    theirs.send("after")  # the connection's own recv still works alongside (nothing is left buffered)
    assert reader.read() == ["after"]
    reader.close()
    theirs.send("recv")
    assert ours.recv() == "recv"


def test_a_message_that_arrives_in_parts_waits_for_the_rest():
    ours, theirs = multiprocessing.Pipe()
    reader = FrameReader(ours)
    first, second = pickle.dumps(report(7)), pickle.dumps("second")
    stream = struct.pack("!i", len(first)) + first + struct.pack("!i", len(second)) + second
    middle = 4 + len(first) + 6  # the first frame, then the second one's size and part of its pickle
    for start, end, expected in ((0, 2, []), (2, 50, []), (50, middle, [7]), (middle, len(stream), ["second"])):
        os.write(theirs.fileno(), stream[start:end])  # the bytes as a socket may deliver them: in any parts
        got = reader.read()
        assert [m if isinstance(m, str) else m.deltas[15].completions[0].new_token_ids[0] for m in got] == expected
    assert reader.read() == []
    reader.close()


def test_a_large_message_and_eof():
    ours, theirs = multiprocessing.Pipe()
    reader = FrameReader(ours)
    big = list(range(300_000))  # over a megabyte: several reads, and the sender blocks until they are done
    sender = threading.Thread(target=lambda: (theirs.send(big), theirs.send("tail"), theirs.close()))
    sender.start()
    got = []
    with pytest.raises(EOFError):
        while True:
            got += reader.read()
    sender.join()
    assert got == [big, "tail"]


def test_read_in_an_event_loop():
    """Each readable event gives the messages that are whole; a peer that closes makes read() raise EOFError."""
    ours, theirs = multiprocessing.Pipe()
    reader = FrameReader(ours)

    async def main() -> list:
        loop, got, done = asyncio.get_running_loop(), [], asyncio.Event()

        def readable() -> None:
            try:
                got.extend(reader.read())
            except EOFError:
                loop.remove_reader(reader.fileno())
                done.set()

        loop.add_reader(reader.fileno(), readable)
        for step in range(20):
            theirs.send(report(step))
            await asyncio.sleep(0)
        theirs.close()
        await asyncio.wait_for(done.wait(), 10)
        return got

    got = asyncio.run(main())
    assert [m.deltas[0].completions[0].new_token_ids[0] for m in got] == list(range(20))


def _read_all(conn, count: int, got: list) -> None:
    for _ in range(count):
        got.append(conn.recv())


def test_a_writer_on_a_full_nonblocking_pipe_loses_nothing_and_never_blocks_its_loop():
    """uvloop leaves a watched descriptor non-blocking: ``Connection.send`` on a full pipe then fails part-way.
    The writer keeps what the pipe cannot take and writes it, in order, when the loop sees the pipe writable."""
    ours, theirs = multiprocessing.Pipe()
    os.set_blocking(ours.fileno(), False)  # as uvloop's add_reader leaves it
    writer = FrameWriter(ours)
    messages = [("add", i, list(range(5000 + i))) for i in range(40)]  # ~1 MB: far more than the pipe holds
    got: list = []

    async def main() -> None:
        writer.attach(asyncio.get_running_loop())
        for message in messages:
            writer.send(message)  # returns at once, the pipe full or not
        assert writer.pending > 0
        reading = threading.Thread(target=_read_all, args=(theirs, len(messages), got))
        reading.start()
        while writer.pending:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(reading.join, 30)

    asyncio.run(main())
    assert got == messages
    writer.detach()
    assert os.get_blocking(ours.fileno())  # blocking again, for a receiver thread's recv and close()
    ours.close()
    theirs.close()


def test_a_writer_without_a_loop_waits_for_a_full_nonblocking_pipe():
    ours, theirs = multiprocessing.Pipe()
    os.set_blocking(ours.fileno(), False)  # left so by a loop that read it before
    messages = [("add", i, list(range(20000))) for i in range(10)]
    got: list = []
    reading = threading.Thread(target=_read_all, args=(theirs, len(messages), got))
    reading.start()
    writer = FrameWriter(ours)
    for message in messages:
        writer.send(message)
    reading.join(30)
    assert got == messages and writer.pending == 0
    theirs.close()
    with pytest.raises(OSError):  # the peer is gone: the sender hears of it (RankedEngine leaves it to the reader)
        for _ in range(100):
            writer.send(messages[0])
    ours.close()
