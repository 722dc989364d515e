"""Bytes in, `HttpRequest`s out: httptools' callbacks with the limits on what one request may hold.

Limits: header bytes (431; counted raw as well, since httptools holds a header line until it
ends), body bytes per request (413, at the end of the headers when the declared length is over
it), and the body bytes held at once by all connections of the server (503). Only bytes that have
arrived count against that budget, never a declared length (a declaration costs nothing to send),
and none before the headers have passed the server's check (`ServerState.check_headers`: the API
key), so a refused request's body is never buffered. `release_body_bytes` gives them back once the
request is answered or dropped. What the parser finds goes to its connection (`ParseEvents`),
which owns the timers, the queue of requests, the socket, and the per-connection ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import httptools

from nanoserve.server.http.types import HttpRequest, Response, ServerState


class ParseEvents(Protocol):
    def request_started(self) -> None: ...
    def continue_wanted(self) -> None: ...  # the client waits for `100 Continue` to send a body
    def request_parsed(self, request: HttpRequest) -> None: ...
    def queue_error(self, status: int, message: str) -> None: ...  # then stop parsing
    def queue_refusal(self, response: Response) -> None: ...  # the same, with a whole response
    def upgrade_requested(self) -> None: ...


class _ParseFailure(Exception):
    """Raised inside a parser callback to stop parsing after a limit was hit."""


@dataclass(slots=True)
class PartialRequest:
    url: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    body_bytes: int = 0
    header_bytes: int = 0
    expect_continue: bool = False  # a `100 Continue` is owed before the body comes
    asked_continue: bool = False  # the request sent `Expect: 100-continue` (kept once answered)
    headers_done: bool = False
    reserved: int = 0  # body bytes received, counted against the server-wide budget


class RequestParser:
    def __init__(self, state: ServerState, events: ParseEvents) -> None:
        self.state = state
        self.limits = state.limits
        self.events = events
        self.parser = httptools.HttpRequestParser(self)
        self.partial: PartialRequest | None = None  # the request being read
        self.raw_header_bytes = 0
        self.held_body_bytes = 0  # this connection's share of the server-wide body budget

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.events.upgrade_requested()
        except _ParseFailure:
            pass
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _ParseFailure):
                pass
            else:
                self.events.queue_error(400, "Invalid HTTP request received.")
        else:
            if self.partial is not None and not self.partial.headers_done:
                # httptools buffers a header line until it ends, so count raw bytes as well.
                self.raw_header_bytes += len(data)
                if self.raw_header_bytes > self.limits.max_header_bytes:
                    self.events.queue_error(431, "Request header fields too large.")

    def drop_partial(self) -> None:
        """Forget the request being read (an error reply takes its place)."""
        if self.partial is not None:
            self.release_body_bytes(self.partial.reserved)
        self.partial = None

    def release_body_bytes(self, count: int) -> None:
        count = min(count, self.held_body_bytes)
        self.held_body_bytes -= count
        self.state.buffered_body_bytes -= count

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self.partial = PartialRequest()
        self.raw_header_bytes = 0
        self.events.request_started()

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
        self._check_headers()
        for name, value in partial.headers:
            if name == "content-length" and value.strip().isdigit():
                # More than a request may ever hold: refused now, before any of it is read.
                if int(value) > self.limits.max_body_bytes:
                    self._fail(413, "Request body too large.")
            elif name == "expect" and value.strip().lower() == "100-continue":
                partial.expect_continue = partial.asked_continue = True
        if partial.expect_continue:
            self.events.continue_wanted()

    def on_body(self, body: bytes) -> None:
        partial = self.partial
        assert partial is not None
        partial.body_bytes += len(body)
        if partial.body_bytes > self.limits.max_body_bytes:
            self._fail(413, "Request body too large.")
        self._reserve_body_bytes(len(body))  # as it arrives, never on a declaration
        partial.body.append(body)

    def on_message_complete(self) -> None:
        partial = self.partial
        assert partial is not None
        self.partial = None
        self.events.request_parsed(self._request(partial, b"".join(partial.body)))

    def _request(self, partial: PartialRequest, body: bytes) -> HttpRequest:
        path, _, query = partial.url.decode("latin-1").partition("?")
        return HttpRequest(
            method=self.parser.get_method().decode("ascii"),
            path=path,
            query=query,
            http_version=self.parser.get_http_version(),
            headers=partial.headers,
            body=body,
            keep_alive=self.parser.should_keep_alive(),
            reserved_bytes=partial.reserved,
            expects_continue=partial.asked_continue,
        )

    # ---- limits ----
    def _check_headers(self) -> None:
        """The server's check of the headers alone (the API key), before any body byte is
        held: a refused request is answered without its body being read."""
        check = self.state.check_headers
        if check is None:
            return
        assert self.partial is not None
        refusal = check(self._request(self.partial, b""))
        if refusal is not None:
            self.events.queue_refusal(refusal)
            raise _ParseFailure()

    def _reserve_body_bytes(self, count: int) -> None:
        """Count body bytes against the server-wide budget, or refuse the request (503)."""
        state = self.state
        if state.buffered_body_bytes + count > self.limits.max_buffered_body_bytes:
            self._fail(503, "The server holds too many request bodies right now. Retry later.")
        state.buffered_body_bytes += count
        self.held_body_bytes += count
        assert self.partial is not None
        self.partial.reserved += count

    def _count_header_bytes(self, count: int) -> None:
        assert self.partial is not None
        self.partial.header_bytes += count
        if self.partial.header_bytes > self.limits.max_header_bytes:
            self._fail(431, "Request header fields too large.")

    def _fail(self, status: int, message: str) -> None:
        """From a parser callback: queue an error reply and stop the parser."""
        self.events.queue_error(status, message)
        raise _ParseFailure()
