"""Speculative decoding (n-gram) in the engine against the same engine without it (the oracle):
greedy tokens and their logprobs identical, in fp32 and in bf16 at every CPU kernel level (each
verification row is computed as a decode row, so the bits agree), with stop strings, EOS,
max_tokens, n > 1, small token budgets and preemption; the KV kept for accepted tokens is the
KV a later request reuses through the prefix cache; proposals actually happen and are counted."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def repetitive_prompts(count: int, seed: int, vocab: int = 300) -> list[list[int]]:
    """Prompts that repeat a phrase: the model's continuation often repeats it too, so the
    n-gram proposer has something to propose and some of it is kept."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 12))]
        prompts.append(phrase * rng.randint(2, 5) + phrase[: rng.randint(0, len(phrase))])
    return prompts


def run(llm: LLM, prompts, params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same_tokens_and_logprobs(ours, theirs, tolerance: float) -> None:
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=tolerance) for t in a)


def pair(model_dir, **kwargs) -> tuple[LLM, LLM]:
    plain = LLM(model=str(model_dir), **kwargs)
    spec = LLM(model=str(model_dir), speculative_config=NGRAM, **kwargs)
    return plain, spec


@pytest.fixture(scope="module")
def fp32_pair(tiny_llama_dir):
    return pair(tiny_llama_dir, dtype="float32", num_kv_blocks=512)


def test_greedy_tokens_and_logprobs_are_identical(fp32_pair):
    plain, spec = fp32_pair
    prompts = repetitive_prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=3)
    for ours, theirs in zip(run(spec, prompts, params), run(plain, prompts, params)):
        assert_same_tokens_and_logprobs(ours, theirs, 1e-5)
    stats = spec.llm_engine.stats().spec_decoding
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)


def test_stops_lengths_and_n_behave_as_without_speculation(fp32_pair):
    plain, spec = fp32_pair
    prompts = repetitive_prompts(6, seed=2)
    reference = run(plain, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokenizer = plain.get_tokenizer()
    # A stop string taken from the middle of each reference output, a stop token id, EOS on.
    for prompt, ref in zip(prompts, reference):
        text = ref.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3] or "zzz"
        stop_id = ref.outputs[0].token_ids[17]
        for params in (
            SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, n=2),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=10, ignore_eos=True),
        ):
            ours, theirs = run(spec, [prompt], params)[0], run(plain, [prompt], params)[0]
            assert [
                (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in ours.outputs
            ] == [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in theirs.outputs]
    assert tokenizer is not None


def test_small_budgets_and_preemption_change_nothing(tiny_llama_dir):
    prompts = repetitive_prompts(10, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512)
    expected = [o.outputs[0].token_ids for o in run(plain, prompts, params)]
    # 20 tokens a step cut proposals short; 24 blocks of 16 force preemptions by recompute.
    for kwargs in ({"max_num_batched_tokens": 20}, {"num_kv_blocks": 24}):
        spec = LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            speculative_config=NGRAM,
            **{"num_kv_blocks": 512, **kwargs},
        )
        assert [o.outputs[0].token_ids for o in run(spec, prompts, params)] == expected
        if "num_kv_blocks" in kwargs and kwargs["num_kv_blocks"] == 24:
            assert spec.llm_engine.stats().num_preemptions_total > 0


def test_kept_kv_is_what_the_prefix_cache_serves_later(fp32_pair):
    """After a speculative run, its prompt + output as a new prompt hits the cached blocks the
    verification steps registered; the continuation equals a fresh engine's."""
    plain, spec = fp32_pair
    prompt = repetitive_prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first = run(spec, [prompt], params)[0].outputs[0].token_ids
    longer = prompt + list(first)
    before = spec.llm_engine.stats()
    ours = run(spec, [longer], params)[0]
    hits = spec.llm_engine.stats().prefix_cache_hits_total - before.prefix_cache_hits_total
    assert (
        hits >= (len(longer) - 1) // 16 * 16 - 16
    )  # all but the last block or two came from the cache
    assert ours.outputs[0].token_ids == run(plain, [longer], params)[0].outputs[0].token_ids


def test_bf16_bits_are_a_plain_decodes_at_every_level(tiny_llama_dir, cpu_isa):
    plain, spec = pair(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=512)
    prompts = repetitive_prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    for ours, theirs in zip(run(spec, prompts, params), run(plain, prompts, params)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in ours.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in e.items()} for e in theirs.outputs[0].logprobs
        ]


