"""The write half of one HTTP/1.1 connection: run the handler, frame its response, and wait
out write backpressure.

Framing: a status line and headers checked for CR/LF/NUL (a value must not inject a header or
split the response), Content-Length for a whole body, chunked for a stream on HTTP/1.1 (on
HTTP/1.0 the stream ends with the connection), no body for HEAD, 204 and 304.

Backpressure, which SSE to a slow reader depends on: the transport calls `pause` above its
high-water mark and `resume` once drained; every streamed piece awaits `drain`, so a stream waits
for its reader instead of buffering. A reader that takes nothing for `write_timeout` seconds is
dropped (`on_write_timeout`), and `connection_lost` wakes any sender still waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus

from nanoserve.server.http.types import (
    App,
    ErrorResponse,
    HttpLimits,
    HttpRequest,
    Response,
    StreamingResponse,
)

logger = logging.getLogger("nanoserve.server")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_date_cache: tuple[int, str] = (-1, "")


def date_header() -> str:
    """The `Date` header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if now != _date_cache[0]:
        _date_cache = (now, formatdate(now, usegmt=True))
    return _date_cache[1]


def _check_header_text(text: str) -> str:
    # A CR or LF in a header would let a value inject headers or split the response.
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError(f"invalid character in response header: {text!r}")
    return text


def encode_head(
    http_version: str,
    status: int,
    headers: list[tuple[str, str]],
    content_type: str | None,
    content_length: int | None,
) -> bytes:
    """Status line and headers. `content_length` None: the caller frames the body itself."""
    version = "1.0" if http_version == "1.0" else "1.1"
    lines = [
        f"HTTP/{version} {status} {_REASONS.get(status, 'Unknown')}",
        f"date: {date_header()}",
        "server: nanoserve",
    ]
    if content_type is not None:
        lines.append(f"content-type: {_check_header_text(content_type)}")
    if content_length is not None:
        lines.append(f"content-length: {content_length}")
    for name, value in headers:
        lines.append(f"{_check_header_text(name)}: {_check_header_text(value)}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")


class ResponseWriter:
    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        limits: HttpLimits,
        error_response: ErrorResponse,
        on_write_timeout: Callable[[], None],
    ) -> None:
        self.transport = transport
        self.loop = loop
        self.limits = limits
        self.error_response = error_response
        self.on_write_timeout = on_write_timeout
        self.paused = False
        self.lost = False
        self.head_sent = False  # of the response being answered
        self.drain_waiters: list[asyncio.Future] = []
        self.write_timer: asyncio.TimerHandle | None = None
        transport.set_write_buffer_limits(high=limits.write_high_water)

    # ---- backpressure ----
    def pause(self) -> None:
        self.paused = True
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(
                self.limits.write_timeout, self._on_write_timeout
            )

    def resume(self) -> None:
        self.paused = False
        self.cancel_timer()
        self._wake_senders()

    def connection_lost(self) -> None:
        self.lost = True
        self.cancel_timer()
        self._wake_senders()

    async def drain(self) -> None:
        if self.paused and not self.lost:
            waiter = self.loop.create_future()
            self.drain_waiters.append(waiter)
            await waiter

    def cancel_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _wake_senders(self) -> None:
        for waiter in self.drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.drain_waiters.clear()

    def _on_write_timeout(self) -> None:
        self.write_timer = None
        if not self.lost and self.paused:
            self.on_write_timeout()

    # ---- one request's answer ----
    async def respond(
        self, request: HttpRequest, app: App, shutting_down: Callable[[], bool]
    ) -> bool:
        """Run the handler and send its response; returns whether the connection stays open.
        An error before the response started is answered 500; after it started, the connection
        closes (a half-sent response cannot be taken back)."""
        try:
            response = await app(request)
        except Exception:
            logger.exception("Unhandled error in %s %s", request.method, request.path)
            self.write_error(500, "Internal server error.")
            return False
        keep_alive = request.keep_alive and not shutting_down()
        self.head_sent = False
        try:
            if isinstance(response, StreamingResponse):
                return await self.write_stream(request, response, keep_alive)
            self.write_response(request, response, keep_alive)
            return keep_alive
        except Exception:
            logger.exception("Error while sending %s %s", request.method, request.path)
            if not self.head_sent:
                self.write_error(500, "Internal server error.")
            return False

    def write_continue(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(CONTINUE)

    def write_response(self, request: HttpRequest, response: Response, keep_alive: bool) -> None:
        if not keep_alive:
            response.headers.append(("connection", "close"))
        elif request.http_version == "1.0":
            response.headers.append(("connection", "keep-alive"))
        body = response.body
        head = encode_head(
            request.http_version,
            response.status,
            response.headers,
            response.content_type,
            len(body),
        )
        if request.method == "HEAD" or response.status in (204, 304):
            body = b""
        self.head_sent = True
        if not self.transport.is_closing():
            self.transport.write(head + body)

    async def write_stream(
        self, request: HttpRequest, response: StreamingResponse, keep_alive: bool
    ) -> bool:
        """Send each piece as it comes, waiting out backpressure; returns keep-alive."""
        chunked = request.http_version == "1.1"
        keep_alive = keep_alive and chunked
        headers = list(response.headers)
        if chunked:
            headers.append(("transfer-encoding", "chunked"))
        if not keep_alive:
            headers.append(("connection", "close"))
        body = response.body
        try:
            head = encode_head(
                request.http_version, response.status, headers, response.content_type, None
            )
        except Exception:
            await body.aclose()
            raise
        self.head_sent = True
        self.transport.write(head)
        try:
            async for chunk in body:
                if not chunk or self.lost:
                    continue
                if chunked:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                else:
                    self.transport.write(chunk)
                await self.drain()
        finally:
            await body.aclose()
        if chunked and not self.lost:
            self.transport.write(b"0\r\n\r\n")
        return keep_alive

    def write_error(self, status: int, message: str, response: Response | None = None) -> None:
        """An error reply, always with `Connection: close` (the caller closes); `response`, when
        given, is sent as it is (a refusal with headers of its own, such as the 401's)."""
        if self.transport.is_closing():
            return
        response = response or self.error_response(status, message)
        response.headers.append(("connection", "close"))
        head = encode_head(
            "1.1", response.status, response.headers, response.content_type, len(response.body)
        )
        self.transport.write(head + response.body)
