"""What the HTTP layer and the route handlers pass each other: the limits, a parsed request, a
response (whole or streamed), and the state the connections of one server share."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    request_read_timeout: float = 30.0  # seconds to receive one request's headers and body
    keep_alive_timeout: float = 5.0  # idle seconds before an idle connection is closed
    max_pipelined_requests: int = 32  # queued complete requests before reading pauses
    write_high_water: int = 64 * 1024
    write_timeout: float = 60.0  # seconds a send may wait on a reader that takes no data
    max_buffered_body_bytes: int = 256 * 1024 * 1024  # all request bodies held at once: 503 above


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: str
    http_version: str
    headers: list[tuple[str, str]]  # names lower-cased, in arrival order
    body: bytes
    keep_alive: bool = True
    reserved_bytes: int = 0  # this body's share of the server-wide body budget (bytes received)
    expects_continue: bool = False  # sent `Expect: 100-continue`: interim 100s are welcome

    def header(self, name: str) -> str | None:
        """The value of a header (name lower-case); repeated headers are joined by ', '."""
        values = [value for key, value in self.headers if key == name]
        return ", ".join(values) if values else None


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class StreamingResponse:
    """A body produced piece by piece; each piece is sent (and drained) before the next."""

    body: AsyncGenerator[bytes, None]
    status: int = 200
    content_type: str | None = "text/event-stream; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


App = Callable[[HttpRequest], Awaitable["Response | StreamingResponse"]]
ErrorResponse = Callable[[int, str], Response]  # the body of an error found by the HTTP layer
# Asked once a request's headers are in (its body still empty): a refusal to send instead of
# reading the body (the API key's 401), or None.
HeaderCheck = Callable[[HttpRequest], "Response | None"]


def plain_error(status: int, message: str) -> Response:
    return Response(status, message.encode() + b"\n", content_type="text/plain; charset=utf-8")


@dataclass(slots=True, eq=False)
class ServerState:
    """What the connections of one server share: the route table, the limits, the open
    connections, and the request body bytes held at once across all of them."""

    app: App
    limits: HttpLimits = field(default_factory=HttpLimits)
    error_response: ErrorResponse = plain_error
    check_headers: HeaderCheck | None = None
    connections: set = field(default_factory=set)
    buffered_body_bytes: int = 0
