"""SIGTERM with streams open (issue 15, item 8): a stream that ends within the grace period ends
normally; when the grace period runs out, each open stream gets an error event and `[DONE]`
before its connection closes, and the server exits 0. A real `nanoserve serve` process."""

from __future__ import annotations

import json
import signal

from tests.distributed.test_tp_server import ServerProcess
from tests.server.server_helpers import connect, read_response


def open_stream(port: int, max_tokens: int):
    sock = connect(port, timeout=60)
    body = json.dumps(
        {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    ).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    return sock


def test_sigterm_ends_open_streams_with_an_error_event(long_context_llama_dir):
    server = ServerProcess(
        "--model",
        str(long_context_llama_dir),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "1024",
        "--shutdown-grace-period",
        "1",
    )
    # A step of this model costs at least ~1 ms (Python and the sampler, whatever the kernels),
    # so a 4,000-token stream outlasts the 1 s grace period by 4x or more, while the 10-token one
    # ends within it with as wide a margin. (At 4 s of grace, a Zen 5 EPYC finished 4,000 tokens.)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        long_streams = [open_stream(port, 4000) for _ in range(2)]
        short_stream = open_stream(port, 10)
        for sock in long_streams + [short_stream]:  # each has started
            sock.settimeout(60)
            first = b""
            while b"data: " not in first:
                first += sock.recv(4096)
            sock._nanoserve_buffer = first  # read_response starts from these bytes
        server.proc.send_signal(signal.SIGTERM)
        status, _, body = read_response(short_stream, timeout=60)
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        assert b'"error"' not in body  # finished within the grace period
        for sock in long_streams:
            status, _, body = read_response(sock, timeout=60)  # chunked: read to its last chunk
            events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]", events[-3:]
            error = json.loads(events[-2][len("data: ") :])["error"]
            assert error["code"] == 503 and "shutting down" in error["message"]
            assert len(events) < 4000  # cut short by the shutdown
        assert server.proc.wait(timeout=60) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
