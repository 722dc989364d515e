"""GPTQ and AWQ checkpoints (models/gptq_awq.py) as AutoGPTQ / AutoAWQ store them
(tests/gptq_awq_models.py): the words read as their formats define them (pinned by words packed
by hand, and for AWQ by compressed-tensors' own converter of AutoAWQ checkpoints), linear layers
holding the integers in the GGUF kernels' formats, greedy tokens equal to the
dequantize-then-reference path, logprobs close to transformers running the dequantized
weights, tensor parallelism equal to one rank, and the one-line errors for what is not served."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.kernels import quant
from nanoserve.kernels.choice import reset_kernel_choice
from nanoserve.layers.fused_moe import FusedMoE
from nanoserve.models.gptq_awq import group_quant_config, parse_config
from tests.gptq_awq_models import (
    SCHEMES,
    awq_as_compressed_tensors,
    dequantized_transformers,
    pack_awq,
    pack_gptq,
    quantize_checkpoint,
    write_quantized_llama,
)
from tests.models.family_checkpoints import write_random_checkpoint
from tests.models.test_compressed_tensors import (
    _experts_with_rounded_inputs,
    assert_cli_one_line_error,
    assert_moe_tensor_parallel_equals_one_rank,
    assert_same_greedy,
    assert_tensor_parallel_equals_one_rank,
    build,
    greedy,
)

SERVED = [
    "gptq-4bit-g128",
    "gptq-4bit-asym-g64",
    "gptq-8bit-g128",
    "gptq-4bit-channel",
    "gptq-4bit-actorder",
    "awq-4bit-g128",
]
DEQUANTIZED = ["gptq-8bit-asym-g64"]  # no kernel format has int8 with zero points: float at load
FUSED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}  # transformers' layer -> ours
PAIRS = [
    ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ("self_attn.o_proj", ["self_attn.o_proj"]),
    ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
    ("mlp.down_proj", ["mlp.down_proj"]),
]


@pytest.fixture(scope="module", params=SERVED + DEQUANTIZED)
def scheme(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(scheme, tmp_path_factory):
    return write_quantized_llama(tmp_path_factory.mktemp(scheme), scheme, seed=31)


def expected_qtype(scheme: str) -> str | None:
    method, bits, _, symmetric, act_order = SCHEMES[scheme]
    if bits == 8 and not symmetric:
        return None
    if bits == 8:
        return "q8_0"
    return "q4_0" if symmetric and method == "gptq" else "q4_1"


def _layer(model, index: int, name: str):
    module = model.model.layers[index]
    for part in name.split("."):
        module = getattr(module, part)
    return module


# ---- the bytes -----------------------------------------------------------------------------


def _integers(config: dict, tensors: dict):
    return parse_config(config).integers(tensors, "layer")


def test_gptq_words_packed_by_hand():
    """GPTQ: qweight row r holds inputs 8r..8r+7 (4-bit) from bit 0 up, for its column's
    output; qzeros the outputs' zero points the same way along a row, each stored minus one
    (v1; a stored 15 means 16, as vLLM reads it per value); g_idx in input order is plain groups."""
    k, n = 32, 8
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qweight[0, 0] = 0x76543210  # output 0, inputs 0-7 = 0..7
    qweight[3, 5] = 0x1F00000A  # output 5: input 24 = 10, 30 = 15, 31 = 1
    qzeros = torch.tensor(
        [[0x0000F037]], dtype=torch.int32
    )  # outputs 0..7 store 7, 3, 0, 15, then 0
    scales = torch.arange(1, n + 1, dtype=torch.float16).reshape(1, n)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    weight = _integers(
        config,
        {
            "qweight": qweight,
            "qzeros": qzeros,
            "scales": scales,
            "g_idx": torch.zeros(k, dtype=torch.int32),
        },
    )
    assert weight.g_idx is None and weight.group == 32 and weight.bits == 4
    u = weight.q + 8
    assert u[0, :8].tolist() == list(range(8)) and u[0, 8:].eq(0).all()
    assert (u[5, 24], u[5, 30], u[5, 31]) == (10, 15, 1)
    assert (weight.zero[:, 0] + 8).tolist() == [8, 4, 1, 16, 1, 1, 1, 1]
    dense = weight.dequantized()
    assert dense[0, 3] == 1 * (3 - 8) and dense[5, 24] == 6 * (10 - 1)
    # v2 ("gptq_v2"): the zero points as stored. 8-bit: four inputs a word.
    weight = _integers(
        {**config, "checkpoint_format": "gptq_v2"},
        {"qweight": qweight, "qzeros": qzeros, "scales": scales},
    )
    assert (weight.zero[:, 0] + 8).tolist() == [7, 3, 0, 15, 0, 0, 0, 0]
    words = torch.zeros(k // 4, n, dtype=torch.int32)
    words[1, 2] = 0x04C30201  # output 2: inputs 4..7 = 1, 2, 195, 4
    zeros8 = torch.full(
        (1, n // 4), 0x7F7F7F7F, dtype=torch.int32
    )  # 127 + 1 = 128 everywhere: symmetric
    weight = _integers(
        {**config, "bits": 8, "sym": True}, {"qweight": words, "qzeros": zeros8, "scales": scales}
    )
    assert (
        (weight.q[2, 4:8] + 128).tolist() == [1, 2, 195, 4]
        and weight.zero is None
        and weight.qtype == "q8_0"
    )


def test_awq_words_packed_by_hand():
    """AWQ (gemm): qweight [k, n / 8], a word's nibbles j = 0..7 holding outputs 0 2 4 6 1 3 5 7;
    the zero points the same way, as stored; the same reading as compressed-tensors' converter."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    qweight = torch.zeros(32, 2, dtype=torch.int32)
    qweight[1, 0] = 0x76543210
    qweight[2, 1] = 0x0000000F
    qzeros = torch.tensor([[0x11111111, 0x00000050]], dtype=torch.int32)
    scales = torch.ones(1, 16, dtype=torch.float16)
    weight = _integers(
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"},
        {"qweight": qweight, "qzeros": qzeros, "scales": scales},
    )
    u = weight.q + 8
    assert u[:8, 1].tolist() == [0, 4, 1, 5, 2, 6, 3, 7] and u[8, 2] == 15
    assert (weight.zero[:, 0] + 8).tolist() == [1] * 8 + [0, 0, 5, 0, 0, 0, 0, 0]
    converter = AutoAWQConverter(group_size=32)
    theirs, their_scale, their_zero = converter._convert_gemm_module(qweight, scales, qzeros)
    assert torch.equal(theirs.to(torch.int16), weight.q)
    assert torch.equal(their_zero.to(torch.int16).reshape(16, 1), weight.zero)


