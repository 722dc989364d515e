"""A small HTTP/1.1 server on asyncio + httptools.

One `HttpProtocol` per connection parses requests, queues pipelined ones and answers them in
order, one handler task at a time. The handler (`App`) returns a `Response` or a
`StreamingResponse`; a client that goes away cancels its handler task, which is how the OpenAI
layer learns to abort the engine request. Limits: header bytes (431), body bytes (413), the time
allowed to read one request (408), the keep-alive idle time, the request bodies held at once
across all connections (503), and write backpressure (a stream waits for the socket to drain
instead of buffering, for at most the write timeout).
"""
from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import Awaitable, Callable

from nanoserve.server.http_protocol import HttpProtocol
from nanoserve.server.http_types import HttpLimits, Request, Response, StreamingResponse

App = Callable[[Request], Awaitable["Response | StreamingResponse"]]


class HttpServer:
    def __init__(self, app: App, limits: HttpLimits | None = None,
                 error_response: Callable[[int, str], Response] | None = None) -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpProtocol] = set()
        self.error_response = error_response or _plain_error
        self.server: asyncio.AbstractServer | None = None
        self.buffered_body_bytes = 0  # request bodies held, across connections
        self._date_second = -1
        self._date = ""

    def date_header(self) -> str:
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date = formatdate(now, usegmt=True)
        return self._date

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await self.loop.create_server(
            lambda: HttpProtocol(self), host=host, port=port, reuse_address=True, backlog=2048)
        address = self.server.sockets[0].getsockname()
        return address[0], address[1]

    async def shutdown(self, grace_period: float,
                       on_grace_expired: Callable[[], None] | None = None,
                       final_words_period: float = 2.0) -> None:
        """Stop accepting and let in-flight requests finish within the grace period. Then
        `on_grace_expired` (the engine fails what is left, so each stream ends with an error
        event) and `final_words_period` seconds to send those last words; then abort the rest."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.shutdown()
        await self._wait_for_connections(grace_period)
        if self.connections and on_grace_expired is not None:
            on_grace_expired()
            await self._wait_for_connections(final_words_period)
        for connection in list(self.connections):
            connection.abort()
        await asyncio.sleep(0)

    async def _wait_for_connections(self, seconds: float) -> None:
        deadline = self.loop.time() + seconds
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)


def _plain_error(status: int, message: str) -> Response:
    return Response(status, message.encode() + b"\n", content_type="text/plain; charset=utf-8")


__all__ = ["App", "HttpLimits", "HttpProtocol", "HttpServer", "Request", "Response",
           "StreamingResponse"]
