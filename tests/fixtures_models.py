"""Shared model fixtures. Registered from tests/conftest.py with pytest_plugins = ["tests.fixtures_models"]."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) in its normal home, imported once per machine."""
    from nanoserve.models.gguf.importer import ensure_default_model  # needs gguf: import lazily

    return ensure_default_model(progress=True)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The original GGUF file, for tests that compare against transformers' own GGUF loader."""
    from nanoserve.models.gguf.importer import download_default_gguf

    return download_default_gguf(tmp_path_factory.mktemp("smollm2-gguf"), progress=True)
