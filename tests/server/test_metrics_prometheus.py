"""/metrics read back by prometheus_client's own parser: vLLM's families with their types and
label sets, and counters that move by exactly what known requests did. Two servers in one
process keep separate counts (a registry each)."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request
from tests.server.test_vllm_metrics import EXPECTED, EXTRA_LABELS, NANOSERVE

BASE_LABELS = {"model_name", "engine"}


def scrape(port: int) -> dict:
    status, headers, body = http_request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def sample(families: dict, family: str, name: str | None = None, **labels) -> float:
    found = [
        s.value
        for s in families[family].samples
        if s.name == (name or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def two_servers(tiny_llama_dir):
    handles = [ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 128}) for _ in range(2)]
    yield handles
    for handle in handles:
        handle.close()


def test_families_types_and_label_sets(two_servers):
    handle = two_servers[0]
    families = scrape(handle.port)
    # The parser names a counter family without its _total suffix, as the client library does.
    expected = {
        (name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name): kind
        for name, kind in (EXPECTED | NANOSERVE).items()
    }
    assert {name: family.type for name, family in families.items()} == expected
    model = handle.engine.served_model_name
    for name, family in families.items():
        assert family.samples, name
        for item in family.samples:
            keys = set(item.labels) - {"le"}
            assert not item.name.endswith("_created"), item.name
            if name == "vllm:cache_config_info":
                assert item.labels["engine"] == "0" and item.value == 1
            elif name == "vllm:admission_rejections":
                assert keys == {"model_name", "reason"} and item.labels["model_name"] == model
            else:
                extra = EXTRA_LABELS.get(name + "_total" if family.type == "counter" else name)
                assert keys == BASE_LABELS | ({extra[0]} if extra else set()), item
                assert item.labels["model_name"] == model and item.labels["engine"] == "0"
        if family.type == "histogram":
            bounds = [s.labels["le"] for s in family.samples if s.name == name + "_bucket"]
            assert bounds[-1] == "+Inf" and len(bounds) == len(set(bounds))


def test_counters_move_by_what_the_requests_did(two_servers):
    busy, other = two_servers
    model = busy.engine.served_model_name
    before, other_before = scrape(busy.port), scrape(other.port)
    client = busy.client()
    prompts = [[40 + i] * 10 for i in range(3)]  # 10 tokens each, under one block: no cache hits
    for prompt in prompts:
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):  # refused before the engine: counts nothing
        client.completions.create(model=model, prompt="hi", max_tokens=1, temperature=-1)
    after, other_after = scrape(busy.port), scrape(other.port)

    def delta(family: str, name: str | None = None, **labels) -> float:
        return sample(after, family, name, **labels) - sample(before, family, name, **labels)

    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 30
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == 12
    assert (
        delta(
            "vllm:prompt_tokens_by_source",
            "vllm:prompt_tokens_by_source_total",
            source="local_compute",
        )
        == 30
    )
    for reason, count in (("length", 3), ("stop", 0), ("abort", 0), ("error", 0)):
        assert (
            delta("vllm:request_success", "vllm:request_success_total", finished_reason=reason)
            == count
        )
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 30
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 12
    assert delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    assert (
        delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 3 * 3
    )
    assert (
        delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_bucket", le="5.0")
        == 3
    )  # 4 <= 5
    assert (
        delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_bucket", le="2.0")
        == 0
    )
    assert sample(after, "vllm:num_requests_running") == 0
    # the other server, in the same process, saw none of it
    for name in ("vllm:prompt_tokens_total", "vllm:request_success_total"):
        family = name[: -len("_total")]
        assert [s.value for s in other_after[family].samples] == [
            s.value for s in other_before[family].samples
        ]


def test_cache_config_info_carries_the_kv_pool_in_tokens(two_servers):
    """vLLM 0.32's labels, which its test_metrics_exist reads: the KV pool in tokens (here 128
    blocks of 16) and how many requests of max_model_len it holds."""
    handle = two_servers[0]
    (info,) = scrape(handle.port)["vllm:cache_config_info"].samples
    engine = handle.engine
    assert info.labels["num_gpu_blocks"] == "128" and info.labels["block_size"] == "16"
    assert int(info.labels["kv_cache_size_tokens"]) == 128 * 16
    assert float(info.labels["kv_cache_max_concurrency"]) == 128 * 16 / engine.max_model_len
