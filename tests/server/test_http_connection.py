"""The HTTP connection against a fake transport (tests/server/http_fakes.py), as uvicorn tests
its protocols: bytes go in through `data_received`, what the connection writes is recorded, and
time is a clock the test moves (timers fire when the test advances it), so nothing sleeps and no
case depends on how busy the machine is. Handlers run as real tasks on the running loop; `until`
gives them loop turns, never wall time. Every expected response is exact bytes."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.server.http import writer as http_writer
from nanoserve.server.http.types import (
    HttpLimits,
    HttpRequest,
    Response,
    ServerState,
    StreamingResponse,
)
from tests.server.http_fakes import Client, run_async, until

DATE = "Mon, 30 Nov 2026 12:00:00 GMT"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    monkeypatch.setattr(http_writer, "date_header", lambda: DATE)


class Routes:
    """A small route table that records what its handlers saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()  # /wait answers once set
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.chunks_produced = 0
        self.stream_closed = False

    async def __call__(self, request: HttpRequest):
        self.started.append(request.path)
        if request.path == "/hello":
            return Response(200, b"hello", content_type="text/plain")
        if request.path == "/echo":
            return Response(200, request.body, content_type="text/plain")
        if request.path == "/wait":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.path)
                raise
            return Response(200, b"waited", content_type="text/plain")
        if request.path == "/badheader":
            return Response(200, b"x", headers=[("x-bad", "a\r\nx-injected: 1")])
        if request.path == "/stream":
            size, count = (int(x) for x in request.query.split(","))
            return StreamingResponse(self._stream(size, count), content_type="text/plain")
        return Response(404, b"not found", content_type="text/plain")

    async def _stream(self, size: int, count: int):
        try:
            for index in range(count):
                self.chunks_produced += 1
                yield bytes([ord("a") + index % 26]) * size
        finally:
            self.stream_closed = True


def new_state(routes: Routes, **limits) -> ServerState:
    limits.setdefault("max_header_bytes", 1024)
    limits.setdefault("max_body_bytes", 1000)
    return ServerState(routes, HttpLimits(**limits))


def connect(**limits) -> tuple[Client, Routes]:
    routes = Routes()
    return Client(new_state(routes, **limits)), routes


