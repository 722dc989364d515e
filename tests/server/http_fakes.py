"""A fake transport and a fake clock for driving an `HttpConnection` without sockets or sleeps,
as uvicorn's protocol tests do: bytes go in through `data_received`, writes are recorded, and
timers fire only when the test moves the clock."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from nanoserve.server.http.connection import HttpConnection
from nanoserve.server.http.types import ServerState


def run_async(test):
    """Run an `async def` test on a fresh event loop."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), 30))

    return wrapper


class FakeTimer:
    def __init__(self, when: float, callback: Callable, args: tuple) -> None:
        self.when, self.callback, self.args = when, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """The connection's loop: tasks and futures on the real loop, timers on a clock that moves
    only when the test calls `advance`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable, *args) -> FakeTimer:
        timer = FakeTimer(self.now + delay, callback, args)
        self.timers.append(timer)
        return timer

    def create_task(self, coro) -> asyncio.Task:
        return self.loop.create_task(coro)

    def create_future(self) -> asyncio.Future:
        return self.loop.create_future()

    def advance(self, seconds: float) -> None:
        """Move the clock, firing (in order) every timer that falls due, including timers the
        fired ones arm."""
        self.now += seconds
        while True:
            due = [t for t in self.timers if not t.cancelled and t.when <= self.now]
            if not due:
                return
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            timer.callback(*timer.args)


class FakeTransport(asyncio.Transport):
    """Records writes. While `reader_reads` is False the written bytes pile up in a buffer and
    the protocol is paused above the high-water mark, as a real socket transport does;
    `drain()` plays a reader that catches up."""

    def __init__(self, protocol: HttpConnection, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.protocol = protocol
        self.loop = loop
        self.written = bytearray()
        self.high_water = 64 * 1024
        self.buffered = 0
        self.writing_paused = False
        self.reader_reads = True
        self.reading = True
        self.closed = False
        self.aborted = False

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self.high_water = high

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.written += data
        if not self.reader_reads:
            self.buffered += len(data)
            if self.buffered > self.high_water and not self.writing_paused:
                self.writing_paused = True
                self.protocol.pause_writing()

    def drain(self) -> None:
        self.buffered = 0
        if self.writing_paused:
            self.writing_paused = False
            self.protocol.resume_writing()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def take(self) -> bytes:
        """What was written since the last take."""
        data = bytes(self.written)
        self.written.clear()
        return data


class Client:
    """One connection: the protocol, its fake transport and its clock."""

    def __init__(self, state: ServerState) -> None:
        loop = asyncio.get_running_loop()
        self.clock = FakeClock(loop)
        self.connection = HttpConnection(state, self.clock)
        self.transport = FakeTransport(self.connection, loop)
        self.connection.connection_made(self.transport)

    def send(self, data: bytes) -> None:
        self.connection.data_received(data)

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        await until(condition, what)

    async def settled(self) -> None:
        """Until no request is being answered or queued (handlers finished writing)."""
        connection = self.connection
        await until(lambda: connection.task is None and not connection.pending, "answers")
        await asyncio.sleep(0)  # a close schedules connection_lost with call_soon

    @property
    def closed(self) -> bool:
        return self.transport.closed


async def until(condition: Callable[[], bool], what: str, turns: int = 1000) -> None:
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened within {turns} loop turns: {what}")
