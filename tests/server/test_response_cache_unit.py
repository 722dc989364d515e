"""The response cache on its own (no server): what the key covers, what is stored, LRU by bytes,
TTL on an injected clock."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from nanoserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.response_cache import (
    KEY_PARAMS,
    ResponseCache,
    cache_key,
    is_cacheable,
    is_complete,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def output(
    request_id: str = "r", text: str = "hello", finish_reason: str | None = "stop", tokens: int = 3
) -> RequestOutput:
    logprobs = [
        {7 + i: Logprob(-0.25 * i, 1, "x"), 9: Logprob(-math.inf, 2, None)} for i in range(tokens)
    ]
    choice = CompletionOutput(
        0,
        text,
        list(range(5, 5 + tokens)),
        None,
        logprobs,
        finish_reason,
        "." if finish_reason == "stop" else None,
    )
    return RequestOutput(
        request_id,
        "p",
        [1, 2, 3],
        [choice],
        finish_reason is not None,
        RequestMetrics(1.0, 2.0),
        2,
        [None, {2: Logprob(-1.5, 1, "b")}, None],
    )


def key(prompt=(1, 2, 3), **params) -> bytes:
    return cache_key("model", [list(prompt)], SamplingParams(**{"temperature": 0.0, **params}))


def test_key_lists_every_sampling_param():
    # A new SamplingParams field must be added to KEY_PARAMS (or this test changed on purpose).
    assert sorted(KEY_PARAMS) == sorted(f.name for f in dataclasses.fields(SamplingParams))


def test_cacheable_only_when_the_input_determines_the_output():
    assert is_cacheable(SamplingParams(temperature=0.0))
    assert is_cacheable(SamplingParams(temperature=0.9, seed=3, n=4))
    assert not is_cacheable(SamplingParams(temperature=0.9))
    assert not is_cacheable(SamplingParams(temperature=1e-6))


def test_key_changes_with_every_field_that_changes_output():
    base = key()
    assert key() == base
    assert key(presence_penalty=0) == key(presence_penalty=0.0)  # same setting, same key
    assert key(logit_bias={3: 1.0, 4: -2.0}) == key(logit_bias={4: -2.0, 3: 1.0})
    variants = [
        dict(n=2),
        dict(top_p=0.5),
        dict(top_k=5),
        dict(min_p=0.1),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(max_tokens=17),
        dict(min_tokens=2),
        dict(stop=["x"]),
        dict(stop_token_ids=[4]),
        dict(include_stop_str_in_output=True),
        dict(ignore_eos=True),
        dict(seed=1),
        dict(logprobs=0),
        dict(logprobs=2),
        dict(prompt_logprobs=1),
        dict(skip_special_tokens=False),
        dict(spaces_between_special_tokens=False),
        dict(logit_bias={3: 1.0}),
        dict(max_tokens=None),
        dict(temperature=0.5, seed=1),
    ]
    keys = {key(**variant) for variant in variants}
    assert len(keys) == len(variants) and base not in keys
    assert key(prompt=(1, 2, 4)) != base
    assert cache_key("other", [[1, 2, 3]], SamplingParams(temperature=0.0)) != base
    # two prompts are not their concatenation
    assert cache_key("model", [[1], [2, 3]], SamplingParams(temperature=0.0)) != cache_key(
        "model", [[1, 2], [3]], SamplingParams(temperature=0.0)
    )


def test_hit_returns_the_stored_outputs_as_fresh_objects():
    cache = ResponseCache(1 << 20, 60.0, Clock())
    stored = [output("a"), output("b", text="bye", finish_reason="length")]
    assert cache.put(b"k", stored)
    first = cache.get(b"k")
    assert first == [
        dataclasses.replace(o, request_id="", prompt=None, prompt_token_ids=[], metrics=None)
        for o in stored
    ]
    first[0].outputs[0].token_ids.append(99)  # a handler that changed its copy changes nothing
    assert cache.get(b"k")[0].outputs[0].token_ids == [5, 6, 7]
    assert cache.get(b"missing") is None
    assert (cache.queries, cache.hits) == (3, 2)


@pytest.mark.parametrize(
    "outputs",
    [
        [output(finish_reason="abort")],
        [output(finish_reason="error")],
        [output(finish_reason=None)],
        [output(), None],
        [],
        [dataclasses.replace(output(), outputs=[])],
    ],
)
def test_failed_aborted_or_unfinished_requests_are_not_stored(outputs):
    assert not is_complete(outputs)
    cache = ResponseCache(1 << 20, 60.0)
    assert not cache.put(b"k", outputs)
    assert len(cache) == 0 and cache.size_bytes == 0


def test_lru_eviction_keeps_the_byte_bound():
    cache = ResponseCache(4000, 60.0, Clock())
    keys = [bytes([i]) * 32 for i in range(40)]
    for i, k in enumerate(keys):
        assert cache.put(k, [output(text="t" * 20)])
        if i == 2:
            assert cache.get(keys[0]) is not None  # keys[0] is now more recent than keys[1]
        assert cache.size_bytes <= 4000
        assert cache.size_bytes == sum(
            cache.entry_size(k, blob) for k, (blob, _) in cache.entries.items()
        )
    assert 3 <= len(cache) < 40
    survivors = list(cache.entries)
    assert survivors == keys[40 - len(survivors) :]  # the least recently used went first
    # the estimate is honest: at least the encoded bytes and both bytes objects
    blob, _ = cache.entries[keys[-1]]
    assert cache.entry_size(keys[-1], blob) >= len(blob) + 32 + 100


def test_entry_larger_than_the_cache_is_refused():
    cache = ResponseCache(300, 60.0)
    assert not cache.put(b"k", [output(text="x" * 1000, tokens=50)])
    assert len(cache) == 0


def test_entries_expire_after_the_ttl():
    clock = Clock()
    cache = ResponseCache(1 << 20, 10.0, clock)
    cache.put(b"old", [output()])
    clock.now += 9.999
    assert cache.get(b"old") is not None
    clock.now += 0.001
    assert cache.get(b"old") is None and len(cache) == 0 and cache.size_bytes == 0
    cache.put(b"a", [output()])
    clock.now += 20
    cache.put(b"b", [output()])  # expired entries at the cold end leave on the next store
    assert list(cache.entries) == [b"b"]


def test_replacing_and_clearing():
    cache = ResponseCache(1 << 20, 60.0)
    cache.put(b"k", [output(text="one")])
    cache.put(b"k", [output(text="two")])
    assert len(cache) == 1 and cache.get(b"k")[0].outputs[0].text == "two"
    assert cache.clear() == 1 and cache.size_bytes == 0 and cache.get(b"k") is None


def test_disabled_cache_stores_nothing():
    cache = ResponseCache(0, 60.0)
    assert not cache.enabled and not cache.put(b"k", [output()])


@pytest.mark.parametrize(
    "flag, value, message",
    [
        (
            "--response-cache-size",
            "-1",
            "--response-cache-size must be a finite number >= 0, got -1.0",
        ),
        (
            "--response-cache-size",
            "inf",
            "--response-cache-size must be a finite number >= 0, got inf",
        ),
        ("--response-cache-ttl", "0", "--response-cache-ttl must be > 0, got 0.0"),
    ],
)
def test_bad_flags_are_one_line(tiny_llama_dir, flag, value, message):
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "serve", "--model", str(tiny_llama_dir), flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"nanoserve: error: {message}"]


def test_structured_outputs_are_in_the_key():
    from nanoserve.sampling_params import StructuredOutputsParams

    def key(**kind):
        constraint = StructuredOutputsParams(**kind) if kind else None
        return cache_key(
            "m", [[1, 2, 3]], SamplingParams(temperature=0, structured_outputs=constraint)
        )

    keys = {
        key(),
        key(regex="a+"),
        key(regex="b+"),
        key(json={"type": "object"}),
        key(json={"type": "object"}, disable_any_whitespace=True),
    }
    assert len(keys) == 5
    assert key(choice=["x", "y"]) == key(choice=["x", "y"])
