"""Raw-socket tests of the HTTP/1.1 layer against a trivial route table (no engine)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from nanoserve.server.http_server import HttpServer
from nanoserve.server.http_types import HttpLimits, Request, Response, StreamingResponse

from tests.server.server_helpers import connect, is_closed, read_response


class Probe:
    """What the handlers saw, shared with the test thread."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.stream_closed = threading.Event()
        self.chunks_produced = 0


def make_app(probe: Probe):
    async def app(request: Request):
        if request.path == "/hello":
            if request.method not in ("GET", "HEAD"):
                return Response(405, b"", headers=[("allow", "GET")])
            return Response(200, b"hello", content_type="text/plain")
        if request.path == "/echo":
            return Response(200, request.body, content_type="application/octet-stream")
        if request.path == "/slow":
            await asyncio.sleep(float(request.query or "0.2"))
            return Response(200, b"slow", content_type="text/plain")
        if request.path == "/wait":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                probe.cancelled.set()
                raise
        if request.path == "/badheader":
            return Response(200, b"x", headers=[("x-bad", "a\r\nx-injected: 1")])
        if request.path == "/stream":
            size, count = (int(x) for x in request.query.split(","))

            async def body():
                try:
                    for _ in range(count):
                        probe.chunks_produced += 1
                        yield b"x" * size
                        await asyncio.sleep(0)
                finally:
                    probe.stream_closed.set()
            return StreamingResponse(body())
        return Response(404, b"not found", content_type="text/plain")
    return app


@pytest.fixture
def server(loop_thread):
    probe = Probe()
    limits = HttpLimits(max_header_bytes=4096, max_body_bytes=10_000, request_read_timeout=0.6,
                        keep_alive_timeout=0.6, write_high_water=16 * 1024)

    async def start():
        http = HttpServer(make_app(probe), limits)
        host, port = await http.start("127.0.0.1", 0)
        return http, port
    http, port = loop_thread.call(start)
    yield port, probe, http, loop_thread
    loop_thread.call(lambda: http.shutdown(0.5))


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def test_keep_alive_and_idle_timeout(server):
    port, *_ = server
    sock = connect(port)
    for _ in range(3):
        sock.sendall(get("/hello"))
        status, headers, body = read_response(sock)
        assert (status, body) == (200, b"hello")
        assert headers.get("connection") != "close"
        assert "date" in headers
    start = time.monotonic()
    assert is_closed(sock, timeout=5)  # idle keep-alive timeout (0.6 s)
    assert 0.4 < time.monotonic() - start < 3


def test_silent_connection_is_closed(server):
    port, *_ = server
    sock = connect(port)
    assert is_closed(sock, timeout=5)


