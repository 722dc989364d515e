"""Qwen3, Phi-3, Gemma 2 / 3 and Mistral (sliding window) against transformers: greedy fp32
tokens equal for prompts shorter and longer than the window, alone and batched, with chunked
prefill, and with the chat template the checkpoint ships."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.models.config import ModelConfig
from tests.engine.hf_oracle import hf_greedy
from tests.helpers import random_prompts
from tests.models.family_checkpoints import WINDOW, write_random_checkpoint

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
FAMILIES = ["qwen3", "phi3", "phi4-mini", "gemma2", "gemma3", "mistral"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return request.param, write_random_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param
    )


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def generate_ids(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers(family_dir):
    family, model_dir = family_dir
    hf_model = load_hf(model_dir)
    vocab = hf_model.config.vocab_size
    # Shorter than the window, and up to 3x longer (then the window slides during decode too).
    prompts = random_prompts(2, vocab, seed=5, min_len=5, max_len=WINDOW - 8)
    prompts += random_prompts(2, vocab, seed=6, min_len=WINDOW + 5, max_len=3 * WINDOW)
    expected = [hf_greedy(hf_model, prompt, NUM_TOKENS) for prompt in prompts]
    # max_num_batched_tokens=32: the long prompts are prefilled in chunks.
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    assert generate_ids(llm, prompts) == expected, family
    assert generate_ids(llm, prompts[3:]) == expected[3:]
    assert llm.llm_engine.max_model_len == 512  # no cap at the window any more


def test_chat_template_from_the_checkpoint(family_dir):
    from transformers import AutoTokenizer

    family, model_dir = family_dir
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ("<start_of_turn>model" in prompt) == family.startswith("gemma")
    prompt_ids = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == hf_greedy(load_hf(model_dir), prompt_ids, NUM_TOKENS)


def test_layer_types_and_windows(family_dir):
    family, model_dir = family_dir
    config = ModelConfig.from_dir(model_dir)
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    if family == "qwen3":
        assert windows == [None, None]
    elif family.startswith("gemma"):
        assert windows == [WINDOW, None, WINDOW, None]
    else:
        assert windows == [WINDOW] * config.num_hidden_layers


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dir(tmp_path)
    message = str(error.value)
    assert "\n" not in message
    assert "unsupported architecture GPTNeoXForCausalLM" in message
    for name in (
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "MistralForCausalLM",
    ):
        assert name in message


def test_window_no_shorter_than_max_model_len_is_dropped(tmp_path):
    """Such a window never leaves a key out: the layers keep Llama's fast kernels."""
    model_dir = write_random_checkpoint(tmp_path / "mistral", "mistral")

    def windows(max_model_len):
        llm = LLM(
            model=str(model_dir), dtype="float32", num_kv_blocks=16, max_model_len=max_model_len
        )
        return [
            layer.self_attn.attn.sliding_window
            for layer in llm.llm_engine.runner.model.model.layers
        ]

    assert windows(WINDOW) == [None, None]
    assert windows(WINDOW + 1) == [WINDOW, WINDOW]


