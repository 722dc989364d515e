"""The one dispatch place: which implementation runs, and that importing never loads Triton."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import nanoserve.kernels as kernels
from tests.kernels.utils import DEVICE, make_paged_batch


def test_use_triton_follows_device_and_environment(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("NANOSERVE_KERNELS", raising=False)
    kernels.reset_kernel_choice()
    assert not kernels.use_triton(cpu)
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    assert kernels.use_triton(cpu)
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    kernels.reset_kernel_choice()
    assert not kernels.use_triton(cpu)
    monkeypatch.setenv("NANOSERVE_KERNELS", "cuda")
    kernels.reset_kernel_choice()
    with pytest.raises(ValueError, match="NANOSERVE_KERNELS"):
        kernels.use_triton(cpu)


def test_the_environment_is_read_once(monkeypatch):
    """NANOSERVE_KERNELS is read at the first dispatch, not on every kernel call."""
    cpu = torch.zeros(1)
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    assert kernels.use_triton(cpu)
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    assert kernels.use_triton(cpu)  # still the cached choice
    kernels.reset_kernel_choice()
    assert not kernels.use_triton(cpu)


@pytest.mark.parametrize("choice", ["triton", "reference"])
def test_every_op_dispatches(monkeypatch, choice):
    """Each public op calls the implementation NANOSERVE_KERNELS selects, with its arguments."""
    monkeypatch.setenv("NANOSERVE_KERNELS", choice)
    kernels.reset_kernel_choice()
    calls = []
    names = ["store_kvcache", "paged_attention", "rms_norm", "fused_add_rms_norm", "apply_rotary"]
    for name in names:
        impl = f"{name}_{choice}"
        monkeypatch.setattr(kernels, impl, lambda *a, _n=impl, **k: calls.append((_n, len(a))))
    kernels.store_kvcache(torch.zeros(1), None, None, None, None)
    kernels.paged_attention(torch.zeros(1), None, None, None, None, None, 1.0, 1, 5)
    kernels.rms_norm(torch.zeros(1), None, 1e-6)
    kernels.fused_add_rms_norm(torch.zeros(1), None, None, 1e-6)
    kernels.apply_rotary(torch.zeros(1), None, None, None)
    assert calls == [(f"store_kvcache_{choice}", 5), (f"paged_attention_{choice}", 9),
                     (f"rms_norm_{choice}", 3), (f"fused_add_rms_norm_{choice}", 4),
                     (f"apply_rotary_{choice}", 4)]


def test_forced_triton_attention_equals_reference(monkeypatch):
    batch = make_paged_batch([3, 1], [5, 20], num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=16, dtype=torch.float32, device=DEVICE)
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    kernels.reset_kernel_choice()
    expected = kernels.paged_attention(*batch.args())
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    actual = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_importing_kernels_does_not_import_triton():
    code = ("import sys, nanoserve.kernels, nanoserve.kernels.attention; "
            "assert 'triton' not in sys.modules, 'triton imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
