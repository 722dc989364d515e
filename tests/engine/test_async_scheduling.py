"""--async-scheduling (engine/async_scheduling.py) on the CPU path: the same tokens, text, finish
reasons and prompt-cache hits as the engine without it (itself checked against transformers in
test_engine_tiny.py), for requests that end at different steps (max_tokens, EOS, stop tokens,
stop strings), aborts, preemption (recompute and swap), prefix caching, penalties and prompt
logprobs; and, from the engine's StepLog (counted, not timed), that each step N+1 was planned
before step N's tokens were collected."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.swap import HostBlockPool
from nanoserve.outputs import RequestOutputKind
from tests.helpers import random_prompts

LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_llm(model_dir, async_scheduling: bool, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_num_batched_tokens", 256)
    return LLM(model=str(model_dir), dtype="float32", async_scheduling=async_scheduling, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def eos_token(tiny_llama_dir) -> int:
    """A token the tiny model generates often, at different places: made its EOS below, so that
    requests end by EOS at different steps."""
    llm = make_llm(tiny_llama_dir, False)
    vocab = llm.llm_engine.model_config.vocab_size
    outputs = token_ids(generate(llm, random_prompts(12, vocab, seed=7), LONG))
    counts = collections.Counter(t for tokens in outputs for t in tokens[2:])
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, eos_token, tmp_path_factory):
    """The tiny Llama with `eos_token` as a second EOS id (generation_config.json)."""
    path = tmp_path_factory.mktemp("async-llama") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    generation = {"eos_token_id": [config["eos_token_id"], eos_token]}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def sync_llm(model_dir):
    return make_llm(model_dir, False)


@pytest.fixture(scope="module")
def async_llm(model_dir):
    return make_llm(model_dir, True)


def overlapped_pairs(log) -> int:
    """Steps n whose successor n + 1 was planned before n was collected, from the event log."""
    where = {event: i for i, event in enumerate(log.events)}
    return sum(
        1
        for (kind, n), i in where.items()
        if kind == "collect" and where.get(("schedule", n + 1), len(where)) < i
    )


def mixed_params(llm: LLM, prompts, eos_token: int) -> list[SamplingParams]:
    """Requests that end at different steps, each in its own way; the stop token and stop
    string are taken from what the engine generates for that prompt."""
    reference = generate(llm, prompts, LONG)
    tokenizer = llm.llm_engine.tokenizer
    params = []
    for i, output in enumerate(reference):
        tokens = output.outputs[0].token_ids
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True))
        elif kind == 1:  # EOS (the second EOS id), or max_tokens when it never comes
            params.append(SamplingParams(temperature=0, max_tokens=30))
        elif kind == 2:  # a stop token id, its first place in the output past the start
            params.append(
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                               stop_token_ids=[tokens[4 + i % 7]])
            )  # fmt: skip
        elif kind == 3:  # a stop string from the middle of the output's text
            text = tokenizer.decode(tokens[6:], skip_special_tokens=True)
            stop = text[: max(2, len(text) // 3)].strip() or text[:2]
            params.append(
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
            )
        elif kind == 4:  # min_tokens holds EOS back
            params.append(SamplingParams(temperature=0, max_tokens=20, min_tokens=8))
        else:  # seeded sampling: the request's own generator, whatever the batch
            params.append(
                SamplingParams(temperature=0.9, max_tokens=16, seed=i, logprobs=2, ignore_eos=True)
            )
    assert any(p.stop for p in params) and any(p.stop_token_ids for p in params)
    assert eos_token in llm.llm_engine.eos_token_ids
    return params


def summary(outputs) -> list[tuple]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
         o.outputs[0].stop_reason)
        for o in outputs
    ]  # fmt: skip


def test_same_outputs_and_each_step_planned_before_the_last_is_collected(
    sync_llm, async_llm, eos_token
):
    vocab = sync_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(18, vocab, seed=11, min_len=3, max_len=60)
    params = mixed_params(sync_llm, prompts, eos_token)
    expected = generate(sync_llm, prompts, params)
    log = async_llm.llm_engine.async_scheduling.log
    launched_before, overlapped_before = log.num_launched, log.num_overlapped
    got = generate(async_llm, prompts, params)
    assert summary(got) == summary(expected)
    reasons = collections.Counter(o.outputs[0].finish_reason for o in expected)
    stop_reasons = {type(o.outputs[0].stop_reason) for o in expected}
    assert reasons["stop"] >= 4 and reasons["length"] >= 4, reasons  # ends of every kind
    assert {int, str, type(None)} <= stop_reasons
    lengths = {len(o.outputs[0].token_ids) for o in expected}
    assert len(lengths) >= 8  # they finish at many different steps
    for ours, theirs in zip(got, expected):
        if theirs.outputs[0].logprobs is not None:
            for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
                assert a.keys() == b.keys()
                for token in a:
                    assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
    # Every step after the first was planned while the one before was in flight.
    steps = log.num_launched - launched_before
    assert steps >= max(lengths)
    assert log.num_overlapped - overlapped_before == steps - 1 and log.num_drained == 0
    assert overlapped_pairs(log) >= steps - 1
    engine = async_llm.llm_engine
    assert engine.async_scheduling.in_flight is None and not engine.has_unfinished_requests()
    assert engine.block_managers[0].num_used_blocks == 0


def test_no_step_is_spent_on_a_request_at_its_max_tokens(async_llm):
    """A sequence whose token on the device is its last (max_tokens) is not scheduled again."""
    log = async_llm.llm_engine.async_scheduling.log
    before = log.num_launched
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    generate(async_llm, [[5, 6, 7, 8]], params)
    assert log.num_launched - before == 9


def test_abort_while_its_step_is_in_flight(sync_llm, async_llm):
    vocab = sync_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(3, vocab, seed=12, min_len=5, max_len=30)
    expected = token_ids(generate(sync_llm, prompts, LONG))
    engine = async_llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"abort-{i}", {"prompt_token_ids": prompt}, LONG, output_kind=RequestOutputKind.DELTA
        )
    streamed = collections.defaultdict(list)
    aborted = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed[output.request_id] += output.outputs[0].token_ids
        if aborted is None and len(streamed["abort-1"]) >= 5:
            in_flight = engine.async_scheduling.in_flight
            assert "abort-1" in in_flight.scheduler_output.request_ids
            (aborted,) = engine.abort_request("abort-1")
    assert aborted.outputs[0].finish_reason == "abort"
    # What was streamed is what the engine without the flag gives; nothing after the abort.
    assert streamed["abort-1"] == expected[1][: len(streamed["abort-1"])]
    assert aborted.outputs[0].token_ids == streamed["abort-1"]
    assert streamed["abort-0"] == expected[0] and streamed["abort-2"] == expected[2]
    assert engine.block_managers[0].num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_same_outputs(model_dir, sync_llm, mode):
    vocab = sync_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(24, vocab, seed=13, min_len=20, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = token_ids(generate(sync_llm, prompts, params))
    swap = {"preemption_mode": "swap", "num_swap_blocks": 64} if mode == "swap" else {}
    # Up to (40 + 16) / 16 = 4 blocks a sequence, ~80 for all of them: give 24.
    small = make_llm(model_dir, True, num_kv_blocks=24, **swap)
    assert token_ids(generate(small, prompts, params)) == expected
    engine = small.llm_engine
    assert engine.schedulers[0].num_preemptions > 0
    if mode == "swap":
        assert engine.schedulers[0].num_swap_outs > 0
    assert engine.async_scheduling.log.num_overlapped > 0
    assert engine.block_managers[0].num_used_blocks == 0
    assert engine.host_pool is None or engine.host_pool.usage == 0


def test_prefix_caching_same_hits_and_tokens(sync_llm, async_llm):
    """Blocks are registered for the prefix cache as their token ids become known: later
    requests find the same cached prefixes as without the flag."""
    vocab = sync_llm.llm_engine.model_config.vocab_size
    prefix = random_prompts(1, vocab, seed=14, min_len=70, max_len=70)[0]
    tails = random_prompts(4, vocab, seed=15, min_len=1, max_len=20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for llm in (sync_llm, async_llm):
        llm.llm_engine.reset_prefix_cache()
        first = generate(llm, [prefix + tails[0]], params)
        # The first request's generated tokens are cached too: a prompt that continues it.
        continued = prefix + tails[0] + first[0].outputs[0].token_ids[:18] + tails[1]
        rest = generate(llm, [prefix + t for t in tails[1:]] + [continued], params)
        outputs = first + rest
        results.append([(o.outputs[0].token_ids, o.num_cached_tokens) for o in outputs])
    assert results[0] == results[1]
    # The prefix's 4 full blocks, and for the last, blocks of the first request's output too.
    assert all(cached >= 64 for _, cached in results[1][1:]) and results[1][-1][1] >= 80


def test_penalties_and_prompt_logprobs_drain(model_dir, sync_llm):
    """Steps whose sampling reads the last token on the host, or whose prompt-logprob rows
    follow the last step's, are planned after it is collected; the outputs are the same."""
    vocab = sync_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(4, vocab, seed=16, min_len=40, max_len=60)
    params = [
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    sync_llm.llm_engine.reset_prefix_cache()
    expected = generate(sync_llm, prompts, params)
    # A small token budget splits the prompts into chunks: each prompt-logprob chunk drains.
    chunked = make_llm(model_dir, True, max_num_batched_tokens=32)
    got = generate(chunked, prompts, params)
    assert token_ids(got) == token_ids(expected)
    log = chunked.llm_engine.async_scheduling.log
    assert log.num_drained >= 9 and log.num_overlapped > 0
    ours, theirs = got[2].prompt_logprobs, expected[2].prompt_logprobs
    assert len(ours) == len(theirs) == len(prompts[2]) and ours[0] is None
    for a, b in zip(ours[1:], theirs[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)


def test_scheduler_counts_the_tokens_still_on_the_device():
    """The engine's bookkeeping by hand: launching a step counts its tokens as computed and
    gives each sampling sequence a placeholder; collecting it appends the token."""
    scheduler = Scheduler(BlockManager(16, 4), 4, 64, max_model_len=64)
    seq = Sequence(0, "r", 0, [3] * 8, 8, SamplingParams(max_tokens=3), 0, 0)
    scheduler.add(seq)

    def launch(expected_new: int) -> None:
        (item,) = scheduler.schedule().scheduled_seqs
        assert item.num_new_tokens == expected_new and item.completes_prompt
        seq.num_output_placeholders += 1
        seq.num_computed_tokens += item.num_new_tokens

    def collect() -> None:
        seq.num_output_placeholders -= 1
        seq.token_ids.append(9)

    launch(8)
    launch(1)  # the token on the device is its input
    assert len(seq.block_table) == 3  # position 8, in a third block
    collect()
    launch(1)
    collect()  # 2 tokens out, 1 on the device: max_tokens reached whatever it is
    assert seq.num_output_placeholders == 1
    assert scheduler.schedule().scheduled_seqs == []


@settings(max_examples=80, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 14)),
        min_size=1,
        max_size=16,
    ),
    num_blocks=st.integers(12, 40),
    budget=st.integers(8, 96),
    max_seqs=st.integers(1, 6),
    swap=st.booleans(),
)
def test_scheduler_with_one_step_in_flight(requests, num_blocks, budget, max_seqs, swap):
    """The scheduler driven as engine/async_scheduling.py drives it (each step launched before
    the one before is collected; a request may end early, as by EOS, whatever its placeholder):
    the budgets hold, a row's blocks cover it, every request ends with its tokens, none is
    scheduled past max_tokens, and no block is leaked."""
    block_size = 4
    manager = BlockManager(num_blocks, block_size)
    host = HostBlockPool(64) if swap else None
    scheduler = Scheduler(manager, max_seqs, budget, host_pool=host, max_model_len=160)
    pending, seqs, in_flight = list(enumerate(requests)), [], []
    ends_at = {}  # seq_id -> the output length at which it "hits EOS" (0: never)
    for _ in range(3000):
        if pending:
            i, (prompt_len, max_tokens, eos_at) = pending.pop(0)
            prompt_len = min(prompt_len, num_blocks * block_size - max_tokens - 1)
            params = SamplingParams(max_tokens=max_tokens)
            seq = Sequence(i, str(i), 0, [3 + i] * prompt_len, prompt_len, params, 0, i)
            ends_at[i] = eos_at
            seqs.append(seq)
            scheduler.add(seq)
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens <= budget
        sampled = []
        for item in output.scheduled_seqs:  # launch
            seq = item.seq
            assert seq.num_output_tokens + seq.num_output_placeholders < seq.params.max_tokens
            assert (
                len(seq.block_table) * block_size >= seq.num_computed_tokens + item.num_new_tokens
            )
            if item.completes_prompt:
                seq.num_output_placeholders += 1
                sampled.append(seq)
            seq.num_computed_tokens += item.num_new_tokens
        for seq in in_flight:  # collect the step before
            seq.num_output_placeholders -= 1
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                known = min(seq.num_computed_tokens, seq.num_tokens)
                manager.register_full_blocks(seq, known)
            seq.token_ids.append(7)
            out = seq.num_output_tokens
            if out >= seq.params.max_tokens or out == ends_at[seq.seq_id]:
                scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
        in_flight = sampled
        if not (pending or scheduler.has_work() or in_flight):
            break
    else:
        raise AssertionError("the scheduler made no progress")
    for seq in seqs:
        assert seq.is_finished and seq.num_output_placeholders == 0
        eos_at = ends_at[seq.seq_id] or seq.params.max_tokens
        assert seq.num_output_tokens == min(seq.params.max_tokens, eos_at)
    assert manager.num_used_blocks == 0 and (host is None or host.usage == 0)


