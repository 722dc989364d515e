"""The output processor on its own: stop checks are plain functions of a sequence, and
`process` reports what finished without touching any scheduler (the engine frees those
sequences in their own virtual engine's scheduler)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.output_processor import OutputProcessor, check_stop, check_stop_strings
from nanoserve.engine.output_state import OutputState
from nanoserve.engine.request import Request
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.layers.sampler import SamplerOutput
from nanoserve.outputs import RequestMetrics, RequestOutputKind
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import Tokenizer

PROMPT = [5, 9, 14]
EOS = 2


def make_seq(params: SamplingParams, index: int = 0) -> Sequence:
    return Sequence(index, "r", index, list(PROMPT), len(PROMPT), params, 0, 0)


def text_state(text: str) -> OutputState:
    return OutputState(detokenizer=None, text=text)


@pytest.mark.parametrize(
    "generated, params, expected",
    [
        ([7], SamplingParams(stop_token_ids=[7], max_tokens=8), ("stop", 7)),
        ([7], SamplingParams(stop_token_ids=[7], min_tokens=2, max_tokens=8), (None, None)),
        ([4, EOS], SamplingParams(max_tokens=8), ("stop", None)),
        ([4, EOS], SamplingParams(max_tokens=8, ignore_eos=True), (None, None)),
        ([4, 4, 4], SamplingParams(max_tokens=3), ("length", None)),
        ([4] * 7, SamplingParams(), ("length", None)),  # the context (10 tokens) is full
    ],
)
def test_check_stop(generated, params, expected):
    seq = make_seq(params)
    seq.token_ids.extend(generated)
    assert check_stop(seq, generated[-1], {EOS}, max_model_len=10) == expected


def test_check_stop_strings_cuts_the_text_at_the_earliest():
    state = text_state("abcde")
    assert check_stop_strings(state, SamplingParams(stop=["cd", "bc"]), 4) == ("stop", "bc")
    assert state.text == "a"
    kept = text_state("abcde")
    params = SamplingParams(stop=["cd"], include_stop_str_in_output=True)
    assert check_stop_strings(kept, params, 2) == ("stop", "cd") and kept.text == "abcd"
    late = text_state("abcde")  # only the last character is new: "bc" was looked for before
    assert check_stop_strings(late, SamplingParams(stop=["bc"]), 1) == (None, None)
    assert late.text == "abcde"
    assert check_stop_strings(text_state(""), SamplingParams(stop=["x"]), 1) == (None, None)


def test_process_reports_what_finished(tiny_llama_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    processor = OutputProcessor(tokenizer, {EOS}, max_model_len=64)
    params = SamplingParams(n=2, max_tokens=3, stop_token_ids=[7])
    seqs = [make_seq(params, index) for index in range(2)]
    request = Request(
        "r",
        None,
        list(PROMPT),
        params,
        seqs,
        RequestMetrics(0.0),
        output_kind=RequestOutputKind.DELTA,
    )
    requests = {"r": request}

    def step(tokens: list[int]):
        return processor.process(
            requests, seqs, SamplerOutput(torch.tensor(tokens), None, None, None), []
        )

    first = step([7, 4])  # the first sequence takes its stop token
    assert first.finished_seqs == [seqs[0]] and not first.finished_requests
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].finish_reason == "stop"
    assert seqs[0].stop_reason == 7 and not request.finished
    assert [o.index for o in first.outputs[0].outputs] == [0, 1]
    second = step([9, 4])  # the finished one is skipped
    assert not second.finished_seqs and seqs[0].output_token_ids == [7]
    third = step([9, 4])
    assert third.finished_seqs == [seqs[1]] and third.finished_requests == [request]
    assert request.finished and seqs[1].finish_reason == "length"
    assert third.outputs[0].finished and third.outputs[0].metrics.num_generation_tokens == 4
    assert processor.generation_tokens_total == 4 and processor.prompt_tokens_total == len(PROMPT)


@pytest.mark.parametrize("stop_by", ["eos", "stop_token_ids"])
def test_a_stop_tokens_text_stays_out_unless_asked_for(tiny_llama_dir, stop_by):
    """As vLLM: the token that ends a sequence by id adds no text, even with special tokens
    kept (a parser that reads special tokens would otherwise see the eos text), unless
    include_stop_str_in_output; a token that ends it by length keeps its text."""
    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    processor = OutputProcessor(tokenizer, {EOS}, max_model_len=64)
    stop = EOS if stop_by == "eos" else 9
    texts = {}
    for keep in (False, True):
        params = SamplingParams(
            max_tokens=5,
            skip_special_tokens=False,
            include_stop_str_in_output=keep,
            stop_token_ids=[] if stop_by == "eos" else [9],
        )
        seq = make_seq(params, 0)
        request = Request("r", None, list(PROMPT), params, [seq], RequestMetrics(0.0))
        for token in (4, 5, stop):
            processor.process(
                {"r": request}, [seq], SamplerOutput(torch.tensor([token]), None, None, None), []
            )
        assert seq.finish_reason == "stop" and seq.output_token_ids == [4, 5, stop]
        texts[keep] = processor.state(request, seq).text
    stop_text = tokenizer.decode([stop], skip_special_tokens=False)
    assert stop_text and texts[True] == texts[False] + stop_text
    assert texts[False] == tokenizer.decode([4, 5], skip_special_tokens=False)
