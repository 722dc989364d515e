"""use_beam_search on /v1/completions through a real server with the openai client: the choices
are LLM.beam_search's beams on the same model, best first (which tests/engine/test_beam_search.py
checks against transformers), and what beam search cannot do is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from nanoserve import LLM
from nanoserve.beam_search import BeamSearchParams
from tests.server.server_helpers import http_request

PROMPTS = [[5, 17, 42, 99, 7, 13, 250], [300, 12, 77]]


def test_choices_are_the_offline_beams(tiny_server, tiny_llama_dir):
    result = tiny_server.client().completions.create(
        model=tiny_server.engine.served_model_name,
        prompt=PROMPTS,
        n=3,
        max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True},
    )
    offline = LLM(model=str(tiny_llama_dir), num_kv_blocks=256).beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS], BeamSearchParams(3, 8, length_penalty=0.7)
    )
    assert [c.index for c in result.choices] == list(range(6))
    for index, (prompt, beams) in enumerate(zip(PROMPTS, offline)):
        choices = result.choices[3 * index : 3 * index + 3]
        assert [c.model_extra["token_ids"] for c in choices] == [
            beam.tokens[len(prompt) :] for beam in beams.sequences
        ]
        assert [c.finish_reason for c in choices] == [
            beam.finish_reason for beam in beams.sequences
        ]
    assert result.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert result.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in result.choices
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
        ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
        ({"use_beam_search": True, "n": 2, "echo": True}, "echo"),
        (
            {"use_beam_search": True, "n": 2, "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
        ),
        ({"use_beam_search": True, "n": 40}, "n"),
        ({"length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_what_beam_search_cannot_do_is_refused(tiny_server, body, param):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, **body}
    status, _, payload = http_request(tiny_server.port, "POST", "/v1/completions", json.dumps(body))
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == param
