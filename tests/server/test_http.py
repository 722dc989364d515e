"""The HTTP server over real loopback sockets, against a trivial route table (no engine): what a
fake transport cannot show (accepting, the event loop's own transports, shutting down). The
parser-level cases (limits, timeouts, pipelining, framing, backpressure) are in
test_http_connection.py. Nothing here waits on wall time for something to happen: handlers
signal events, and deadlines are generous."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nanoserve.server.http.server import HttpServer
from nanoserve.server.http.types import HttpLimits, HttpRequest, Response, StreamingResponse
from tests.server.server_helpers import connect, is_closed, read_response

DEADLINE = 30.0  # seconds; only a broken server takes that long


class Probe:
    """What the handlers saw, shared with the test thread."""

    def __init__(self) -> None:
        self.release = asyncio.Event()  # /wait answers once set (on the server's loop)
        self.started: dict[str, threading.Event] = {
            "/wait": threading.Event(),
            "/stuck": threading.Event(),
        }
        self.cancelled = threading.Event()


def make_app(probe: Probe):
    async def app(request: HttpRequest):
        if request.path == "/hello":
            return Response(200, b"hello", content_type="text/plain")
        if request.path in ("/wait", "/stuck"):
            probe.started[request.path].set()
            try:
                if request.path == "/wait":
                    await probe.release.wait()
                else:
                    await asyncio.Event().wait()  # never answers
            except asyncio.CancelledError:
                probe.cancelled.set()
                raise
            return Response(200, b"waited", content_type="text/plain")
        if request.path == "/stream":
            size, count = (int(x) for x in request.query.split(","))

            async def body():
                for index in range(count):
                    yield bytes([ord("a") + index % 26]) * size

            return StreamingResponse(body())
        return Response(404, b"not found", content_type="text/plain")

    return app


@pytest.fixture
def server(loop_thread):
    probe = Probe()
    limits = HttpLimits(keep_alive_timeout=1.0)

    async def start():
        http = HttpServer(make_app(probe), limits)
        host, port = await http.start("127.0.0.1", 0)
        return http, port

    http, port = loop_thread.call(start)
    yield port, probe, http, loop_thread
    loop_thread.call(lambda: http.shutdown(0.5))


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def test_keep_alive_round_trip(server):
    port, *_ = server
    sock = connect(port, DEADLINE)
    for _ in range(3):
        sock.sendall(get("/hello"))
        status, headers, body = read_response(sock, DEADLINE)
        assert (status, body) == (200, b"hello")
        assert headers["content-length"] == "5" and "connection" not in headers
        assert headers["date"].endswith(" GMT") and headers["server"] == "nanoserve"
    assert is_closed(sock, timeout=DEADLINE)  # the keep-alive time (1 s) runs out
    sock.close()


def test_streamed_response(server):
    port, *_ = server
    sock = connect(port, DEADLINE)
    sock.sendall(get("/stream?1000,50"))
    status, headers, body = read_response(sock, DEADLINE)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert body == b"".join(bytes([ord("a") + index % 26]) * 1000 for index in range(50))
    sock.sendall(get("/hello"))  # still usable after a chunked response
    assert read_response(sock, DEADLINE)[::2] == (200, b"hello")
    sock.close()


def test_graceful_shutdown(server):
    port, probe, http, loop_thread = server
    waiting = connect(port, DEADLINE)
    waiting.sendall(get("/wait"))
    stuck = connect(port, DEADLINE)
    stuck.sendall(get("/stuck"))
    idle = connect(port, DEADLINE)
    idle.sendall(get("/hello"))
    assert read_response(idle, DEADLINE)[0] == 200  # accepted, and now idle
    assert probe.started["/wait"].wait(DEADLINE) and probe.started["/stuck"].wait(DEADLINE)
    done = threading.Event()

    async def shut_down_then_release():
        shutdown = asyncio.ensure_future(http.shutdown(2.0))
        await asyncio.sleep(0)  # one loop turn: the listener is closed, every connection told
        probe.release.set()  # the request under way finishes within the grace period
        await shutdown

    threading.Thread(
        target=lambda: (loop_thread.call(shut_down_then_release), done.set()), daemon=True
    ).start()
    status, headers, body = read_response(waiting, DEADLINE)
    assert (status, body) == (200, b"waited") and headers["connection"] == "close"
    assert is_closed(waiting, timeout=DEADLINE)
    assert is_closed(idle, timeout=DEADLINE)
    with pytest.raises(ConnectionRefusedError):  # no longer accepting
        connect(port, DEADLINE)
    assert done.wait(DEADLINE)
    assert probe.cancelled.is_set()  # the request still running at the deadline was aborted
    assert is_closed(stuck, timeout=DEADLINE)
    assert not http.connections
    for sock in (waiting, stuck, idle):
        sock.close()
