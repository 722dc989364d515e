"""Sampling parameters: validation, seeds, stops, penalties and logprobs on a real (tiny) model."""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers.sampler import SamplingBatch, apply_top_k_top_p_min_p
from tests.engine.hf_oracle import load_hf
from tests.helpers import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("n", 0),
        ("logprobs", -2),
        ("prompt_logprobs", -2),
        ("stop", [""]),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_seed_is_reproducible_whatever_the_batch(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, vocab, seed=11)]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(prompts, [seeded] + [other] * 5, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == mixed
    different = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert llm.generate([prompts[0]], different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, vocab, seed=12)]
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    top1 = llm.generate(
        prompts,
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_filters_keep_expected_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    probs = logits.softmax(-1)
    batch = SamplingBatch(
        temperature=torch.ones(2),
        top_p=torch.tensor([float(probs[0, 0] + probs[0, 1]) + 1e-4, 1.0]),
        top_k=torch.tensor([0, 2]),
        min_p=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_counts=None,
        prompt_mask=None,
        logit_bias=None,
        generators=[None, None],
        default_generator=None,
        all_greedy=False,
        max_logprobs=-1,
    )
    kept = apply_top_k_top_p_min_p(logits, batch).isfinite()
    assert kept.tolist() == [[True, True, True, False, False], [False, False, False, True, True]]
    batch.top_p = batch.top_k = None
    batch.min_p = torch.tensor([0.3, 0.0])
    kept = apply_top_k_top_p_min_p(logits, batch).isfinite()
    # min_p 0.3 keeps tokens with p >= 0.3 * p_max: e^-1 = 0.37 passes, e^-2 = 0.14 does not.
    assert kept[0].tolist() == [True, True, False, False, False] and kept[1].all()


def test_stop_string_and_stop_token(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": random_prompts(1, vocab, seed=13)[0]}
    full = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    text, tokens = full.outputs[0].text, full.outputs[0].token_ids
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    by_token = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[tokens[5]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_token.token_ids == tokens[: tokens.index(tokens[5]) + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == tokens[5]
    assert full.outputs[0].finish_reason == "length"


def test_eos_and_min_tokens(llm):
    engine = llm.llm_engine
    eos = engine.tokenizer.eos_token_id
    vocab = engine.model_config.vocab_size
    prompt = {"prompt_token_ids": random_prompts(1, vocab, seed=14)[0]}
    # A logit bias makes EOS certain: the sequence stops at once unless min_tokens holds it back.
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0})
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]


def test_penalties_change_repetition(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": random_prompts(1, vocab, seed=15)[0]}
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0].token_ids
    penalized = (
        llm.generate(
            [prompt],
            SamplingParams(
                temperature=0,
                max_tokens=40,
                ignore_eos=True,
                presence_penalty=2.0,
                frequency_penalty=2.0,
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(penalized)) >= len(set(plain))
    repetition = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=5.0),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(set(repetition.token_ids)) >= len(set(plain))


def test_logprobs_match_transformers(llm, tiny_llama_dir):
    vocab = llm.llm_engine.model_config.vocab_size
    prompt_ids = random_prompts(1, vocab, seed=16)[0]
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    hf = load_hf(tiny_llama_dir)
    ids = prompt_ids + out.token_ids
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt_ids) - 1 + step]
        assert math.isclose(entry[token].logprob, float(row[token]), abs_tol=1e-4)
        assert entry[token].rank == 1
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)
    assert math.isclose(
        out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))
    )


def test_n_returns_distinct_samples(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": random_prompts(1, vocab, seed=17)[0]}
    out = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(len(o.token_ids) == 16 for o in out.outputs)


def test_whole_vocabulary_logprobs_leave_the_callers_params_alone(tiny_llama_dir):
    """logprobs=-1 means the whole vocabulary: the engine resolves it on a clone of the params."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1)
    output = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    vocab = llm.llm_engine.model_config.vocab_size
    assert params.logprobs == -1
    assert all(len(step) == vocab for step in output.outputs[0].logprobs)
    copy = params.clone()
    assert copy == params and copy is not params


def test_logit_bias_tensor_matches_entry_by_entry():
    """The batch's bias rows (two index_put_ calls) against the rule written out entry by
    entry: biases added, stop and EOS tokens -inf while min_tokens holds them back."""
    from nanoserve.engine.sampling_batch import _logit_bias
    from nanoserve.engine.step_input import SamplingInput

    vocab, eos, inf = 50, 5, float("inf")

    def seq(num_output_tokens: int = 0, **params):
        return SamplingInput(0, SamplingParams(**params), None, num_output_tokens)

    seqs = [
        seq(logit_bias={3: 1.5, 7: -2.0, 49: 100.0}),
        seq(),
        seq(1, logit_bias={3: 0.5, 4: 0.25}, stop_token_ids=[3, 9], min_tokens=2),
        seq(2, stop_token_ids=[9], min_tokens=2, ignore_eos=True),
    ]
    expected = torch.zeros(len(seqs), vocab)
    expected[0, 3], expected[0, 7], expected[0, 49] = 1.5, -2.0, 100.0
    expected[2, 4] = 0.25
    expected[2, 3] = expected[2, 9] = expected[2, eos] = -inf
    assert torch.equal(_logit_bias(seqs, vocab, {eos}), expected)
    assert _logit_bias([seqs[1], seqs[3]], vocab, {eos}) is None
