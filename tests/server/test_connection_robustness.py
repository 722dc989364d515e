"""Connections that misbehave, end to end on a real server over loopback (issue 15, items 5, 6,
7, 10; issue 52, rows 3 and 11): non-streamed requests are aborted in the engine when their
clients go away (keep-alive or `Connection: close`, with or without `Expect: 100-continue`); a
half-closed client still gets its answer where a write can tell it from a gone one (a stream
under way, or a request that sent `Expect: 100-continue`); a reader that reads nothing is cut off
after the write timeout; request bodies held at once are bounded across connections, counted as
their bytes arrive. The same cases at the parser level, with a fake transport and clock (and bare
CRLFs not restarting the keep-alive time), are in test_http_connection.py; the body budget
against the API key in test_body_budget.py."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from nanoserve.server.http.types import HttpLimits
from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import (
    StepSpy,
    connect,
    is_closed,
    letter_bias,
    read_response,
    scrape_metrics,
)

MB = 1024 * 1024


@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir):
    limits = HttpLimits(
        keep_alive_timeout=1.0,
        write_timeout=1.0,
        write_high_water=1024,
        max_body_bytes=3 * MB,
        max_buffered_body_bytes=4 * MB,
    )
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 256}, limits=limits)
    yield handle
    handle.close()


def request_bytes(
    body: dict | bytes,
    *,
    close: bool = False,
    version: str = "1.1",
    content_length: int | None = None,
    expect: bool = False,
) -> bytes:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    length = len(payload) if content_length is None else content_length
    head = (
        f"POST /v1/completions HTTP/{version}\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n"
        + ("Connection: close\r\n" if close else "")
        + ("Expect: 100-continue\r\n" if expect else "")
        + "\r\n"
    )
    return head.encode() + payload


def final_response(sock, timeout: float = 60.0):
    """The response after any interim 1xx ones."""
    while True:
        status, headers, body = read_response(sock, timeout)
        if status >= 200:
            return status, headers, body


def abort_count(handle) -> float:
    key = (
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="%s"}'
        % handle.engine.served_model_name
    )
    return scrape_metrics(handle.port)[key]


# HTTP/1.1: the client sent `Expect: 100-continue`, so interim 100s may probe it after its EOF
# (without one, the EOF itself is the leaving: test_non_streamed_requests_are_aborted_when_...).
@pytest.mark.parametrize("close,version", [(True, "1.1"), (False, "1.1"), (True, "1.0")])
def test_non_streamed_request_is_aborted_when_its_client_leaves(strict_server, close, version):
    port = strict_server.port
    engine, async_engine = strict_server.engine, strict_server.server.engine
    before = scrape_metrics(port)
    aborted = abort_count(strict_server)
    # From its second step on, the engine's step waits (on the step thread; the event loop stays
    # free) until the server has asked to abort the request: it can't finish before its client
    # leaves, however fast steps are here.
    abort_asked = threading.Event()
    real_step, real_abort = engine.step, async_engine.abort
    steps = 0

    def held_step():
        nonlocal steps
        outputs = real_step()
        steps += 1
        if steps > 1:
            abort_asked.wait(30)  # a bound only so that a broken test can't hang the suite
        return outputs

    def abort(request_id):
        real_abort(request_id)
        abort_asked.set()

    engine.step, async_engine.abort = held_step, abort
    try:
        sock = connect(port)
        sock.sendall(
            request_bytes(
                {"prompt": "hello", "max_tokens": 480, "ignore_eos": True},
                close=close,
                version=version,
                expect=version == "1.1",
            )
        )
        wait_until(
            lambda: scrape_metrics(port)["vllm:num_requests_running"] == 1,
            "the request",
            timeout=60,
        )
        sock.close()
        assert abort_asked.wait(60), "the server did not abort the request of a client that left"
    finally:
        abort_asked.set()
        engine.step, async_engine.abort = real_step, real_abort
    wait_until(
        lambda: scrape_metrics(port)["vllm:num_requests_running"] == 0, "the abort", timeout=60
    )
    assert abort_count(strict_server) == aborted + 1
    generated = (
        scrape_metrics(port)["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"]
    )
    assert generated < 470  # stopped early, not run to the end for nobody


class HoldWhenAllRun:
    """Wraps the engine's step (on the step thread; the event loop stays free): the first step
    waits until the test says all `count` requests are submitted, and once they all run, the step
    waits until the server has asked to abort every one. So none can finish before its client
    leaves, however fast steps are here, or however the requests' arrivals are spread."""

    def __init__(self, handle, count: int) -> None:
        self.engine, self.async_engine = handle.engine, handle.server.engine
        self.count = count
        self.all_submitted = threading.Event()
        self.all_running = threading.Event()
        self.all_aborted = threading.Event()
        self.aborted: list[str] = []
        self.real_step, self.real_abort = self.engine.step, self.async_engine.abort
        self.engine.step, self.async_engine.abort = self.step, self.abort

    def step(self):
        outputs = self.real_step()
        self.all_submitted.wait(30)  # (the bounds only keep a broken test from hanging)
        if len(self.engine.schedulers[0].running) >= self.count:
            self.all_running.set()
            if not self.all_aborted.wait(30):
                self.all_aborted.set()  # the rest run free (and the test fails on its counts)
        return outputs

    def abort(self, request_id: str) -> None:
        self.real_abort(request_id)
        self.aborted.append(request_id)
        if len(self.aborted) >= self.count:
            self.all_aborted.set()

    def restore(self) -> None:
        self.all_submitted.set()
        self.all_aborted.set()
        self.engine.step, self.async_engine.abort = self.real_step, self.real_abort