def get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def reply(
    status: str,
    body: bytes = b"",
    *,
    content_type: str | None = "text/plain",
    headers: tuple[tuple[str, str], ...] = (),
    version: str = "1.1",
    length: bool = True,
) -> bytes:
    """The exact bytes of a response with a Content-Length (or a chunked head: length=False)."""
    lines = [f"HTTP/{version} {status}", f"date: {DATE}", "server: nanoserve"]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    if length:
        lines.append(f"content-length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def error(status: str, message: str) -> bytes:
    return reply(
        status,
        message.encode() + b"\n",
        content_type="text/plain; charset=utf-8",
        headers=(("connection", "close"),),
    )


HELLO = reply("200 OK", b"hello")
TOO_LARGE_431 = error("431 Request Header Fields Too Large", "Request header fields too large.")
TOO_LARGE_413 = error("413 Request Entity Too Large", "Request body too large.")
TIMED_OUT_408 = error("408 Request Timeout", "Timed out reading the request.")
BAD_400 = error("400 Bad Request", "Invalid HTTP request received.")


# ---- limits ----
@run_async
async def test_header_over_the_limit_is_431_then_close():
    client, routes = connect()
    client.send(get("/hello", "X-Big: " + "a" * 2000 + "\r\n"))
    await client.settled()
    assert client.transport.take() == TOO_LARGE_431
    assert client.closed and routes.started == []


@run_async
async def test_header_line_that_never_ends_is_431():
    # httptools holds a header line until its CRLF: the raw bytes are counted as they come.
    client, routes = connect()
    client.send(b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 500)
    assert client.transport.written == b"" and not client.closed
    client.send(b"a" * 600)
    await client.settled()
    assert client.transport.take() == TOO_LARGE_431
    assert client.closed and routes.started == []


@run_async
async def test_declared_body_over_the_limit_is_413_before_the_body():
    client, routes = connect()
    client.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")
    await client.settled()
    assert client.transport.take() == TOO_LARGE_413
    assert client.closed and routes.started == []


@run_async
async def test_chunked_body_over_the_limit_is_413():
    client, routes = connect()
    client.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    client.send(b"1f4\r\n" + b"a" * 500 + b"\r\n")  # 500 bytes: within the 1000
    assert client.transport.written == b""
    client.send(b"1f5\r\n" + b"a" * 501 + b"\r\n")  # 1001
    await client.settled()
    assert client.transport.take() == TOO_LARGE_413
    assert client.closed and routes.started == []


@run_async
async def test_slow_headers_are_408_at_the_read_deadline_however_they_trickle():
    client, routes = connect(request_read_timeout=10.0)
    client.send(b"GET /hello HTTP/1.1\r\n")
    for _ in range(9):  # a header line a second: each one is progress, the deadline holds
        client.clock.advance(1.0)
        client.send(b"X-A: b\r\n")
    client.clock.advance(0.99)
    assert client.transport.written == b"" and not client.closed
    client.clock.advance(0.01)
    await client.settled()
    assert client.transport.take() == TIMED_OUT_408
    assert client.closed and routes.started == []


@run_async
async def test_slow_body_is_408():
    client, routes = connect(request_read_timeout=10.0)
    client.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    client.clock.advance(10.0)
    await client.settled()
    assert client.transport.take() == TIMED_OUT_408
    assert client.closed and routes.started == []


@run_async
async def test_read_deadline_waits_while_reading_is_paused_for_pipelining():
    # Reading paused by the server (too many queued requests) is not the client's delay.
    client, routes = connect(request_read_timeout=10.0, max_pipelined_requests=2)
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    client.send(get("/hello") + get("/hello") + b"GET /hello HTTP/1.1\r\n")
    assert not client.transport.reading  # two queued behind the one being answered
    client.clock.advance(25.0)
    assert client.transport.written == b"" and not client.closed
    routes.release.set()
    await client.until(lambda: routes.started[:2] == ["/wait", "/hello"], "the second request")
    assert client.transport.reading  # a queued request was taken: reading resumes
    client.send(b"Host: x\r\n\r\n")
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited") + HELLO + HELLO + HELLO


# ---- keep-alive ----
@run_async
async def test_keep_alive_then_idle_close():
    client, routes = connect(keep_alive_timeout=5.0)
    for _ in range(3):
        client.send(get("/hello"))
        await client.settled()
        assert client.transport.take() == HELLO
        client.clock.advance(4.0)  # each request restarts the idle time
    assert not client.closed
    client.clock.advance(1.0)  # 5 s since the last response
    await asyncio.sleep(0)
    assert client.closed and client.transport.written == b""


@run_async
async def test_silent_connection_is_closed_after_the_keep_alive_time():
    client, _ = connect(keep_alive_timeout=5.0)
    client.clock.advance(4.99)
    assert not client.closed
    client.clock.advance(0.01)
    assert client.closed and client.transport.written == b""


@run_async
async def test_bare_crlfs_do_not_restart_the_idle_time():
    client, _ = connect(keep_alive_timeout=5.0)
    for _ in range(4):
        client.clock.advance(1.0)
        client.send(b"\r\n")
    client.clock.advance(1.0)  # 5 s since connect, whatever came in between
    assert client.closed and client.transport.written == b""


@run_async
async def test_idle_time_does_not_run_while_a_request_is_answered():
    client, routes = connect(keep_alive_timeout=5.0)
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    client.clock.advance(60.0)
    assert not client.closed
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited")
    client.clock.advance(5.0)
    assert client.closed


@run_async
async def test_http10_is_answered_then_closed():
    client, _ = connect()
    client.send(b"GET /hello HTTP/1.0\r\n\r\n")
    await client.settled()
    assert client.transport.take() == reply(
        "200 OK", b"hello", version="1.0", headers=(("connection", "close"),)
    )
    assert client.closed


@run_async
async def test_http10_keep_alive_is_honoured_and_said():
    client, _ = connect()
    client.send(b"GET /hello HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
    await client.settled()
    assert client.transport.take() == reply(
        "200 OK", b"hello", version="1.0", headers=(("connection", "keep-alive"),)
    )
    assert not client.closed


# ---- pipelining ----
@run_async
async def test_pipelined_requests_are_answered_in_order():
    client, routes = connect()
    client.send(get("/wait") + get("/hello") + post("/echo", b"abc"))
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    for _ in range(10):
        await asyncio.sleep(0)
    assert routes.started == ["/wait"] and client.transport.written == b""  # one at a time
    routes.release.set()
    await client.settled()
    assert routes.started == ["/wait", "/hello", "/echo"]
    assert client.transport.take() == reply("200 OK", b"waited") + HELLO + reply("200 OK", b"abc")
    assert not client.closed


@run_async
async def test_too_many_pipelined_requests_pause_reading():
    client, routes = connect(max_pipelined_requests=2)
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    client.send(get("/hello"))
    assert client.transport.reading
    client.send(get("/hello"))
    assert not client.transport.reading  # two queued behind the one being answered
    routes.release.set()
    await client.settled()
    assert client.transport.reading
    assert client.transport.take() == reply("200 OK", b"waited") + HELLO + HELLO


@run_async
async def test_request_split_across_reads():
    client, _ = connect()
    data = post("/echo", b"hello world")
    for index in range(len(data)):
        client.send(data[index : index + 1])
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"hello world")


@run_async
async def test_connection_close_ignores_pipelined_garbage():
    client, routes = connect()
    client.send(get("/hello", "Connection: Close\r\n") + b"GARBAGE\r\n\r\n" + get("/hello"))
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"hello", headers=(("connection", "close"),))
    assert client.closed and routes.started == ["/hello"]


