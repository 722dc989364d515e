"""Small FP8 checkpoints for the tests: a random Llama written by transformers' own classes
(tests/conftest.write_random_llama), its *_proj layers rounded to FP8 E4M3 by torch's own
conversion (round to nearest even) after dividing by a scale (amax / 448 per tensor or per
128 x 128 block), stored as `quant_method: "fp8"` checkpoints are (vLLM's Fp8Config, transformers'
FineGrainedFP8: `weight` float8_e4m3fn with `weight_scale_inv` per block, or AutoFP8's
`weight_scale` per tensor and, with a static activation scheme, `input_scale`). The float
checkpoint stays beside it in `hf/`; `meaning.safetensors` beside the checkpoint holds what each
layer means (float32: torch's FP8 -> float32 times the scale). compressed-tensors' FP8
(`float-quantized`) checkpoints are written by the package's own compressor
(tests/compressed_tensors_models.py, the fp8-* schemes)."""

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
FP8_MAX = 448.0
# name -> (weight_block_size or None (per tensor), activation_scheme, scale dtype)
SCHEMES = {
    "fp8-block128": ((128, 128), "dynamic", torch.float32),  # DeepSeek / Qwen3-FP8
    "fp8-block128-bf16": ((128, 128), "dynamic", torch.bfloat16),
    "fp8-block64x32": ((64, 32), "dynamic", torch.float32),
    "fp8-tensor-static": (None, "static", torch.float32),  # AutoFP8
}


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None, scale_dtype: torch.dtype):
    """(float8_e4m3fn [n, k], the scale as stored, the meaning float32 [n, k])."""
    n, k = weight.shape
    if block is None:
        scale = (weight.abs().amax() / FP8_MAX).reshape(())
    else:
        rows, inputs = block
        blocks = torch.zeros(-(-n // rows), -(-k // inputs))
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = (
                    weight[i * rows : (i + 1) * rows, j * inputs : (j + 1) * inputs].abs().amax()
                    / FP8_MAX
                )
        scale = blocks
    scale = scale.clamp(min=1e-12).to(scale_dtype)
    full = (
        scale.float().expand(n, k)
        if block is None
        else scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    )
    q = (weight / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def quantize_checkpoint(source: Path, model_dir: Path, scheme_name: str) -> Path:
    """A copy of the float checkpoint `source` with every *_proj layer in FP8 by `scheme_name`."""
    block, activations, scale_dtype = SCHEMES[scheme_name]
    shutil.copytree(
        source, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json")
    )
    tensors, meaning = {}, {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not name.endswith("proj.weight"):
                tensors[name] = tensor
                continue
            q, scale, meant = quantize_fp8(tensor.float(), block, scale_dtype)
            prefix = name.removesuffix("weight")
            tensors[name] = q
            tensors[prefix + ("weight_scale_inv" if block is not None else "weight_scale")] = scale
            if activations == "static":
                tensors[prefix + "input_scale"] = torch.tensor(0.01, dtype=torch.float32)
            meaning[name] = meant.contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(meaning, model_dir.parent / "meaning.safetensors")  # not in the checkpoint
    config = json.loads((model_dir / "config.json").read_text())
    quant_config = {"quant_method": "fp8", "activation_scheme": activations, "fmt": "e4m3"}
    if block is not None:
        quant_config["weight_block_size"] = list(block)
    config["quantization_config"] = quant_config
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def write_fp8_llama(out_dir: Path, scheme_name: str, seed: int = 0, **shape) -> Path:
    """out_dir/model: the FP8 checkpoint; out_dir/hf: the float one it was made from."""
    hf_dir = write_random_llama(out_dir / "hf", seed=seed, **{**DEFAULT_SHAPE, **shape})
    return quantize_checkpoint(hf_dir, out_dir / "model", scheme_name)


def dequantized_transformers(model_dir: Path):
    """transformers' model (float32) of the float checkpoint with each FP8 layer's weight replaced
    by its meaning (written beside it as `dequantized/`)."""
    from tests.compressed_tensors_models import float_tensors, transformers_with_weights

    float_dir = model_dir.parent / "hf"
    tensors = float_tensors(float_dir) | load_file(model_dir.parent / "meaning.safetensors")
    return transformers_with_weights(float_dir, tensors, model_dir.parent / "dequantized")
