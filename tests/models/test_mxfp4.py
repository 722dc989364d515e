"""MXFP4 checkpoints (gpt-oss's experts as OpenAI releases them): the dequantization against
transformers' own (`convert_moe_packed_tensors`) on random blocks; a gpt-oss checkpoint whose
experts this test wrote as MXFP4 served with the tokens and logprobs transformers gives on the
dequantized weights; unpaired tensors and other bad input are one-line errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.models.gguf.model import check_quantization
from nanoserve.models.mxfp4 import dequantize_mxfp4
from tests.engine.hf_oracle import hf_greedy
from tests.helpers import random_prompts
from tests.models.moe_checkpoints import write_moe_checkpoint
from tests.models.test_families import load_hf
from tests.mxfp4_models import mxfp4_checkpoint

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def test_dequantize_matches_transformers_on_random_blocks():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 10, 128]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    assert torch.equal(ours, theirs.transpose(1, 2))
    assert torch.equal(
        dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours
    )  # bf16 holds them


def write_mxfp4_checkpoint(tmp_path):
    """A random gpt-oss checkpoint with its experts in MXFP4, and beside it the same model with
    the experts as transformers dequantizes them (the oracle's weights)."""
    float_dir = write_moe_checkpoint(tmp_path / "float", "gpt_oss")
    quant_dir, oracle_dir = tmp_path / "mxfp4", tmp_path / "dequantized"
    meaning = mxfp4_checkpoint(float_dir, quant_dir)
    shutil.copytree(float_dir, oracle_dir)
    save_file(
        load_file(float_dir / "model.safetensors") | meaning, oracle_dir / "model.safetensors"
    )
    return float_dir, quant_dir, oracle_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))


def _prompt_logprobs(llm, prompt) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs


def test_dequantized_mxfp4_gpt_oss_matches_transformers(checkpoints, monkeypatch):
    """Where no kernel takes the quantized experts, they are dequantized at load: the tokens
    and logprobs transformers gives on the dequantized experts."""
    import nanoserve.layers.fused_moe as fused_moe_layer

    float_dir, quant_dir, oracle_dir = checkpoints
    oracle = load_hf(oracle_dir)
    prompts = random_prompts(3, oracle.config.vocab_size, seed=21, min_len=4, max_len=30)
    expected = [hf_greedy(oracle, prompt, 8) for prompt in prompts]
    # The rounding to FP4 is coarse: the float model's tokens differ (else the test would not
    # tell whether the MXFP4 tensors were read at all).
    assert [hf_greedy(load_hf(float_dir), prompt, 8) for prompt in prompts] != expected
    check_quantization(None, quant_dir)
    check_quantization("mxfp4", quant_dir)
    monkeypatch.setattr(fused_moe_layer, "quantized_expert_form", lambda device, qtype: None)
    llm = LLM(model=str(quant_dir), dtype="float32", num_kv_blocks=32)
    experts = llm.llm_engine.runner.model.model.layers[0].mlp.experts
    assert not experts.expert_weights.quantized_matrices() and not experts.w13_weight.is_meta
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    got = _prompt_logprobs(llm, prompts[2])
    with torch.inference_mode():
        reference = oracle(input_ids=torch.tensor([prompts[2]])).logits[0].float().log_softmax(-1)
    for position in range(1, len(prompts[2])):
        token = prompts[2][position]
        assert abs(got[position][token].logprob - float(reference[position - 1, token])) < 1e-3


def test_mxfp4_experts_stay_quantized_on_the_cpu(checkpoints):
    """On a CPU each expert is an MXFP4 QuantWeight (4 bits a weight) holding exactly
    transformers' dequantized values; the model's logprobs are those of transformers on them but
    for the int8 rounding of the experts' activations."""
    from nanoserve.kernels.quant import dequantize_weight
    from nanoserve.models.gpt_oss import deinterleave

    _, quant_dir, oracle_dir = checkpoints
    oracle = load_hf(oracle_dir)
    llm = LLM(model=str(quant_dir), dtype="float32", num_kv_blocks=32)
    for index, layer in enumerate(llm.llm_engine.runner.model.model.layers):
        experts = layer.mlp.experts
        assert experts.w13_weight.is_meta and experts.w2_weight.is_meta  # the float copies are gone
        theirs = oracle.model.layers[index].mlp.experts
        for expert, (w13, w2) in enumerate(
            zip(experts.expert_weights.quantized("w13"), experts.expert_weights.quantized("w2"))
        ):
            assert w13.qtype == w2.qtype == "mxfp4"
            assert w13.nbytes * 8 == w13.n * w13.k * 5  # a nibble a weight, an fp32 scale per 32
            assert torch.equal(
                dequantize_weight(w13), deinterleave(theirs.gate_up_proj[expert].detach()).T
            )
            assert torch.equal(dequantize_weight(w2), theirs.down_proj[expert].detach().T)
    prompt = random_prompts(1, oracle.config.vocab_size, seed=22, min_len=30, max_len=30)[0]
    got = _prompt_logprobs(llm, prompt)
    with torch.inference_mode():
        reference = oracle(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    errors = [
        abs(got[p][prompt[p]].logprob - float(reference[p - 1, prompt[p]]))
        for p in range(1, len(prompt))
    ]
    # (0.085 and 0.026 here: this random model's large weights amplify the int8 rounding; a
    # wrong scale or row order is off by whole units.)
    assert max(errors) < 0.15 and sum(errors) / len(errors) < 0.05, errors


def test_mxfp4_bf16_tokens_do_not_depend_on_the_batch(checkpoints):
    _, quant_dir, _ = checkpoints
    llm = LLM(
        model=str(quant_dir),
        dtype="bfloat16",
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    experts = llm.llm_engine.runner.model.model.layers[0].mlp.experts
    assert experts.expert_weights.quantized_matrices() == {"w13", "w2"}
    prompts = random_prompts(4, 300, seed=12, min_len=5, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(batch):
        return [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        ]

    assert [generate([p])[0] for p in prompts] == generate(prompts)


def test_unpaired_mxfp4_tensor_is_one_line(checkpoints, tmp_path):
    _, quant_dir, _ = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(quant_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj_scales is missing") as error:
        LLM(model=str(broken), dtype="float32", num_kv_blocks=8)
    assert "\n" not in str(error.value)


def test_mxfp4_flag_on_another_checkpoint_is_refused(checkpoints):
    float_dir, quant_dir, _ = checkpoints
    with pytest.raises(ValueError, match="does not apply"):
        check_quantization("mxfp4", float_dir)
    with pytest.raises(ValueError, match="its quantization is mxfp4"):
        check_quantization("fp8", quant_dir)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8),
            torch.zeros(2, 4, dtype=torch.uint8),
            torch.float32,
        )
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 3, 16), torch.zeros(2, 3, dtype=torch.uint8), torch.float32)
