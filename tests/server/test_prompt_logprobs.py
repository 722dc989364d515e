"""prompt_logprobs and echo logprobs (issue 18), checked against an oracle: Hugging Face
transformers' forward pass of the whole prompt (log_softmax values close, top-k ids equal).

The server computes logits for prompt rows only for requests that ask, collects them across
prefill chunks, and skips prefix-cache reads for them (a cached prefix has no logits)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.engine.hf_oracle import load_hf
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request, sse_events

PROMPT_IDS = [
    17,
    91,
    5,
    230,
    44,
    44,
    301,
    12,
    9,
    150,
    77,
    260,
    3,
    18,
    99,
    140,
    201,
    33,
    70,
    8,
    111,
    56,
    250,
    7,
    64,
    180,
    29,
    11,
    300,
    42,
    120,
    6,
    88,
    215,
    19,
    160,
    45,
    2,
    270,
    31,
]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir):
    """log_softmax of the next-token logits at every prompt position: row i predicts token i+1."""
    model = load_hf(tiny_llama_dir)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT_IDS])).logits[0].float()
    return logits.log_softmax(dim=-1)


@pytest.fixture(scope="module")
def chunked_server(tiny_llama_dir):
    """Prefill in chunks of 16 tokens, prefix caching on: a 40-token prompt takes 3 steps."""
    handle = ServerHandle(
        tiny_llama_dir,
        engine_kwargs={
            "max_num_batched_tokens": 16,
            "enable_prefix_caching": True,
            "num_kv_blocks": 256,
        },
    )
    yield handle
    handle.close()


def post(port: int, path: str, body: dict) -> tuple[int, dict | bytes]:
    status, _, raw = http_request(port, "POST", path, json.dumps(body), timeout=60)
    return status, (json.loads(raw) if status != 200 or not body.get("stream") else raw)


def check_against_oracle(prompt_logprobs: list, oracle: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT_IDS)
    assert prompt_logprobs[0] is None
    for position in range(1, len(PROMPT_IDS)):
        entry = {int(token): value for token, value in prompt_logprobs[position].items()}
        expected_row = oracle[position - 1]
        token = PROMPT_IDS[position]
        assert abs(entry[token]["logprob"] - expected_row[token].item()) < TOLERANCE
        assert entry[token]["rank"] == int((expected_row > expected_row[token]).sum()) + 1
        top_ids = expected_row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top_ids}, position
        for rank, top_id in enumerate(top_ids, start=1):
            assert abs(entry[top_id]["logprob"] - expected_row[top_id].item()) < TOLERANCE
            if top_id != token:
                assert entry[top_id]["rank"] == rank
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_match_a_full_forward(tiny_server, oracle, k):
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "prompt_logprobs": k},
    )
    assert status == 200, body
    [choice] = body["choices"]
    check_against_oracle(choice["prompt_logprobs"], oracle, k)
    assert choice["logprobs"] is None  # only the prompt's were asked for


def test_prompt_logprobs_across_chunks_and_with_a_cached_prefix(chunked_server, oracle):
    request = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    first = post(chunked_server.port, "/v1/completions", request)[1]
    check_against_oracle(first["choices"][0]["prompt_logprobs"], oracle, 2)
    # Without prompt logprobs the same prompt now comes from the prefix cache ...
    plain = post(
        chunked_server.port,
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0},
    )[1]
    assert plain["choices"][0]["prompt_logprobs"] is None
    # ... but a request that asks recomputes every row, and gets them all, equal to the first.
    again = post(chunked_server.port, "/v1/completions", request)[1]
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert again["choices"][0]["text"] == plain["choices"][0]["text"] == first["choices"][0]["text"]
    engine = chunked_server.engine
    assert engine.block_managers[0].prefix_cache_hits > 0  # the plain request did hit the cache


def test_prompt_logprobs_through_the_openai_client(tiny_server, oracle):
    client = tiny_server.client()
    model = tiny_server.engine.served_model_name
    result = client.completions.create(
        model=model,
        prompt=[PROMPT_IDS, PROMPT_IDS[:10]],
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    assert len(result.choices) == 2
    check_against_oracle(result.choices[0].prompt_logprobs, oracle, 1)
    assert len(result.choices[1].prompt_logprobs) == 10
    plain = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=1)
    assert plain.choices[0].prompt_logprobs is None


def test_chat_prompt_logprobs_cover_the_rendered_prompt(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    for k in (0, 1, 2):
        result = client.chat.completions.create(
            model=tiny_server.engine.served_model_name,
            messages=messages,
            max_tokens=1,
            extra_body={"prompt_logprobs": k},
        )
        prompt_logprobs = result.prompt_logprobs
        assert len(prompt_logprobs) == result.usage.prompt_tokens and prompt_logprobs[0] is None
        assert all(k <= len(entry) <= k + 1 for entry in prompt_logprobs[1:])
    plain = client.chat.completions.create(
        model=tiny_server.engine.served_model_name, messages=messages, max_tokens=1
    )
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("logprobs", [0, 2])
def test_echo_logprobs_start_with_the_prompt(tiny_server, oracle, logprobs):
    request = {
        "prompt": PROMPT_IDS,
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "logprobs": logprobs,
    }
    status, body = post(tiny_server.port, "/v1/completions", request)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    total = len(PROMPT_IDS) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == total
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for position in range(1, len(PROMPT_IDS)):
        expected = oracle[position - 1][PROMPT_IDS[position]].item()
        assert abs(lp["token_logprobs"][position] - expected) < TOLERANCE
    text = body["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and text.startswith("".join(lp["tokens"][: len(PROMPT_IDS)]))
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(total)]
    assert lp["text_offset"] == offsets
    # Tokens as ids (distinct keys even where several tokens decode to the same text).
    body = post(
        tiny_server.port, "/v1/completions", {**request, "return_tokens_as_token_ids": True}
    )[1]
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["token_ids"] is None  # only with return_token_ids
    assert lp["tokens"][: len(PROMPT_IDS)] == [f"token_id:{t}" for t in PROMPT_IDS]
    for position, top in enumerate(lp["top_logprobs"][1:], start=1):
        assert max(logprobs, 1) <= len(top) <= logprobs + 1
        assert lp["tokens"][position] in top  # the chosen token first, then the best ones
        if position < len(PROMPT_IDS):
            best = oracle[position - 1].topk(max(logprobs, 1)).indices.tolist()
            assert {f"token_id:{t}" for t in best[:logprobs]} <= set(top)


def test_logprobs_zero_returns_the_chosen_token(tiny_server):
    client = tiny_server.client()
    result = client.completions.create(
        model=tiny_server.engine.served_model_name,
        prompt=PROMPT_IDS,
        max_tokens=4,
        temperature=0,
        logprobs=0,
    )
    lp = result.choices[0].logprobs
    assert all(len(top) == 1 for top in lp.top_logprobs)
    assert [list(top.values())[0] for top in lp.top_logprobs] == lp.token_logprobs
    assert [list(top)[0] for top in lp.top_logprobs] == lp.tokens


def test_echo_with_max_tokens_zero_returns_the_prompt(tiny_server, oracle):
    status, body = post(
        tiny_server.port,
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    assert status == 200, body
    choice = body["choices"][0]
    prompt_text = tiny_server.engine.tokenizer.decode(PROMPT_IDS, skip_special_tokens=False)
    assert choice["text"] == prompt_text
    assert len(choice["logprobs"]["tokens"]) == len(PROMPT_IDS)
    assert (
        abs(choice["logprobs"]["token_logprobs"][5] - oracle[4][PROMPT_IDS[5]].item()) < TOLERANCE
    )


def test_echo_stream_carries_the_prompt_logprobs_first(tiny_server):
    status, raw = post(
        tiny_server.port,
        "/v1/completions",
        {
            "prompt": PROMPT_IDS,
            "max_tokens": 3,
            "temperature": 0,
            "echo": True,
            "logprobs": 1,
            "stream": True,
        },
    )
    assert status == 200
    events = [e for e in sse_events(raw) if isinstance(e, dict)]
    first = events[0]["choices"][0]
    assert first["prompt_token_ids"] == PROMPT_IDS  # echo sends the prompt's ids, as vLLM
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    values = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(tokens) == len(PROMPT_IDS) + 3 and values[0] is None
    text = "".join(e["choices"][0]["text"] for e in events)
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)


@pytest.mark.parametrize(
    "path,base",
    [
        ("/v1/completions", {"prompt": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ],
)
@pytest.mark.parametrize(
    "fields,message",
    [
        ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
        ({"prompt_logprobs": -1}, "Requested prompt logprobs of"),  # the vocabulary > max_logprobs
        ({"prompt_logprobs": 21}, "which is greater than max allowed: 20"),
        (
            {"prompt_logprobs": 1, "stream": True},
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
    ],
)
def test_bad_prompt_logprobs_are_400(tiny_server, path, base, fields, message):
    status, body = post(tiny_server.port, path, {**base, "max_tokens": 2, **fields})
    assert status == 400, body
    error = body["error"]
    assert message in error["message"] and error["param"] == "prompt_logprobs", error
    with pytest.raises(openai.BadRequestError):
        client = tiny_server.client()
        if path == "/v1/completions":
            client.completions.create(
                model=tiny_server.engine.served_model_name,
                prompt="hello",
                max_tokens=2,
                extra_body={"prompt_logprobs": -2},
            )
        else:
            client.chat.completions.create(
                model=tiny_server.engine.served_model_name,
                messages=base["messages"],
                max_tokens=2,
                extra_body={"prompt_logprobs": -2},
            )
    assert post(tiny_server.port, path, {**base, "max_tokens": 2})[0] == 200  # still serving


def test_whole_vocabulary_logprobs_with_max_logprobs_minus_one(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"max_logprobs": -1, "num_kv_blocks": 256})
    try:
        vocab = handle.engine.model_config.vocab_size
        client = handle.client()
        result = client.chat.completions.create(
            model=handle.engine.served_model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            logprobs=True,
            top_logprobs=-1,
            extra_body={"prompt_logprobs": -1},
        )
        assert len(result.choices[0].logprobs.content[0].top_logprobs) == vocab
        assert all(len(entry) == vocab for entry in result.prompt_logprobs[1:])
    finally:
        handle.close()
