"""Output kinds: DELTA outputs are exactly the cumulative output cut in pieces, each token once,
and with stop strings no delta ever carries text that the stop later takes back; FINAL_ONLY
gives one output per request, at its end."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.outputs import RequestOutputKind

PROMPT = [5, 9, 14, 3, 27, 8]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256).llm_engine


def run(engine, request_id: str, params: SamplingParams, kind: RequestOutputKind) -> list:
    engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params, output_kind=kind)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_deltas_add_up_to_the_cumulative_output(engine):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2, logprobs=2)
    whole = run(engine, "cumulative", params, RequestOutputKind.CUMULATIVE)[-1]
    deltas = run(engine, "delta", params, RequestOutputKind.DELTA)
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for choice in whole.outputs:
        pieces = [c for d in deltas for c in d.outputs if c.index == choice.index]
        assert all(len(c.token_ids) <= 1 for c in pieces)  # one token per step: never resent
        assert [t for c in pieces for t in c.token_ids] == choice.token_ids
        assert "".join(c.text for c in pieces) == choice.text
        assert [e for c in pieces for e in c.logprobs] == choice.logprobs
        assert [c.finish_reason for c in pieces][-1] == choice.finish_reason == "length"
    folded = deltas[0]
    for delta in deltas[1:]:
        folded.add(delta)
    assert [(c.text, c.token_ids) for c in folded.outputs] == [
        (c.text, c.token_ids) for c in whole.outputs
    ]


def test_stop_string_text_is_held_back_in_deltas(engine):
    free_deltas = run(
        engine,
        "free",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        RequestOutputKind.DELTA,
    )
    pieces = [c.text for d in free_deltas for c in d.outputs]
    free = "".join(pieces)
    # A stop string that begins in one token's text and ends in the next one's: its first
    # character is generated a step before the stop is found.
    stop = None
    for k in range(2, len(pieces) - 1):
        candidate = pieces[k][-1:] + pieces[k + 1][:1]
        boundary = len("".join(pieces[: k + 1]))
        if len(candidate) == 2 and free.index(candidate) == boundary - 1:
            stop = candidate
            break
    assert stop is not None, pieces
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    whole = run(engine, "stopped", params, RequestOutputKind.CUMULATIVE)[-1].outputs[0]
    deltas = run(engine, "stopped-delta", params, RequestOutputKind.DELTA)
    texts = [c.text for d in deltas for c in d.outputs]
    assert "".join(texts) == whole.text == free[: free.index(stop)]
    sent = ""
    for text in texts[:-1]:  # what went out before the end is never taken back
        sent += text
        assert len(sent) <= len(whole.text)
    assert deltas[-1].outputs[0].stop_reason == stop


def test_final_only_gives_one_output(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run(engine, "final", params, RequestOutputKind.FINAL_ONLY)
    assert len(outputs) == 1 and outputs[0].finished
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_prompt_forms_are_one_typed_prompt(tiny_llama_dir, engine):
    """vLLM's prompt forms all reach the engine as a TextPrompt or a TokensPrompt."""
    from nanoserve import TextPrompt, TokensPrompt
    from nanoserve.errors import InvalidRequestError
    from nanoserve.inputs import parse_prompt

    assert parse_prompt("hi") == parse_prompt({"prompt": "hi"}) == TextPrompt("hi")
    assert (
        parse_prompt([5, 6]) == parse_prompt({"prompt_token_ids": [5, 6]}) == TokensPrompt([5, 6])
    )
    assert parse_prompt({"prompt_token_ids": [5], "prompt": "x"}) == TokensPrompt([5], "x")
    with pytest.raises(InvalidRequestError):
        parse_prompt({"text": "hi"})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    forms = [PROMPT, {"prompt_token_ids": PROMPT}, TokensPrompt(PROMPT, "its text")]
    for i, form in enumerate(forms):
        engine.add_request(f"form-{i}", form, params, output_kind=RequestOutputKind.FINAL_ONLY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step())
    assert len({tuple(finals[f"form-{i}"].outputs[0].token_ids) for i in range(3)}) == 1
    assert [finals[f"form-{i}"].prompt for i in range(3)] == [None, None, "its text"]


def test_metrics_count_the_tokens_the_deltas_carry(engine):
    """Each output's metrics say how many tokens were generated so far, all outputs together
    and the longest one, whatever the output kind (the server reads them, not the deltas)."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2, ignore_eos=True)
    engine.add_request(
        "counted", {"prompt_token_ids": PROMPT}, params, output_kind=RequestOutputKind.DELTA
    )
    seen: dict[int, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for choice in output.outputs:
                seen[choice.index] = seen.get(choice.index, 0) + len(choice.token_ids)
            assert output.metrics.num_generation_tokens == sum(seen.values())
            assert output.metrics.max_num_generation_tokens == max(seen.values())
            steps += 1
    assert steps > 1 and seen == {0: 12, 1: 12}