def test_a_failed_step_fails_the_requests_in_flight_and_the_engine_goes_on(async_llm):
    """A step that raises while the one before is in flight fails the requests of both
    (StepError, as without the flag a failed step fails its own); nothing is left in flight or
    held, and the next request runs."""
    from nanoserve.errors import StepError

    engine = async_llm.llm_engine
    for i in range(2):
        engine.add_request(f"fail-{i}", {"prompt_token_ids": [5 + i] * 9}, LONG)
    forward, calls = engine.runner.forward, []

    def failing_forward(model_input):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return forward(model_input)

    engine.runner.forward = failing_forward
    try:
        with pytest.raises(StepError) as caught:
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.runner.forward = forward
    assert sorted(caught.value.request_ids) == ["fail-0", "fail-1"]
    assert {o.outputs[0].finish_reason for o in caught.value.outputs} == {"abort"}
    assert engine.async_scheduling.in_flight is None and not engine.has_unfinished_requests()
    assert engine.block_managers[0].num_used_blocks == 0
    (output,) = generate(async_llm, [[5] * 9], LONG)
    assert len(output.outputs[0].token_ids) == 24


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "--async-scheduling is not supported with speculative decoding"),
        ({"pipeline_parallel_size": 2},
         "--async-scheduling is not supported with pipeline parallelism"),
    ],
)  # fmt: skip
def test_refused_where_it_cannot_work(extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(async_scheduling=True, **extra)


def test_refused_for_a_pooling_model():
    from types import SimpleNamespace

    from nanoserve.engine.async_scheduling import AsyncScheduling

    for flags in ({"runner": "pooling"}, {"task": "embed"}):
        with pytest.raises(ValueError, match="not supported with pooling models"):
            EngineConfig(async_scheduling=True, **flags)
    with pytest.raises(ValueError, match="not supported with pooling models"):
        AsyncScheduling.of(SimpleNamespace(pooler=object()))  # a pooling model found at load


def test_the_flag():
    import argparse

    from nanoserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not engine_config_from_args(parser.parse_args([])).async_scheduling


def test_structured_outputs_and_beam_search(sync_llm, async_llm):
    """A constrained request's grammar takes each token on the host before its next bitmask:
    the steps after one it sampled in are drained, and it gets the same text as without the
    flag beside free requests that overlap. Beam search (one-token requests) is unchanged."""
    from nanoserve import StructuredOutputsParams
    from nanoserve.beam_search import BeamSearchParams

    vocab = sync_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(3, vocab, seed=17)
    regex = r"[a-z]{3,8}( [a-z]{2,6}){2,4}\."
    params = [
        SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
        ),
        LONG,
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    expected = generate(sync_llm, prompts, params)
    log = async_llm.llm_engine.async_scheduling.log
    drained = log.num_drained
    got = generate(async_llm, prompts, params)
    assert summary(got) == summary(expected)
    assert got[0].outputs[0].finish_reason == "stop"  # the grammar completed
    assert log.num_drained - drained >= len(got[0].outputs[0].token_ids) - 1
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    ours, theirs = (llm.beam_search([{"prompt_token_ids": prompts[1]}], beams) for llm in
                    (async_llm, sync_llm))  # fmt: skip
    assert [s.tokens for s in ours[0].sequences] == [s.tokens for s in theirs[0].sequences]