def test_sampling_with_speculation_keeps_lengths_and_seeds(fp32_pair):
    _, spec = fp32_pair
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, max_tokens=25, ignore_eos=True, seed=11
    )
    first = [o.outputs[0].token_ids for o in run(spec, prompts, params)]
    again = [o.outputs[0].token_ids for o in run(spec, prompts, params)]
    assert first == again  # a seeded request is reproducible with speculation too
    assert all(len(tokens) == 25 for tokens in first)


def test_nothing_to_look_up_proposes_nothing(fp32_pair):
    _, spec = fp32_pair
    before = spec.llm_engine.stats().spec_decoding.num_drafts
    rng = random.Random(7)
    prompt = rng.sample(range(3, 380), 40)  # no token twice
    run(spec, [prompt], SamplingParams(temperature=0, max_tokens=1))
    assert spec.llm_engine.stats().spec_decoding.num_drafts == before


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "speed": 9}', "speed"),
        ("not json", "not JSON"),
    ],
)
def test_bad_configs_are_one_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)


def test_tensor_parallel_verification_equals_one_rank(tiny_llama_dir):
    prompts = repetitive_prompts(4, seed=9)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)
    expected = [o.outputs[0].token_ids for o in run(plain, prompts, params)]
    with LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=256,
        tensor_parallel_size=2,
        speculative_config=NGRAM,
    ) as spec:
        assert [o.outputs[0].token_ids for o in run(spec, prompts, params)] == expected
        assert spec.llm_engine.stats().spec_decoding.num_drafts > 0


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory):
    """A second random Llama with the same tokenizer: a draft that often disagrees."""
    from tests.conftest import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("draft-llama"), seed=7, num_layers=1)


@pytest.mark.parametrize("draft", ["same", "other"])
def test_draft_model_greedy_equals_plain_decoding(tiny_llama_dir, other_llama_dir, draft):
    draft_dir = tiny_llama_dir if draft == "same" else other_llama_dir
    prompts = repetitive_prompts(6, seed=10)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, logprobs=2)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)
    spec = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3},
    )
    for ours, theirs in zip(run(spec, prompts, params), run(plain, prompts, params)):
        assert_same_tokens_and_logprobs(ours, theirs, 1e-4)
    stats = spec.llm_engine.stats().spec_decoding
    if draft == "same":  # the target itself proposes: every proposal is kept
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    proposer = spec.llm_engine.speculation.proposer
    assert not proposer.shadows  # every finished sequence's draft blocks freed
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_draft_model_sampling_is_seeded_and_bounded(tiny_llama_dir, other_llama_dir):
    spec = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=256,
        speculative_config={"model": str(other_llama_dir), "num_speculative_tokens": 3},
    )
    prompts = repetitive_prompts(3, seed=11)
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=20, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in run(spec, prompts, params)]
    assert first == [o.outputs[0].token_ids for o in run(spec, prompts, params)]
    assert all(len(tokens) == 20 for tokens in first)
    assert spec.llm_engine.stats().spec_decoding.num_drafts > 0


def test_draft_model_config_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(
            speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 2},
            tensor_parallel_size=2,
        )


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_structured_outputs_under_speculation_equal_plain(
    tiny_llama_dir, other_llama_dir, proposer
):
    """A repetitive grammar (so proposals happen) on the tiny model's vocabulary: greedy tokens
    equal a plain constrained decode's, the text fits the grammar, and proposals were made."""
    from nanoserve.sampling_params import StructuredOutputsParams

    regex = "(a|b|c)(a|b|c| )*(x|y)"
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    config = (
        NGRAM
        if proposer == "ngram"
        else {"model": str(other_llama_dir), "num_speculative_tokens": 3}
    )
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)
    spec = LLM(
        model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, speculative_config=config
    )
    prompts = repetitive_prompts(4, seed=12)
    ours, theirs = run(spec, prompts, params), run(plain, prompts, params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    assert spec.llm_engine.stats().spec_decoding.num_drafts > 0
    sampled = SamplingParams(
        temperature=1.0,
        max_tokens=40,
        seed=3,
        structured_outputs=StructuredOutputsParams(regex=regex),
    )
    import re

    for out in run(spec, prompts, sampled):
        text = out.outputs[0].text
        assert re.fullmatch(regex, text) or out.outputs[0].finish_reason == "length"
        assert re.fullmatch("(a|b|c)(a|b|c| )*(x|y)?", text)
