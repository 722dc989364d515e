"""/metrics exports vLLM 0.32's engine and request metrics (issue 18): the names, types and labels
of its PrometheusStatLogger, with counts that follow the requests served (the values vLLM's own
test_metrics.py expects)."""

from __future__ import annotations

import json
import re

import pytest

from nanoserve.server.metrics import token_buckets
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import http_request

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# vLLM 0.32, vllm/v1/metrics/loggers.py (PrometheusStatLogger), as exposed: name -> type
EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:engine_sleep_state": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:external_prefix_cache_queries_total": "counter",
    "vllm:external_prefix_cache_hits_total": "counter",
    "vllm:mm_cache_queries_total": "counter",
    "vllm:mm_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:prompt_tokens_by_source_total": "counter",
    "vllm:prompt_tokens_cached_total": "counter",
    "vllm:prompt_tokens_cached_by_source_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:admission_rejections_total": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:estimated_flops_per_gpu_total": "counter",
    "vllm:estimated_read_bytes_per_gpu_total": "counter",
    "vllm:estimated_write_bytes_per_gpu_total": "counter",
    "vllm:cache_config_info": "gauge",
    # vLLM V0's swap gauges (--preemption-mode swap, issue 11); 0 under preemption by recompute.
    "vllm:num_requests_swapped": "gauge",
    "vllm:cpu_cache_usage_perc": "gauge",
}
# nanoserve's own series beside them (the response cache, issue 11; prompt images, issue 56),
# labelled the same way
NANOSERVE = {
    "nanoserve:response_cache_queries_total": "counter",
    "nanoserve:response_cache_hits_total": "counter",
    "nanoserve:prompt_images_total": "counter",
    "nanoserve:prompt_image_tokens_total": "counter",
}
EXTRA_LABELS = {
    "vllm:num_requests_waiting_by_reason": ("reason", {"capacity", "deferred"}),
    "vllm:engine_sleep_state": ("sleep_state", {"awake", "weights_offloaded", "discard_all"}),
    "vllm:prompt_tokens_by_source_total": (
        "source",
        {"local_compute", "local_cache_hit", "external_kv_transfer"},
    ),
    "vllm:prompt_tokens_cached_by_source_total": (
        "source",
        {"device", "host", "p2p", "disk", "external_unspecified"},
    ),
    "vllm:request_success_total": (
        "finished_reason",
        {"stop", "length", "abort", "error", "repetition"},
    ),
}


def scrape(port: int) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    status, headers, body = http_request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    types, samples = {}, []
    for line in body.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            name, labels, value = SAMPLE.match(line).groups()
            samples.append((name, dict(LABEL.findall(labels or "")), float(value)))
    return types, samples


def value(samples, name: str, **labels) -> float:
    found = [
        v for n, got, v in samples if n == name and all(got.get(k) == x for k, x in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def metrics_server(tiny_llama_dir):
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 256})
    yield handle
    handle.close()


