"""No module asks a layer which optional weight it happens to hold: a linear layer's weight is
one object (layers/linear_weight.py) chosen at load, and a MoE layer is known by its type. This
scans nanoserve/ for getattr / hasattr / setattr / delattr with a weight attribute's name as a
string constant; the allowlist is empty and should stay so."""

from __future__ import annotations

import ast
from pathlib import Path

import nanoserve

PACKAGE_DIR = Path(nanoserve.__file__).parent

# A layer's weight and what used to stand beside it, each probed for once.
WEIGHT_ATTRIBUTES = {
    "weight",
    "bias",
    "weight_form",
    "packed_weight",
    "gemm_weight",
    "quant_weight",
    "quant_parts",
    "input_perm",
    "lora",
    "packed",
    "quant_experts",
    "expert_weights",
    "cpu_table",
    "prepack_gemm",
    "finish_quantized",
    "kernel_components",
}
PROBES = {"getattr", "hasattr", "setattr", "delattr"}
ALLOWED: set[tuple[str, str]] = set()  # (file relative to nanoserve/, attribute)


def probes(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of each probe of a weight attribute by a string constant in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in PROBES
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in WEIGHT_ATTRIBUTES
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def test_no_module_probes_a_layer_for_weight_attributes():
    found = [
        f"{path.relative_to(PACKAGE_DIR)}:{line}: {attribute}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for line, attribute in probes(path.read_text())
        if (str(path.relative_to(PACKAGE_DIR)), attribute) not in ALLOWED
    ]
    assert found == [], "probes for optional weight attributes:\n" + "\n".join(found)


def test_the_scan_finds_probes():
    source = 'a = getattr(m, "quant_weight", None)\nb = hasattr(m, "gemm_weight")\nc = m.weight\n'
    assert probes(source) == [(1, "quant_weight"), (2, "gemm_weight")]
    assert probes('getattr(m, "q_norm", None)') == []
