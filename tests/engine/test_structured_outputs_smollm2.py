"""Structured outputs on the real SmolLM2-135M-Instruct: what comes out parses and validates
(jsonschema) for nested objects, arrays, enums and numbers; regex, choice and EBNF outputs match;
stop strings still cut; a finished grammar ends with "stop"; bad specs raise naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanoserve import LLM, SamplingParams, StructuredOutputsParams
from nanoserve.errors import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "colors": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "height_m", "colors", "address"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
ANSWER_GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
ANSWER_RE = r"The answer is (yes|no)\."


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024)


def chat_prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def params(seed: int | None = None, max_tokens: int = 96, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=0 if seed is None else 0.8,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def test_outputs_validate_and_match(llm):
    person = chat_prompt(llm, "Describe a made-up person as JSON.")
    requests = [
        (person, params(json=PERSON, disable_any_whitespace=True)),
        (chat_prompt(llm, "Give me a US phone number."), params(regex=PHONE)),
        (chat_prompt(llm, "Is 'I love it' positive or negative?"), params(choice=CHOICES)),
        (chat_prompt(llm, "Is the sky blue?"), params(seed=2, grammar=ANSWER_GRAMMAR)),
        (chat_prompt(llm, "List two fruits as JSON."), params(json_object=True, max_tokens=32)),
    ]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert re.fullmatch(PHONE, texts[1]), texts[1]
    assert texts[2] in CHOICES
    assert re.fullmatch(ANSWER_RE, texts[3]), texts[3]
    if outputs[4].outputs[0].finish_reason == "stop":  # it may run out of tokens mid-object
        assert isinstance(json.loads(texts[4]), (dict, list))
    for output in outputs[:4]:
        assert output.outputs[0].finish_reason == "stop"


def test_stop_strings_cut_and_a_finished_grammar_stops(llm):
    prompt = chat_prompt(llm, "Is the sky blue?")
    stopped, endless = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(
                temperature=0,
                max_tokens=32,
                stop=["answer"],
                structured_outputs=StructuredOutputsParams(grammar=ANSWER_GRAMMAR),
            ),
            SamplingParams(
                temperature=0,
                max_tokens=64,
                ignore_eos=True,
                structured_outputs=StructuredOutputsParams(choice=CHOICES),
            ),
        ],
        use_tqdm=False,
    )
    assert stopped.outputs[0].text == "The "
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", "answer")
    # ignore_eos cannot run past the grammar: it ends when the grammar takes its stop token.
    assert endless.outputs[0].text in CHOICES and endless.outputs[0].finish_reason == "stop"
    assert len(endless.outputs[0].token_ids) < 64


@pytest.mark.parametrize(
    "kind,message",
    [
        ({"json": '{"type": "object", "properties": 5}'}, "properties must be an object"),
        ({"json": "{not json"}, "Failed to parse JSON"),
        ({"regex": "(abc"}, "parenthesis is not closed"),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
def test_bad_specs_raise_naming_the_field(llm, kind, message):
    bad = StructuredOutputsParams(field="guided_x", **kind)
    with pytest.raises(InvalidRequestError, match=message) as caught:
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    assert caught.value.param == "guided_x"
    assert not llm.llm_engine.has_unfinished_requests()


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
