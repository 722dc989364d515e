"""One HTTP/1.1 connection: keep-alive, pipelining, the timers, and the order of answers.

Bytes go to the `RequestParser` (http_parser.py: httptools, header and body limits, the
server-wide body budget); the requests it completes queue in `pending` and are answered in order,
one handler task at a time, through the `ResponseWriter` (http_writer.py: framing, write
backpressure). Errors found while parsing (400, 408, 413, 431, 503) queue an error reply in order,
then the connection closes. `connection_lost` cancels the running handler: that is how a
disconnect reaches the OpenAI layer, which aborts its engine request. So reading goes on (bytes
after the last request are discarded) until the answer is out: a paused socket would hide a
disconnect. A client that half-closes after a complete request is still answered (`eof_received`).

Timers: the time to read one request (408; it waits while reading is paused for pipelining), the
keep-alive idle time (not restarted by bytes that start no request), and, after an EOF, a probe
that tells a half-closed client from a gone one (for a request that sent `Expect: 100-continue`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass

from nanoserve.server.http_parser import RequestParser
from nanoserve.server.http_types import HttpRequest, ServerState
from nanoserve.server.http_writer import ResponseWriter

logger = logging.getLogger("nanoserve.server")

PEER_PROBE_INTERVAL = 0.5  # seconds between writes that check a client which sent EOF is there


@dataclass(slots=True)
class _ErrorReply:
    status: int
    message: str


class HttpConnection(asyncio.Protocol):
    writer: ResponseWriter  # from `connection_made` on

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.limits = state.limits
        self.loop = loop
        self.parser = RequestParser(state, self)
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[HttpRequest | _ErrorReply] = collections.deque()
        self.task: asyncio.Task | None = None
        self.reading_paused = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.read_timer: asyncio.TimerHandle | None = None
        self.probe_timer: asyncio.TimerHandle | None = None
        self.current_request: HttpRequest | None = None
        self.discarded_bytes = 0  # read after parsing stopped (only to notice a disconnect)
        self.stop_parsing = False  # after an error reply or `Connection: close`
        self.closing = False  # shutting down: finish the answer under way, then close
        self.lost = False

    # ---- connection lifecycle ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.writer = ResponseWriter(transport, self.loop, self.limits, self.state.error_response,
                                     self._on_write_timeout)
        self.state.connections.add(self)
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.state.connections.discard(self)
        self._cancel_timers()
        self.writer.connection_lost()  # wakes senders waiting on a drain
        self.parser.release_body_bytes(self.parser.held_body_bytes)
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the handler aborts its engine request

    def eof_received(self) -> bool | None:
        """The client shut its sending side. Answer the requests it completed (returning True
        keeps the socket open for that), then close; with nothing to answer, close now."""
        self._stop_parsing()
        waiting = [self.current_request] if self.task is not None else []
        waiting += [item for item in self.pending if isinstance(item, HttpRequest)]
        # An HTTP/1.0 client cannot be probed (no 1xx for it): its EOF is taken as a disconnect.
        if waiting and waiting[0].http_version == "1.1":
            self._probe_peer()
            return True
        return None

    def _probe_peer(self) -> None:
        """After an EOF only a write tells a half-closed client (waiting for its answer) from a
        gone one: a gone client's kernel answers with a reset and the next write fails, which
        ends the connection and so aborts the request. The probe is an interim `100 Continue`,
        sent until the response starts, and only to a request that asked for one (`Expect:
        100-continue`). Without it nothing is written before the answer: a streamed answer's
        first write finds a gone client, a whole one is computed and then fails to send."""
        self.probe_timer = None
        if self.lost or self.transport is None or self.transport.is_closing():
            return
        request = self.current_request
        if self.task is not None and not self.writer.head_sent and request is not None \
                and request.expects_continue:
            self.writer.write_continue()
        if self.task is not None or self.pending:
            self.probe_timer = self.loop.call_later(PEER_PROBE_INTERVAL, self._probe_peer)

    def pause_writing(self) -> None:
        self.writer.pause()

    def resume_writing(self) -> None:
        self.writer.resume()

    def data_received(self, data: bytes) -> None:
        if self.stop_parsing:
            self.discarded_bytes += len(data)
            if self.discarded_bytes > self.limits.max_header_bytes and not self.reading_paused:
                self.reading_paused = True  # a flood after the last request: stop reading it
                self.transport.pause_reading()
            return
        self.parser.feed(data)
        self._dispatch()

    # ---- what the parser finds (ParseEvents) ----
    def request_started(self) -> None:
        self._cancel_idle_timer()  # only a request ends idleness, not stray bytes (bare CRLFs)
        if self.read_timer is None:
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout)

    def continue_wanted(self) -> None:
        if self.task is None and not self.pending:  # else once the answers before it are out
            self._send_continue()

    def request_parsed(self, request: HttpRequest) -> None:
        self._cancel_read_timer()
        request.keep_alive = request.keep_alive and not self.closing
        self.pending.append(request)
        if not request.keep_alive:
            self._stop_parsing()
        elif len(self.pending) >= self.limits.max_pipelined_requests and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def upgrade_requested(self) -> None:
        self._stop_parsing()  # upgrades are not offered: answer what was parsed, then close

    # ---- helpers ----
    def queue_error(self, status: int, message: str) -> None:
        """Queue an error reply (answered in order, then the connection closes)."""
        if self.stop_parsing:
            return
        self.parser.drop_partial()
        self._cancel_read_timer()
        self.pending.append(_ErrorReply(status, message))
        self._stop_parsing()

    def _stop_parsing(self) -> None:
        # Reading goes on (and discards) so that a disconnect still cancels the handler.
        self.stop_parsing = True
        if self.reading_paused and self.transport is not None and not self.transport.is_closing():
            self.reading_paused = False
            self.transport.resume_reading()

    def _send_continue(self) -> None:
        self.writer.write_continue()
        assert self.parser.partial is not None
        self.parser.partial.expect_continue = False

    def _dispatch(self) -> None:
        """Start the next queued request if none is being answered."""
        if self.task is not None or self.lost:
            return
        if not self.pending:
            if self.stop_parsing or self.closing:
                self._close()
                return
            partial = self.parser.partial
            if partial is not None and partial.expect_continue:
                self._send_continue()
            if partial is None:
                self._arm_idle_timer()
            return
        item = self.pending.popleft()
        if self.reading_paused and not self.stop_parsing:
            self.reading_paused = False
            self.transport.resume_reading()
        if isinstance(item, _ErrorReply):
            self.writer.write_error(item.status, item.message)
            self._close()
            return
        self.current_request = item
        self.writer.head_sent = False
        self.task = self.loop.create_task(self._handle(item))

    async def _handle(self, request: HttpRequest) -> None:
        keep_alive = request.keep_alive
        try:
            keep_alive = await self.writer.respond(request, self.state.app, lambda: self.closing)
        finally:
            self.task = None
            self.parser.release_body_bytes(request.reserved_bytes)
            if not keep_alive:
                self.stop_parsing = True
                self.pending.clear()
            if not self.lost:
                self._dispatch()

    def _close(self) -> None:
        self._cancel_timers()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # ---- timers ----
    def _arm_idle_timer(self) -> None:
        if not self.lost and self.idle_timer is None:  # not restarted by bytes that start nothing
            self.idle_timer = self.loop.call_later(self.limits.keep_alive_timeout, self._close)

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _cancel_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_idle_timer()
        self._cancel_read_timer()
        self.writer.cancel_timer()
        if self.probe_timer is not None:
            self.probe_timer.cancel()
            self.probe_timer = None

    def _on_write_timeout(self) -> None:
        logger.info("closing a connection whose reader took no data for %.0f s",
                    self.limits.write_timeout)
        self.abort()  # connection_lost follows: the handler is cancelled, its request aborted

    def _on_read_timeout(self) -> None:
        self.read_timer = None
        if self.parser.partial is None or self.lost:
            return
        if self.reading_paused:  # our own pipelining pause: not the client's fault
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout)
            return
        self.queue_error(408, "Timed out reading the request.")
        self._dispatch()

    # ---- shutdown ----
    def shutdown(self) -> None:
        """Stop reading; close now if idle, else once the answer under way is sent (with
        `Connection: close`; requests queued behind it are dropped, for the client to retry)."""
        self.closing = True
        self._stop_parsing()
        if self.task is None and not self.pending:
            self._close()

    def abort(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.transport is not None:
            self.transport.abort()
