"""Server-only command-line flags (engine flags belong to nanoserve.cli) and `run_server`."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from nanoserve.server.http import HttpLimits

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int | None = None
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    limits: HttpLimits = field(default_factory=HttpLimits)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000,
                       help="port to listen on; 0 picks a free one (the bound address is printed)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                            "$NANOSERVE_API_KEY or $VLLM_API_KEY)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 while this many requests wait for the engine")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open")
    group.add_argument("--request-read-timeout", type=float, default=30.0,
                       help="seconds allowed to receive one request's headers and body")
    group.add_argument("--max-request-header-bytes", type=int, default=64 * 1024,
                       help="larger request headers get 431")
    group.add_argument("--max-request-body-bytes", type=int, default=32 * 1024 * 1024,
                       help="larger request bodies get 413")
    group.add_argument("--shutdown-grace-period", type=float, default=30.0,
                       help="seconds in-flight requests may finish after SIGTERM/SIGINT")
    group.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                       choices=LOG_LEVELS, help="server log level")


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    def get(name: str, default):
        value = getattr(args, name, None)
        return default if value is None else value

    api_key = get("api_key", None) or os.environ.get("NANOSERVE_API_KEY") or \
        os.environ.get("VLLM_API_KEY") or None
    limits = HttpLimits(
        max_header_bytes=get("max_request_header_bytes", 64 * 1024),
        max_body_bytes=get("max_request_body_bytes", 32 * 1024 * 1024),
        request_read_timeout=get("request_read_timeout", 30.0),
        keep_alive_timeout=get("timeout_keep_alive", 5.0))
    for name, value in (("--port", get("port", 8000)),):
        if not 0 <= value <= 65535:
            raise ValueError(f"{name} must be in [0, 65535], got {value}")
    for name, value in (("--timeout-keep-alive", limits.keep_alive_timeout),
                        ("--request-read-timeout", limits.request_read_timeout),
                        ("--max-request-header-bytes", limits.max_header_bytes),
                        ("--max-request-body-bytes", limits.max_body_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    waiting = get("max_waiting_requests", None)
    if waiting is not None and waiting < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {waiting}")
    return ServerOptions(host=get("host", "127.0.0.1"), port=get("port", 8000), api_key=api_key,
                         max_waiting_requests=waiting,
                         shutdown_grace_period=get("shutdown_grace_period", 30.0),
                         log_level=get("log_level", "info"), limits=limits)


def run_server(engine_config, args: argparse.Namespace) -> int:
    """Build the engine, serve until SIGTERM/SIGINT, shut down gracefully; the exit code."""
    from nanoserve.server.api_server import run

    return run(engine_config, options_from_args(args))
