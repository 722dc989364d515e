"""The browser chat page: GET / (and /index.html) serves one static HTML file, shipped as package
data, and GET /ui/config tells it whether to ask for an API key. `--no-ui` leaves all three out,
so they answer 404 like any unknown route."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import lru_cache
from importlib import resources

from nanoserve.server.http.types import HttpRequest, Response
from nanoserve.server.serving import encode_json

PAGE_PATHS = ("/", "/index.html")
CONFIG_PATH = "/ui/config"
# The page talks to this server only: the policy forbids any other origin, and inline script
# and style are its only code.
PAGE_HEADERS = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
]


@lru_cache(maxsize=1)
def chat_page() -> bytes:
    return resources.files("nanoserve.server").joinpath("static", "chat.html").read_bytes()


def ui_routes(
    api_key_required: bool,
) -> dict[str, dict[str, Callable[[HttpRequest], Awaitable[Response]]]]:
    """Route table entries for the page and its config, to merge into the app's routes."""
    page = chat_page()  # read once at startup: a missing file fails the start, not a request
    config = encode_json({"api_key_required": api_key_required})

    async def serve_page(request: HttpRequest) -> Response:
        return Response(
            200, page, content_type="text/html; charset=utf-8", headers=list(PAGE_HEADERS)
        )

    async def serve_config(request: HttpRequest) -> Response:
        return Response(200, config, headers=[("cache-control", "no-cache")])

    routes = {path: {"GET": serve_page} for path in PAGE_PATHS}
    routes[CONFIG_PATH] = {"GET": serve_config}
    return routes
