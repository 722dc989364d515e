"""The fused MoE path (kernels/fused_moe.py) against its oracle, the loop over experts: the
router's top-k, the grouping of rows by expert, the grouped GEMMs in fp32 and (through
kernels/cpu/gemm*.cpp) bf16, with tokens that share an expert and experts that get no token,
top-2 and top-8 of 8; the expert-parallel and intermediate-split shards summing to the whole;
the Triton kernel (the interpreter on a CPU) against the same oracle; gpt-oss's expert biases
and clamped SwiGLU on every path against a float64 loop written from transformers' definition."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.fused_moe import (
    fused_experts_grouped,
    fused_experts_reference,
    fused_experts_triton,
    fused_moe,
    fused_topk,
    moe_align,
    moe_align_block_size,
    pack_expert_weights,
    swiglu_oai,
    unpacked_experts,
)
from tests.kernels.utils import DEVICE, DTYPES, dtype_id

HIDDEN, INTER, EXPERTS = 64, 32, 8


def expert_weights(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def crowded_routing(tokens: int, top_k: int, seed=1):
    """Every token picks expert 3 (several tokens, one expert); experts 6 and 7 get no token
    unless every expert is picked (top-8)."""
    gen = torch.Generator().manual_seed(seed)
    ids = (
        torch.stack(
            [torch.randperm(EXPERTS - 3, generator=gen)[: top_k - 1] for _ in range(tokens)]
        )
        if top_k < EXPERTS
        else torch.stack([torch.randperm(EXPERTS, generator=gen) for _ in range(tokens)])
    )
    if top_k < EXPERTS:
        ids = torch.where(ids >= 3, ids + 1, ids)  # 0..5 without 3
        ids = torch.cat([torch.full((tokens, 1), 3), ids], dim=1)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights, ids


def test_fused_topk_is_softmax_top_k_with_optional_renormalisation():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 4.0, -1.0, 0.0]])
    weights, ids = fused_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 3], [0, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = fused_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="top_k"):
        fused_topk(logits, 5, renormalize=True)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("renormalize", [False, True])
def test_cpu_topk_picks_what_torch_picks_and_is_row_invariant(dtype, renormalize):
    """kernels/cpu/moe.cpp's ns_moe_topk (fused_topk on CPU) against fused_topk_reference (torch's
    softmax and topk): the same experts in the same order, weights within fp32 rounding; a token's
    choice the same alone as among others."""
    from nanoserve.kernels.fused_moe import fused_topk_reference

    logits = (torch.randn(37, 128, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    logits = logits[:, :-3]  # rows of stride 128 over 125 experts
    for top_k in (1, 2, 8):
        weights, ids = cpu_ops.moe_topk(logits, top_k, renormalize)
        expected_weights, expected_ids = fused_topk_reference(logits, top_k, renormalize)
        # The same experts, but bf16 logits tie, and torch.topk orders ties as it likes: the
        # chosen logits must be the same values in the same order.
        assert torch.equal(logits.gather(1, ids), logits.gather(1, expected_ids))
        assert dtype == torch.bfloat16 or torch.equal(ids, expected_ids)
        torch.testing.assert_close(
            weights, expected_weights, atol=0, rtol=2e-6
        )  # a few ulps: sums in other orders
        assert torch.equal(fused_topk(logits, top_k, renormalize)[0], weights)
        for token in (0, 36):
            alone = cpu_ops.moe_topk(logits[token : token + 1], top_k, renormalize)
            assert torch.equal(alone[0][0], weights[token]) and torch.equal(alone[1][0], ids[token])
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0]], dtype=dtype)
    assert cpu_ops.moe_topk(tied, 3, False)[1].tolist() == [
        [1, 2, 0]
    ]  # equal values: the lower expert first


def test_moe_align_groups_rows_by_expert_stably_and_puts_remote_experts_first():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
    sorted_rows, offsets = moe_align(ids, 3)
    assert sorted_rows.tolist() == [3, 1, 4, 0, 2, 5]  # -1; expert 0: rows 1, 4; expert 2: 0, 2, 5
    assert offsets.tolist() == [1, 3, 3, 6]  # expert 1 has no row


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_equals_the_loop_in_fp32(top_k, tokens):
    w13, w2 = expert_weights()
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, ids = crowded_routing(tokens, top_k)
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(
        fused_experts_grouped(hidden, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5
    )
    assert expected.abs().max() > 0.1  # not trivially zero


def test_unpicked_experts_and_remote_slots_contribute_nothing():
    w13, w2 = expert_weights()
    hidden = torch.randn(5, HIDDEN)
    weights, ids = crowded_routing(5, 2)
    # An unpicked expert's weights can be anything.
    poisoned = w13.clone()
    poisoned[7] = float("nan")
    torch.testing.assert_close(
        fused_experts_grouped(hidden, poisoned, w2, weights, ids),
        fused_experts_reference(hidden, w13, w2, weights, ids),
    )
    # Slots of experts on another rank (-1) add nothing: only the first slot counts.
    remote = ids.clone()
    remote[:, 1] = -1
    only_first = fused_experts_reference(hidden, w13, w2, weights[:, :1], ids[:, :1])
    torch.testing.assert_close(fused_experts_grouped(hidden, w13, w2, weights, remote), only_first)


@pytest.mark.parametrize("renormalize", [False, True])
def test_expert_parallel_and_intermediate_split_shards_sum_to_the_whole(renormalize):
    """What the two tensor-parallel layouts of layers/fused_moe.FusedMoE compute on 2 ranks,
    summed as the all-reduce does."""
    w13, w2 = expert_weights()
    gen = torch.Generator().manual_seed(3)
    hidden, logits = torch.randn(9, HIDDEN, generator=gen), torch.randn(9, EXPERTS, generator=gen)
    whole = fused_moe(hidden, logits, w13, w2, 2, renormalize)
    expert_parallel = torch.zeros_like(whole)
    for rank in range(2):
        local = slice(4 * rank, 4 * rank + 4)
        expert_map = torch.full((EXPERTS,), -1)
        expert_map[local] = torch.arange(4)
        expert_parallel += fused_moe(
            hidden, logits, w13[local], w2[local], 2, renormalize, expert_map
        )
    torch.testing.assert_close(expert_parallel, whole, atol=1e-5, rtol=1e-5)
    split = torch.zeros_like(whole)
    half = INTER // 2
    for rank in range(2):
        mine = torch.arange(rank * half, (rank + 1) * half)
        rows = torch.cat([mine, INTER + mine])  # this rank's gate rows and up rows
        split += fused_moe(
            hidden,
            logits,
            w13[:, rows],
            w2[:, :, rank * half : (rank + 1) * half].contiguous(),
            2,
            renormalize,
        )
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")
@pytest.mark.parametrize("top_k", [2, 8])
def test_bf16_through_the_cpu_gemm_is_close_to_the_loop_and_row_invariant(top_k):
    w13, w2 = expert_weights(torch.bfloat16)
    packed = (pack_expert_weights(w13), pack_expert_weights(w2))
    assert packed[0] is not None and packed[1] is not None
    hidden = torch.randn(33, HIDDEN).to(torch.bfloat16)
    weights, ids = crowded_routing(33, top_k)
    batch = fused_experts_grouped(hidden, w13, w2, weights, ids, packed)
    expected = fused_experts_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(batch.float(), expected.float(), atol=3e-2, rtol=3e-2)
    # A token's bits do not depend on the other tokens (the batch, chunking, the prefix cache).
    for token in (0, 17, 32):
        alone = fused_experts_grouped(
            hidden[token : token + 1],
            w13,
            w2,
            weights[token : token + 1],
            ids[token : token + 1],
            packed,
        )
        assert torch.equal(alone[0], batch[token]), token


def test_pack_expert_weights_refuses_what_the_gemm_cannot_take():
    assert (
        pack_expert_weights(torch.zeros(2, 16, 48, dtype=torch.bfloat16)) is None
    )  # K not a multiple of 32
    assert pack_expert_weights(torch.zeros(2, 16, 64)) is None  # fp32


def test_moe_align_block_size_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
    sorted_rows, block_experts = moe_align_block_size(ids, 3, 4)
    pad = 6
    assert sorted_rows.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    # expert 0, expert 2 (expert 1 has no block), remote rows, then unused blocks (3: skipped)
    assert block_experts.tolist()[:3] == [0, 2, 3] and set(block_experts.tolist()[3:]) <= {3}
    assert sorted_rows.shape[0] == 4 * block_experts.shape[0] >= 6 + 4 * 3


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)  # bf16 on a GPU only
@pytest.mark.parametrize(
    "top_k,tokens", [(2, 1), (2, 21), (8, 5), (2, 150)]
)  # 150: blocks of 64 rows
def test_triton_equals_the_loop(dtype, top_k, tokens):
    """Under the Triton interpreter on a CPU (no bf16 there), natively on CUDA."""

    w13, w2 = (w.to(DEVICE, dtype) for w in expert_weights())
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(
        DEVICE, dtype
    )
    weights, ids = (t.to(DEVICE) for t in crowded_routing(tokens, top_k))
    remote = ids.clone()
    remote[0, -1] = -1  # an expert on another rank
    tol = {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=3e-3, rtol=3e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }[dtype]
    for routing in (ids, remote):
        expected = fused_experts_reference(hidden, w13, w2, weights, routing)
        torch.testing.assert_close(
            fused_experts_triton(hidden, w13, w2, weights, routing), expected, **tol
        )


def test_no_tokens_and_no_local_rows():
    w13, w2 = expert_weights()
    no_ids = torch.zeros(0, 2, dtype=torch.long)
    empty = fused_experts_grouped(torch.zeros(0, HIDDEN), w13, w2, torch.zeros(0, 2), no_ids)
    assert empty.shape == (0, HIDDEN)
    remote_only = fused_experts_grouped(
        torch.randn(3, HIDDEN), w13, w2, torch.ones(3, 2), torch.full((3, 2), -1)
    )
    assert torch.equal(remote_only, torch.zeros(3, HIDDEN))


def expert_biases(dtype=torch.float32, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(EXPERTS, 2 * INTER, generator=gen).to(dtype),
        torch.randn(EXPERTS, HIDDEN, generator=gen).to(dtype),
    )


def gpt_oss_experts_float64(hidden, w13, w2, b13, b2, weights, ids, alpha=1.702, limit=7.0):
    """gpt-oss's experts token by token in float64 (transformers' GptOssExperts, gate and up
    already de-interleaved): (up + 1) * glu with the gate clamped above and up to +-limit."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    h, w13, w2, b13, b2 = (t.double().cpu() for t in (hidden, w13, w2, b13, b2))
    for token in range(h.shape[0]):
        for slot, expert in enumerate(ids[token].tolist()):
            if expert < 0:
                continue
            gate, up = (w13[expert] @ h[token] + b13[expert]).chunk(2)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[token] += float(weights[token, slot]) * (w2[expert] @ act + b2[expert])
    return out


