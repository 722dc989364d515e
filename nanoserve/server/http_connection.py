"""One HTTP/1.1 connection, the read half: httptools parsing, limits, keep-alive, pipelining.

Complete requests queue in `pending` and are answered in order, one handler task at a time; the
write half (framing, write backpressure) is `http_writer.ResponseWriter`. Errors found while
parsing (400, 408, 413, 431, 503) queue an error reply in order, then the connection closes.
`connection_lost` cancels the running handler: that is how a disconnect reaches the OpenAI layer,
which aborts its engine request. So reading goes on (bytes after the last request are discarded)
until the answer is out: a paused socket would hide a disconnect. A client that half-closes after
a complete request is still answered (`eof_received`).

Bounds: header bytes, body bytes (per request, and all bodies held at once across connections),
the time to read one request, keep-alive idle time (not restarted by bytes that start no
request), and the time a send may wait for a reader that does not read (`write_timeout`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field

import httptools

from nanoserve.server.http_types import Request, ServerState
from nanoserve.server.http_writer import ResponseWriter

logger = logging.getLogger("nanoserve.server")

PEER_PROBE_INTERVAL = 0.5  # seconds between writes that check a client which sent EOF is there


class _ParseFailure(Exception):
    """Raised inside a parser callback to stop parsing after a limit was hit."""


@dataclass(slots=True)
class _ErrorReply:
    status: int
    message: str


@dataclass(slots=True)
class _Partial:
    url: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    header_bytes: int = 0
    expect_continue: bool = False
    headers_done: bool = False
    reserved: int = 0  # body bytes counted against the server-wide budget


class HttpConnection(asyncio.Protocol):
    writer: ResponseWriter  # from `connection_made` on

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.limits = state.limits
        self.loop = loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.partial: _Partial | None = None
        self.raw_header_bytes = 0
        self.pending: collections.deque[Request | _ErrorReply] = collections.deque()
        self.task: asyncio.Task | None = None
        self.reading_paused = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self.read_timer: asyncio.TimerHandle | None = None
        self.probe_timer: asyncio.TimerHandle | None = None
        self.current_request: Request | None = None
        self.held_body_bytes = 0  # this connection's share of the server-wide body budget
        self.discarded_bytes = 0  # read after parsing stopped (only to notice a disconnect)
        self.stop_parsing = False  # after an error reply or `Connection: close`
        self.closing = False  # shutting down: answer what is queued, then close
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
        self._release_body_bytes(self.held_body_bytes)
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the handler aborts its engine request

    def eof_received(self) -> bool | None:
        """The client shut its sending side. Answer the requests it completed (returning True
        keeps the socket open for that), then close; with nothing to answer, close now."""
        self._stop_parsing()
        waiting = [self.current_request] if self.task is not None else []
        waiting += [item for item in self.pending if isinstance(item, Request)]
        # An HTTP/1.0 client cannot be probed (no 1xx for it): its EOF is taken as a disconnect.
        if waiting and waiting[0].http_version == "1.1":
            self._probe_peer()
            return True
        return None

    def _probe_peer(self) -> None:
        """After an EOF only a write tells a half-closed client (waiting for its answer) from a
        gone one: a gone client's kernel answers with a reset and the next write fails, which
        ends the connection and so aborts the request. An interim `100 Continue` is a write
        every HTTP/1.1 client accepts before a response; sent until the response starts."""
        self.probe_timer = None
        if self.lost or self.transport is None or self.transport.is_closing():
            return
        request = self.current_request
        if self.task is not None and not self.writer.head_sent and request is not None \
                and request.http_version == "1.1":
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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Protocol upgrades are not offered; answer what was parsed, then close.
            self._stop_parsing()
        except _ParseFailure:
            pass
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _ParseFailure):
                pass
            else:
                self._queue_error(400, "Invalid HTTP request received.")
        else:
            if self.partial is not None and not self.partial.headers_done:
                # httptools buffers a header line until it ends, so count raw bytes as well.
                self.raw_header_bytes += len(data)
                if self.raw_header_bytes > self.limits.max_header_bytes:
                    self._queue_error(431, "Request header fields too large.")
        self._dispatch()

    # ---- parser callbacks ----
    def on_message_begin(self) -> None:
        self._cancel_idle_timer()  # only a request ends idleness, not stray bytes (bare CRLFs)
        self.partial = _Partial()
        self.raw_header_bytes = 0
        if self.read_timer is None:
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout)

    def on_url(self, url: bytes) -> None:
        assert self.partial is not None
        self.partial.url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.partial is not None
        self._count_header_bytes(len(name) + len(value) + 4)
        self.partial.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        partial = self.partial
        assert partial is not None
        partial.headers_done = True
        for name, value in partial.headers:
            if name == "content-length" and value.strip().isdigit():
                if int(value) > self.limits.max_body_bytes:
                    self._fail(413, "Request body too large.")
                self._reserve_body_bytes(int(value))
            elif name == "expect" and value.strip().lower() == "100-continue":
                partial.expect_continue = True
        if partial.expect_continue and self.task is None and not self.pending:
            self._send_continue()

    def on_body(self, body: bytes) -> None:
        partial = self.partial
        assert partial is not None
        partial.body_bytes += len(body)
        if partial.body_bytes > self.limits.max_body_bytes:
            self._fail(413, "Request body too large.")
        if partial.body_bytes > partial.reserved:  # no Content-Length (chunked): as it comes
            self._reserve_body_bytes(partial.body_bytes - partial.reserved)
        partial.body.append(body)

    def on_message_complete(self) -> None:
        partial = self.partial
        assert partial is not None
        self.partial = None
        self._cancel_read_timer()
        keep_alive = self.parser.should_keep_alive() and not self.closing
        url = partial.url.decode("latin-1")
        path, _, query = url.partition("?")
        request = Request(
            method=self.parser.get_method().decode("ascii"),
            path=path,
            query=query,
            http_version=self.parser.get_http_version(),
            headers=partial.headers,
            body=b"".join(partial.body),
            keep_alive=keep_alive,
            reserved_bytes=partial.reserved,
        )
        self.pending.append(request)
        if not keep_alive:
            self._stop_parsing()
        elif len(self.pending) >= self.limits.max_pipelined_requests and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    # ---- helpers ----
    def _reserve_body_bytes(self, count: int) -> None:
        """Count body bytes against the server-wide budget, or refuse the request (503)."""
        state = self.state
        if state.buffered_body_bytes + count > self.limits.max_buffered_body_bytes:
            self._fail(503, "The server holds too many request bodies right now. Retry later.")
        state.buffered_body_bytes += count
        self.held_body_bytes += count
        assert self.partial is not None
        self.partial.reserved += count

    def _release_body_bytes(self, count: int) -> None:
        count = min(count, self.held_body_bytes)
        self.held_body_bytes -= count
        self.state.buffered_body_bytes -= count

    def _count_header_bytes(self, count: int) -> None:
        assert self.partial is not None
        self.partial.header_bytes += count
        if self.partial.header_bytes > self.limits.max_header_bytes:
            self._fail(431, "Request header fields too large.")

    def _fail(self, status: int, message: str) -> None:
        """From a parser callback: queue an error reply and stop the parser."""
        self._queue_error(status, message)
        raise _ParseFailure()

    def _queue_error(self, status: int, message: str) -> None:
        """Queue an error reply (answered in order, then the connection closes)."""
        if self.stop_parsing:
            return
        if self.partial is not None:
            self._release_body_bytes(self.partial.reserved)
        self.partial = None
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
        assert self.partial is not None
        self.partial.expect_continue = False

    def _dispatch(self) -> None:
        """Start the next queued request if none is being answered."""
        if self.task is not None or self.lost:
            return
        if not self.pending:
            if self.stop_parsing or self.closing:
                self._close()
                return
            if self.partial is not None and self.partial.expect_continue:
                self._send_continue()
            if self.partial is None:
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

    async def _handle(self, request: Request) -> None:
        keep_alive = request.keep_alive
        try:
            keep_alive = await self.writer.respond(request, self.state.app, lambda: self.closing)
        finally:
            self.task = None
            self._release_body_bytes(request.reserved_bytes)
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
        if self.partial is None or self.lost:
            return
        if self.reading_paused:  # our own pipelining pause: not the client's fault
            self.read_timer = self.loop.call_later(
                self.limits.request_read_timeout, self._on_read_timeout)
            return
        self._queue_error(408, "Timed out reading the request.")
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
