"""With --api-key, authentication is an allowlist (issue 52 row 1): every route in the app's table
(and under its /v1/models/ and /v1/responses/ prefixes), optional ones switched on, answers 401
with the OpenAI error body without the key (Anthropic's on /v1/messages), except /health, /ping,
/version and the chat page. The key opens them as a bearer token or as an `x-api-key` header.
Routes that change server state exist only in development mode (NANOSERVE_SERVER_DEV_MODE)."""

from __future__ import annotations

import argparse
import json

import pytest

from nanoserve.server.app import OPEN_PATHS
from nanoserve.server.args import add_server_args, options_from_args
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

KEY = "sekret"
ALLOWLIST = {"/health", "/ping", "/version", "/", "/index.html", "/ui/config"}
# One body that each POST route would act on without the key check: a chat (and /invocations)
# request, a prompt, token ids, an adapter to load or unload.
BODY = json.dumps(
    {
        "messages": [{"role": "user", "content": "hi"}],
        "prompt": "hi",
        "tokens": [1],
        "input": "hi",
        "max_tokens": 1,
        "lora_name": "a",
        "lora_path": "/nonexistent",
    }
)
WRONG = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"x-api-key": "wrong"},
    {"x-api-key": f"{KEY}x"},
    {"x-api-key": f"Bearer {KEY}"},
]
RIGHT = [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}]
UNAUTHORIZED = {
    "message": (
        "Unauthorized: a valid API key is required (Authorization: Bearer <key>, or "
        "x-api-key: <key>)."
    ),
    "type": "AuthenticationError",
    "param": None,
    "code": 401,
}


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir):
    """Every optional route on: load tracking, tokenizer info, runtime LoRA, development mode."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NANOSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
        handle = ServerHandle(
            tiny_llama_dir,
            engine_kwargs={"enable_lora": True, "max_loras": 1, "num_kv_blocks": 64},
            api_key=KEY,
            enable_server_load_tracking=True,
            enable_tokenizer_info_endpoint=True,
            server_dev_mode=True,
        )
    yield handle
    handle.close()


def every_route(app) -> list[tuple[str, str]]:
    """(method, path) for every route the app serves, read from its tables."""
    routes = [(method, path) for path, methods in app.routes.items() for method in methods]
    routes += [
        (method, prefix + "some-id")
        for prefix, methods in app.prefix_routes.items()
        for method in methods
    ]
    return routes


def send(port: int, method: str, path: str, headers: dict[str, str]):
    return http_request(port, method, path, BODY if method == "POST" else None, headers)


def test_the_open_paths_are_the_allowlist():
    assert OPEN_PATHS == ALLOWLIST


def test_every_route_but_the_allowlist_needs_the_key(keyed_server):
    port = keyed_server.port
    routes = every_route(keyed_server.server.app)
    paths = {path for _, path in routes}
    # the table really holds the optional routes, so the walk covers them
    assert {
        "/invocations",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/load",
        "/tokenizer_info",
        "/reset_prefix_cache",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/models/some-id",
        "/v1/responses/some-id",
        "/v1/messages",
        "/v1/messages/count_tokens",
    } <= paths
    assert ALLOWLIST <= paths
    closed = [(method, path) for method, path in routes if path not in ALLOWLIST]
    for method, path in closed:
        for headers in WRONG:
            status, response_headers, body = send(port, method, path, headers)
            assert status == 401, (method, path, headers, body)
            assert json.loads(body) == unauthorized(path), (method, path)
            assert response_headers["www-authenticate"] == "Bearer"
    # with the key each of them is reached (whatever it then answers)
    for method, path in closed:
        for headers in RIGHT:
            status, _, body = send(port, method, path, headers)
            assert status != 401, (method, path, headers, body)


def unauthorized(path: str) -> dict:
    if path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's shape
        message = UNAUTHORIZED["message"]
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    return {"error": UNAUTHORIZED}


def test_the_allowlist_answers_without_the_key(keyed_server):
    for method, path in every_route(keyed_server.server.app):
        if path in ALLOWLIST:
            assert send(keyed_server.port, method, path, {})[0] == 200, (method, path)


@pytest.mark.parametrize(
    "path",
    ["/nope", "/v1/nope", "/health/", "/HEALTH", "/health%00", "/v1/models/", "/ui/config/x"],
)
def test_unknown_paths_need_the_key_too(keyed_server, path):
    """Without the key no route's existence shows: 401, not 404 or 405."""
    status, _, body = http_request(keyed_server.port, "GET", path)
    assert status == 401 and json.loads(body) == {"error": UNAUTHORIZED}
    status, _, _ = http_request(
        keyed_server.port, "GET", path, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 404


def test_the_key_is_checked_before_the_method(keyed_server):
    status, _, _ = http_request(keyed_server.port, "DELETE", "/invocations")
    assert status == 401
    status, _, _ = http_request(
        keyed_server.port, "DELETE", "/invocations", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 405


def test_reset_prefix_cache_only_in_dev_mode(tiny_server, keyed_server):
    assert "/reset_prefix_cache" not in tiny_server.server.app.routes
    status, _, body = http_request(tiny_server.port, "POST", "/reset_prefix_cache")
    assert status == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    status, _, body = http_request(
        keyed_server.port, "POST", "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert (status, body) == (200, b"")  # with no response cache, too


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({}, False),
        ({"NANOSERVE_SERVER_DEV_MODE": "1"}, True),
        ({"VLLM_SERVER_DEV_MODE": "1"}, True),
        ({"NANOSERVE_SERVER_DEV_MODE": "0", "VLLM_SERVER_DEV_MODE": "1"}, False),
        ({"VLLM_SERVER_DEV_MODE": "0"}, False),
    ],
)
def test_dev_mode_comes_from_the_environment(monkeypatch, environment, expected):
    for name in ("NANOSERVE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert options_from_args(parser.parse_args([])).server_dev_mode is expected
