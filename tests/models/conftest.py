"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest

from nanoserve.kernels import quant


@pytest.fixture
def exact_gemm(monkeypatch):
    """Every GGUF layer as x @ dequantize(w)^T in float32, no int8 activations (nothing packed
    for the C++ kernel, quant.reference_gemm replaced): a GEMM whose output moves continuously
    with its input, so two paths that differ in the last bits of an activation differ in the
    last bits of the logprobs, not by an int8 rounding step."""

    def exact(x, w, bias):
        out = x.float() @ quant.dequantize_weight(w).T
        return (out if bias is None else out + bias.float()).to(x.dtype)

    monkeypatch.setattr(quant, "pack_for_cpu", lambda weight: None)
    monkeypatch.setattr(quant, "reference_gemm", exact)
