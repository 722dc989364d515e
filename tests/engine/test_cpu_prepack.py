"""bf16 linear weights prepacked for oneDNN on CPU give the same logits as F.linear."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.gemm import onednn_available
from nanoserve.layers.cpu_prepack import prepack_linear_weights
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.linear import ColumnParallelLinear


@pytest.mark.skipif(
    not onednn_available(),
    reason="oneDNN's bf16 linear ops are not in this torch build or not run by this CPU",
)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(0)
    linear = ColumnParallelLinear(96, 160, bias=True, dtype=torch.bfloat16)
    head = ParallelLMHead(500, 96, dtype=torch.bfloat16)
    for module in (linear, head):
        module.weight.data.normal_()
    linear.bias.data.normal_()
    x = torch.randn(rows, 96).to(torch.bfloat16)
    expected = (linear(x), head(x))
    assert prepack_linear_weights(torch.nn.ModuleList([linear, head])) == 2
    assert linear.weight_form.onednn is not None and head.weight_form.onednn is not None
    for got, want in zip((linear(x), head(x)), expected):
        torch.testing.assert_close(got.float(), want.float(), atol=0.25, rtol=2e-2)


def test_fp32_is_never_packed():
    linear = ColumnParallelLinear(32, 32, bias=False, dtype=torch.float32)
    assert prepack_linear_weights(linear) == 0 and linear.weight_form.onednn is None
