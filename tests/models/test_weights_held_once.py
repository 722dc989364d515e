"""A bf16 weight our CPU GEMM has packed is held once (layers/cpu_prepack.py): the packing, the
parameter moved to the meta device, except a weight another module shares (a tied LM head's is
the embedding's table); the weight bytes the engine reports count what is held."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.gemm import unquantized_gemm
from nanoserve.layers.linear import LinearBase
from tests.conftest import write_random_llama

needs_gemm = pytest.mark.skipif(
    not cpu_ops.gemm_available(), reason="the CPU kernels don't load here"
)


@needs_gemm
@pytest.mark.parametrize("tie", [False, True])
def test_packed_weights_are_held_once(tmp_path, tie):
    path = write_random_llama(tmp_path / "model", tie=tie, dtype="bfloat16")
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128)
    runner = llm.llm_engine.runner
    model = runner.model
    linears = [module for module in model.modules() if isinstance(module, LinearBase)]
    assert linears and all(m.weight_form.gemm is not None and m.weight.is_meta for m in linears)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head.weight_form.gemm is not None and not embedding.weight.is_meta
    assert (head.weight is embedding.weight) == tie and head.weight.is_meta != tie
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    packings = sum(
        m.weight_form.gemm.numel() * m.weight_form.gemm.element_size() for m in [*linears, head]
    )
    assert runner.weight_bytes == held + packings
    # Each weight once in bf16 (padding aside); a tied head's packing is a second vocabulary table.
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    head_packing = head.weight_form.gemm.numel() * head.weight_form.gemm.element_size()
    assert runner.weight_bytes < dense * 1.1 + (head_packing if tie else 0)
    out = llm.generate(
        ["hello there"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


@needs_gemm
def test_a_released_weight_still_takes_any_rows(tmp_path):
    """Strided or fp32 rows (F.linear's cases before) go through the packing too, same bits as
    contiguous bf16 rows."""
    llm = LLM(
        model=str(write_random_llama(tmp_path / "model", dtype="bfloat16")),
        dtype="bfloat16",
        max_model_len=128,
    )
    layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.is_meta
    k = layer.weight.shape[1]
    wide = torch.randn(5, k + 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = wide[:, 4 : 4 + k]
    expected = unquantized_gemm(rows.contiguous(), layer.weight, None, layer.weight_form.gemm)
    assert torch.equal(unquantized_gemm(rows, layer.weight, None, layer.weight_form.gemm), expected)
    as_fp32 = unquantized_gemm(rows.float(), layer.weight, None, layer.weight_form.gemm)
    assert as_fp32.dtype == torch.float32 and torch.equal(as_fp32, expected.float())
    assert torch.equal(
        unquantized_gemm(rows.reshape(1, 5, k), layer.weight, None, layer.weight_form.gemm)[0],
        expected,
    )


@needs_gemm
@pytest.mark.parametrize("n", [16, 37])
def test_unpack_reads_the_gemm_packing_back(n):
    weight = torch.randn(n, 64, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    assert torch.equal(cpu_ops.unpack_gemm_weight(cpu_ops.pack_gemm_weight(weight), n), weight)


@needs_gemm
def test_moe_experts_are_held_once(tmp_path, monkeypatch):
    """A MoE layer's experts live in their packing only; the torch reference path multiplies the
    matrices read back from it: the same tokens and logprob bits as the reference on parameters
    that were never packed (NANOSERVE_CPU_GEMM=onednn packs nothing for our GEMM)."""
    import nanoserve.kernels as kernels
    from nanoserve.layers.fused_moe import FusedMoE
    from tests.models.moe_checkpoints import write_moe_checkpoint

    model_dir = write_moe_checkpoint(tmp_path / "olmoe", "olmoe")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 2]}, {"prompt_token_ids": [40, 41, 7]}]

    def reference_outputs(llm):
        monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
        kernels.reset_kernel_choice()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            monkeypatch.delenv("NANOSERVE_KERNELS")
            kernels.reset_kernel_choice()
        return [
            (
                o.outputs[0].token_ids,
                [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            )
            for o in outputs
        ]

    packed = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=32)
    layers = [m for m in packed.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(
        m.expert_weights.operands() != (None, None) and m.w13_weight.is_meta and m.w2_weight.is_meta
        for m in layers
    )
    assert (
        len(packed.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids) == 6
    )  # the grouped path
    ours = reference_outputs(packed)
    packed.shutdown()
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "onednn")
    plain = LLM(model=str(model_dir), dtype="bfloat16", num_kv_blocks=32)
    monkeypatch.delenv("NANOSERVE_CPU_GEMM")
    assert all(
        m.expert_weights.operands() == (None, None) and not m.w13_weight.is_meta
        for m in plain.llm_engine.runner.model.modules()
        if isinstance(m, FusedMoE)
    )
    assert ours == reference_outputs(plain)