ACTIVATION = lambda gate_up: swiglu_oai(gate_up, alpha=1.702, limit=7.0)  # noqa: E731


@pytest.mark.parametrize("tokens", [1, 9])
def test_gpt_oss_biases_and_activation_on_the_loop_and_grouped(tokens):
    w13, w2 = expert_weights()
    w13 = w13 * 6  # gate / up values past the clamp at 7
    bias = expert_biases()
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, ids = crowded_routing(tokens, 2)
    ids[0, 1] = -1  # an expert on another rank adds nothing, its bias neither
    expected = gpt_oss_experts_float64(hidden, w13, w2, *bias, weights, ids)
    gate_up = hidden @ w13[3].T + bias[0][3]
    assert (gate_up.abs() > 7).any()  # the clamps are reached
    for fused in (fused_experts_reference, fused_experts_grouped):
        got = fused(hidden, w13, w2, weights, ids, None, bias, ACTIVATION)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(
        fused_experts_grouped(hidden, w13, w2, weights, ids, None, None, ACTIVATION).double(),
        expected,
        atol=1e-2,
    )


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")
def test_gpt_oss_biases_through_the_cpu_gemm_are_row_invariant():
    w13, w2 = expert_weights(torch.bfloat16)
    bias = expert_biases(torch.bfloat16)
    packed = (pack_expert_weights(w13), pack_expert_weights(w2))
    hidden = torch.randn(20, HIDDEN).to(torch.bfloat16)
    weights, ids = crowded_routing(20, 2)
    batch = fused_experts_grouped(hidden, w13, w2, weights, ids, packed, bias, ACTIVATION)
    expected = gpt_oss_experts_float64(hidden, w13, w2, *bias, weights, ids)
    torch.testing.assert_close(batch.double(), expected, atol=5e-2, rtol=5e-2)
    for token in (0, 19):
        alone = fused_experts_grouped(
            hidden[token : token + 1],
            w13,
            w2,
            weights[token : token + 1],
            ids[token : token + 1],
            packed,
            bias,
            ACTIVATION,
        )
        assert torch.equal(alone[0], batch[token]), token


