"""compressed-tensors checkpoints (models/compressed_tensors.py) written by the package's own
compressors (tests/compressed_tensors_models.py): linear layers holding the checkpoint's integers
in the GGUF kernels' formats (their dequantized values those of the package's decompress, to the
bf16 it computes in), greedy tokens equal to the dequantize-then-reference path
(kernels/quant.reference_gemm), logprobs close to transformers running the package's dequantized
weights, tensor parallelism equal to one rank, and the one-line errors for what is not served."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import quant
from nanoserve.kernels.choice import reset_kernel_choice
from nanoserve.models.compressed_tensors import compressed_tensors_config

ct = pytest.importorskip("compressed_tensors")

from tests.compressed_tensors_models import (  # noqa: E402
    compress_checkpoint,
    dequantized_transformers,
    quantized_layers,
    write_compressed_llama,
)
from tests.gguf_models import teacher_forced  # noqa: E402
from tests.models.family_checkpoints import write_random_checkpoint  # noqa: E402
from tests.models.moe_checkpoints import write_moe_checkpoint  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of", "import torch\nx ="]
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
NEAR_TIE = 0.15  # top-2 logprob gap under which a different rounding may pick either token (as
#                   much as a logprob may move between the paths, see assert_same_greedy)
SERVED = [
    "w8a16-channel",
    "w8a8-channel",
    "w8a16-group64",
    "w8a16-tensor",
    "w4a16-group32",
    "w4a16-asym-group64",
]


@pytest.fixture(scope="module", params=SERVED)
def checkpoint(request, tmp_path_factory):
    return write_compressed_llama(tmp_path_factory.mktemp(request.param), request.param, seed=28)


def build(path, device: str = "cpu", **kwargs) -> LLM:
    return LLM(model=str(path), num_kv_blocks=64, device=device, **kwargs)


def greedy(llm: LLM) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Per prompt: the greedy tokens, their logprobs, and each step's gap between the top two."""
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    gaps = [
        [
            np.subtract(*sorted((lp.logprob for lp in step.values()), reverse=True)[:2])
            for step in o.outputs[0].logprobs
        ]
        for o in outputs
    ]
    return tokens, logprobs, gaps


def assert_same_greedy(ours, reference, typical: float, worst: float = NEAR_TIE) -> None:
    """Tokens equal, unless at a near-tie in the reference (two paths that round differently may
    part there; the rest of that prompt is then not compared, its prefixes differ); the logprobs'
    differences mostly (the median) within `typical`, all within `worst` (a few move more where
    an activation lands on the other side of an int8 rounding step). Most steps must be compared,
    or the comparison would prove nothing."""
    differences = []
    for tokens, logprobs, ref_tokens, ref_logprobs, ref_gaps in zip(*ours[:2], *reference):
        for token, logprob, ref_token, ref_logprob, gap in zip(
            tokens, logprobs, ref_tokens, ref_logprobs, ref_gaps
        ):
            if token != ref_token:
                assert gap < NEAR_TIE, (tokens, ref_tokens)
                break
            differences.append(abs(logprob - ref_logprob))
    assert len(differences) >= 0.6 * NUM_TOKENS * len(PROMPTS), len(differences)
    assert np.median(differences) <= typical and max(differences) <= worst, differences


def expected_qtype(path) -> str:
    """The kernel format a checkpoint's weights go into: int8 -> Q8_0, int4 -> Q4_0, or Q4_1
    with zero points."""
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    weights = groups["group_0"]["weights"]
    if weights["num_bits"] == 8:
        return "q8_0"
    return "q4_0" if weights["symmetric"] else "q4_1"


@torch.inference_mode()
def test_layers_hold_the_checkpoints_integers(checkpoint):
    """Each quantized layer (fused q/k/v and gate/up too) is one QuantWeight in its kernel
    format, no float copy kept, its integers once (as components, or only in the CPU packing);
    its values are the package's dequantized weights; lm_head (ignored) and the embedding stay
    float."""
    model = build(checkpoint, dtype="float32").llm_engine.runner.model
    oracle = dequantized_transformers(checkpoint)
    for index in range(2):
        ours, theirs = model.model.layers[index], oracle.model.layers[index]
        pairs = [
            (
                ours.self_attn.qkv_proj,
                [theirs.self_attn.q_proj, theirs.self_attn.k_proj, theirs.self_attn.v_proj],
            ),
            (ours.self_attn.o_proj, [theirs.self_attn.o_proj]),
            (ours.mlp.gate_up_proj, [theirs.mlp.gate_proj, theirs.mlp.up_proj]),
            (ours.mlp.down_proj, [theirs.mlp.down_proj]),
        ]
        for layer, parts in pairs:
            (weight,) = layer.weight_form.parts
            assert weight.qtype == expected_qtype(checkpoint) and weight.raw is None
            assert weight.components is None or weight.packed is None  # never held twice
            assert layer.weight.device.type == "meta"
            expected = torch.cat([part.weight for part in parts])
            assert torch.equal(quant.dequantize_weight(weight), expected)
    assert not model.lm_head.weight_form.quantized and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(
        model.lm_head.weight[: oracle.lm_head.weight.shape[0]], oracle.lm_head.weight
    )


