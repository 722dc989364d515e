"""Speculative decoding through the command line and a real server: the flag is vLLM's, a bad
config is one line, /metrics carries vLLM's spec_decode counters (parsed with
prometheus_client's parser), and the served tokens equal the offline engine's without it."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from nanoserve import LLM, SamplingParams
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.spec_decode.test_spec_engine import NGRAM, repetitive_prompts
from tests.test_cli import run_cli


def test_generate_with_the_flag_and_a_bad_config(tiny_llama_dir):
    good = run_cli(
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--num-kv-blocks",
        "64",
        "--speculative-config",
        json.dumps(NGRAM),
        "a b a b a b",
    )
    assert good.returncode == 0, good.stderr
    bad = run_cli(
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--speculative-config",
        '{"method": "ngram"}',
        "hi",
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_speculative_tokens" in lines[0]


def test_served_tokens_and_metrics(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir, {"dtype": "float32", "num_kv_blocks": 256, "speculative_config": NGRAM}
    )
    try:
        prompts = repetitive_prompts(8, seed=1)  # some of whose continuations repeat them
        result = handle.client().completions.create(
            model=handle.engine.served_model_name,
            prompt=prompts,
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        expected = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256).generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            use_tqdm=False,
        )
        assert [c.model_extra["token_ids"] for c in result.choices] == [
            o.outputs[0].token_ids for o in expected
        ]
        _, _, body = http_request(handle.port, "GET", "/metrics")
        samples = {
            (s.name, s.labels.get("position")): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
        drafted = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
        accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
        per_pos = [
            samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
            for i in range(4)
        ]
        assert drafts > 0 and 0 < accepted <= drafted <= 4 * drafts
        assert sum(per_pos) == accepted
    finally:
        handle.close()