def test_longrope_cache_past_the_switch_equals_transformers_long_factors():
    """Past original_max_position_embeddings the cache holds the long factors' rotation, times
    the attention factor, as transformers computes for a sequence that long."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from nanoserve.kernels.rotary import build_cos_sin_cache
    from tests.models.family_checkpoints import LONG_FACTOR, LONGROPE_SWITCH, SHORT_FACTOR

    rope = {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=LONGROPE_SWITCH,
        partial_rotary_factor=0.75,
        rope_scaling=rope,
    )
    ours = build_cos_sin_cache(
        12, 512, 10000.0, {**rope, "original_max_position_embeddings": LONGROPE_SWITCH}
    )
    positions = torch.arange(512)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    long = slice(LONGROPE_SWITCH, 512)
    torch.testing.assert_close(ours[long, :6], cos[0, long, :6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[long, 6:], sin[0, long, :6], atol=1e-4, rtol=1e-4)


# YaRN on the tiny Qwen2 (head_dim 16, max_position_embeddings 512): the two shapes config.json
# gives it, Qwen2.5's rope_scaling beside rope_theta and transformers 5's rope_parameters (gpt-oss's
# keys). With rope_scaling's, frequency 0 is kept, 1..2 partly and 3..7 fully divided by the factor;
# both scale cos/sin by ~1.14.
YARN_CONFIGS = {
    "rope_scaling": {
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    },
    "rope_parameters": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
            "rope_theta": 20000.0,
        }
    },
}


@pytest.mark.parametrize("shape", list(YARN_CONFIGS))
@torch.inference_mode()
def test_yarn_greedy_and_logprobs_match_transformers(tmp_path, shape):
    import json

    model_dir = write_random_checkpoint(tmp_path / "qwen2", "qwen2")
    unscaled_model = load_hf(model_dir)
    prompts = random_prompts(3, unscaled_model.config.vocab_size, seed=7, min_len=5, max_len=150)
    unscaled = [hf_greedy(unscaled_model, prompt, NUM_TOKENS) for prompt in prompts]
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["rope_parameters"]
    (model_dir / "config.json").write_text(json.dumps({**raw, **YARN_CONFIGS[shape]}))
    hf_model = load_hf(model_dir)
    assert hf_model.config.rope_parameters["rope_type"] == "yarn"
    expected = [hf_greedy(hf_model, prompt, NUM_TOKENS) for prompt in prompts]
    assert expected != unscaled  # the scaling shows in the tokens

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, tokens, output in zip(prompts, expected, outputs):
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens
        ours = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        rows = torch.log_softmax(hf_model(torch.tensor([prompt + tokens])).logits[0], dim=-1)[
            len(prompt) - 1 : -1
        ]
        theirs = [row[t].item() for row, t in zip(rows, tokens)]
        assert ours == pytest.approx(theirs, abs=1e-4)


GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000,
}


@pytest.mark.parametrize(
    "raw,expected",
    [
        # Gemma 3 1B as exported before layer_types: rope bases side by side, a 6-layer pattern.
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "num_hidden_layers": 7,
                "sliding_window": 512,
                "sliding_window_pattern": 6,
                "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 256,
            },
            dict(
                windows=[512] * 5 + [None, 512],
                rope_theta=1000000.0,
                rope_local_base_freq=10000.0,
                hidden_act="gelu_pytorch_tanh",
                query_pre_attn_scalar=256,
            ),
        ),
        # Gemma 2: even layers slide.
        (
            {
                "architectures": ["Gemma2ForCausalLM"],
                "num_hidden_layers": 3,
                "sliding_window": 4096,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
            dict(
                windows=[4096, None, 4096],
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            ),
        ),
        # Phi-3 128k: LongRoPE with original_max_position_embeddings outside rope_scaling.
        (
            {
                "architectures": ["Phi3ForCausalLM"],
                "num_hidden_layers": 2,
                "sliding_window": 262144,
                "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
            },
            dict(
                windows=[262144] * 2,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [2.0],
                    "original_max_position_embeddings": 4096,
                },
            ),
        ),
        # Qwen2.5 / Qwen3 long context: YaRN in rope_scaling, rope_theta beside it.
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "num_hidden_layers": 1,
                "rope_theta": 1000000.0,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            dict(
                windows=[None],
                rope_theta=1000000.0,
                rope_scaling={
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            ),
        ),
        # transformers 5 (gpt-oss's YaRN): theta and scaling in rope_parameters, whose theta wins over a
        # top-level one as in transformers.
        *[
            (
                {
                    "architectures": ["LlamaForCausalLM"],
                    "num_hidden_layers": 1,
                    **top,
                    "rope_parameters": GPT_OSS_ROPE,
                },
                dict(windows=[None], rope_theta=150000.0, rope_scaling=GPT_OSS_ROPE),
            )
            for top in ({}, {"rope_theta": 10000.0})
        ],
        # Qwen2.5: a sliding_window with use_sliding_window false is no window.
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "num_hidden_layers": 2,
                "sliding_window": 32768,
                "use_sliding_window": False,
                "max_window_layers": 1,
            },
            dict(windows=[None, None], attention_bias=True),
        ),
    ],
)
def test_config_json_without_layer_types(tmp_path, raw, expected):
    import json

    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**base, **raw}))
    config = ModelConfig.from_dir(tmp_path)
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == expected.pop(
        "windows"
    )
    for name, value in expected.items():
        assert getattr(config, name) == value, name
