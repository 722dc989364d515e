"""models/cpu_decode.py: a CPU step of decodes runs its decoder layers in one C++ call. It calls
the modules' kernels in the same order on the same inputs, so tokens and logprobs must be
bit-identical to the modules' path, with mixed steps (prompt chunks beside decodes, which take
the modules) in between."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import quant
from nanoserve.kernels.cpu import ops as cpu_ops
from nanoserve.kernels.quant import QuantWeight
from nanoserve.layers.linear_weight import QuantizedWeight
from nanoserve.models.cpu_decode import FusedDecode
from tests.conftest import write_random_llama
from tests.kernels.test_quant import random_blocks

pytestmark = pytest.mark.skipif(
    not cpu_ops.gemm_available(),
    reason="the fused decode path needs the CPU kernels (no compiler here)",
)

# head_dim 64 (the AMX attention kernel on AMX) and 32 (ops.cpp's), GQA and MHA; at every ISA level
# this machine runs (the cpu_isa fixture).
SHAPES = {
    "gqa-d64": dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "mha-d32": dict(hidden_size=128, num_heads=4, num_kv_heads=4, intermediate_size=256),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory):
    return write_random_llama(
        tmp_path_factory.mktemp(request.param), seed=5, num_layers=3, **SHAPES[request.param]
    )


def generate(llm: LLM, fused: bool):
    runner = llm.llm_engine.runner
    kept = runner.fused_decode
    calls = []
    if fused:
        run = kept.run

        def counted(*args):
            hidden = run(*args)
            calls.append(hidden is not None)
            return hidden

        runner.fused_decode = FusedDecode.__new__(FusedDecode)
        runner.fused_decode.__dict__.update(kept.__dict__)
        runner.fused_decode.run = counted
    else:
        runner.fused_decode = None
    try:
        rng = random.Random(3)
        vocab = llm.llm_engine.model_config.vocab_size
        # Different lengths and budgets: prompts arrive while others decode (mixed steps), and a
        # chunked prompt's chunks share steps with decodes.
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}
            for n in (5, 40, 90, 17, 130)
        ]
        params = [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
            for m in (30, 12, 20, 25, 8)
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.fused_decode = kept
    result = [
        (
            o.outputs[0].token_ids,
            [[(t, lp.logprob) for t, lp in sorted(step.items())] for step in o.outputs[0].logprobs],
        )
        for o in outputs
    ]
    return result, calls


def assert_fused_gives_the_modules_bits(model) -> None:
    """The model served with the fused decode steps and without: the same tokens and logprobs,
    the fused path having run in enough steps (and not in those with prompt rows)."""
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_num_batched_tokens=64,
        num_kv_blocks=128,
        device="cpu",
    )
    assert llm.llm_engine.runner.fused_decode is not None
    fused, calls = generate(llm, fused=True)
    modules, _ = generate(llm, fused=False)
    assert sum(calls) >= 10, "the fused path ran in too few steps to be tested"
    assert not all(calls), "no step with prompt rows took the modules' path"
    for index, (a, b) in enumerate(zip(fused, modules)):
        assert a[0] == b[0], f"request {index}: tokens differ"
        assert a[1] == b[1], f"request {index}: logprobs differ"


def test_fused_decode_gives_the_modules_bits(model_dir, cpu_isa):
    assert_fused_gives_the_modules_bits(model_dir)


def test_fused_decode_not_built_where_it_does_not_apply(tmp_path, monkeypatch):
    model_dir = write_random_llama(tmp_path / "m", seed=1)
    assert (
        LLM(model=str(model_dir), dtype="float32", device="cpu").llm_engine.runner.fused_decode
        is None
    )
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "onednn")  # oneDNN GEMMs: no packed weights
    assert (
        LLM(model=str(model_dir), dtype="bfloat16", device="cpu").llm_engine.runner.fused_decode
        is None
    )


# ---- linear layers in GGUF blocks (kernels/quant.py, kernels/cpu/gemm_quant.cpp) -------------


def _quant_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    weight = QuantWeight(qtype, n, k, random_blocks(qtype, n, k, seed=seed))
    quant.pack_for_cpu(weight)
    assert weight.packed is not None
    return weight


def _quantize_layers(model) -> None:
    """Every linear layer of every decoder layer in GGUF blocks: a Q4_K_M-like mix where the
    shapes take 256-element blocks (QKV in three parts, Q4_K q and k beside a Q6_K v), the 32-element
    formats elsewhere."""
    seed = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hidden, inter = attn.qkv_proj.weight.shape[1], mlp.down_proj.weight.shape[1]
        k_quants = hidden % 256 == 0 and inter % 256 == 0
        seed += 1
        if k_quants:
            attn.qkv_proj.weight_form = QuantizedWeight(
                [
                    _quant_weight(qtype, n, hidden, seed + i)
                    for i, (qtype, n) in enumerate(
                        [("q4_k", attn.q_size), ("q4_k", attn.kv_size), ("q6_k", attn.kv_size)]
                    )
                ]
            )
        else:
            attn.qkv_proj.weight_form = QuantizedWeight(
                [_quant_weight("q4_0", attn.q_size + 2 * attn.kv_size, hidden, seed)]
            )
        attn.o_proj.weight_form = QuantizedWeight(
            [_quant_weight("q8_0", hidden, attn.q_size, seed + 3)]
        )
        mlp.gate_up_proj.weight_form = QuantizedWeight(
            [_quant_weight("q4_1", 2 * inter, hidden, seed + 4)]
        )
        mlp.down_proj.weight_form = QuantizedWeight(
            [_quant_weight("q6_k" if k_quants else "q8_0", hidden, inter, seed + 5)]
        )


def _linear_by_calls(linear, x):
    parts = linear.weight_form.parts
    return torch.cat([quant.quant_gemm(x, part, None) for part in parts], dim=-1)


def _layers_by_calls(model, input_ids, positions, metadata):
    """The step's final-normed hidden states through the per-layer kernel calls in the modules'
    order (models/llama.py's CPU path), the linear layers through quant.quant_gemm."""
    hidden, residual = model.model.embed_tokens(input_ids), None
    rows = hidden.shape[0]
    for layer in model.model.layers:
        attn, mlp, eps = layer.self_attn, layer.mlp, layer.input_layernorm.eps
        if residual is None:
            residual, hidden = (
                hidden,
                cpu_ops.rms_norm(hidden, None, layer.input_layernorm.weight, eps)[0],
            )
        else:
            hidden, residual = cpu_ops.rms_norm(hidden, residual, layer.input_layernorm.weight, eps)
        qkv = _linear_by_calls(attn.qkv_proj, hidden)
        cache = attn.attn
        assert cpu_ops.rotary_store(
            qkv,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            positions,
            model.cos_sin_cache,
            cache.key_cache,
            cache.value_cache,
            metadata.slot_mapping,
        )
        query = qkv[:, : attn.q_size].view(rows, attn.num_heads, attn.head_dim)
        out = cpu_ops.paged_attention(
            query,
            cache.key_cache,
            cache.value_cache,
            metadata.block_table,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            cache.scale,
        )
        o = _linear_by_calls(attn.o_proj, out.reshape(rows, attn.q_size))
        hidden, residual = cpu_ops.rms_norm(o, residual, layer.post_attention_layernorm.weight, eps)
        hidden = _linear_by_calls(
            mlp.down_proj, cpu_ops.silu_and_mul(_linear_by_calls(mlp.gate_up_proj, hidden))
        )
    return model.model.norm(hidden, residual)[0]


def test_fused_decode_on_quantized_layers_gives_the_calls_bits(model_dir, cpu_isa):
    """Each fused step (real engine metadata, batches of 1 to 5 decodes) against the same step
    through the per-layer calls from the same KV-cache state: hidden states and the cache writes
    bit for bit."""
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_num_batched_tokens=64,
        num_kv_blocks=128,
        device="cpu",
    )
    runner = llm.llm_engine.runner
    model = runner.model
    _quantize_layers(model)
    fused = FusedDecode.build(model, 1)
    assert fused is not None
    caches = [layer.self_attn.attn for layer in model.model.layers]
    checked = []

    def run(input_ids, positions, metadata):
        before = [(c.key_cache.clone(), c.value_cache.clone()) for c in caches]
        hidden = FusedDecode.run(fused, input_ids, positions, metadata)
        if hidden is None:
            return None
        after = [(c.key_cache.clone(), c.value_cache.clone()) for c in caches]
        for c, (key, value) in zip(caches, before):
            c.key_cache.copy_(key)
            c.value_cache.copy_(value)
        expected = _layers_by_calls(model, input_ids, positions, metadata)
        same_cache = all(
            torch.equal(c.key_cache, k) and torch.equal(c.value_cache, v)
            for c, (k, v) in zip(caches, after)
        )
        checked.append((input_ids.shape[0], torch.equal(hidden, expected) and same_cache))
        return hidden

    fused.run = run
    runner.fused_decode = fused
    rng = random.Random(4)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]}
        for n in (5, 40, 17, 70, 9)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 6, 10, 8, 4)
    ]
    llm.generate(prompts, params, use_tqdm=False)
    assert len(checked) >= 8 and max(rows for rows, _ in checked) >= 3, checked
    assert all(ok for _, ok in checked), checked


