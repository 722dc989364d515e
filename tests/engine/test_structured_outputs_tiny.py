"""Structured outputs on the tiny random Llama (its byte-level BPE vocabulary works with
xgrammar): constrained rows never change the free rows of a batch, preemption by recompute and
by swap keep each matcher in step with its sequence, n > 1 gets a matcher per sequence, and a
grammar still compiling holds back only its own request."""

from __future__ import annotations

import json
import re
import threading

import pytest

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_swap_preemption import SMALL, assert_nothing_leaked, random_prompts

REGEX = r"[a-z]{3,12}( [a-z]{2,10}){4,8}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"type": "string", "enum": ["fox", "dog", "cat"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "kind", "tags"],
}


def constrained(seed: int | None = None, **kind) -> SamplingParams:
    # A random model given free whitespace in JSON spends its tokens on whitespace.
    if "json" in kind:
        kind["disable_any_whitespace"] = True
    return SamplingParams(
        temperature=0 if seed is None else 1.0,
        seed=seed,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def run(llm: LLM, prompts, params) -> list[list[tuple[list[int], str, str]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def assert_matches(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        value = json.loads(text)
        assert set(value) == {"id", "kind", "tags"} and value["kind"] in ("fox", "dog", "cat")
        assert 0 <= value["id"] <= 999 and 1 <= len(value["tags"]) <= 3


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir):
    return LLM(
        model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=256, num_kv_blocks=512
    )


@pytest.fixture(scope="module")
def prompts(roomy):
    return random_prompts(16, roomy.llm_engine.model_config.vocab_size, seed=11)


def test_free_rows_are_unchanged_by_constrained_rows(roomy, prompts):
    free = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
    ] * 4
    alone = run(roomy, prompts[:8], free)
    mixed_params = []
    for index, params in enumerate(free):
        other = constrained(regex=REGEX) if index % 2 else constrained(json=SCHEMA)
        mixed_params += [params, other]
    mixed_prompts = [p for prompt in prompts[:8] for p in (prompt, prompt)]
    mixed = run(roomy, mixed_prompts, mixed_params)
    assert mixed[0::2] == alone
    for index, outputs in enumerate(mixed[1::2]):
        assert_matches("regex" if index % 2 else "json", outputs[0][1])
    assert roomy.llm_engine.structured_output.num_compiles == 2  # two grammars, cached by text


def test_preemption_by_recompute_and_swap_keeps_matchers_in_step(tiny_llama_dir, roomy, prompts):
    params = [
        constrained(regex=REGEX) if i % 2 else constrained(json=SCHEMA, seed=i)
        for i in range(len(prompts))
    ]
    reference = run(roomy, prompts, params)
    for i, outputs in enumerate(reference):
        assert_matches("regex" if i % 2 else "json", outputs[0][1])
    for mode in ("recompute", "swap"):
        extra = {"preemption_mode": "swap", "num_swap_blocks": 256} if mode == "swap" else {}
        small = LLM(model=str(tiny_llama_dir), **SMALL, **extra)
        assert run(small, prompts, params) == reference, mode
        assert small.llm_engine.schedulers[0].num_preemptions > 0, mode
        assert_nothing_leaked(small)


def test_n_sequences_each_follow_the_grammar(roomy, prompts):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )
    outputs = run(roomy, prompts[:2], params)
    for request in outputs:
        assert len({text for _, text, _ in request}) > 1  # four sequences, four samples
        for _, text, reason in request:
            assert_matches("regex", text)
            assert reason == "stop"  # the grammar ended each one


def test_a_compiling_grammar_holds_back_only_its_request(roomy, prompts):
    engine = roomy.llm_engine
    engine.prepare_structured_output(constrained(regex=REGEX)).result()
    manager = engine.structured_output
    gate = threading.Event()
    manager.executor.submit(gate.wait)  # the compile thread is busy until the gate opens
    schema = dict(SCHEMA, title="not compiled yet")
    engine.add_request("constrained", {"prompt_token_ids": prompts[0]}, constrained(json=schema))
    engine.add_request(
        "free",
        {"prompt_token_ids": prompts[1]},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    finished = {}
    try:
        while "free" not in finished:
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            waiting = [s.request_id for s in engine.schedulers[0].waiting]
            assert waiting == ["constrained"]  # never scheduled while its grammar compiles
    finally:
        gate.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert_matches("json", finished["constrained"].outputs[0].text)


def test_a_failed_compile_fails_only_its_request(roomy, prompts):
    from nanoserve.engine.llm_engine import StepError

    engine = roomy.llm_engine
    engine.prepare_structured_output(constrained(regex=REGEX)).result()
    gate = threading.Event()
    engine.structured_output.executor.submit(gate.wait)
    engine.add_request("bad", {"prompt_token_ids": prompts[2]}, constrained(regex="(unclosed"))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("free", {"prompt_token_ids": prompts[3]}, free)
    engine.step()  # the free request's prefill; the bad one waits for its grammar
    gate.set()
    engine.structured_output.compile(StructuredOutputsParams(regex="(unclosed")).exception()
    with pytest.raises(StepError) as caught:
        engine.step()
    assert caught.value.request_ids == ["bad"] and "parenthesis" in str(caught.value.cause)
    assert caught.value.cause.param == "structured_outputs"
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    reference = run(roomy, [prompts[3]], free)[0][0][0]
    assert list(finished["free"].outputs[0].token_ids) == reference


def test_min_tokens_past_the_grammar_end_stops_cleanly(roomy, prompts):
    # After the choice only a stop token fits the grammar, and min_tokens forbids it: the
    # output ends where the grammar did, with no token outside it.
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature,
            seed=1,
            max_tokens=16,
            min_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        )
        ((output,),) = run(roomy, [prompts[4]], params)
        assert output[1] in ("yes", "no") and output[2] == "stop"


def test_choice_strings_are_escaped_exactly(roomy):
    import xgrammar

    choices = ['say "hi"', "back\\slash", "café ☕", "new\nline"]
    compiled = roomy.llm_engine.prepare_structured_output(
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=choices))
    ).result()
    for choice in choices:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert matcher.accept_string(choice) and matcher.is_terminated(), choice
    for wrong in ['say \\"hi\\"', "backslash", "café", "say"]:
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert not (matcher.accept_string(wrong) and matcher.is_terminated()), wrong