@run_async
async def test_error_reply_waits_for_the_responses_before_it():
    client, routes = connect()
    client.send(get("/wait") + b"GARBAGE\r\n\r\n")
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    assert client.transport.written == b""
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited") + BAD_400
    assert client.closed


# ---- request framing ----
@run_async
async def test_chunked_request_body():
    client, _ = connect()
    client.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"hello world")
    assert not client.closed


@run_async
async def test_malformed_request_is_400_then_close():
    client, routes = connect()
    client.send(b"GARBAGE\r\n\r\n")
    await client.settled()
    assert client.transport.take() == BAD_400
    assert client.closed and routes.started == []


@run_async
async def test_bare_cr_in_a_header_value_is_400():
    client, routes = connect()
    client.send(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n")
    await client.settled()
    assert client.transport.take() == BAD_400
    assert client.closed and routes.started == []


@run_async
async def test_upgrade_is_not_offered():
    client, routes = connect()
    client.send(get("/hello", "Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    await client.settled()
    assert client.transport.take().startswith(b"HTTP/1.1 200 OK\r\n")
    assert client.closed


@run_async
async def test_expect_100_continue():
    client, _ = connect()
    client.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    assert client.transport.take() == CONTINUE
    client.send(b"hello")
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"hello")
    # over the limit: the final status comes instead of 100
    client.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\nExpect: 100-continue\r\n\r\n"
    )
    await client.settled()
    assert client.transport.take() == TOO_LARGE_413
    assert client.closed


@run_async
async def test_expect_100_continue_waits_for_the_request_before_it():
    client, routes = connect()
    client.send(
        get("/wait") + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    assert client.transport.written == b""
    routes.release.set()
    await client.until(lambda: client.transport.written.endswith(CONTINUE), "the 100")
    assert client.transport.take() == reply("200 OK", b"waited") + CONTINUE
    client.send(b"ok")
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"ok")


# ---- response framing ----
@run_async
async def test_head_has_no_body():
    client, _ = connect()
    client.send(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n" + get("/hello"))
    await client.settled()
    # content-length says what GET would send; the next response follows the head directly
    assert client.transport.take() == reply("200 OK", b"hello")[:-5] + HELLO


@run_async
async def test_response_header_injection_is_a_500():
    client, _ = connect()
    client.send(get("/badheader"))
    await client.settled()
    assert client.transport.take() == error("500 Internal Server Error", "Internal server error.")
    assert client.closed


@run_async
async def test_handler_exception_is_a_500_then_close():
    calls: list[str] = []

    async def app(request: HttpRequest):
        calls.append(request.path)
        raise RuntimeError("boom")

    client = Client(ServerState(app, HttpLimits()))
    client.send(get("/hello") + get("/hello"))
    await client.settled()
    assert client.transport.take() == error("500 Internal Server Error", "Internal server error.")
    assert client.closed and calls == ["/hello"]  # the pipelined one is dropped with the close


@run_async
async def test_streamed_response_is_chunked_and_keeps_the_connection():
    client, _ = connect()
    client.send(get("/stream?3,2") + get("/hello"))
    await client.settled()
    head = reply(
        "200 OK",
        content_type="text/plain",
        length=False,
        headers=(("transfer-encoding", "chunked"),),
    )
    assert client.transport.take() == head + b"3\r\naaa\r\n3\r\nbbb\r\n0\r\n\r\n" + HELLO
    assert not client.closed


@run_async
async def test_streamed_response_to_http10_ends_with_the_connection():
    client, _ = connect()
    client.send(b"GET /stream?3,2 HTTP/1.0\r\n\r\n")
    await client.settled()
    head = reply(
        "200 OK",
        content_type="text/plain",
        length=False,
        version="1.0",
        headers=(("connection", "close"),),
    )
    assert client.transport.take() == head + b"aaabbb"
    assert client.closed


# ---- write backpressure ----
@run_async
async def test_write_backpressure_pauses_the_stream_until_the_reader_catches_up():
    client, routes = connect(write_high_water=1000)
    client.transport.reader_reads = False
    client.send(get("/stream?400,100"))
    await client.until(lambda: client.transport.writing_paused, "the transport to pause")
    for _ in range(20):
        await asyncio.sleep(0)
    # The head and three 400-byte chunks pass the 1000-byte mark; the stream then waits.
    assert routes.chunks_produced == 3
    client.transport.reader_reads = True
    client.transport.drain()
    await client.settled()
    assert routes.chunks_produced == 100 and routes.stream_closed
    assert client.transport.take().endswith(b"190\r\n" + b"v" * 400 + b"\r\n0\r\n\r\n")
    assert not client.closed


@run_async
async def test_reader_that_takes_nothing_is_dropped_after_the_write_timeout():
    client, routes = connect(write_high_water=1000, write_timeout=60.0)
    client.transport.reader_reads = False
    client.send(get("/stream?400,100"))
    await client.until(lambda: client.transport.writing_paused, "the transport to pause")
    client.clock.advance(59.0)
    assert not client.closed
    client.clock.advance(1.0)
    assert client.transport.aborted
    await client.until(lambda: routes.stream_closed, "the stream to be closed")
    assert routes.chunks_produced == 3


@run_async
async def test_write_timeout_is_reset_when_the_reader_catches_up():
    client, routes = connect(write_high_water=1000, write_timeout=60.0)
    client.transport.reader_reads = False
    client.send(get("/stream?400,100"))
    await client.until(lambda: client.transport.writing_paused, "the transport to pause")
    client.clock.advance(50.0)
    client.transport.drain()  # some progress, then paused again
    await client.until(lambda: client.transport.writing_paused, "the transport to pause again")
    client.clock.advance(50.0)
    assert not client.transport.aborted
    client.transport.reader_reads = True
    client.transport.drain()
    await client.settled()
    assert routes.chunks_produced == 100 and not client.closed


# ---- the server-wide body budget ----
@run_async
async def test_bodies_held_at_once_across_connections_are_bounded():
    routes = Routes()
    state = new_state(routes, max_body_bytes=1000, max_buffered_body_bytes=1500)
    holder, other, chunked = Client(state), Client(state), Client(state)
    holder.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"a" * 900)
    assert state.buffered_body_bytes == 900  # what arrived, not what was declared
    # a declaration alone holds nothing: another 1000-byte body may start
    other.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    assert state.buffered_body_bytes == 900 and not other.closed
    other.send(b"a" * 500)
    assert state.buffered_body_bytes == 1400
    # a chunked body counts as it arrives too; past the budget it is refused
    chunked.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"c8\r\n" + b"a" * 200 + b"\r\n"
    )  # 1600 held: over the 1500
    await chunked.settled()
    assert chunked.transport.take() == error(
        "503 Service Unavailable",
        "The server holds too many request bodies right now. Retry later.",
    )
    assert chunked.closed and state.buffered_body_bytes == 1400  # its bytes never stayed
    # the first request completes and is answered; its bytes go back to the budget
    holder.send(b"a" * 100)
    await holder.settled()
    assert holder.transport.take() == reply("200 OK", b"a" * 1000)
    assert state.buffered_body_bytes == 500 and routes.started == ["/echo"]
    other.connection.connection_lost(None)  # a client that leaves mid-body gives its bytes back
    assert state.buffered_body_bytes == 0