@pytest.mark.parametrize("tokens", [1, 21])
def test_gpt_oss_biases_and_activation_on_triton(tokens):
    w13, w2 = (w.to(DEVICE) for w in expert_weights())
    bias = tuple(b.to(DEVICE) for b in expert_biases())
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in crowded_routing(tokens, 2))
    ids[0, -1] = -1
    expected = gpt_oss_experts_float64(hidden, w13, w2, *bias, weights.cpu(), ids.cpu())
    got = fused_experts_triton(hidden, w13, w2, weights, ids, None, bias, ACTIVATION)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-4, rtol=1e-4)


def _quantized_experts(weights: torch.Tensor) -> list:
    """Each expert's matrix rounded to Q8_0 components (8 bits and a scale per 32 inputs)."""
    from nanoserve.kernels.quant import QuantComponents, QuantWeight

    out = []
    for matrix in weights:
        blocks = matrix.float().unflatten(-1, (-1, 32))
        scale = blocks.abs().amax(-1).clamp(min=1e-8) / 127
        u = (torch.round(blocks / scale[..., None]) + 128).to(torch.uint8).flatten(-2)
        out.append(
            QuantWeight(
                "q8_0", matrix.shape[0], matrix.shape[1], None, components=QuantComponents(u, scale)
            )
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_quantized_experts_on_the_grouped_path_equal_their_reference_gemm_loop(dtype):
    """A quantized checkpoint's experts (kernels/quant.py QuantWeights, packed for the C++ kernel
    where it builds) through the grouped path: bit for bit the loop over experts with
    quant.reference_gemm, biases and gpt-oss's activation included, and row invariant."""
    from nanoserve.kernels import quant

    w13, w2 = expert_weights()
    q13, q2 = _quantized_experts(w13), _quantized_experts(w2)
    for weight in q13 + q2:
        quant.pack_for_cpu(weight)
    bias = tuple(b.to(dtype) for b in expert_biases())
    hidden = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(13)).to(dtype)
    weights, ids = crowded_routing(13, 2)
    ids[1, 1] = -1
    meta13, meta2 = (torch.empty(w.shape, dtype=dtype, device="meta") for w in (w13, w2))
    got = fused_experts_grouped(hidden, meta13, meta2, weights, ids, (q13, q2), bias, ACTIVATION)
    expected = torch.zeros(hidden.shape, dtype=torch.float32)
    for token in range(13):
        for slot, expert in enumerate(ids[token].tolist()):
            if expert < 0:
                continue
            gate_up = quant.reference_gemm(hidden[token : token + 1], q13[expert], bias[0][expert])
            down = quant.reference_gemm(ACTIVATION(gate_up), q2[expert], bias[1][expert])
            expected[token] += down[0].float() * weights[token, slot]
    assert torch.equal(got, expected.to(dtype))
    alone = fused_experts_grouped(
        hidden[5:6], meta13, meta2, weights[5:6], ids[5:6], (q13, q2), bias, ACTIVATION
    )
    assert torch.equal(alone[0], got[5])
    # The loop (NANOSERVE_KERNELS=reference) reads the same experts dequantized: the products of
    # unrounded activations, close to the int8 ones.
    loop = fused_experts_reference(
        hidden,
        unpacked_experts(meta13, q13),
        unpacked_experts(meta2, q2),
        weights,
        ids,
        None,
        bias,
        ACTIVATION,
    )
    torch.testing.assert_close(loop.float(), got.float(), atol=0.1, rtol=0.05)


