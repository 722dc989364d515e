"""Fixtures for the server tests; helpers live in server_helpers.py."""

from __future__ import annotations

import gc
import json

import pytest

from tests.conftest import write_random_llama
from tests.server.server_helpers import LoopThread


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


class ServerHandle:
    """A real nanoserve server (real sockets) on a background event loop."""

    def __init__(self, model_dir, engine_kwargs: dict | None = None, **options) -> None:
        from nanoserve.config import EngineConfig
        from nanoserve.engine.llm_engine import LLMEngine
        from nanoserve.server.api_server import start_server
        from nanoserve.server.args import ServerOptions
        from nanoserve.server.http.types import HttpLimits

        limits = options.pop("limits", None) or HttpLimits()
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), **(engine_kwargs or {})))
        self.loop_thread = LoopThread()
        self.options = ServerOptions(port=0, limits=limits, **options)
        self.server = self.loop_thread.call(lambda: start_server(self.engine, self.options))
        self.port = self.server.port
        self.url = self.server.url

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=60, **kwargs)

    def close(self, grace: float = 1.0) -> None:
        self.loop_thread.call(lambda: self.server.shutdown(grace))
        self.loop_thread.close()
        # The engine is ours (start_server serves an engine it is given, as `serve` does): stop
        # its worker ranks (--tp) and leave the process group, or the next engine in this
        # process would wait for them in its first collective.
        self.engine.shutdown()
        # The engine sits in reference cycles (async engine, streams, threads): free its KV pool
        # (2 GiB by default on CPU) now, not at some later full collection, so that the servers
        # of a whole test run never pile up in memory.
        self.engine = self.server = None
        gc.collect()


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir)
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def long_context_llama_dir(tmp_path_factory):
    """The tiny random Llama with a 4096-token context, so one stream can outlast a grace period."""
    path = write_random_llama(tmp_path_factory.mktemp("long-llama"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return path
