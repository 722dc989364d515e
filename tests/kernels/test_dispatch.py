"""The one dispatch place: which implementation runs, and that importing never loads Triton."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
    assert calls == [
        (f"store_kvcache_{choice}", 5),
        (f"paged_attention_{choice}", 9),
        (f"rms_norm_{choice}", 3),
        (f"fused_add_rms_norm_{choice}", 4),
        (f"apply_rotary_{choice}", 4),
    ]


def test_forced_triton_attention_equals_reference(monkeypatch):
    batch = make_paged_batch(
        [3, 1],
        [5, 20],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=DEVICE,
    )
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    kernels.reset_kernel_choice()
    expected = kernels.paged_attention(*batch.args())
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    kernels.reset_kernel_choice()
    actual = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_importing_kernels_does_not_import_triton():
    code = (
        "import sys, nanoserve.kernels, nanoserve.kernels.attention; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- only kernels/ knows the device: layers and models never ask ---------------------------------
PACKAGE = Path(kernels.__file__).parent.parent
DEVICE_QUESTIONS = {"is_cuda", "is_cpu", "use_triton", "cpu_ops", "prefill_row_tile"}


def _device_questions(path: Path) -> list[str]:
    """Where a module asks which device or kernel set it runs on: `.is_cuda` / `.is_cpu`,
    `device.type`, `torch.cuda`, the kernels' own `use_triton` / `cpu_ops`, or the step's
    `prefill_row_tile` (a CPU-only value) read as one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute):
            if node.attr in DEVICE_QUESTIONS:
                name = node.attr
            elif (
                node.attr == "type"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "device"
            ):
                name = "device.type"
            elif (
                node.attr == "cuda"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                name = "torch.cuda"
        elif isinstance(node, ast.Name) and node.id in DEVICE_QUESTIONS:
            name = node.id
        elif isinstance(node, ast.ImportFrom):
            hits = [alias.name for alias in node.names if alias.name in DEVICE_QUESTIONS]
            name = ", ".join(hits) or (
                node.module if node.module and node.module.endswith("cpu_ops") else None
            )
        if name:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return found


def test_layers_and_models_never_ask_for_the_device():
    offenders = []
    for folder in ("layers", "models"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            hits = _device_questions(path)
            if path.name == "attention.py" and folder == "layers":
                # AttentionMetadata carries prefill_row_tile (the engine's padding) to RowTiling.
                hits = [hit for hit in hits if not hit.endswith("prefill_row_tile")]
            offenders += hits
    assert offenders == [], "dispatch on the device in nanoserve/kernels/:\n" + "\n".join(offenders)


def test_the_device_check_sees_a_question():
    assert any(
        hit.endswith("is_cuda") for hit in _device_questions(PACKAGE / "kernels" / "__init__.py")
    )


def _fused_qkv(
    tokens=5, heads=4, kv_heads=2, dim=64, blocks=4, block_size=16, dtype=torch.bfloat16
):
    torch.manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 40][:tokens])
    slots = torch.tensor([0, 1, 2, 17, -1][:tokens])  # -1: a padding row, not written
    # Head-major underneath, as the engine allocates a CPU pool (engine/kv_allocation.py).
    caches = [
        torch.zeros(blocks, kv_heads, block_size, dim, dtype=dtype).permute(0, 2, 1, 3)
        for _ in range(2)
    ]
    return qkv, positions, slots, caches


def test_rotary_and_store_kvcache_is_one_op_on_every_path(monkeypatch):
    """The fused C++ pass (CPU, when the kernels load) gives what apply_rotary + store_kvcache
    give under NANOSERVE_KERNELS=reference."""
    heads, kv_heads, dim = 4, 2, 64
    cos_sin = kernels.build_cos_sin_cache(dim, 64, 10000.0, None)
    results = {}
    for choice in ("auto", "reference"):
        monkeypatch.setenv("NANOSERVE_KERNELS", choice)
        kernels.reset_kernel_choice()
        qkv, positions, slots, (key_cache, value_cache) = _fused_qkv(
            heads=heads, kv_heads=kv_heads, dim=dim
        )
        v = qkv[:, (heads + kv_heads) * dim :].reshape(-1, kv_heads, dim).clone()
        q = kernels.rotary_and_store_kvcache(
            qkv, heads, kv_heads, dim, positions, cos_sin, key_cache, value_cache, slots
        )
        assert q.shape == (qkv.shape[0], heads, dim)
        assert torch.equal(value_cache[0, 1], v[1])
        written = value_cache.reshape(-1, kv_heads * dim).abs().sum(1).nonzero().flatten().tolist()
        assert written == [0, 1, 2, 17]  # slot -1 (a padding row) is not written
        results[choice] = (q.float(), key_cache.float(), value_cache.float())
    for fused, reference in zip(results["auto"], results["reference"]):
        torch.testing.assert_close(fused, reference, atol=2e-2, rtol=2e-2)
