"""The request body budget against clients that declare bodies they never send, on a real server
with an API key over loopback (issue 52, row 3): a declared `Content-Length` holds nothing (only
bytes that arrive count), the key is checked when the headers end (a request without it gets its
401 before any of its body is read), and a declaration over the per-request limit is a 413 at
once. The budget is counted, not timed: the server's `buffered_body_bytes`."""

from __future__ import annotations

import json

import pytest

from nanoserve.server.http.types import HttpLimits
from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import connect, is_closed, read_response

MB = 1024 * 1024
KEY = "sekret"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir):
    limits = HttpLimits(max_body_bytes=MB, max_buffered_body_bytes=4 * MB)
    handle = ServerHandle(tiny_llama_dir, api_key=KEY, limits=limits)
    yield handle
    handle.close()


def declaration(length: int, *, key: str | None = KEY, expect: bool = False) -> bytes:
    """A request's head that declares `length` body bytes (none of which follow)."""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key is not None else "")
        + ("Expect: 100-continue\r\n" if expect else "")
        + "\r\n"
    ).encode()


def headers_read(handle, count: int) -> bool:
    """Whether `count` connections have sent whole heads and are waiting on their bodies."""
    connections = list(handle.server.http.connections)
    return (
        sum(
            1
            for connection in connections
            if connection.parser.partial is not None and connection.parser.partial.headers_done
        )
        >= count
    )


def test_declared_bodies_that_never_come_hold_no_budget(keyed_server):
    state = keyed_server.server.http.state
    # Four connections declare 1 MB each (4 MB: the whole budget, were declarations reserved)
    # and send nothing more.
    holders = [connect(keyed_server.port) for _ in range(4)]
    for sock in holders:
        sock.sendall(declaration(MB))
    wait_until(lambda: headers_read(keyed_server, 4), "the four heads")
    assert state.buffered_body_bytes == 0
    # Another client's ordinary request is served.
    completion = keyed_server.client(api_key=KEY).completions.create(
        model=keyed_server.engine.served_model_name,
        prompt="hello",
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage.completion_tokens == 3
    # The holders are still there, waiting on their bodies; the bytes they send are counted.
    assert headers_read(keyed_server, 4)
    holders[0].sendall(b" " * 1000)
    wait_until(lambda: state.buffered_body_bytes == 1000, "the bytes that came")
    for sock in holders:
        sock.close()
    wait_until(lambda: state.buffered_body_bytes == 0, "the bytes to be released")


@pytest.mark.parametrize("expect", [False, True])
def test_a_request_without_the_key_is_refused_before_its_body(keyed_server, expect):
    state = keyed_server.server.http.state
    for key in (None, "wrong"):
        sock = connect(keyed_server.port)
        sock.sendall(declaration(MB, key=key, expect=expect))  # the body never comes
        status, headers, body = read_response(sock, timeout=30)  # (a hang bound)
        assert status == 401, (status, body[:200])  # not `100 Continue`, not a wait for the body
        assert headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == 401
        assert is_closed(sock, timeout=30)
        sock.close()
        assert state.buffered_body_bytes == 0


def test_a_declaration_over_the_request_limit_is_413_at_once(keyed_server):
    sock = connect(keyed_server.port)
    sock.sendall(declaration(MB + 1))
    status, headers, body = read_response(sock, timeout=30)  # no body byte was sent
    assert status == 413 and json.loads(body)["error"]["code"] == 413
    assert is_closed(sock, timeout=30)
    sock.close()
    # at the limit, the body is awaited (and the request then answered)
    sock = connect(keyed_server.port)
    payload = json.dumps({"prompt": "hello", "max_tokens": 2, "ignore_eos": True}).encode()
    payload += b" " * (MB - len(payload))
    sock.sendall(declaration(MB) + payload)
    status, _, body = read_response(sock, timeout=60)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    sock.close()