def test_greedy_equals_the_reference_path(checkpoint, monkeypatch):
    """The engine as it runs (the CPU kernels where they take the layer) against the same engine
    with every kernel on its torch reference (quant_gemm's reference_gemm), float32 activations."""
    ours = greedy(build(checkpoint, dtype="float32"))
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    assert_same_greedy(ours, greedy(build(checkpoint, dtype="float32")), typical=1e-4)


def _blockwise_int8_inputs(model, layers: set[str]) -> None:
    """Each quantized linear layer (`layers`) of transformers' model rounds its inputs as our kernels do
    (int8 per block of 32 along each row, kernels/quant.quantize_activations) before its float
    product with the dequantized weight."""

    def round_inputs(module, args):
        x = args[0]
        q, dx, _ = quant.quantize_activations(x.reshape(-1, x.shape[-1]))
        values = (q.float().reshape(q.shape[0], -1, 32) * dx.unsqueeze(-1)).reshape(x.shape)
        return (values.to(x.dtype),)

    for name, module in model.named_modules():
        if name in layers:
            module.register_forward_pre_hook(round_inputs)
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter) and any(
            layer.startswith(name + ".") for layer in layers
        ):  # stacked experts
            module.forward = types.MethodType(_experts_with_rounded_inputs, module)