# Issue 52, row 11: no `Expect: 100-continue`, so nothing may be written before the answer; the
# connection reads on while the request runs, and the client's EOF is its leaving.
@pytest.mark.parametrize("close", [False, True])
def test_non_streamed_requests_are_aborted_when_their_clients_leave(strict_server, close):
    port, engine = strict_server.port, strict_server.engine
    count, max_tokens = 16, 300
    before = scrape_metrics(port)
    aborted = abort_count(strict_server)
    free_blocks = engine.schedulers[0].block_manager.num_free_blocks
    hold = HoldWhenAllRun(strict_server, count)
    try:
        socks = [connect(port) for _ in range(count)]
        for index, sock in enumerate(socks):
            sock.sendall(
                request_bytes(
                    {"prompt": f"request {index}", "max_tokens": max_tokens, "ignore_eos": True},
                    close=close,
                )
            )
        wait_until(lambda: len(hold.async_engine.streams) >= count, "the requests", timeout=60)
        hold.all_submitted.set()
        assert hold.all_running.wait(60), "the requests never all ran"
        for sock in socks:
            sock.close()
        assert hold.all_aborted.wait(60) and len(hold.aborted) == count, hold.aborted
    finally:
        hold.restore()
    wait_until(
        lambda: scrape_metrics(port)["vllm:num_requests_running"] == 0, "the aborts", timeout=60
    )
    assert abort_count(strict_server) == aborted + count
    generated = (
        scrape_metrics(port)["vllm:generation_tokens_total"]
        - before["vllm:generation_tokens_total"]
    )
    assert generated < count * max_tokens // 2, generated  # stopped early, not run for nobody
    wait_until(lambda: not engine.requests, "the engine to drop them", timeout=60)
    assert engine.schedulers[0].block_manager.num_free_blocks == free_blocks


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_that_asked_for_100_is_answered(strict_server, close, stream):
    sock = connect(strict_server.port)
    sock.sendall(
        request_bytes(
            {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "stream": stream},
            close=close,
            expect=True,
        )
    )
    sock.shutdown(socket.SHUT_WR)  # the whole request is sent; now wait for the answer
    status, _, body = final_response(sock)  # after the `100 Continue` probes
    assert status == 200, body[:300]
    if stream:
        assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    else:
        assert json.loads(body)["usage"]["completion_tokens"] == 40
    assert is_closed(sock, timeout=60)  # no more requests can come: the server closes
    sock.close()


