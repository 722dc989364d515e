"""A small HTTP/1.1 server on asyncio + httptools: listen, track connections, shut down gracefully.

One `HttpConnection` per connection (connection.py: keep-alive, pipelining, timers) reads
requests through a `RequestParser` (parser.py: httptools, header and body limits) and answers
them in order through a `ResponseWriter` (writer.py: framing, write backpressure). The
handler (`App`) returns a `Response` or a `StreamingResponse`; a client that goes away cancels its
handler task, which is how the OpenAI layer learns to abort the engine request. Limits: header
bytes (431), body bytes (413, at once for a declared length over it), the time allowed to read one request (408), the keep-alive idle
time, the request body bytes held at once across all connections (503; counted as they arrive,
after the headers passed `check_headers`) and by one connection, and write backpressure (a
stream waits for the socket to drain instead of buffering, for at most the write timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nanoserve.server.http.connection import HttpConnection
from nanoserve.server.http.types import (
    App,
    ErrorResponse,
    HeaderCheck,
    HttpLimits,
    ServerState,
    plain_error,
)


class HttpServer:
    def __init__(
        self,
        app: App,
        limits: HttpLimits | None = None,
        error_response: ErrorResponse | None = None,
        check_headers: HeaderCheck | None = None,
    ) -> None:
        """`check_headers`: asked once each request's headers are in, before its body is read
        (the API key); a response it returns is sent instead, then the connection closes."""
        self.state = ServerState(
            app, limits or HttpLimits(), error_response or plain_error, check_headers
        )
        self.loop = asyncio.get_running_loop()
        self.server: asyncio.AbstractServer | None = None

    @property
    def connections(self) -> set[HttpConnection]:
        return self.state.connections

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await self.loop.create_server(
            lambda: HttpConnection(self.state, self.loop),
            host=host,
            port=port,
            reuse_address=True,
            backlog=2048,
        )
        address = self.server.sockets[0].getsockname()
        return address[0], address[1]

    async def shutdown(
        self,
        grace_period: float,
        on_grace_expired: Callable[[], None] | None = None,
        final_words_period: float = 2.0,
    ) -> None:
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