def test_every_vllm_metric_with_its_type_and_labels(metrics_server):
    http_request(
        metrics_server.port,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "hello", "max_tokens": 2}),
    )
    types, samples = scrape(metrics_server.port)
    assert types == EXPECTED | NANOSERVE
    model = metrics_server.engine.served_model_name
    for name, kind in (EXPECTED | NANOSERVE).items():
        mine = [
            (n, labels)
            for n, labels, _ in samples
            if n == name or (kind == "histogram" and n.rsplit("_", 1)[0] == name)
        ]
        assert mine, name
        for sample_name, labels in mine:
            keys = set(labels) - {"le"}
            if name == "vllm:cache_config_info":
                assert labels["engine"] == "0" and labels["block_size"] == "16"
                continue
            if name == "vllm:admission_rejections_total":  # vLLM labels it without engine
                assert keys == {"model_name", "reason"} and labels["model_name"] == model
                continue
            assert labels["model_name"] == model and labels["engine"] == "0", sample_name
            extra = EXTRA_LABELS.get(name)
            assert keys == {"model_name", "engine"} | ({extra[0]} if extra else set()), sample_name
        if name in EXTRA_LABELS:
            label, values = EXTRA_LABELS[name]
            assert {labels[label] for _, labels in mine} == values
    assert value(samples, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_counts_follow_the_requests(tiny_llama_dir):
    """vLLM's test_metrics_counts: N sequential requests of P prompt tokens and T new tokens."""
    handle = ServerHandle(tiny_llama_dir, engine_kwargs={"num_kv_blocks": 256})
    try:
        requests, prompt, new_tokens = 4, list(range(40, 50)), 5  # P < one block: no cache hits
        client = handle.client()
        for _ in range(requests):
            client.completions.create(
                model=handle.engine.served_model_name,
                prompt=prompt,
                max_tokens=new_tokens,
                extra_body={"ignore_eos": True},
            )
        _, samples = scrape(handle.port)
        n, p, t = requests, len(prompt), new_tokens
        expected = {
            "vllm:time_to_first_token_seconds_count": n,
            "vllm:e2e_request_latency_seconds_count": n,
            "vllm:request_queue_time_seconds_count": n,
            "vllm:request_inference_time_seconds_count": n,
            "vllm:request_prefill_time_seconds_count": n,
            "vllm:request_decode_time_seconds_count": n,
            "vllm:request_prompt_tokens_sum": n * p,
            "vllm:request_prompt_tokens_count": n,
            "vllm:request_generation_tokens_sum": n * t,
            "vllm:request_generation_tokens_count": n,
            "vllm:request_params_n_count": n,
            "vllm:request_params_n_sum": n,
            "vllm:request_params_max_tokens_sum": n * t,
            "vllm:request_params_max_tokens_count": n,
            "vllm:request_max_num_generation_tokens_sum": n * t,
            "vllm:iteration_tokens_total_sum": n * (p + t),
            "vllm:iteration_tokens_total_count": n * t,
            "vllm:inter_token_latency_seconds_count": n * (t - 1),
            "vllm:request_time_per_output_token_seconds_count": n,
            "vllm:request_num_preemptions_sum": 0,
            "vllm:request_num_preemptions_count": n,
            "vllm:request_prefill_kv_computed_tokens_sum": n * p,
            "vllm:prompt_tokens_total": n * p,
            "vllm:generation_tokens_total": n * t,
            "vllm:prompt_tokens_cached_total": 0,
        }
        for name, count in expected.items():
            assert value(samples, name) == count, name
        assert value(samples, "vllm:request_success_total", finished_reason="length") == n
        assert value(samples, "vllm:prompt_tokens_by_source_total", source="local_compute") == n * p
        # every histogram: cumulative buckets, +Inf equal to the count
        for name in {s[0][: -len("_bucket")] for s in samples if s[0].endswith("_bucket")}:
            buckets = [v for s, _, v in samples if s == name + "_bucket"]
            assert buckets == sorted(buckets)
            assert buckets[-1] == value(samples, name + "_count")
        # A prompt of 40 tokens asked twice: the second reads two blocks from the prefix cache.
        for _ in range(2):
            client.completions.create(
                model=handle.engine.served_model_name, prompt=list(range(60, 100)), max_tokens=1
            )
        _, samples = scrape(handle.port)
        assert value(samples, "vllm:prompt_tokens_cached_total") == 32
        assert value(samples, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 32
        assert (
            value(samples, "vllm:prompt_tokens_cached_by_source_total", source="device")
            == value(samples, "vllm:prefix_cache_hits_total")
            == 32
        )
    finally:
        handle.close()


def test_admission_rejections_are_counted(tiny_llama_dir):
    handle = ServerHandle(
        tiny_llama_dir, engine_kwargs={"num_kv_blocks": 256}, max_waiting_requests=0
    )  # every request is refused
    try:
        for _ in range(3):
            status, _, _ = http_request(
                handle.port,
                "POST",
                "/v1/completions",
                json.dumps({"prompt": "hi", "max_tokens": 2}),
            )
            assert status == 503
        _, samples = scrape(handle.port)
        assert value(samples, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 3
        assert (
            value(samples, "vllm:num_requests_waiting_by_reason", reason="capacity")
            == value(samples, "vllm:num_requests_waiting")
            == 0
        )
    finally:
        handle.close()


def test_token_buckets_as_vllm():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(512)[-1] == 500
