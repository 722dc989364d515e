"""Small GPTQ and AWQ checkpoints for the tests: a random Llama written by transformers' own
classes (tests/conftest.write_random_llama), its *_proj layers quantized round-to-nearest per
group (GPTQ's quantizer, min/max per group, without the Hessian step, which only chooses which
integers; the format does not change) and stored as AutoGPTQ (v1 "gptq" checkpoint format:
zero points minus one) or AutoAWQ (GEMM: packed along the outputs in the order 0 2 4 6 1 3 5 7)
save them: `qweight`, `qzeros`, `scales` float16, GPTQ's `g_idx`; config.json's
quantization_config as those tools write it. The float checkpoint stays beside it in `hf/`, and
`meaning.safetensors` beside the checkpoint holds what each layer means (float32 [n, k], scale * (q - z) from the integers before
packing). The oracle of our reading of the bytes: for AWQ, compressed-tensors' own converter of
AutoAWQ checkpoints (`awq_as_compressed_tensors`); for GPTQ, words packed by hand in
tests/models/test_gptq_awq.py and these integers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import write_random_llama

DEFAULT_SHAPE = dict(
    hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# name -> (method, bits, group size, symmetric, act order)
SCHEMES = {
    "gptq-4bit-g128": ("gptq", 4, 128, True, False),
    "gptq-4bit-asym-g64": ("gptq", 4, 64, False, False),
    "gptq-8bit-g128": ("gptq", 8, 128, True, False),
    "gptq-4bit-channel": ("gptq", 4, -1, True, False),
    "gptq-4bit-actorder": ("gptq", 4, 64, False, True),  # inputs sorted by group at load
    "gptq-8bit-asym-g64": (
        "gptq",
        8,
        64,
        False,
        False,
    ),  # dequantized at load (no int8 kernel with zero points)
    "awq-4bit-g128": ("awq", 4, 128, False, False),
    "awq-4bit-g64": ("awq", 4, 64, False, False),
}


def quantize_rtn(weight: torch.Tensor, bits: int, group: int, symmetric: bool, g_idx: torch.Tensor):
    """GPTQ's quantizer on each group of inputs (g_idx[i]: input i's group): float16 scales
    [groups, n], zero points and integers (unsigned, [groups, n] and [n, k])."""
    n, k = weight.shape
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        columns = weight[:, g_idx == g]
        low = columns.amin(1).clamp(max=0)
        high = columns.amax(1).clamp(min=0)
        if symmetric:
            high = torch.maximum(low.abs(), high)
            low = -high
        scale = ((high - low) / maxq).clamp(min=1e-8).half().float()
        scales[g] = scale
        zeros[g] = (
            (1 << (bits - 1)) if symmetric else torch.round(-low / scale).clamp(0, maxq).long()
        )
    q = torch.round(weight / scales[g_idx].t()) + zeros[g_idx].t()
    return scales.half(), zeros, q.clamp(0, maxq).long()


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [rows, m] -> int32 words [rows, ceil(m * bits / 32)], value j of a word at bit
    bits * j (a last word's missing values zero, as GPTQModel pads the zero points of a layer whose
    outputs don't fill whole words)."""
    per_word = 32 // bits
    rows, m = values.shape
    if m % per_word:
        values = np.concatenate(
            [values, np.zeros((rows, per_word - m % per_word), dtype=values.dtype)], axis=1
        )
        m = values.shape[1]
    values = values.astype(np.uint32).reshape(rows, m // per_word, per_word)
    words = np.zeros((rows, m // per_word), dtype=np.uint32)
    for j in range(per_word):
        words |= (values[:, :, j] & ((1 << bits) - 1)) << np.uint32(bits * j)
    return words.view(np.int32)


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's layout: qweight [k * bits / 32, n] (along the inputs), qzeros [groups, n * bits / 32]
    (along the outputs) holding each zero point minus one (the v1 checkpoint format)."""
    qweight = _words(q.numpy(), bits).T  # [n, k / per word] -> [k / per word, n]
    qzeros = _words((zeros.numpy() - 1) & ((1 << bits) - 1), bits)
    return torch.from_numpy(np.ascontiguousarray(qweight)), torch.from_numpy(qzeros)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [k, n / 8] and qzeros [groups, n / 8], eight outputs a word
    in the order 0 2 4 6 1 3 5 7."""

    def interleave(values: np.ndarray) -> np.ndarray:
        rows, n = values.shape
        return values.reshape(rows, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, n)

    qweight = _words(interleave(q.t().contiguous().numpy()), 4)
    qzeros = _words(interleave(zeros.numpy()), 4)
    return torch.from_numpy(qweight), torch.from_numpy(qzeros)


def _quant_config(scheme_name: str) -> dict:
    method, bits, group, symmetric, act_order = SCHEMES[scheme_name]
    if method == "gptq":  # as optimum / GPTQModel write it
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": act_order,
            "sym": symmetric,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "checkpoint_format": "gptq",
            "lm_head": False,
        }
    return {
        "quant_method": "awq",
        "bits": bits,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def quantize_checkpoint(
    source: Path, model_dir: Path, scheme_name: str, seed: int = 0, lm_head: bool = False
) -> Path:
    """A copy of the float checkpoint `source` with every *_proj layer quantized by `scheme_name`
    (SCHEMES), and the LM head too with `lm_head` (GPTQModel's lm_head option), saved as its tool
    saves it; meaning.safetensors beside model_dir: each layer's meaning."""
    method, bits, group, symmetric, act_order = SCHEMES[scheme_name]
    shutil.copytree(
        source, model_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json")
    )
    generator = torch.Generator().manual_seed(seed)
    tensors, meaning, orders = {}, {}, {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not (name.endswith("proj.weight") or lm_head and name == "lm_head.weight"):
                tensors[name] = tensor
                continue
            weight = tensor.float()
            n, k = weight.shape
            size = k if group == -1 else group
            g_idx = torch.arange(k) // size
            if act_order:  # GPTQ's desc_act: groups made in a permuted order of the inputs, one
                # order per input (the Hessian's diagonal): q/k/v share theirs, gate/up too
                key = (
                    name.replace("k_proj", "q_proj")
                    .replace("v_proj", "q_proj")
                    .replace("up_proj", "gate_proj")
                )
                if key not in orders:
                    orders[key] = torch.argsort(torch.randperm(k, generator=generator))
                g_idx = g_idx[orders[key]]
            scales, zeros, q = quantize_rtn(weight, bits, size, symmetric, g_idx)
            prefix = name.removesuffix("weight")
            meaning[prefix + "weight"] = (
                scales.float()[g_idx].t() * (q - zeros[g_idx].t()).float()
            ).contiguous()
            if method == "gptq":
                qweight, qzeros = pack_gptq(q, zeros, bits)
                tensors[prefix + "g_idx"] = g_idx.to(torch.int32)
            else:
                qweight, qzeros = pack_awq(q, zeros)
            tensors.update(
                {prefix + "qweight": qweight, prefix + "qzeros": qzeros, prefix + "scales": scales}
            )
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(meaning, model_dir.parent / "meaning.safetensors")  # not in the checkpoint
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _quant_config(scheme_name) | (
        {"lm_head": True} if lm_head else {}
    )
    config["torch_dtype"] = "float16"
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def write_quantized_llama(
    out_dir: Path, scheme_name: str, seed: int = 0, lm_head: bool = False, **shape
) -> Path:
    """out_dir/model: the GPTQ / AWQ checkpoint; out_dir/hf: the float one it was made from."""
    hf_dir = write_random_llama(out_dir / "hf", seed=seed, **{**DEFAULT_SHAPE, **shape})
    return quantize_checkpoint(hf_dir, out_dir / "model", scheme_name, seed=seed, lm_head=lm_head)


def awq_as_compressed_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Each AWQ layer's float32 weight as compressed-tensors reads the checkpoint: its AutoAWQ
    converter (compressed_tensors.entrypoints.convert) to pack-quantized tensors, then the
    package's decompressor (scales as float32, so it computes in float32)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    from tests.compressed_tensors_models import decompressed

    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    converter = AutoAWQConverter.from_autoawq_config(config)
    converted = converter.process(dict(load_file(model_dir / "model.safetensors")))
    return decompressed(converted, converter._build_quant_config().config_groups["config_group_0"])


def dequantized_transformers(model_dir: Path):
    """transformers' model (float32) of the float checkpoint with each quantized layer's weight
    replaced by its meaning (written beside it as `dequantized/`)."""
    from tests.compressed_tensors_models import float_tensors, transformers_with_weights

    float_dir = model_dir.parent / "hf"
    tensors = float_tensors(float_dir) | load_file(model_dir.parent / "meaning.safetensors")
    return transformers_with_weights(float_dir, tensors, model_dir.parent / "dequantized")