@run_async
async def test_a_declared_length_holds_nothing_until_its_bytes_come():
    # Declaring costs a client nothing: connections that declare and send nothing must not take
    # the budget from the rest (issue 52, row 3).
    routes = Routes()
    state = new_state(routes, max_body_bytes=1000, max_buffered_body_bytes=1500)
    idle = [Client(state) for _ in range(4)]
    for client in idle:
        client.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    assert state.buffered_body_bytes == 0
    other = Client(state)
    other.send(post("/echo", b"abc"))
    await other.settled()
    assert other.transport.take() == reply("200 OK", b"abc")
    assert not any(client.closed for client in idle)


@run_async
async def test_one_connection_holds_at_most_one_body_of_the_limit():
    # Pipelined bodies behind an answer under way: reading pauses once the connection holds
    # max_body_bytes, and goes on as answers give their bytes back.
    routes = Routes()
    state = new_state(routes, max_body_bytes=1000, max_buffered_body_bytes=10_000)
    client = Client(state)
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    client.send(post("/echo", b"a" * 600) + post("/echo", b"b" * 300))
    assert client.transport.reading and state.buffered_body_bytes == 900
    client.send(post("/echo", b"c" * 200))
    assert not client.transport.reading and state.buffered_body_bytes == 1100
    routes.release.set()
    await client.settled()
    assert client.transport.reading and state.buffered_body_bytes == 0
    assert client.transport.take() == (
        reply("200 OK", b"waited")
        + reply("200 OK", b"a" * 600)
        + reply("200 OK", b"b" * 300)
        + reply("200 OK", b"c" * 200)
    )