def _round(x: torch.Tensor) -> torch.Tensor:
    q, dx, _ = quant.quantize_activations(x)
    return (q.float().reshape(q.shape[0], -1, 32) * dx.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def _experts_with_rounded_inputs(self, hidden_states, top_k_index, top_k_weights):
    """transformers' stacked experts (Qwen3-MoE's: gate_up_proj [experts, 2 * inter, hidden],
    down_proj [experts, hidden, inter]), each matrix's input rounded as our kernels round it."""
    out = torch.zeros_like(hidden_states)
    for expert in range(self.gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(_round(hidden_states[token]), self.gate_up_proj[expert]).chunk(
            2, dim=-1
        )
        rows = F.linear(_round(self.act_fn(gate) * up), self.down_proj[expert])
        out.index_add_(0, token, (rows * top_k_weights[token, slot, None]).to(out.dtype))
    return out


@torch.inference_mode()
def assert_close_to_transformers(path, device: str = "cpu") -> None:
    """Our greedy tokens teacher-forced through transformers' model holding the package's
    dequantized weights, its linear layers' inputs rounded to int8 per block of 32 as our kernels
    round them: the logprobs mostly to float32 rounding (some move more where an activation lands
    on the other side of a rounding step), each token the argmax up to that. Layers that we
    dequantize at load (all of them on CUDA) take float inputs there too."""
    model = dequantized_transformers(path)
    layers = quantized_layers(path)  # MoE experts' too: they stay quantized on a CPU
    _blockwise_int8_inputs(model, set() if device == "cuda" else layers)
    llm = build(path, device, dtype="float32")
    tokens, logprobs, _ = greedy(llm)
    differences = []
    forced = teacher_forced(model, llm.get_tokenizer(), PROMPTS, tokens)
    for prompt, ours, (rows, theirs) in zip(PROMPTS, logprobs, forced):
        differences += [abs(a - b) for a, b in zip(ours, theirs)]
        assert all(row.max().item() - value < NEAR_TIE for row, value in zip(rows, theirs)), prompt
    assert max(differences) < NEAR_TIE, differences
    # Most to float32 rounding: the median. (With zero points, Q4_1's scale * u and min terms
    # cancel in float32, so its rounding noise crosses more int8 steps than the others'.)
    assert np.median(differences) < 1e-3, sorted(differences)


def test_logprobs_close_to_transformers_on_the_dequantized_weights(checkpoint):
    assert_close_to_transformers(checkpoint)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen3_moe"])
def test_other_families(family, tmp_path):
    """Qwen3 (q/k norms), Phi-3 (q, k and v in one checkpoint tensor, gate and up too: one
    compressed tensor per fused layer, split into the layer's shards as a float one is) and
    Qwen3-MoE (each expert's matrices kept in the kernel format by the fused MoE, the router float)."""
    if family == "qwen3_moe":
        hf_dir = write_moe_checkpoint(tmp_path / "hf", family, seed=6)
    else:
        hf_dir = write_random_checkpoint(tmp_path / "hf", family, seed=6)
    path = compress_checkpoint(hf_dir, tmp_path / "model", "w8a8-channel")
    model = build(path, dtype="float32").llm_engine.runner.model
    assert all(layer.self_attn.qkv_proj.weight_form.quantized for layer in model.model.layers)
    if family == "qwen3_moe":
        experts = [layer.mlp.experts for layer in model.model.layers]
        assert all(
            e.expert_weights.quantized_matrices() == {"w13", "w2"} and e.w13_weight.is_meta
            for e in experts
        )
        assert all(
            w.qtype == "q8_0"
            for e in experts
            for matrix in ("w13", "w2")
            for w in e.expert_weights.quantized(matrix)
        )
    assert_close_to_transformers(path)


def test_quantized_lm_head(tmp_path):
    """A checkpoint that quantizes lm_head too (not ignored): the head keeps its integers
    (ParallelLMHead's QuantizedWeight, as a GGUF head does)."""
    path = write_compressed_llama(tmp_path, "w8a16-channel", seed=8, ignore=())
    model = build(path, dtype="float32").llm_engine.runner.model
    assert model.lm_head.weight_form.quantized and model.lm_head.weight.device.type == "meta"
    assert_close_to_transformers(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequantizes_at_load(tmp_path):
    """On CUDA (whose Triton kernel reads GGUF bytes) every layer is dequantized into its float
    weight at load: the logprobs those of transformers on the same dequantized weights."""
    path = write_compressed_llama(tmp_path, "w4a16-asym-group64", seed=8)
    model = build(path, "cuda", dtype="float32").llm_engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not qkv.weight_form.quantized and qkv.weight.device.type == "cuda"
    assert_close_to_transformers(path, "cuda")


def test_tensor_parallel_equals_one_rank(tmp_path):
    """tp=2 (gloo): column-parallel layers take whole rows, row-parallel ones whole blocks of 32
    inputs with their scales; the tokens equal one rank's, and each rank holds about half."""
    assert_tensor_parallel_equals_one_rank(
        write_compressed_llama(tmp_path, "w4a16-asym-group64", seed=5)
    )


def assert_tensor_parallel_equals_one_rank(path) -> None:
    with build(path, dtype="float32") as llm:
        one = greedy(llm)
        (full_bytes,) = llm.llm_engine.runner.rank_weight_bytes
    with build(path, dtype="float32", tensor_parallel_size=2) as llm:
        two = greedy(llm)
        rank_bytes = list(llm.llm_engine.runner.rank_weight_bytes)
    assert_same_greedy(two, one, typical=1e-3)
    assert len(rank_bytes) == 2 and all(size < 0.75 * full_bytes for size in rank_bytes), (
        rank_bytes,
        full_bytes,
    )


def assert_moe_tensor_parallel_equals_one_rank(path, expert_inter: int) -> None:
    """tp=2, split along the experts' intermediate dimension and with --enable-expert-parallel:
    the tokens equal one rank's; an intermediate size of 32 (16 inputs a rank, not a block: the
    down matrices dequantized at load) moves the logprobs by one rank's int8 rounding."""
    with build(path, dtype="float32") as llm:
        one = greedy(llm)
    for expert_parallel in (False, True):
        with build(
            path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel
        ) as llm:
            split_down = expert_inter == 32 and not expert_parallel
            assert_same_greedy(greedy(llm), one, typical=3e-2 if split_down else 1e-3)


def test_static_activation_scales_are_accepted(tmp_path):
    """W8A8 with a static input_scale: served with the kernel's dynamic per-block scales, so the
    same tokens and logprob bits as the same weights without activation quantization (W8A16)."""
    static = write_compressed_llama(tmp_path / "static", "w8a8-static", seed=9)
    plain = write_compressed_llama(tmp_path / "plain", "w8a16-channel", seed=9)
    assert greedy(build(static, dtype="float32")) == greedy(build(plain, dtype="float32"))


def test_groups_smaller_than_a_block_are_dequantized_at_load(tmp_path):
    """Groups of 16 don't fit the kernels' blocks of 32: the layer is dequantized into its float
    weight (the package's values) and multiplied as any float layer."""
    path = write_compressed_llama(tmp_path, "w8a16-group16", seed=4)
    model = build(path, dtype="float32").llm_engine.runner.model
    oracle = dequantized_transformers(path)
    down = model.model.layers[0].mlp.down_proj
    assert not down.weight_form.quantized
    assert torch.allclose(
        down.weight, oracle.model.layers[0].mlp.down_proj.weight, rtol=1e-2, atol=0
    )


def _edit_config(path, change) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    change(config["quantization_config"])
    config_file.write_text(json.dumps(config))


BAD_CONFIGS = {
    "float4 weights": lambda q: q["config_groups"]["group_0"]["weights"].update(
        type="float", num_bits=4
    ),
    "format 'int-quantized' for FP8 weights": lambda q: q["config_groups"]["group_0"][
        "weights"
    ].update(type="float"),
    "asymmetric int8 activations": lambda q: q["config_groups"]["group_0"].update(
        input_activations={
            "num_bits": 8,
            "type": "int",
            "symmetric": False,
            "dynamic": True,
            "strategy": "token",
        }
    ),
    "float8 activations": lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
    ),
    "weight strategy 'block'": lambda q: q["config_groups"]["group_0"]["weights"].update(
        strategy="block"
    ),
    "asymmetric int8 weights": lambda q: q["config_groups"]["group_0"]["weights"].update(
        symmetric=False
    ),
    "KV cache quantization": lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
    "format 'marlin-24'": lambda q: q["config_groups"]["group_0"].update(format="marlin-24"),
}


@pytest.fixture(scope="module")
def w8a16(tmp_path_factory):
    return write_compressed_llama(tmp_path_factory.mktemp("w8a16"), "w8a16-channel", seed=2)


@pytest.mark.parametrize("what", list(BAD_CONFIGS))
def test_unsupported_schemes_are_one_line_errors(what, w8a16, tmp_path):
    import shutil

    path = shutil.copytree(w8a16, tmp_path / "model")
    _edit_config(path, BAD_CONFIGS[what])
    with pytest.raises(ValueError, match=f"compressed-tensors .*{what}.* is not supported"):
        compressed_tensors_config(path)
    if what == "float4 weights":
        assert_cli_one_line_error(path, "float4 weights")


def assert_cli_one_line_error(path, fragment: str) -> None:
    """`nanoserve generate --model path`: one line on stderr naming `fragment`, a non-zero exit."""
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "generate", "--model", str(path), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_quantization_flag(w8a16, tmp_path):
    build(w8a16, quantization="compressed-tensors")  # implied, accepted
    with pytest.raises(ValueError, match="--quantization gguf does not apply"):
        build(w8a16, quantization="gguf")
    with pytest.raises(ValueError, match="--quantization compressed-tensors does not apply"):
        build(w8a16.parent / "hf", quantization="compressed-tensors")
    import shutil

    other = shutil.copytree(w8a16, tmp_path / "bnb")
    _edit_config(other, lambda q: q.update(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        build(other)


def test_a_layers_tensors_in_different_shards(w8a16, tmp_path):
    """A sharded checkpoint (model.safetensors.index.json) whose layers have their weight in one
    file and their scales in another: each layer is made once all of its tensors have come, and
    the model is the one-file checkpoint's, bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(
        w8a16, tmp_path / "sharded", ignore=shutil.ignore_patterns("*.safetensors")
    )
    tensors = load_file(w8a16 / "model.safetensors")
    scales = {name: t for name, t in tensors.items() if name.endswith("weight_scale")}
    rest = {name: t for name, t in tensors.items() if name not in scales}
    save_file(scales, path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(rest, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {name: "model-00001-of-00002.safetensors" for name in scales}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in rest})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert greedy(build(path, dtype="float32")) == greedy(build(w8a16, dtype="float32"))


def test_a_layer_missing_a_tensor_is_an_error(w8a16, tmp_path):
    """A layer with its weight_scale but not its int8 weight: an error naming the layer and what it lacks."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(
        w8a16, tmp_path / "broken", ignore=shutil.ignore_patterns("*.safetensors")
    )
    tensors = load_file(w8a16 / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"model.layers.1.mlp.up_proj: the checkpoint lacks weight$"
    ):
        build(path)