def test_the_test_packers_round_trip():
    """tests/gptq_awq_models' packers, read back: the integers they were given."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=gen)
    zeros = torch.randint(1, 16, (2, 16), generator=gen)
    scales = torch.rand(2, 16, generator=gen).half()
    g_idx = (torch.arange(64) // 32).to(torch.int32)
    for config, (qweight, qzeros) in (
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
            pack_gptq(q, zeros, 4),
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 32}, pack_awq(q, zeros)),
    ):
        weight = _integers(
            config, {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
        )
        assert torch.equal(weight.q + 8, q.to(torch.int16)) and torch.equal(
            weight.zero + 8, zeros.t().to(torch.int16)
        )


def test_awq_checkpoint_read_as_compressed_tensors_converts_it(tmp_path):
    """Every layer of an AWQ checkpoint dequantized as we read it equals compressed-tensors'
    reading (its AutoAWQ converter, then its decompressor), bit for bit, and the meaning of
    the integers the checkpoint was made from."""
    path = write_quantized_llama(tmp_path, "awq-4bit-g64", seed=3)
    theirs = awq_as_compressed_tensors(path)
    meaning = load_file(path.parent / "meaning.safetensors")
    config = group_quant_config(path)
    tensors = load_file(path / "model.safetensors")
    assert len(theirs) == 2 * 7
    for name, expected in theirs.items():
        layer = name.removesuffix(".weight")
        ours = config.integers(
            {role: tensors[f"{layer}.{role}"] for role in ("qweight", "qzeros", "scales")}, layer
        )
        assert torch.equal(ours.dequantized(), expected) and torch.equal(expected, meaning[name]), (
            name
        )


# ---- served ---------------------------------------------------------------------------------


@torch.inference_mode()
def test_layers_hold_the_checkpoints_integers(scheme, checkpoint):
    """Each quantized layer (fused q/k/v and gate/up too) is one QuantWeight in its kernel
    format, no float copy kept; its values the checkpoint's meaning (act order: its inputs
    sorted by group, in the layer's input_perm, which q/k/v and gate/up share). Asymmetric int8
    (no kernel format): the float weight, dequantized at load. lm_head and the embedding stay float."""
    model = build(checkpoint, dtype="float32").llm_engine.runner.model
    meaning = load_file(checkpoint.parent / "meaning.safetensors")
    qtype = expected_qtype(scheme)
    for index in range(2):
        for ours, parts in PAIRS:
            layer = _layer(model, index, ours)
            expected = torch.cat([meaning[f"model.layers.{index}.{part}.weight"] for part in parts])
            if qtype is None:
                assert not layer.weight_form.quantized and torch.equal(layer.weight, expected)
                continue
            assert layer.weight_form.parts[0].qtype == qtype and layer.weight.device.type == "meta"
            assert (layer.weight_form.input_perm is not None) == SCHEMES[scheme][4]
            if layer.weight_form.input_perm is not None:
                assert not torch.equal(
                    layer.weight_form.input_perm, torch.arange(expected.shape[1])
                )
                expected = expected[:, layer.weight_form.input_perm]
            assert torch.equal(quant.dequantize_weight(layer.weight_form.parts[0]), expected)
    assert not model.lm_head.weight_form.quantized and model.lm_head.weight.dtype == torch.float32


def test_greedy_equals_the_reference_path(checkpoint, monkeypatch):
    """The engine as it runs (the CPU kernels where they take the layer) against the same engine
    with every kernel on its torch reference, float32 activations."""
    ours = greedy(build(checkpoint, dtype="float32"))
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    assert_same_greedy(ours, greedy(build(checkpoint, dtype="float32")), typical=1e-4)


def _int8_blocks(order: torch.Tensor | None):
    """A forward pre-hook rounding a layer's inputs as our kernels do: int8 per block of 32 along
    each row (kernels/quant.quantize_activations), the blocks taken in the layer's input order."""

    def round_inputs(module, args):
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        if order is not None:
            rows = rows[:, order]
        q, dx, _ = quant.quantize_activations(rows)
        values = (q.float().reshape(q.shape[0], -1, 32) * dx.unsqueeze(-1)).reshape(rows.shape)
        if order is not None:
            values = values[:, torch.argsort(order)]
        return (values.reshape(x.shape).to(x.dtype),)

    return round_inputs