def test_half_closed_client_of_a_stream_under_way_is_answered(strict_server):
    engine = strict_server.engine
    spy = StepSpy(engine)
    try:
        sock = connect(strict_server.port)
        body = {
            "prompt": "hello",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
            "logit_bias": letter_bias(strict_server.server.app.ctx.tokenizer),
        }
        # The second step is held while the client half-closes: the stream is under way.
        step = spy.hold_second_step(lambda: sock.sendall(request_bytes(body)))
        try:
            received = b""
            while b"data: " not in received:  # the first step's event
                received += sock.recv(4096)
            sock.shutdown(socket.SHUT_WR)
        finally:
            spy.release(step)
        sock.settimeout(60)
        while chunk := sock.recv(65536):  # the rest, then the server's close
            received += chunk
    finally:
        spy.restore()
    sock.close()
    assert received.startswith(b"HTTP/1.1 200 OK") and received.endswith(b"0\r\n\r\n")
    events = [line for line in received.split(b"\n") if line.startswith(b"data: {")]
    assert b"data: [DONE]" in received and b'"error"' not in received
    assert sum(json.loads(event[6:])["choices"][0]["text"] == "a" for event in events) == 40


def test_reader_that_never_reads_is_cut_off(strict_server):
    server = strict_server.server
    port = strict_server.port
    wait_until(lambda: not server.http.connections, "idle connections to close", timeout=60)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    # Over 10 MB of SSE (16 choices x 400 tokens x top-20 logprobs), past every buffer.
    sock.sendall(
        request_bytes(
            {
                "prompt": "hello",
                "max_tokens": 400,
                "ignore_eos": True,
                "n": 16,
                "logprobs": 20,
                "stream": True,
            }
        )
    )
    wait_until(lambda: server.http.connections, "the connection", timeout=60)
    # write_timeout is 1 s: the server gives up on this reader and drops the connection.
    wait_until(
        lambda: not server.http.connections, "the server to drop a non-reading client", timeout=30
    )
    wait_until(
        lambda: scrape_metrics(port)["vllm:num_requests_running"] == 0, "the request", timeout=30
    )
    sock.settimeout(5)
    received = b""
    try:
        while chunk := sock.recv(65536):  # what was in flight, then the end
            received += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert received.startswith(b"HTTP/1.1 200")
    assert not received.endswith(b"0\r\n\r\n"), len(received)  # cut off, not completed


def test_request_bodies_held_at_once_are_bounded(strict_server):
    server = strict_server.server
    port = strict_server.port
    body = json.dumps({"prompt": "x" * (2 * MB + 500 * 1024), "max_tokens": 1}).encode()
    holder = connect(port)
    held = request_bytes(body)[:-1000]
    holder.sendall(held)  # 2.5 MB, all but its last 1000 bytes
    wait_until(
        lambda: server.http.state.buffered_body_bytes >= len(body) - 1000, "the bytes", timeout=60
    )
    # A second 2.5 MB body would hold 5 MB at once, over the 4 MB budget: 503 once its bytes
    # pass it (a declaration alone holds nothing: test_body_budget.py).
    other = connect(port)
    try:
        other.sendall(request_bytes(body))
    except (ConnectionResetError, BrokenPipeError):
        pass
    status, headers, raw = read_response(other, timeout=10)
    assert status == 503, raw[:200]
    assert json.loads(raw)["error"]["code"] == 503
    other.close()
    # A chunked body (no length declared) counts as it arrives, and is refused the same way.
    chunked = connect(port)
    chunked.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
        b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    piece = 256 * 1024
    for _ in range(8):  # 2 MB: over what is left of the budget
        try:
            chunked.sendall(b"%x\r\n%b\r\n" % (piece, b" " * piece))
        except (ConnectionResetError, BrokenPipeError):
            break
    assert read_response(chunked, timeout=10)[0] == 503
    chunked.close()
    # The first request completes and is answered; its bytes go back to the budget.
    holder.sendall(request_bytes(body)[len(held) :])
    status, _, raw = final_response(holder)
    assert status == 400 and b"maximum context length" in raw  # 2.5 MB of text: too long
    holder.close()
    wait_until(
        lambda: server.http.state.buffered_body_bytes == 0, "the budget to be released", timeout=60
    )
    again = connect(port)
    again.sendall(request_bytes(body))
    assert final_response(again)[0] == 400  # admitted (and answered), no longer 503
    again.close()
    wait_until(
        lambda: server.http.state.buffered_body_bytes == 0, "the budget to be released", timeout=60
    )
