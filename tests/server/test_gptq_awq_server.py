"""`nanoserve serve --model DIR` for GPTQ and AWQ checkpoints of the default model (its
projections quantized to 4 bits per group of 64 and stored as AutoGPTQ / AutoAWQ store them,
tests/gptq_awq_models.py): served with their int4 layers, answering the openai client with what
the offline engine gives on the same checkpoint."""

from __future__ import annotations

import pytest

from tests.server.test_cli_server import assert_served_as_offline

pytest.importorskip("openai")


@pytest.fixture(scope="module", params=["gptq-4bit-asym-g64", "awq-4bit-g64"])
def smollm2_int4(request, smollm2_dir, tmp_path_factory):
    from tests.gptq_awq_models import quantize_checkpoint

    return request.param.split("-")[0], quantize_checkpoint(
        smollm2_dir, tmp_path_factory.mktemp("smollm2") / "int4", request.param
    )


def test_serve_a_gptq_or_awq_checkpoint(smollm2_int4):
    method, path = smollm2_int4
    assert_served_as_offline(path, method, "q4_1")
