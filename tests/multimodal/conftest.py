"""The tiny random LLaVA checkpoint, written once per session."""

from __future__ import annotations

import pytest

from tests.multimodal.llava_checkpoint import write_random_llava


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    return write_random_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def qwen_vl_dir(tmp_path_factory):
    from tests.multimodal.qwen_vl_checkpoint import write_random_qwen_vl

    return write_random_qwen_vl(tmp_path_factory.mktemp("qwen_vl"))
