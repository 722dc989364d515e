"""`nanoserve serve --model DIR` for a compressed-tensors checkpoint (the default model quantized
to W8A8 by the package's own compressor): served with its int8 layers, answering the openai
client with what the offline engine gives on the same checkpoint."""

from __future__ import annotations

import pytest

from tests.server.test_cli_server import assert_served_as_offline

pytest.importorskip("openai")
pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def smollm2_w8a8(smollm2_dir, tmp_path_factory):
    from tests.compressed_tensors_models import compress_checkpoint

    return compress_checkpoint(
        smollm2_dir, tmp_path_factory.mktemp("smollm2") / "w8a8", "w8a8-channel"
    )


def test_serve_a_compressed_tensors_checkpoint(smollm2_w8a8):
    assert_served_as_offline(smollm2_w8a8, "compressed-tensors", "q8_0")