def test_pipelined_requests_answered_in_order(server):
    port, *_ = server
    sock = connect(port)
    body = b"abc"
    sock.sendall(get("/slow?0.3") + get("/hello")
                 + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n" + body)
    assert read_response(sock)[2] == b"slow"
    assert read_response(sock)[2] == b"hello"
    assert read_response(sock)[2] == b"abc"


def test_chunked_request_body(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert read_response(sock)[:3:2] == (200, b"hello world")


def test_malformed_request_gets_400_and_close(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"GARBAGE\r\n\r\n")
    status, headers, _ = read_response(sock)
    assert status == 400 and headers["connection"] == "close"
    assert is_closed(sock)


def test_header_value_with_bare_cr_rejected(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n")
    assert read_response(sock)[0] == 400


def test_response_header_injection_blocked(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(get("/badheader"))
    status, headers, _ = read_response(sock)
    assert status == 500 and "x-injected" not in headers


def test_header_limit_431(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(get("/hello", "X-Big: " + "a" * 8000 + "\r\n"))
    status, headers, _ = read_response(sock)
    assert status == 431 and headers["connection"] == "close"
    # a header line that never ends is cut off as well
    sock = connect(port)
    sock.sendall(b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 6000)
    assert read_response(sock)[0] == 431


def test_body_limit_413(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n")
    assert read_response(sock)[0] == 413
    sock = connect(port)
    chunk = b"2710\r\n" + b"a" * 10000 + b"\r\n"
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2)
    assert read_response(sock)[0] == 413


def test_slowloris_times_out_408(server):
    port, *_ = server
    sock = connect(port)
    start = time.monotonic()
    sock.sendall(b"GET /hello HTTP/1.1\r\n")
    try:
        for _ in range(20):  # keep trickling header bytes; the read deadline still holds
            time.sleep(0.1)
            sock.sendall(b"X-A: b\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, _, _ = read_response(sock)
    assert status == 408
    assert time.monotonic() - start < 2.5
    assert is_closed(sock)


def test_slow_body_times_out(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    assert read_response(sock)[0] == 408


def test_expect_100_continue(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock)[0] == 100
    sock.sendall(b"hello")
    assert read_response(sock)[:3:2] == (200, b"hello")
    # over the limit: the final status comes instead of 100
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock)[0] == 413


def test_http10_closes_and_head_has_no_body(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(b"GET /hello HTTP/1.0\r\n\r\n")
    status, headers, body = read_response(sock)
    assert (status, body) == (200, b"hello")
    assert is_closed(sock)
    sock = connect(port)
    sock.sendall(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        data += sock.recv(4096)
    assert data.startswith(b"HTTP/1.1 200") and b"content-length: 5" in data
    sock.sendall(get("/hello"))  # HEAD had no body: the next response follows directly
    assert read_response(sock)[2] == b"hello"


def test_connection_close_ignores_pipelined_garbage(server):
    port, *_ = server
    sock = connect(port)
    sock.sendall(get("/hello", "Connection: Close\r\n") + b"GARBAGE\r\n\r\n")
    status, headers, body = read_response(sock)
    assert (status, body) == (200, b"hello") and headers["connection"] == "close"
    assert is_closed(sock)


def test_disconnect_cancels_waiting_handler(server):
    port, probe, *_ = server
    sock = connect(port)
    sock.sendall(get("/wait"))
    time.sleep(0.1)
    sock.close()
    assert probe.cancelled.wait(5)


def test_write_backpressure_pauses_stream(server):
    port, probe, *_ = server
    sock = connect(port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    total_chunks, size = 2000, 32 * 1024  # 64 MB if it were all buffered
    sock.sendall(get(f"/stream?{size},{total_chunks}"))
    time.sleep(0.5)  # read nothing: the stream must stall on a bounded buffer
    produced = probe.chunks_produced
    assert produced < 200, produced
    # a stalled reader that goes away ends the stream
    sock.close()
    assert probe.stream_closed.wait(5)


def test_stream_completes_for_reader(server):
    port, probe, *_ = server
    sock = connect(port)
    sock.sendall(get("/stream?1000,50"))
    status, headers, body = read_response(sock)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert len(body) == 50_000
    sock.sendall(get("/hello"))  # still usable after a chunked response
    assert read_response(sock)[2] == b"hello"


def test_graceful_shutdown(server):
    port, probe, http, loop_thread = server
    slow = connect(port)
    slow.sendall(get("/slow?0.5"))
    stuck = connect(port)
    stuck.sendall(get("/wait"))
    idle = connect(port)
    time.sleep(0.1)
    done = threading.Event()

    def shut():
        loop_thread.call(lambda: http.shutdown(1.5))
        done.set()
    threading.Thread(target=shut, daemon=True).start()
    time.sleep(0.1)
    with pytest.raises(OSError):  # no longer accepting
        connect(port, timeout=1).sendall(get("/hello"))
        raise OSError("accepted")
    status, headers, body = read_response(slow)
    assert (status, body) == (200, b"slow") and headers["connection"] == "close"
    assert is_closed(idle)
    assert done.wait(5)
    assert probe.cancelled.is_set()  # the request still running at the deadline was aborted