def _hooked_greedy(llm, model):
    """Our greedy tokens; transformers' `model` hooked so that each layer we hold on the kernels
    rounds its inputs as ours (in its input order); those dequantized at load don't."""
    ours = dict(llm.llm_engine.runner.model.named_modules())  # (rank 0's)
    for name, module in model.named_modules():
        experts = ours.get(name)
        if isinstance(experts, FusedMoE) and experts.expert_weights.quantized_matrices():
            module.forward = types.MethodType(_experts_with_rounded_inputs, module)
            continue
        if not (name.endswith("_proj") or name == "lm_head"):
            continue
        parent, _, leaf = name.rpartition(".")
        fused = f"{parent}.{FUSED_INTO.get(leaf, leaf)}" if parent else name
        if fused in ours and ours[fused].weight_form.quantized:
            module.register_forward_pre_hook(_int8_blocks(ours[fused].weight_form.input_perm))
    return greedy(llm)


@torch.inference_mode()
def assert_close_to_transformers(path, **kwargs) -> None:
    """Our greedy tokens teacher-forced through transformers' model holding the checkpoint's
    meaning, the quantized layers' inputs rounded to int8 per block of 32 as our kernels round
    them (layers dequantized at load take float inputs): logprobs close, each token the argmax."""
    import numpy as np

    from tests.gguf_models import teacher_forced
    from tests.models.test_compressed_tensors import NEAR_TIE, PROMPTS

    model = dequantized_transformers(path)
    with build(path, dtype="float32", **kwargs) as llm:
        tokens, logprobs, _ = _hooked_greedy(llm, model)
        tokenizer = llm.get_tokenizer()
    differences = []
    for prompt, mine, (rows, theirs) in zip(
        PROMPTS, logprobs, teacher_forced(model, tokenizer, PROMPTS, tokens)
    ):
        differences += [abs(a - b) for a, b in zip(mine, theirs)]
        assert all(row.max().item() - value < NEAR_TIE for row, value in zip(rows, theirs)), prompt
    # Float32 rounding apart, an activation that lands on the other side of an int8 rounding step
    # moves one value by a step (about 1% of its block's largest): the logprobs after it differ by
    # up to a few 1e-2 (a misread layer moves them by whole units).
    assert max(differences) < NEAR_TIE and np.median(differences) < 1e-2, sorted(differences)


def test_logprobs_close_to_transformers_on_the_dequantized_weights(checkpoint):
    assert_close_to_transformers(checkpoint)


