"""Small compressed-tensors checkpoints for the tests: a random Llama written by transformers' own
classes (tests/conftest.write_random_llama), its linear layers quantized and compressed by the
`compressed-tensors` package's own code (calculate_qparams for the scales, the registered
compressor of the format for the stored tensors, QuantizationConfig for config.json), lm_head
ignored as llm-compressor's recipes do. The float checkpoint stays beside it in `hf/`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import write_random_llama

DEFAULT_SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2
)
# name -> (weight bits, strategy, group size, symmetric, format, activations)
SCHEMES = {
    "w8a16-channel": (8, "channel", None, True, "int-quantized", None),
    "w8a8-channel": (8, "channel", None, True, "int-quantized", "dynamic"),
    "w8a16-group64": (8, "group", 64, True, "naive-quantized", None),
    "w8a16-tensor": (8, "tensor", None, True, "int-quantized", None),
    "w8a8-static": (8, "channel", None, True, "int-quantized", "static"),
    "w4a16-group32": (4, "group", 32, True, "pack-quantized", None),
    "w4a16-asym-group64": (4, "group", 64, False, "pack-quantized", None),
    "w8a16-group16": (8, "group", 16, True, "int-quantized", None),  # dequantized at load
    # FP8 (E4M3) weights: llm-compressor's FP8-dynamic, FP8 block and static FP8 schemes
    "fp8-dynamic": (8, "channel", None, True, "float-quantized", "dynamic"),
    "fp8-block": (8, "block", None, True, "float-quantized", "dynamic"),
    "fp8-static": (8, "tensor", None, True, "float-quantized", "static"),
}
FP8_BLOCK = [128, 128]


def _scheme(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    bits, strategy, group_size, symmetric, form, activations = SCHEMES[name]
    kind = "float" if form == "float-quantized" else "int"
    weights = QuantizationArgs(
        num_bits=bits,
        type=kind,
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size,
        block_structure=FP8_BLOCK if strategy == "block" else None,
    )
    inputs = None
    if activations is not None:
        dynamic = activations == "dynamic"
        strategy = ("group" if strategy == "block" else "token") if dynamic else "tensor"
        inputs = QuantizationArgs(
            num_bits=8,
            type=kind,
            symmetric=True,
            dynamic=dynamic,
            strategy=strategy,
            group_size=FP8_BLOCK[1] if strategy == "group" else None,
        )
    return QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=inputs, format=form
    )


def _compressed_layer(weight: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """The layer's stored tensors, as llm-compressor's weight observer and the format's compressor
    make them (bf16 scales, as its checkpoints store them)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    rows = weight.shape[0]
    if args.strategy == "tensor":
        grouped = weight.reshape(1, 1, -1)
    elif args.strategy == "block":
        (rows, inputs), (n, k) = args.block_structure, weight.shape
        grouped = (
            weight.reshape(n // rows, rows, k // inputs, inputs)
            .transpose(1, 2)
            .reshape(n // rows, k // inputs, -1)
        )
    else:
        grouped = (
            weight.reshape(rows, -1, args.group_size)
            if args.strategy == "group"
            else weight.reshape(rows, 1, -1)
        )
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    layer = {
        "weight": weight,
        "weight_scale": scale.to(torch.bfloat16),
        "weight_zero_point": zero_point.to(torch.int8),
    }
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    compressed = compressor.compress(layer, scheme)
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        top = 448.0 if scheme.input_activations.type == "float" else 127.0
        compressed["input_scale"] = (weight.abs().amax() / top).reshape(1).to(torch.bfloat16)
    return compressed


def compress_checkpoint(
    source: Path, model_dir: Path, scheme_name: str, ignore: tuple[str, ...] = ("lm_head",)
) -> Path:
    """A copy of the float checkpoint `source` with every linear layer (the *_proj ones and the
    LM head) but `ignore`d ones quantized by `scheme_name` (SCHEMES), as llm-compressor saves one."""
    from compressed_tensors.quantization import QuantizationConfig

    shutil.copytree(
        source, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json")
    )
    scheme = _scheme(scheme_name)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            quantized = name.endswith("proj.weight") or name == "lm_head.weight"
            if quantized and name.removesuffix(".weight") not in ignore:
                prefix = name.removesuffix("weight")
                layer = _compressed_layer(tensor.float(), scheme)
                tensors.update({prefix + key: value.contiguous() for key, value in layer.items()})
            else:
                tensors[name] = tensor
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    quant_config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=list(ignore),
        format=scheme.format,
        quantization_status="compressed",
    )
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        **quant_config.model_dump(mode="json"),
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def write_compressed_llama(
    out_dir: Path, scheme_name: str, seed: int = 0, ignore: tuple[str, ...] = ("lm_head",), **shape
) -> Path:
    """out_dir/model: the quantized checkpoint (config.json with its quantization_config);
    out_dir/hf: the float one it was made from."""
    hf_dir = write_random_llama(out_dir / "hf", seed=seed, **{**DEFAULT_SHAPE, **shape})
    return compress_checkpoint(hf_dir, out_dir / "model", scheme_name, ignore)


def quantized_layers(model_dir: Path) -> set[str]:
    """The checkpoint's layers that hold a weight_scale."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {
            name.removesuffix(".weight_scale")
            for name in f.keys()
            if name.endswith(".weight_scale")
        }


def dequantized_transformers(model_dir: Path):
    """transformers' model (float32) of the checkpoint with every quantized layer's weight as the
    compressed-tensors package decompresses it, written as a float checkpoint beside it
    (`dequantized/`, so that transformers lays the tensors out itself, fusing MoE experts): the
    oracle of what the checkpoint means. Its scales go in as float32, so that the package computes
    in float32 (with the stored bf16 it rounds each product to bf16)."""
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    float_dir = model_dir.parent / "hf"
    tensors = float_tensors(float_dir)
    tensors.update(decompressed(load_file(model_dir / "model.safetensors"), scheme))
    return transformers_with_weights(float_dir, tensors, model_dir.parent / "dequantized")


def decompressed(stored: dict[str, torch.Tensor], scheme) -> dict[str, torch.Tensor]:
    """Each quantized layer's float32 weight (name "<layer>.weight") as the package's compressor
    for the scheme's format decompresses the stored tensors, its scales as float32 (so that the
    package computes in float32; with bf16 scales it rounds each product to bf16)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    weights = {}
    for name in stored:
        if name.endswith(".weight_scale"):
            layer = name.removesuffix(".weight_scale")
            parts = {
                key.removeprefix(layer + "."): value
                for key, value in stored.items()
                if key.startswith(layer + ".")
            }
            parts["weight_scale"] = parts["weight_scale"].float()
            weights[f"{layer}.weight"] = (
                compressor.decompress(parts, scheme)["weight"].float().contiguous()
            )
    return weights


def float_tensors(float_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(float_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def transformers_with_weights(float_dir: Path, tensors: dict[str, torch.Tensor], out_dir: Path):
    """transformers' model (float32) of the checkpoint float_dir with `tensors` as its weights,
    written as a float checkpoint in out_dir (so that transformers lays the tensors out itself,
    fusing MoE experts)."""
    from transformers import AutoModelForCausalLM

    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(
        float_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json")
    )
    save_file(
        {name: t.contiguous() for name, t in tensors.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    return AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
