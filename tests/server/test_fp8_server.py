"""`nanoserve serve --model DIR` for an FP8 checkpoint of the default model (its projections in
FP8 E4M3 with 128 x 128 block scales, stored as `quant_method: "fp8"` checkpoints are,
tests/fp8_models.py): served with its FP8 layers, answering the openai client with what the
offline engine gives on the same checkpoint."""

from __future__ import annotations

import pytest

from tests.server.test_cli_server import assert_served_as_offline

pytest.importorskip("openai")


def test_serve_an_fp8_checkpoint(smollm2_dir, tmp_path):
    from tests.fp8_models import quantize_checkpoint

    path = quantize_checkpoint(smollm2_dir, tmp_path / "fp8", "fp8-block128")
    assert_served_as_offline(path, "fp8", "fp8_e4m3")