@pytest.mark.parametrize("preset", ["q4_1", "q4_k_m", "llama_cpp_q4_k_m", "llama_cpp_q5_k_m"])
def test_fused_decode_on_a_gguf_file_gives_the_modules_bits(preset, tmp_path, cpu_isa):
    """A GGUF model served as it is (its layers' QuantizedWeight forms): the fused steps
    and the modules' path give the same tokens and logprobs. The llama.cpp mixes on their own
    shape (hidden 384: Q5_0 / Q5_1 beside Q4_K / Q5_K, Q6_K and Q8_0)."""
    gguf_models = pytest.importorskip(
        "tests.gguf_models", reason="GGUF serving (models/gguf/weights.py) not here"
    )
    shape = (
        {}
        if preset in gguf_models.LLAMA_CPP_MIXES
        else dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
    )
    assert_fused_gives_the_modules_bits(
        gguf_models.write_quantized_gguf(tmp_path, preset, seed=3, **shape)
    )


def test_fused_decode_on_a_compressed_tensors_checkpoint_gives_the_modules_bits(tmp_path, cpu_isa):
    """A compressed-tensors checkpoint (int4 with zero points: the Q4_1 kernel format, from
    models/compressed_tensors.py): the fused steps and the modules' path give the same tokens and
    logprobs."""
    ct_models = pytest.importorskip("tests.compressed_tensors_models")
    pytest.importorskip("compressed_tensors")
    assert_fused_gives_the_modules_bits(
        ct_models.write_compressed_llama(tmp_path, "w4a16-asym-group64", seed=3)
    )


