"""The token-bitmask kernels against xgrammar's own CPU kernel (the oracle), with a batch whose
rows are only partly constrained, vocabularies that are not a multiple of 32, and a bitmask
narrower than the logits (the padding tokens past it are forbidden)."""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels.token_bitmask import (
    apply_token_bitmask_cpu,
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
    unpack_bitmask,
)

CASES = [(400, 13), (1000, 32), (49152, 1536), (49155, 1536)]  # (vocab, bitmask words)


def make(vocab: int, words: int, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=generator).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator)
    rows = torch.tensor([4, 0, 2])
    return logits.to(device), bitmask.to(device), rows.to(device)


def oracle(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """xgrammar's kernel on a full-batch bitmask whose unconstrained rows allow everything."""
    xgrammar = pytest.importorskip("xgrammar")
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    full = torch.full((logits.shape[0], words), -1, dtype=torch.int32)
    width = min(words, bitmask.shape[1])
    full[rows.cpu(), :width] = bitmask.cpu()[:, :width]
    if width < words:  # tokens past the given bitmask are forbidden
        full[rows.cpu(), width:] = 0
    out = logits.cpu().float().clone()
    xgrammar.apply_token_bitmask_inplace(out, full)
    return out.to(logits.dtype)


@pytest.mark.parametrize("vocab,words", CASES)
def test_cpu_and_reference_match_xgrammar(vocab, words):
    logits, bitmask, rows = make(vocab, words)
    expected = oracle(logits, bitmask, rows)
    for apply in (apply_token_bitmask_reference, apply_token_bitmask_cpu):
        out = logits.clone()
        apply(out, bitmask, rows)
        assert torch.equal(out, expected), apply.__name__
    assert torch.equal(out[[1, 3, 5]], logits[[1, 3, 5]])  # free rows untouched
    assert (out[rows] == float("-inf")).any()


def test_unpack_bitmask_token_order():
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    allowed = unpack_bitmask(bitmask, 64)[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]


def test_bfloat16_on_cpu():
    logits, bitmask, rows = make(1000, 32, dtype=torch.bfloat16)
    expected = oracle(logits, bitmask, rows)
    out = logits.clone()
    apply_token_bitmask_cpu(out, bitmask, rows)
    assert torch.equal(out, expected)


def test_bad_shapes_are_refused():
    logits, bitmask, rows = make(400, 13)
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_reference(logits, bitmask, rows[:2])
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_reference(logits, bitmask.long(), rows)


@pytest.mark.parametrize("vocab,words", [(400, 13), (1000, 32)])
def test_triton_interpreter_matches_reference(vocab, words, monkeypatch):
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, bitmask, rows = make(vocab, words, device=device)
    expected = logits.cpu().clone()
    apply_token_bitmask_reference(expected, bitmask.cpu(), rows.cpu())
    out = logits.clone()
    apply_token_bitmask_triton(out, bitmask, rows)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,words", CASES)
def test_triton_on_cuda_matches_reference(vocab, words, dtype):
    logits, bitmask, rows = make(vocab, words, dtype=dtype, device="cuda")
    expected = logits.cpu().clone()
    apply_token_bitmask_reference(expected, bitmask.cpu(), rows.cpu())
    out = logits.clone()
    apply_token_bitmask_triton(out, bitmask, rows)
    assert torch.equal(out.cpu(), expected)
