"""The engine's start-up heap is frozen out of the cyclic collector's walks (startup.
freeze_startup_heap) and handed back on shutdown, so that a dropped engine, in reference cycles
as it is, is still freed by a collection."""

from __future__ import annotations

import gc
import weakref

from nanoserve import LLM


def test_startup_heap_frozen_then_released_on_shutdown(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128)
    model = llm.llm_engine.runner.model
    assert gc.get_freeze_count() > 0
    assert not any(obj is model for obj in gc.get_objects())  # not walked by collections
    model_ref = weakref.ref(model)
    del model
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model_ref() is None


def test_a_later_engine_frees_one_dropped_without_shutdown(tiny_llama_dir):
    first = LLM(model=str(tiny_llama_dir), max_model_len=128)
    first_ref = weakref.ref(first.llm_engine.runner.model)
    del first
    second = LLM(model=str(tiny_llama_dir), max_model_len=128)
    assert first_ref() is None and gc.get_freeze_count() > 0
    second.shutdown()