@pytest.mark.parametrize("scheme", ["gptq-4bit-g128", "awq-4bit-g64", "gptq-4bit-actorder"])
def test_fused_decode_on_a_gptq_or_awq_checkpoint_gives_the_modules_bits(scheme, tmp_path, cpu_isa):
    """GPTQ (symmetric: the Q4_0 kernel format; with activation order, Q4_1 with its inputs
    gathered in the layer's order) and AWQ (zero points: Q4_1) checkpoints, models/gptq_awq.py:
    the fused steps and the modules' path give the same tokens and logprobs."""
    from tests.gptq_awq_models import write_quantized_llama

    assert_fused_gives_the_modules_bits(write_quantized_llama(tmp_path, scheme, seed=3))


@pytest.mark.parametrize("scheme", ["fp8-block128", "fp8-tensor-static"])
def test_fused_decode_on_an_fp8_checkpoint_gives_the_modules_bits(scheme, tmp_path, cpu_isa):
    """FP8 weights (models/fp8.py, kernels/cpu/gemm_fp8.cpp through decode_layers.cpp's linear
    entries): the fused steps and the modules' path give the same tokens and logprobs."""
    from tests.fp8_models import write_fp8_llama

    assert_fused_gives_the_modules_bits(write_fp8_llama(tmp_path, scheme, seed=3))


# ---- Qwen3's per-head Q/K norms and Qwen3-MoE's experts (kernels/cpu/moe.cpp) ----------------


def test_fused_decode_on_qwen3_gives_the_modules_bits(tmp_path, cpu_isa):
    """Dense Qwen3 (q_norm / k_norm over each head, in place before rotary), bf16."""
    from tests.models.family_checkpoints import write_random_checkpoint

    assert_fused_gives_the_modules_bits(
        write_random_checkpoint(tmp_path / "qwen3", "qwen3", seed=2)
    )


@pytest.mark.parametrize("weights", ["bf16", "gguf-q4_k", "gguf-q8_0"])
def test_fused_decode_on_qwen3_moe_gives_the_modules_bits(weights, tmp_path, cpu_isa):
    """Qwen3-MoE, 16 experts (the router's columns whole tiles of 16), top-8, 2 layers: the
    router, softmax + top-k and the experts (bf16 packings, or a GGUF file's blocks kept as they
    are) in the fused step and through layers/fused_moe.py give the same tokens and logprobs."""
    from tests.models.moe_checkpoints import write_moe_checkpoint

    if weights == "bf16":
        model = write_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=4, num_experts=16)
    else:
        gguf_models = pytest.importorskip("tests.gguf_models", reason="GGUF serving not here")
        qtype = weights.split("-")[1]
        # Q4_K needs whole super-blocks of 256 inputs: experts of intermediate 256 (down's inputs).
        model = gguf_models.write_moe_gguf(
            tmp_path,
            "qwen3_moe",
            qtype,
            "q8_0",
            seed=4,
            num_experts=16,
            expert_inter=256 if qtype == "q4_k" else None,
        )
    assert_fused_gives_the_modules_bits(model)
