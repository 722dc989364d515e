"""Helpers for the server tests: a real server on a background thread with its own event loop,
a tiny raw-socket HTTP client, and a spy on the real engine's step that can hold one."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import LLMEngine

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


class LoopThread:
    """An event loop running on a daemon thread; `call(coro_fn)` runs a coroutine on it."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro_fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        async def wrapper():
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP/1.1 response (Content-Length or chunked). Returns status, headers, body."""
    sock.settimeout(timeout)
    buffer = getattr(sock, "_nanoserve_buffer", b"")

    def fill() -> None:
        nonlocal buffer
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed")
        buffer += data

    while b"\r\n\r\n" not in buffer:
        fill()
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if status == 100:
        sock._nanoserve_buffer = buffer  # type: ignore[attr-defined]
        return status, headers, b""
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(buffer) < length:
            fill()
        body, buffer = buffer[:length], buffer[length:]
    elif headers.get("transfer-encoding") == "chunked":
        while True:
            while b"\r\n" not in buffer:
                fill()
            size_line, _, buffer = buffer.partition(b"\r\n")
            size = int(size_line, 16)
            while len(buffer) < size + 2:
                fill()
            body += buffer[:size]
            buffer = buffer[size + 2 :]
            if size == 0:
                break
    sock._nanoserve_buffer = buffer  # type: ignore[attr-defined]
    return status, headers, body


class Conn(socket.socket):
    """A client socket that keeps the bytes read past the end of a response."""

    _nanoserve_buffer = b""


def sse_events(body: bytes) -> list:
    """A streamed body's events: each data line's JSON, or the final "[DONE]"."""
    events = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def connect(port: int, timeout: float = 10.0) -> Conn:
    sock = Conn(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def is_closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes within `timeout` (any buffered bytes are discarded)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes | str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
):
    """One request on a fresh connection: (status, headers, body)."""
    if isinstance(body, str):
        body = body.encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Connection: close"]
    all_headers = {"Content-Type": "application/json"} if body is not None else {}
    all_headers.update(headers or {})
    if body is not None:
        all_headers["Content-Length"] = str(len(body))
    lines += [f"{name}: {value}" for name, value in all_headers.items()]
    sock = connect(port, timeout)
    try:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        return read_response(sock, timeout)
    finally:
        sock.close()


def scrape_metrics(port: int) -> dict[str, float]:
    """Prometheus samples as {'name{labels}': value} plus {'name': value} for unlabelled lookups
    of the first sample of each name."""
    status, _, body = http_request(port, "GET", "/metrics")
    assert status == 200
    samples: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
        samples.setdefault(key.split("{", 1)[0], float(value))
    return samples


class StepSpy:
    """Wraps the real engine's `step`: counts calls, records each call's thread and wall time, and
    lets a test wait for the next step to begin. The real step does all the work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.real_step = engine.step
        self.started = 0
        self.finished = 0
        self.durations: list[float] = []
        self.thread_ids: set[int] = set()
        self.aborts: list[tuple[str, int]] = []  # (request id, steps started when aborted)
        self.cond = threading.Condition()
        # hold_next_step(): the next step, once its real work is done, waits for release() before
        # it returns, so a test can act while a step is certainly still running.
        self.hold_requested = False
        self.released_through = 0  # steps up to this number may return
        real_abort = engine.abort_request

        def abort_request(request_id):
            self.aborts.append((request_id, self.started))
            return real_abort(request_id)

        self.engine = engine
        engine.step = self
        engine.abort_request = abort_request

    def restore(self) -> None:
        """Put the engine's own methods back (for an engine that outlives the test)."""
        del self.engine.step, self.engine.abort_request

    def __call__(self):
        with self.cond:  # one critical section: the step that begins is the one held
            self.started += 1
            number = self.started
            held, self.hold_requested = self.hold_requested, False
            self.thread_ids.add(threading.get_ident())
            self.cond.notify_all()
        start = time.perf_counter()
        try:
            return self.real_step()
        finally:
            self.durations.append(time.perf_counter() - start)
            if held:  # (the bound only keeps a broken test from hanging the suite)
                with self.cond:
                    self.cond.wait_for(lambda: self.released_through >= number, 60)
            with self.cond:
                self.finished += 1
                self.cond.notify_all()

    def wait_for_next_step(self, timeout: float = 60.0, seen: int | None = None) -> int:
        """Block until a step begins after this call (or after step `seen`); returns its number."""
        with self.cond:
            seen = self.started if seen is None else seen
            assert self.cond.wait_for(lambda: self.started > seen, timeout), "no step began"
            return seen + 1

    def hold_next_step(self) -> int:
        """The next step to begin stays running until release(); returns the steps begun so far
        (pass it to wait_for_next_step as `seen`)."""
        with self.cond:
            self.hold_requested = True
            return self.started

    def hold_second_step(self, start: Callable[[], Any]) -> int:
        """Call start() (which sends a request to an idle engine) with the next step held; once
        that first step's output is made, let it return (its event goes out) and hold the second
        step instead. Returns the second step's number: release() it. Between the two, the
        request is certainly mid-stream, however fast its remaining tokens would go."""
        held = self.hold_next_step()
        start()
        first = self.wait_for_next_step(seen=held)
        self.hold_next_step()  # the second step cannot begin before the first returns
        self.release(first)
        return self.wait_for_next_step(seen=first)

    def release(self, step: int) -> None:
        """Let step number `step` (and any before it) return."""
        with self.cond:
            self.released_through = max(self.released_through, step)
            self.cond.notify_all()


def letter_bias(tokenizer, letter: str = "a") -> dict[str, float]:
    """A logit bias under which every generated token is `letter`: each token is text, so each
    step of a stream sends an event (a random model's token may decode to nothing yet)."""
    ids = tokenizer.encode(letter, add_special_tokens=False)
    assert len(ids) == 1, ids
    return {str(ids[0]): 100.0}
