"""Quantized checkpoints held as CUDA holds them (kernels/quant.place: GGUF bytes, GPTQ / AWQ /
compressed-tensors integers and FP8 bytes in kernels/quant_blocks.py's form, the GGUF embedding's
blocks), exercised on a CPU: NANOSERVE_KERNELS=triton makes the loaders choose the Triton forms for
CPU tensors and the GEMMs run in Triton's interpreter. Each quantized layer multiplies as its
checkpoint means it (the GEMV for decode rows, the tiled GEMM for prompt rows), no layer is
dequantized at load, and the weights take the file's bytes within 5%: measured as the bytes the
layers hold here and, on a CUDA machine, as torch.cuda.memory_allocated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nanoserve.kernels import quant, reset_kernel_choice
from nanoserve.layers.linear import LinearBase
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.header import read_gguf_header
from nanoserve.models.registry import build_model, model_weight_bytes

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"  # where the layers' kernels run (the interpreter on a CPU)
if (
    not ON_CUDA
):  # before Triton is first imported (transformers imports it; tests/kernels/conftest.py)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("transformers", reason="the checkpoints are written with transformers")
# our fused layer -> the checkpoint layers stacked in it, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# The non-GGUF checkpoints' shape: small (the interpreter is slow), whole groups of 128.
SMALL = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=2)


def write_source(source: str, tmp_path: Path, dtype: str = "float32") -> tuple[Path, Path]:
    """(the path to load, the file holding its tensors) of a small checkpoint of `source`."""
    kind, _, scheme = source.partition(":")
    if kind == "gguf":
        untied = scheme.endswith("-untied")
        preset = scheme.removesuffix("-untied")
        from tests.gguf_models import write_quantized_gguf

        path = write_quantized_gguf(tmp_path, preset, seed=1, tie=not untied, dtype=dtype)
        return path.parent, path
    if kind in ("gptq", "awq"):
        from tests.gptq_awq_models import write_quantized_llama as write
    elif kind == "fp8":
        from tests.fp8_models import write_fp8_llama as write
    elif kind == "ct":
        from tests.compressed_tensors_models import write_compressed_llama as write
    else:
        from tests.conftest import write_random_llama

        path = write_random_llama(tmp_path / "model", **SMALL)
        return path, path / "model.safetensors"
    path = write(tmp_path, scheme, dtype=dtype, **SMALL)
    return path, path / "model.safetensors"


def meaning(source: str, path: Path, file: Path) -> dict[str, torch.Tensor]:
    """Each layer's float32 weight as the checkpoint means it, by name in Hugging Face's layout."""
    kind = source.split(":")[0]
    if kind == "gguf":
        from tests.gguf_models import dequantized_transformers

        return dequantized_transformers(file).state_dict()
    if kind == "online":  # rounded as vLLM's online FP8 means: a scale per row, amax / 448
        from safetensors.torch import load_file

        weights = {}
        for name, weight in load_file(file).items():
            if name.endswith("_proj.weight"):
                scale = weight.float().abs().amax(dim=1, keepdim=True) / 448.0
                e4m3 = (weight.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                weights[name] = e4m3.float() * scale
        return weights
    module = {
        "gptq": "tests.gptq_awq_models",
        "awq": "tests.gptq_awq_models",
        "fp8": "tests.fp8_models",
        "ct": "tests.compressed_tensors_models",
    }[kind]
    return __import__(module, fromlist=["x"]).dequantized_transformers(path).state_dict()


def held_for_triton(monkeypatch):
    monkeypatch.setenv("NANOSERVE_KERNELS", "triton")
    reset_kernel_choice()
    yield
    monkeypatch.delenv("NANOSERVE_KERNELS")
    reset_kernel_choice()


@pytest.fixture
def triton_forms(monkeypatch):
    yield from held_for_triton(monkeypatch)


def build(path: Path, dtype: torch.dtype, device: str, quantization: str | None = None):
    config = ModelConfig.from_dir(path)
    return build_model(config, dtype, torch.device(device), path, quantization=quantization)


def expected_weight(name: str, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    prefix, _, layer = name.rpartition(".")
    parts = FUSED.get(layer, (layer,))
    return torch.cat([weights[f"{prefix}.{part}.weight"] for part in parts])


LAYER_SOURCES = [
    "gguf:llama_cpp_q4_k_m",  # Q4_K, Q6_K, Q5_0, Q8_0: a fused QKV of two types; tied Q8_0 head
    "gptq:gptq-4bit-actorder",  # zero points; the inputs gathered in group order
    "awq:awq-4bit-g128",
    "ct:w4a16-group32",
    "fp8:fp8-block128",
    "online:fp8",  # --quantization fp8 of a float checkpoint
]


@pytest.mark.parametrize("source", LAYER_SOURCES)
def test_layers_held_for_triton_multiply_as_their_checkpoint_means(tmp_path, triton_forms, source):
    path, file = write_source(source, tmp_path)
    quantization = "fp8" if source.startswith("online") else None
    model = build(path, torch.float32, DEVICE, quantization)
    weights = meaning(source, path, file)
    generator = torch.Generator().manual_seed(0)
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and not name.endswith("lm_head")
    ]
    assert len(layers) == 4 * model.config.num_hidden_layers
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    for index, (name, module) in enumerate(layers):
        form = module.weight_form
        assert form.quantized and module.weight.is_meta, f"{name}: dequantized at load"
        assert all(part.triton and part.packed is None for part in form.parts), name
        if not name.startswith(last):  # (the interpreter is slow: one decoder layer multiplies)
            continue
        weight = expected_weight(name, weights).to(DEVICE)
        # decode rows (the GEMV) on every layer, prompt rows (the tiled GEMM) on every other one
        for m in (2, 5) if index % 2 == 0 else (2,):
            x = torch.randn(m, weight.shape[1], generator=generator).to(DEVICE)
            torch.testing.assert_close(
                form.apply(x, module.weight, None), x @ weight.T, atol=2e-4, rtol=1e-4
            )
    if source.startswith("gguf"):  # the embedding's blocks on the device, rows gathered there
        rows = model.model.embed_tokens.file_rows
        assert rows is not None and rows.qtype == "q8_0"
        ids = torch.tensor([[0, 5, 77], [5, 3, 1]])
        looked_up = model.model.embed_tokens(ids.to(DEVICE)).cpu()
        torch.testing.assert_close(looked_up, weights["model.embed_tokens.weight"][ids])
        head = model.lm_head.weight_form.parts
        assert (head[0].raw is rows.data) == (not source.endswith("untied"))


def file_tensor_bytes(file: Path) -> int:
    if file.suffix == ".gguf":
        return sum(int(tensor.n_bytes) for tensor in read_gguf_header(file).tensors)
    with safe_open(str(file), "pt") as tensors:
        return sum(
            tensors.get_tensor(name).numel() * tensors.get_tensor(name).element_size()
            for name in tensors.keys()
        )


BYTES_SOURCES = [
    "gguf:llama_cpp_q4_k_m",
    "gguf:q4_k_m-untied",
    "gptq:gptq-4bit-g128",
    "gptq:gptq-4bit-actorder",
    "awq:awq-4bit-g64",
    "fp8:fp8-block128",
]


@pytest.mark.parametrize("source", BYTES_SOURCES)
def test_weights_held_for_triton_take_the_files_bytes(tmp_path, triton_forms, source):
    """The bytes the layers hold (models/registry.model_weight_bytes) against the file's tensors,
    bf16 activations (the float tensors are bf16 in the checkpoints; a GGUF file's F32 norms are
    the little difference)."""
    path, file = write_source(source, tmp_path, dtype="bfloat16")
    model = build(path, torch.bfloat16, "cpu")
    held, in_file = model_weight_bytes(model), file_tensor_bytes(file)
    assert abs(held / in_file - 1) < 0.05, (held, in_file)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("source", BYTES_SOURCES)
def test_cuda_memory_for_weights_is_the_files_bytes(tmp_path, source):
    assert os.environ.get("NANOSERVE_KERNELS", "auto") == "auto"
    path, file = write_source(source, tmp_path, dtype="bfloat16")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = build(path, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    in_file = file_tensor_bytes(file)
    assert abs(allocated / in_file - 1) < 0.05, (allocated, in_file)
    assert model_weight_bytes(model) <= allocated
    assert all(
        part.triton
        for module in model.modules()
        if isinstance(module, LinearBase) and module.weight_form.quantized
        for part in module.weight_form.parts
    )


def test_the_held_form_is_chosen_per_device(monkeypatch):
    """CUDA (here: the Triton choice) holds GGUF types, integer components and FP8 for the Triton
    kernels and refuses MXFP4 linear layers (a loader dequantizes them); the CPU holds every
    format for its C++ kernels."""
    cpu = torch.device("cpu")
    assert not quant.held_for_triton(cpu) and quant.linear_keeps_blocks(quant.MXFP4, cpu)
    for _ in held_for_triton(monkeypatch):
        assert quant.held_for_triton(cpu)
        for qtype in ("q4_k", "q6_k", "q5_0", "q8_0", "q4_0", "q4_1", quant.FP8):
            assert quant.linear_keeps_blocks(qtype, cpu), qtype
        assert not quant.linear_keeps_blocks(quant.MXFP4, cpu)
        assert not quant.looks_up_file_rows(cpu)
        parts = quant.QuantComponents(
            torch.full((16, 64), 9, dtype=torch.uint8), torch.full((16, 2), 0.5)
        )
        placed = quant.place(quant.QuantWeight("q4_0", 16, 64, None, components=parts), cpu)
        assert placed.triton and placed.components is None and placed.blocks is not None
        assert placed.nbytes == 16 * 32 + 2  # nibbles, and one fp16 scale for all
        x = torch.ones(1, 64)
        torch.testing.assert_close(quant.quant_gemm(x, placed, None), torch.full((1, 16), 32.0))
