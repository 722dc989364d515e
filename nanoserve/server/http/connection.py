"""One HTTP/1.1 connection: keep-alive, pipelining, the timers, and the order of answers.

Bytes go to the `RequestParser` (parser.py: httptools, header and body limits, the
server-wide body budget); the requests it completes queue in `pending` and are answered in order,
one handler task at a time, through the `ResponseWriter` (writer.py: framing, write
backpressure). Errors found while parsing (400, 401, 408, 413, 431, 503) queue an error reply in
order, then the connection closes. `connection_lost` cancels the running handler: that is how a
disconnect reaches the OpenAI layer, which aborts its engine request. So reading goes on while a
request is answered (bytes after the last request are discarded): a paused socket would hide a
disconnect. What reading may hold is bounded: `max_pipelined_requests` queued requests, and the
body bytes of one connection (queued and partial) at most `max_body_bytes`; past either, reading
pauses until an answer is out.

An EOF is a disconnect (the handler is cancelled at once, as uvicorn does), unless something can
still tell a client that only half-closed from a gone one: the chunks of a stream under way, or
the interim `100 Continue` probes of a request that sent `Expect: 100-continue`. A half-closed
client is answered then; a gone one is found by those writes.

Timers: the time to read one request (408; it waits while reading is paused by the server), the
keep-alive idle time (not restarted by bytes that start no request), and the probe after an EOF.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass

from nanoserve.server.http.parser import RequestParser
from nanoserve.server.http.types import HttpRequest, Response, ServerState
from nanoserve.server.http.writer import ResponseWriter

logger = logging.getLogger("nanoserve.server")

PEER_PROBE_INTERVAL = 0.5  # seconds between writes that check a client which sent EOF is there


@dataclass(slots=True)
class _ErrorReply:
    status: int
    message: str
    response: Response | None = None  # sent as it is (a refusal with its own headers)


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
        self.peer_eof = False  # the client shut its sending side

    # ---- connection lifecycle ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.writer = ResponseWriter(
            transport, self.loop, self.limits, self.state.error_response, self._on_write_timeout
        )
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
        """The client shut its sending side: it has left, or (rarely) only half-closed. Only a
        write tells the two apart, so the connection stays open (returns True) only while one
        will: a stream under way, or the `100 Continue` probes of a request that asked for
        them. Otherwise the transport closes and the handler is cancelled, so a non-streamed
        request of a client that left is aborted within a step, not run for nobody."""
        self.peer_eof = True
        self._stop_parsing()
        if self.task is not None:
            request = self.current_request
            streaming = self.writer.head_sent  # a whole answer is written and done at once
        else:
            request = next((item for item in self.pending if isinstance(item, HttpRequest)), None)
            streaming = False
        if request is None or not (streaming or self._can_probe(request)):
            return None
        if self._can_probe(request):
            self._probe_peer()
        return True

    @staticmethod
    def _can_probe(request: HttpRequest) -> bool:
        # Interim responses exist only in HTTP/1.1, and only a client that asked gets them.
        return request.expects_continue and request.http_version == "1.1"

    def _probe_peer(self) -> None:
        """After an EOF only a write tells a half-closed client (waiting for its answer) from a
        gone one: a gone client's kernel answers with a reset and the next write fails, which
        ends the connection and so aborts the request. The probe is an interim `100 Continue`,
        sent until the response starts, and only to a request that asked for one (`Expect:
        100-continue`); a stream's own chunks do the same."""
        self.probe_timer = None
        if self.lost or self.transport is None or self.transport.is_closing():
            return
        request = self.current_request
        if (
            self.task is not None
            and not self.writer.head_sent
            and request is not None
            and request.expects_continue
        ):
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
        else:
            self.parser.feed(data)
            self._dispatch()
        self._update_reading()

    # ---- what the parser finds (ParseEvents) ----
    def request_started(self) -> None:
        self._cancel_idle_timer()  # only a request ends idleness, not stray bytes (bare CRLFs)
        if self.read_timer is None:
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout
            )

    def continue_wanted(self) -> None:
        if self.task is None and not self.pending:  # else once the answers before it are out
            self._send_continue()

    def request_parsed(self, request: HttpRequest) -> None:
        self._cancel_read_timer()
        request.keep_alive = request.keep_alive and not self.closing
        self.pending.append(request)
        if not request.keep_alive:
            self._stop_parsing()

    def upgrade_requested(self) -> None:
        self._stop_parsing()  # upgrades are not offered: answer what was parsed, then close

    # ---- helpers ----
    def queue_error(self, status: int, message: str, response: Response | None = None) -> None:
        """Queue an error reply (answered in order, then the connection closes)."""
        if self.stop_parsing:
            return
        self.parser.drop_partial()
        self._cancel_read_timer()
        self.pending.append(_ErrorReply(status, message, response))
        self._stop_parsing()

    def queue_refusal(self, response: Response) -> None:
        self.queue_error(response.status, "", response)

    def _stop_parsing(self) -> None:
        # Reading goes on (and discards) so that a disconnect still cancels the handler.
        self.stop_parsing = True
        self._update_reading()

    def _reading_held(self) -> bool:
        """Whether this connection holds as much as it may: reading waits (and an EOF with it)
        until an answer under way or queued gives some back."""
        if self.stop_parsing:  # a flood after the last request: read no more of it
            return self.discarded_bytes > self.limits.max_header_bytes
        if len(self.pending) >= self.limits.max_pipelined_requests:
            return True
        return self.parser.held_body_bytes >= self.limits.max_body_bytes and (
            self.task is not None or bool(self.pending)
        )

    def _update_reading(self) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            return
        held = self._reading_held()
        if held != self.reading_paused:
            self.reading_paused = held
            if held:
                self.transport.pause_reading()
            else:
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
        if isinstance(item, _ErrorReply):
            self.writer.write_error(item.status, item.message, item.response)
            self._close()
            return
        if self.peer_eof and not self._can_probe(item):
            self._close()  # after the EOF nothing could tell whether its client is still there
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
                self._update_reading()

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
        logger.info(
            "closing a connection whose reader took no data for %.0f s", self.limits.write_timeout
        )
        self.abort()  # connection_lost follows: the handler is cancelled, its request aborted

    def _on_read_timeout(self) -> None:
        self.read_timer = None
        if self.parser.partial is None or self.lost:
            return
        if self.reading_paused:  # our own pipelining pause: not the client's fault
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout
            )
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