# ---- the check of the headers (the API key) ----
def refusing_state(routes: Routes, **limits) -> tuple[ServerState, list[HttpRequest]]:
    """A server whose header check refuses /echo without `Authorization: yes`."""
    seen: list[HttpRequest] = []

    def check(request: HttpRequest) -> Response | None:
        seen.append(request)
        if request.path == "/echo" and request.header("authorization") != "yes":
            return Response(
                401, b"no key", content_type="text/plain", headers=[("www-authenticate", "Bearer")]
            )
        return None

    state = new_state(routes, **limits)
    state.check_headers = check
    return state, seen


UNAUTHORIZED_401 = reply(
    "401 Unauthorized", b"no key", headers=(("www-authenticate", "Bearer"), ("connection", "close"))
)


@run_async
async def test_a_refused_request_is_answered_at_the_end_of_its_headers():
    routes = Routes()
    state, seen = refusing_state(routes, max_body_bytes=1000, max_buffered_body_bytes=1500)
    client = Client(state)
    client.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
    )  # no body sent: the answer must not wait for it
    await client.settled()
    assert client.transport.take() == UNAUTHORIZED_401  # no `100 Continue`: it never sends it
    assert client.closed and routes.started == [] and state.buffered_body_bytes == 0
    assert [(r.method, r.path, r.body) for r in seen] == [("POST", "/echo", b"")]
    # with the key, the same request is read and answered
    client = Client(state)
    client.send(post("/echo", b"abc", "Authorization: yes\r\n"))
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"abc")


@run_async
async def test_a_refusal_waits_for_the_answers_before_it_and_reads_no_body():
    routes = Routes()
    state, _ = refusing_state(routes, max_body_bytes=1000, max_buffered_body_bytes=1500)
    client = Client(state)
    client.send(
        get("/wait") + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n" + b"a" * 900
    )
    await client.until(lambda: routes.started == ["/wait"], "the first handler")
    assert state.buffered_body_bytes == 0 and client.transport.written == b""
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited") + UNAUTHORIZED_401
    assert client.closed and routes.started == ["/wait"]


@run_async
async def test_a_refused_body_is_released_at_once_though_the_connection_stays_open():
    # The 413 waits behind the answer under way; the bytes it held must not wait with it.
    routes = Routes()
    state = new_state(routes, max_body_bytes=1000, max_buffered_body_bytes=1500)
    client = Client(state)
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    client.send(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"190\r\n" + b"a" * 400 + b"\r\n"
    )
    assert state.buffered_body_bytes == 400
    client.send(b"259\r\n" + b"a" * 601 + b"\r\n")  # 1001: over the limit
    assert state.buffered_body_bytes == 0 and not client.closed
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited") + TOO_LARGE_413
    assert client.closed