def test_quant_expert_staging_packs_each_expert_once_its_parts_are_in():
    """A quantized expert's weight is made (and packed where the CPU kernels load) as soon as its
    gate and up parts are both staged, so a checkpoint's experts are never all held unpacked; an
    expert missing a part is an error when the layer finishes."""
    from nanoserve.kernels import quant
    from nanoserve.layers.quant_experts import QuantExpertStaging

    generator = torch.Generator().manual_seed(0)

    def part(rows):
        return {
            "u": torch.randint(0, 256, (rows, 64), generator=generator, dtype=torch.uint8),
            "scale": torch.rand(rows, 2, generator=generator),
        }

    staging = QuantExpertStaging(2, {"w13": 64, "w2": 32}, torch.device("cpu"))
    gate, up = part(16), part(16)
    staging.add("w13", 0, 0, "q8_0", gate)
    assert "w13" not in staging.weights
    staging.add("w13", 0, 1, "q8_0", up)
    weight = staging.weights["w13"][0]
    assert (weight.n, weight.k) == (32, 64) and staging.parts["w13"][0] == {}
    assert (weight.packed is not None) == cpu_ops.gemm_available()
    expected = quant.QuantWeight(
        "q8_0",
        32,
        64,
        None,
        components=quant.QuantComponents(
            torch.cat([gate["u"], up["u"]]), torch.cat([gate["scale"], up["scale"]])
        ),
    )
    assert torch.equal(quant.dequantize_weight(weight), quant.dequantize_weight(expected))
    staging.add("w13", 1, 0, "q8_0", part(16))  # expert 1 lacks its up part
    with pytest.raises(ValueError, match="every expert's gate, up and down"):
        staging.finish("w13")
    assert staging.finish("w2") is None


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")
@pytest.mark.parametrize("experts", ["bf16", "q8_0", "q8_0 gate/up, bf16 down"])
@pytest.mark.parametrize("top_k,tokens", [(2, 1), (2, 13), (8, 1), (8, 40)])
def test_one_cpu_call_equals_the_grouped_path_bit_for_bit(experts, top_k, tokens):
    """kernels/cpu/moe.cpp (fused_experts with a cpu_expert_table) against fused_experts_grouped
    on the same packings: the same bits, remote experts' slots (-1) included, and each token's
    output the same alone as in the batch."""
    from nanoserve.kernels import quant
    from nanoserve.kernels.fused_moe import cpu_expert_table, fused_experts

    w13, w2 = expert_weights(torch.bfloat16, seed=tokens)
    q13, q2 = _quantized_experts(w13), _quantized_experts(w2)
    for weight in q13 + q2:
        quant.pack_for_cpu(weight)
    bf16 = (pack_expert_weights(w13), pack_expert_weights(w2))
    packed = {"bf16": bf16, "q8_0": (q13, q2), "q8_0 gate/up, bf16 down": (q13, bf16[1])}[experts]
    table = cpu_expert_table(w13, w2, packed)
    assert table is not None and table.shape == (EXPERTS, 4)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).to(
        torch.bfloat16
    )
    weights, ids = crowded_routing(tokens, top_k)
    ids[0, top_k - 1] = -1  # an expert on another rank
    grouped = fused_experts_grouped(hidden, w13, w2, weights, ids, packed)
    one_call = fused_experts(hidden, w13, w2, weights, ids, packed, table=table)
    assert torch.equal(one_call, grouped)
    assert not torch.equal(one_call, torch.zeros_like(one_call))
    for token in {0, tokens // 2, tokens - 1}:
        alone = fused_experts(
            hidden[token : token + 1],
            w13,
            w2,
            weights[token : token + 1],
            ids[token : token + 1],
            packed,
            table=table,
        )
        assert torch.equal(alone[0], grouped[token]), token


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels did not build here")
def test_cpu_expert_table_refuses_what_moe_cpp_cannot_take():
    from nanoserve.kernels.fused_moe import cpu_expert_table

    w13, w2 = expert_weights(torch.bfloat16)
    packed13 = pack_expert_weights(w13)
    assert cpu_expert_table(w13, w2, None) is None
    assert cpu_expert_table(w13, w2, (packed13, None)) is None  # down not packed
    assert (
        cpu_expert_table(w13, w2, (packed13, _quantized_experts(w2))) is None
    )  # quantized, not packed
    assert (
        cpu_expert_table(w13, w2, (packed13[:-1], pack_expert_weights(w2))) is None
    )  # an expert missing