@pytest.mark.parametrize(
    "family,scheme",
    [
        ("qwen3", "gptq-4bit-asym-g64"),
        ("phi3", "awq-4bit-g64"),
        ("qwen2", "gptq-4bit-g128"),
        ("qwen3_moe", "gptq-4bit-g128"),
        ("qwen3_moe", "awq-4bit-g64"),
    ],
)
def test_other_families(family, scheme, tmp_path):
    """Qwen3 (q/k norms), Phi-3 (q, k and v in one checkpoint tensor, gate and up too: one
    quantized tensor per fused layer, split into the layer's shards as a float one is), Qwen2
    (float q/k/v biases beside the quantized layers, as Qwen2.5's GPTQ-Int4 checkpoints have) and
    Qwen3-MoE (each expert's matrices kept as integers by the fused MoE: Q4_0 / Q4_1)."""
    from tests.models.moe_checkpoints import assert_experts_hold, write_moe_checkpoint

    write = write_moe_checkpoint if family == "qwen3_moe" else write_random_checkpoint
    hf_dir = write(tmp_path / "hf", family, seed=6)
    path = quantize_checkpoint(hf_dir, tmp_path / "model", scheme, seed=6)
    model = build(path, dtype="float32").llm_engine.runner.model
    assert all(layer.self_attn.qkv_proj.weight_form.quantized for layer in model.model.layers)
    if family == "qwen3_moe":
        assert_experts_hold(
            model, load_file(path.parent / "meaning.safetensors"), expected_qtype(scheme)
        )
    assert_close_to_transformers(path)


def test_quantized_lm_head(tmp_path):
    """GPTQModel's lm_head option: the LM head's qweight too, kept as integers (ParallelLMHead's
    QuantizedWeight, as a GGUF head's), its values the checkpoint's meaning; logprobs close to
    transformers with the head's inputs rounded as ours."""
    path = write_quantized_llama(tmp_path, "gptq-4bit-asym-g64", seed=8, lm_head=True)
    model = build(path, dtype="float32").llm_engine.runner.model
    head = model.lm_head
    assert (
        head.weight_form.quantized
        and head.weight_form.parts[0].qtype == "q4_1"
        and head.weight.device.type == "meta"
    )
    meaning = load_file(path.parent / "meaning.safetensors")["lm_head.weight"]
    assert torch.equal(
        quant.dequantize_weight(head.weight_form.parts[0])[: meaning.shape[0]], meaning
    )
    assert_close_to_transformers(path)


def test_tensor_parallel_equals_one_rank(tmp_path):
    """tp=2 (gloo): column-parallel layers take whole rows, row-parallel ones whole blocks of 32
    inputs with their scales and zero points; the tokens equal one rank's, each rank holds about half."""
    assert_tensor_parallel_equals_one_rank(
        write_quantized_llama(tmp_path, "gptq-4bit-asym-g64", seed=5)
    )


@pytest.mark.parametrize("expert_inter", [64, 32])
def test_quantized_moe_under_tensor_parallelism_equals_one_rank(expert_inter, tmp_path):
    """tp=2 (gloo) on a GPTQ Qwen3-MoE, split along the intermediate dimension (vLLM's default) and
    with --enable-expert-parallel (whole experts a rank): each rank keeps its experts' rows and
    whole blocks of 32 of their down matrices' inputs as integers, and the tokens equal one
    rank's. An intermediate size of 32 splits into 16 inputs a rank, not a block: the down
    matrices are then dequantized at load (float inputs, so the logprobs move by the int8
    rounding one rank's kernels do)."""
    from tests.models.moe_checkpoints import write_moe_checkpoint

    hf_dir = write_moe_checkpoint(tmp_path / "hf", "qwen3_moe", seed=6, expert_inter=expert_inter)
    path = quantize_checkpoint(hf_dir, tmp_path / "model", "gptq-4bit-asym-g64", seed=6)
    assert_moe_tensor_parallel_equals_one_rank(path, expert_inter)


# ---- what else a checkpoint may hold, and what is refused ---------------------------------


@pytest.fixture(scope="module")
def gptq4(tmp_path_factory):
    return write_quantized_llama(tmp_path_factory.mktemp("gptq4"), "gptq-4bit-g128", seed=2)


def _copy(path, tmp_path, name="copy"):
    return shutil.copytree(path, tmp_path / name)


def _edit_config(path, change) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    change(config["quantization_config"])
    config_file.write_text(json.dumps(config))


def test_autogptq_quantize_config_json(gptq4, tmp_path):
    """An older AutoGPTQ checkpoint: no quantization_config in config.json, a quantize_config.json
    beside it (no quant_method): served as GPTQ, the same tokens."""
    path = _copy(gptq4, tmp_path)
    config = json.loads((path / "config.json").read_text())
    legacy = config.pop("quantization_config")
    legacy.pop("quant_method")
    (path / "config.json").write_text(json.dumps(config))
    (path / "quantize_config.json").write_text(json.dumps(legacy))
    assert greedy(build(path, dtype="float32")) == greedy(build(gptq4, dtype="float32"))