@run_async
async def test_a_disconnect_releases_the_body_budget():
    routes = Routes()
    state = new_state(routes, max_buffered_body_bytes=1500)
    client = Client(state)
    client.send(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
    assert state.buffered_body_bytes == 3
    client.connection.connection_lost(None)
    assert state.buffered_body_bytes == 0 and not state.connections


# ---- disconnects and half-closes ----
@run_async
async def test_disconnect_cancels_the_handler():
    client, routes = connect()
    client.send(get("/wait"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    client.connection.connection_lost(ConnectionResetError())
    await until(lambda: routes.cancelled == ["/wait"], "the handler to be cancelled")
    assert client.transport.written == b""


@run_async
async def test_disconnect_ends_a_stream_waiting_on_backpressure():
    client, routes = connect(write_high_water=1000)
    client.transport.reader_reads = False
    client.send(get("/stream?400,100"))
    await client.until(lambda: client.transport.writing_paused, "the transport to pause")
    client.connection.connection_lost(ConnectionResetError())
    await client.until(lambda: routes.stream_closed, "the stream to be closed")
    assert routes.chunks_produced < 100


@run_async
async def test_eof_during_a_whole_answer_is_a_disconnect():
    # Nothing may be written before a whole answer, so nothing could tell a half-closed client
    # from a gone one: the EOF is taken as a disconnect, and the handler cancelled at once
    # (issue 52, row 11), for keep-alive and `Connection: close` alike.
    for extra in ("", "Connection: close\r\n"):
        client, routes = connect()
        client.send(get("/wait", extra))
        await client.until(lambda: routes.started == ["/wait"], "the handler")
        assert client.connection.eof_received() is None  # the transport closes
        client.connection.connection_lost(None)
        await until(lambda: routes.cancelled == ["/wait"], "the handler to be cancelled")
        assert client.transport.written == b""  # no `100 Continue` it did not ask for


@run_async
async def test_half_closed_client_of_a_stream_under_way_gets_the_rest():
    # A stream's chunks are the writes that would find a gone client, so a half-closed one is
    # answered to the end.
    client, routes = connect(write_high_water=1000)
    client.transport.reader_reads = False
    client.send(get("/stream?400,10") + get("/hello"))
    await client.until(lambda: client.transport.writing_paused, "the stream to start")
    assert client.connection.eof_received() is True
    client.transport.reader_reads = True
    client.transport.drain()
    await client.settled()
    head, _, body = client.transport.take().partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body.endswith(b"0\r\n\r\n")
    assert routes.chunks_produced == 10
    # the request queued behind it has nothing to tell: it is not answered
    assert client.closed and routes.started == ["/stream"]


@run_async
async def test_half_closed_client_that_asked_for_100_is_probed_with_it():
    client, routes = connect()
    client.send(get("/wait", "Expect: 100-continue\r\n"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    assert client.transport.take() == CONTINUE  # the answer to its Expect
    assert client.connection.eof_received() is True
    assert client.transport.take() == CONTINUE  # the probe that tells a gone client apart
    client.clock.advance(0.5)
    assert client.transport.take() == CONTINUE
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited")
    assert client.closed


@run_async
async def test_http10_eof_is_a_disconnect():
    client, routes = connect()
    client.send(b"GET /wait HTTP/1.0\r\n\r\n")
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    assert client.connection.eof_received() is None  # the transport closes
    client.connection.connection_lost(None)
    await until(lambda: routes.cancelled == ["/wait"], "the handler to be cancelled")


@run_async
async def test_eof_with_nothing_to_answer_closes():
    client, _ = connect()
    assert client.connection.eof_received() is None


# ---- shutdown ----
@run_async
async def test_shutdown_finishes_the_answer_under_way_then_closes():
    # Requests queued behind it are dropped, as after any `Connection: close` response: the
    # client retries them on a new connection.
    client, routes = connect()
    client.send(get("/wait") + get("/hello"))
    await client.until(lambda: routes.started == ["/wait"], "the handler")
    client.connection.shutdown()
    client.send(get("/hello"))  # no longer read
    routes.release.set()
    await client.settled()
    assert client.transport.take() == reply("200 OK", b"waited", headers=(("connection", "close"),))
    assert client.closed and routes.started == ["/wait"]


@run_async
async def test_shutdown_closes_an_idle_connection_now():
    client, _ = connect()
    client.connection.shutdown()
    assert client.closed
