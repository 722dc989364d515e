"""The chat page's routes (no browser): GET / and /index.html serve the packaged HTML with its
headers, /ui/config says whether a key is needed, and --no-ui removes all three (404 as any
unknown route) while /v1/* stays as it was. The browser tests are in test_chat_page_browser.py."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

import nanoserve.server
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import connect, http_request
from tests.server.test_cli_server import start

PAGE = (Path(nanoserve.server.__file__).parent / "static" / "chat.html").read_bytes()


@pytest.mark.parametrize("path", ["/", "/index.html", "/?utm=1"])
def test_page_is_served(tiny_server, path):
    status, headers, body = http_request(tiny_server.port, "GET", path)
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert body == PAGE
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"


def test_head_and_wrong_method(tiny_server):
    sock = connect(tiny_server.port)
    try:  # read_response would wait for a body; a HEAD answer has headers only
        sock.sendall(b"HEAD / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and body == b""
    assert f"content-length: {len(PAGE)}\r\n".encode() in head + b"\r\n"
    status, headers, body = http_request(tiny_server.port, "POST", "/", body="{}")
    assert status == 405 and headers["allow"] == "GET"
    assert json.loads(body)["error"]["code"] == 405


def test_page_fetches_nothing_from_the_network():
    text = PAGE.decode()
    # no external scripts, styles, images or fonts: every URL the page uses is a path here
    assert not re.search(r"(?i)\b(src|href)\s*=", text)
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text)
    assert not re.search(r"(?i)@import|url\(", text)
    assert sorted(set(re.findall(r'fetch\("([^"]+)"', text))) == [
        "/ui/config",
        "/v1/chat/completions",
        "/v1/models",
    ]


def test_ui_config_without_and_with_key(tiny_server, tiny_llama_dir):
    status, headers, body = http_request(tiny_server.port, "GET", "/ui/config")
    assert (status, json.loads(body)) == (200, {"api_key_required": False})
    assert headers["content-type"] == "application/json"
    handle = ServerHandle(tiny_llama_dir, api_key="sekret")
    try:
        status, _, body = http_request(handle.port, "GET", "/ui/config")
        assert (status, json.loads(body)) == (200, {"api_key_required": True})
        # the page itself needs no key (it asks for one); the API still does
        assert http_request(handle.port, "GET", "/")[0] == 200
        assert http_request(handle.port, "GET", "/v1/models")[0] == 401
    finally:
        handle.close()


def test_page_does_not_shadow_the_api(tiny_server):
    status, _, body = http_request(tiny_server.port, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["object"] == "list"
    for path in ("/v1/", "/v1/index.html", "/index.htm", "/ui/", "/chat.html"):
        status, _, body = http_request(tiny_server.port, "GET", path)
        assert status == 404, path
        assert json.loads(body)["error"]["message"] == f"Route {path} not found."


def test_no_ui_flag_removes_the_page(tiny_llama_dir):
    process, port = start(tiny_llama_dir, "--no-ui")
    try:
        for path in ("/", "/index.html", "/ui/config"):
            status, headers, body = http_request(port, "GET", path)
            assert status == 404, path
            assert headers["content-type"] == "application/json"
            assert json.loads(body)["error"] == {
                "message": f"Route {path} not found.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        assert http_request(port, "GET", "/v1/models")[0] == 200
        assert http_request(port, "GET", "/health")[0] == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
