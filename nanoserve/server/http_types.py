"""Request and response objects passed between the HTTP layer and the handlers."""
from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncGenerator

_REASONS = {status.value: status.phrase for status in HTTPStatus}


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
class Request:
    method: str
    path: str
    query: str
    http_version: str
    headers: list[tuple[str, str]]  # names lower-cased, in arrival order
    body: bytes
    keep_alive: bool = True
    reserved_bytes: int = 0  # this body's share of the server-wide body budget

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


def _check_header_text(text: str) -> str:
    # A CR or LF in a header would let a value inject headers or split the response.
    if "\r" in text or "\n" in text or "\0" in text:
        raise ValueError(f"invalid character in response header: {text!r}")
    return text


def encode_head(http_version: str, status: int, headers: list[tuple[str, str]],
                content_type: str | None, content_length: int | None, date: str) -> bytes:
    """Status line and headers. `content_length` None: the caller frames the body itself."""
    version = "1.0" if http_version == "1.0" else "1.1"
    lines = [f"HTTP/{version} {status} {_REASONS.get(status, 'Unknown')}",
             f"date: {date}", "server: nanoserve"]
    if content_type is not None:
        lines.append(f"content-type: {_check_header_text(content_type)}")
    if content_length is not None:
        lines.append(f"content-length: {content_length}")
    for name, value in headers:
        lines.append(f"{_check_header_text(name)}: {_check_header_text(value)}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")
