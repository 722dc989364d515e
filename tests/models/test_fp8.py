"""FP8 (E4M3) weight checkpoints (models/fp8.py): `quant_method: "fp8"` as vLLM / transformers /
AutoFP8 store it (tests/fp8_models.py: block scales `weight_scale_inv`, per-tensor `weight_scale`
with a static `input_scale`) and compressed-tensors' `float-quantized` (written and decompressed
by the compressed-tensors package itself: FP8-dynamic per channel, 128 x 128 blocks, static per
tensor). Linear layers hold the bytes on the FP8 kernel with their meaning exactly, greedy tokens
equal the dequantize-then-matmul reference path, logprobs close to transformers running the
dequantized weights (W8A16: the activations are not rounded), tensor parallelism equal to one
rank, and the one-line errors for what is not served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.kernels import quant
from nanoserve.kernels.choice import reset_kernel_choice
from nanoserve.models.fp8 import fp8_config
from tests.fp8_models import dequantized_transformers, write_fp8_llama
from tests.models.test_compressed_tensors import (
    NEAR_TIE,
    PROMPTS,
    _edit_config,
    assert_cli_one_line_error,
    assert_same_greedy,
    assert_tensor_parallel_equals_one_rank,
    build,
    greedy,
)

FP8_METHOD_SCHEMES = ["fp8-block128", "fp8-block128-bf16", "fp8-block64x32", "fp8-tensor-static"]
COMPRESSED_SCHEMES = ["fp8-dynamic", "fp8-block", "fp8-static"]
PAIRS = [
    ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ("self_attn.o_proj", ["self_attn.o_proj"]),
    ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
    ("mlp.down_proj", ["mlp.down_proj"]),
]


def _write(scheme: str, out_dir, seed: int = 31, **shape):
    if scheme in COMPRESSED_SCHEMES:
        pytest.importorskip("compressed_tensors")
        from tests.compressed_tensors_models import write_compressed_llama

        return write_compressed_llama(out_dir, scheme, seed=seed, **shape)
    return write_fp8_llama(out_dir, scheme, seed=seed, **shape)


def _meaning(path, scheme: str) -> dict[str, torch.Tensor]:
    """Each FP8 layer's float32 weight: the writer's (torch's FP8 conversion times the scale), or
    for compressed-tensors the package's own decompression."""
    if scheme in COMPRESSED_SCHEMES:
        from compressed_tensors.quantization import QuantizationScheme

        from tests.compressed_tensors_models import decompressed

        config = json.loads((path / "config.json").read_text())["quantization_config"]
        return decompressed(
            load_file(path / "model.safetensors"),
            QuantizationScheme.model_validate(config["config_groups"]["group_0"]),
        )
    return load_file(path.parent / "meaning.safetensors")


def _oracle(path, scheme: str):
    if scheme in COMPRESSED_SCHEMES:
        from tests.compressed_tensors_models import dequantized_transformers as package_dequantized

        return package_dequantized(path)
    return dequantized_transformers(path)


@pytest.fixture(scope="module", params=FP8_METHOD_SCHEMES + COMPRESSED_SCHEMES)
def scheme(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(scheme, tmp_path_factory):
    return _write(scheme, tmp_path_factory.mktemp(scheme))


@torch.inference_mode()
def test_layers_hold_the_checkpoints_bytes(scheme, checkpoint):
    """Each FP8 layer (fused q/k/v and gate/up too) is one QuantWeight of the FP8 format, no
    float copy kept, its values exactly the checkpoint's meaning; lm_head stays float."""
    model = build(checkpoint, dtype="float32").llm_engine.runner.model
    assert_layers_hold(model, _meaning(checkpoint, scheme))


def assert_layers_hold(model, meaning: dict[str, torch.Tensor]) -> None:
    """Every linear layer of both decoder layers (fused q/k/v and gate/up: their parts' rows in
    order) is one FP8 QuantWeight, no float copy, its values exactly `meaning`'s; lm_head float."""
    for index in range(2):
        for ours, parts in PAIRS:
            module = model.model.layers[index]
            for part in ours.split("."):
                module = getattr(module, part)
            expected = torch.cat([meaning[f"model.layers.{index}.{part}.weight"] for part in parts])
            assert (
                module.weight_form.parts[0].qtype == quant.FP8
                and module.weight.device.type == "meta"
            )
            assert torch.equal(quant.dequantize_weight(module.weight_form.parts[0]), expected), (
                index,
                ours,
            )
    assert not model.lm_head.weight_form.quantized and model.lm_head.weight.dtype == torch.float32


def test_greedy_equals_the_reference_path(checkpoint, monkeypatch):
    """The engine as it runs (the FP8 kernel) against the same engine with every kernel on its
    torch reference (dequantize, then matmul), float32 activations."""
    ours = greedy(build(checkpoint, dtype="float32"))
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    assert_same_greedy(ours, greedy(build(checkpoint, dtype="float32")), typical=1e-4)


@torch.inference_mode()
def assert_close_to_transformers(path, scheme: str, **kwargs) -> None:
    """Our greedy tokens teacher-forced through transformers' model holding the checkpoint's
    meaning (W8A16: nothing rounds the activations): logprobs equal to float32 rounding, each
    token the argmax."""
    from tests.gguf_models import teacher_forced

    model = _oracle(path, scheme)
    with build(path, dtype="float32", **kwargs) as llm:
        tokens, logprobs, _ = greedy(llm)
        tokenizer = llm.get_tokenizer()
    differences = []
    for prompt, mine, (rows, theirs) in zip(
        PROMPTS, logprobs, teacher_forced(model, tokenizer, PROMPTS, tokens)
    ):
        differences += [abs(a - b) for a, b in zip(mine, theirs)]
        assert all(row.max().item() - value < NEAR_TIE for row, value in zip(rows, theirs)), prompt
    assert max(differences) < 1e-3, sorted(differences)


def test_logprobs_close_to_transformers_on_the_dequantized_weights(scheme, checkpoint):
    assert_close_to_transformers(checkpoint, scheme)


def test_other_family(tmp_path):
    """Qwen3 (q/k norms, its own attention module) with 128 x 128 block scales."""
    from tests.fp8_models import quantize_checkpoint
    from tests.models.family_checkpoints import write_random_checkpoint

    hf = write_random_checkpoint(tmp_path / "hf", "qwen3", seed=2)
    path = quantize_checkpoint(hf, tmp_path / "model", "fp8-block128")
    model = build(path, dtype="float32").llm_engine.runner.model
    assert all(
        layer.self_attn.qkv_proj.weight_form.parts[0].qtype == quant.FP8
        for layer in model.model.layers
    )
    assert_close_to_transformers(path, "fp8-block128")


def test_moe_experts_stay_fp8(tmp_path):
    """Qwen3-MoE in FP8 with 128 x 128 blocks: each expert's matrices kept as FP8 by the fused MoE
    (one byte a weight), their values the checkpoint's meaning; logprobs those of transformers."""
    from safetensors.torch import load_file

    from tests.fp8_models import quantize_checkpoint
    from tests.models.moe_checkpoints import assert_experts_hold, write_moe_checkpoint

    hf = write_moe_checkpoint(tmp_path / "hf", "qwen3_moe", seed=2)
    path = quantize_checkpoint(hf, tmp_path / "model", "fp8-block128")
    model = build(path, dtype="float32").llm_engine.runner.model
    assert_experts_hold(model, load_file(path.parent / "meaning.safetensors"), quant.FP8)
    assert_close_to_transformers(path, "fp8-block128")


def test_tensor_parallel_equals_one_rank(tmp_path):
    """tp=2 (gloo): column-parallel layers take whole rows with their scales, row-parallel ones
    whole blocks of 32 inputs; the tokens equal one rank's, each rank holds about half."""
    assert_tensor_parallel_equals_one_rank(write_fp8_llama(tmp_path, "fp8-block64x32", seed=5))


def test_static_input_scales_are_not_applied(tmp_path):
    """A static activation scheme's input_scale is read and not used (W8A16): the same tokens
    and logprob bits as the same weights under a dynamic scheme without it."""
    static = write_fp8_llama(tmp_path / "static", "fp8-tensor-static", seed=9)
    dynamic = tmp_path / "dynamic"
    shutil.copytree(static, dynamic)
    tensors = {
        name: t
        for name, t in load_file(dynamic / "model.safetensors").items()
        if "input_scale" not in name
    }
    save_file(tensors, dynamic / "model.safetensors", metadata={"format": "pt"})
    _edit_config(dynamic, lambda q: q.update(activation_scheme="dynamic"))
    assert greedy(build(static, dtype="float32")) == greedy(build(dynamic, dtype="float32"))


@torch.inference_mode()
def test_ignored_layers_stay_float(block128, tmp_path):
    """A layer the quantizer left out (`ignored_layers`: a float weight, no scale) is loaded as
    float beside the FP8 ones, and the model still means what it did."""
    path = _copy(block128, tmp_path)
    name = "model.layers.1.mlp.down_proj"
    meaning = load_file(block128.parent / "meaning.safetensors")

    def unquantize(tensors):
        tensors[f"{name}.weight"] = meaning[f"{name}.weight"].clone()
        del tensors[f"{name}.weight_scale_inv"]

    _edit_tensors(path, unquantize)
    _edit_config(path, lambda q: q.update(ignored_layers=[name]))
    with build(path, dtype="float32") as llm:
        model = llm.llm_engine.runner.model
        down = model.model.layers[1].mlp.down_proj
        assert not down.weight_form.quantized and torch.equal(
            down.weight, meaning[f"{name}.weight"]
        )
        assert model.model.layers[0].mlp.down_proj.weight_form.parts[0].qtype == quant.FP8
        ours = greedy(llm)
    assert_same_greedy(ours, greedy(build(block128, dtype="float32")), typical=1e-4)


# ---- what is refused ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def block128(tmp_path_factory):
    return write_fp8_llama(tmp_path_factory.mktemp("block128"), "fp8-block128", seed=7)


def _copy(path, tmp_path, name="copy"):
    return shutil.copytree(path, tmp_path / name)


def _edit_tensors(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


BAD_CONFIGS = {
    "FP8 activation_scheme 'per-token'": lambda q: q.update(activation_scheme="per-token"),
    "FP8 weight_block_size \\[128, 48\\]": lambda q: q.update(weight_block_size=[128, 48]),
    "FP8 fmt 'e5m2'": lambda q: q.update(fmt="e5m2"),
}


@pytest.mark.parametrize("what", list(BAD_CONFIGS))
def test_unsupported_configs_are_one_line_errors(what, block128, tmp_path):
    path = _copy(block128, tmp_path)
    _edit_config(path, BAD_CONFIGS[what])
    with pytest.raises(ValueError, match=f"{what}.* is not supported"):
        fp8_config(path)
    if what.startswith("FP8 fmt"):
        assert_cli_one_line_error(path, "FP8 fmt 'e5m2'")


def test_e5m2_and_nan_weights_are_errors(block128, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    e5m2 = _copy(block128, tmp_path, "e5m2")
    _edit_tensors(e5m2, lambda t: t.update({name: t[name].float().to(torch.float8_e5m2)}))
    with pytest.raises(ValueError, match=f"{name}: FP8 E5M2 weights are not supported"):
        build(e5m2)
    nan = _copy(block128, tmp_path, "nan")

    def poison(tensors):
        weight = tensors[name].view(torch.uint8).clone()
        weight[3, 5] = 0x7F
        tensors[name] = weight.view(torch.float8_e4m3fn)

    _edit_tensors(nan, poison)
    with pytest.raises(ValueError, match=f"{name}: the checkpoint has NaN FP8 weights"):
        build(nan)


def test_a_scale_of_the_wrong_shape_is_an_error(block128, tmp_path):
    path = _copy(block128, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _edit_tensors(path, lambda t: t.update({name: t[name][:1].contiguous()}))
    with pytest.raises(
        ValueError, match="model.layers.0.self_attn.o_proj: a block scale of shape \\[1, 2\\]"
    ):
        build(path)


def test_quantization_flag(block128):
    """fp8 names an FP8 checkpoint's quantization; another value is an error (fp8 on an
    unquantized model is online FP8, below)."""
    build(block128, quantization="fp8")
    for wrong in ("gptq", "compressed-tensors", "gguf"):
        with pytest.raises(ValueError, match=f"--quantization {wrong} does not apply"):
            build(block128, quantization=wrong)


# ---- online FP8: --quantization fp8 on an unquantized checkpoint ------------------------------


def _online_meaning(hf_dir) -> dict[str, torch.Tensor]:
    """Each *_proj weight rounded as online FP8 means it: a scale per output row, amax / 448,
    torch's own E4M3 rounding, read back times the scale (float32)."""
    meaning = {}
    for name, weight in load_file(hf_dir / "model.safetensors").items():
        if name.endswith("proj.weight"):
            values = weight.float()
            scale = (values.abs().amax(dim=1, keepdim=True) / 448.0).clamp(
                min=torch.finfo(torch.float32).tiny
            )
            meaning[name] = (values / scale).clamp(-448, 448).to(
                torch.float8_e4m3fn
            ).float() * scale
    return meaning


@torch.inference_mode()
def test_online_fp8_rounds_each_row_at_load(block128):
    """Every linear layer (fused q/k/v, gate/up too; a fused layer's rows keep their own scales)
    holds the rounded weight on the FP8 kernel and no float copy; the LM head stays float; the
    tokens are transformers' on the rounded weights, logprobs to float32 rounding."""
    from tests.compressed_tensors_models import float_tensors, transformers_with_weights
    from tests.gguf_models import teacher_forced

    hf = block128.parent / "hf"
    meaning = _online_meaning(hf)
    with build(hf, dtype="float32", quantization="fp8") as llm:
        assert_layers_hold(llm.llm_engine.runner.model, meaning)
        tokens, logprobs, _ = greedy(llm)
        tokenizer = llm.get_tokenizer()
    oracle = transformers_with_weights(hf, float_tensors(hf) | meaning, block128.parent / "online")
    for prompt, mine, (rows, theirs) in zip(
        PROMPTS, logprobs, teacher_forced(oracle, tokenizer, PROMPTS, tokens)
    ):
        assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-3, prompt
        assert all(row.max().item() - value < NEAR_TIE for row, value in zip(rows, theirs)), prompt


def test_online_fp8_under_tensor_parallelism_equals_one_rank(block128):
    """tp=2: a row-parallel layer's row scales are the maximum over both ranks' halves, so each
    rank holds what one rank would: the same tokens, logprobs to float32 rounding."""
    hf = block128.parent / "hf"
    with build(hf, dtype="float32", quantization="fp8") as llm:
        one = greedy(llm)
    with build(hf, dtype="float32", quantization="fp8", tensor_parallel_size=2) as llm:
        two = greedy(llm)
    assert_same_greedy(two, one, typical=1e-3)