def test_zero_biases_of_layers_without_bias_are_skipped(gptq4, tmp_path):
    """AutoGPTQ may store a bias of zeros for a layer that has none: skipped, as vLLM skips it;
    a bias that isn't zero is an error naming it (the model would lose it)."""
    path = _copy(gptq4, tmp_path)
    tensors = load_file(gptq4 / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(256, dtype=torch.float16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert greedy(build(path, dtype="float32")) == greedy(build(gptq4, dtype="float32"))
    tensors["model.layers.0.mlp.down_proj.bias"][3] = 1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.down_proj.bias'"):
        build(path)


BAD_CONFIGS = {
    "GPTQ 3-bit weights": lambda q: q.update(bits=3),
    "GPTQ per-module overrides": lambda q: q.update(dynamic={r"-:.*down_proj": {}}),
    "GPTQ checkpoint_format 'marlin'": lambda q: q.update(checkpoint_format="marlin"),
    "GPTQ group_size 0": lambda q: q.update(group_size=0),
    "AWQ version 'gemv'": lambda q: q.update(quant_method="awq", version="gemv"),
    "AWQ 8-bit weights": lambda q: q.update(quant_method="awq", bits=8),
}


@pytest.mark.parametrize("what", list(BAD_CONFIGS))
def test_unsupported_configs_are_one_line_errors(what, gptq4, tmp_path):
    path = _copy(gptq4, tmp_path)
    _edit_config(path, BAD_CONFIGS[what])
    with pytest.raises(ValueError, match=f"{what}.* is not supported"):
        group_quant_config(path)
    if what == "GPTQ 3-bit weights":
        assert_cli_one_line_error(path, "3-bit weights")


def test_quantization_flag(gptq4, tmp_path):
    """gptq / gptq_marlin name a GPTQ checkpoint's quantization (awq / awq_marlin an AWQ one);
    another value, or one of them on a checkpoint of another kind, is an error."""
    build(gptq4, quantization="gptq")
    build(gptq4, quantization="gptq_marlin")
    for wrong in ("awq", "compressed-tensors", "gguf"):
        with pytest.raises(ValueError, match=f"--quantization {wrong} does not apply"):
            build(gptq4, quantization=wrong)
    with pytest.raises(ValueError, match="--quantization gptq does not apply"):
        build(gptq4.parent / "hf", quantization="gptq")
    other = _copy(gptq4, tmp_path, "bnb")
    _edit_config(other, lambda q: q.update(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        build(other)


def test_act_order_under_tensor_parallelism(tmp_path):
    """tp=2 with GPTQ's activation order: column-parallel layers keep their integers (inputs
    sorted by group), row-parallel ones, whose inputs the ranks split, are dequantized at load
    (so they take float inputs, and the logprobs are transformers' with only the column-parallel
    layers' inputs rounded)."""
    path = write_quantized_llama(tmp_path, "gptq-4bit-actorder", seed=7)
    with build(path, dtype="float32", tensor_parallel_size=2) as llm:
        layer = llm.llm_engine.runner.model.model.layers[0]
        assert (
            layer.self_attn.qkv_proj.weight_form.input_perm is not None
            and layer.mlp.gate_up_proj.weight_form.input_perm is not None
        )
        assert (
            not layer.self_attn.o_proj.weight_form.quantized
            and not layer.mlp.down_proj.weight_form.quantized
        )
    assert_close_to_transformers(path, tensor_parallel_size=2)


def test_fused_parts_with_different_act_orders_are_an_error(tmp_path):
    """q, k and v (one layer here) must share their activation order, as GPTQ's do; a checkpoint
    whose k has another is refused naming the layer."""
    path = write_quantized_llama(tmp_path, "gptq-4bit-actorder", seed=7)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj"
    qweight = tensors[f"{name}.qweight"]
    g_idx = tensors[f"{name}.g_idx"]
    order = torch.argsort(g_idx.long(), stable=True)
    swap = torch.arange(g_idx.shape[0])
    first, last = int(order[0]), int(order[-1])
    swap[first], swap[last] = last, first  # two inputs of different groups trade places
    tensors[f"{name}.g_idx"] = g_idx[swap].contiguous()
    assert qweight.dtype == torch.int32
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    # (Whichever of q, k, v the file lists second is the one named.)
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.self_attn.[qkv]_proj: its activation order \(g_idx\) differs "
        r"from the other parts of model.layers.1.self_attn.qkv_proj,",
    ):
        build(path)
