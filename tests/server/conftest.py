"""Fixtures for the server tests; helpers live in server_helpers.py."""
from __future__ import annotations

import pytest

from tests.server.server_helpers import LoopThread


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()
