"""The engine core stays a core (issue 53): llm_engine.py schedules, runs and collects; request
checks and tokenizing (input_processor.py), LoRA adapters (lora/registry.py), the other ranks,
pipeline stepping, speculation, pooling and stats each live in a module of their own."""

from __future__ import annotations

from pathlib import Path

from nanoserve.engine import llm_engine


def test_llm_engine_is_under_400_lines():
    lines = Path(llm_engine.__file__).read_text().splitlines()
    assert len(lines) < 400, f"llm_engine.py has {len(lines)} lines: move a cohesive group out"
