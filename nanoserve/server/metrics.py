"""Prometheus text exposition with vLLM 0.32's metric names, types and labels, written by hand.

Every series carries model_name and engine="0" (one engine), as vLLM's PrometheusStatLogger;
labels are sorted and numbers formatted as prometheus_client writes them. Gauges and engine
counters are read from the engine's stats snapshot at scrape time; the request histograms are
fed by the async engine as requests finish (the `Observer` protocol). Series that only exist
with features nanoserve lacks (LoRA, speculative decoding, KV connectors) are left out; the
ones vLLM always exports for them stay at 0.
"""
from __future__ import annotations

import bisect
import math

from nanoserve.engine.async_engine import FinishedRequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's request-token buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def format_number(value: float) -> str:
    """As prometheus_client (Go's formatting): 1.0, +Inf, 1e+06."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items())) + "}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def render(self, labels: dict[str, str], lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help_text}")
        lines.append(f"# TYPE {self.name} histogram")
        cumulative = 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            cumulative += count
            bucket_labels = _labels({**labels, "le": format_number(bound)})
            lines.append(f"{self.name}_bucket{bucket_labels} {format_number(cumulative)}")
        lines.append(f"{self.name}_count{_labels(labels)} {format_number(cumulative)}")
        lines.append(f"{self.name}_sum{_labels(labels)} {format_number(self.sum)}")


class ServerMetrics:
    """Request-level metrics (an async engine Observer) plus rendering of everything."""

    def __init__(self, model_name: str, max_model_len: int = 8192,
                 cache_config: dict[str, object] | None = None) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.cache_config = {key: str(value) for key, value in (cache_config or {}).items()}
        tokens = token_buckets(max_model_len)

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram("vllm:" + name, help_text, buckets)

        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.num_preemptions = histogram(
            "request_num_preemptions", "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.finished = {reason: 0 for reason in FINISH_REASONS}
        self.admission_rejections = {reason: 0 for reason in ADMISSION_REASONS}

    # ---- Observer ----
    def on_first_token(self, request_id: str, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_step(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self.finished[stats.finish_reason] = self.finished.get(stats.finish_reason, 0) + 1
        self.e2e.observe(stats.e2e_seconds)
        self.queue_time.observe(stats.queued_seconds)
        self.prefill_time.observe(stats.prefill_seconds)
        self.inference_time.observe(stats.inference_seconds)
        self.decode_time.observe(stats.decode_seconds)
        self.num_preemptions.observe(stats.num_preemptions)
        self.prefill_kv_computed.observe(stats.num_prompt_tokens - max(stats.num_cached_tokens, 0))
        self.prompt_tokens.observe(stats.num_prompt_tokens)
        self.generation_tokens.observe(stats.num_generation_tokens)
        self.tpot.observe(stats.time_per_output_token)
        if stats.max_tokens:
            self.params_max_tokens.observe(stats.max_tokens)
        self.max_generation_tokens.observe(stats.max_num_generation_tokens)
        self.params_n.observe(stats.n)

    def on_admission_rejected(self, reason: str) -> None:
        self.admission_rejections[reason] = self.admission_rejections.get(reason, 0) + 1

    # ---- exposition ----
    def render(self, stats) -> str:
        base = self.labels
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str,
                   samples: list[tuple[dict[str, str], float]]) -> None:
            sample_name = name + "_total" if kind == "counter" else name
            lines.append(f"# HELP {sample_name} {help_text}")
            lines.append(f"# TYPE {sample_name} {kind}")
            for labels, value in samples:
                lines.append(f"{sample_name}{_labels(labels)} {format_number(value)}")

        def one(name: str, kind: str, help_text: str, value: float) -> None:
            family(name, kind, help_text, [(base, value)])

        def by(label: str, values: dict[str, float]) -> list[tuple[dict[str, str], float]]:
            return [({**base, label: key}, value) for key, value in values.items()]

        cached = stats.prompt_tokens_cached_total
        one("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
            stats.num_running)
        one("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
            stats.num_waiting)
        family("vllm:num_requests_waiting_by_reason", "gauge",
               "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
               "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
               "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
               by("reason", {"capacity": stats.num_waiting, "deferred": 0}))
        family("vllm:engine_sleep_state", "gauge",
               "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
               "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
               "level 2.", by("sleep_state", {"awake": 1, "weights_offloaded": 0, "discard_all": 0}))
        one("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage)
        one("vllm:prefix_cache_queries", "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries_total)
        one("vllm:prefix_cache_hits", "counter",
            "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits_total)
        one("vllm:external_prefix_cache_queries", "counter",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.", 0)
        one("vllm:external_prefix_cache_hits", "counter",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
            "of number of cached tokens.", 0)
        one("vllm:mm_cache_queries", "counter",
            "Multi-modal cache queries, in terms of number of queried items.", 0)
        one("vllm:mm_cache_hits", "counter",
            "Multi-modal cache hits, in terms of number of cached items.", 0)
        one("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
            stats.num_preemptions_total)
        one("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
            stats.prompt_tokens_total)
        family("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.",
               by("source", {"local_compute": stats.prompt_tokens_total - cached,
                             "local_cache_hit": cached, "external_kv_transfer": 0}))
        one("vllm:prompt_tokens_cached", "counter",
            "Number of cached prompt tokens (local + external).", cached)
        family("vllm:prompt_tokens_cached_by_source", "counter",
               "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
               "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
               "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
               "vllm:external_prefix_cache_hits.",
               by("source", {source: stats.prefix_cache_hits_total if source == "device" else 0
                             for source in CACHE_HIT_SOURCES}))
        one("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
            stats.generation_tokens_total)
        family("vllm:request_success", "counter", "Count of successfully processed requests.",
               by("finished_reason", self.finished))
        family("vllm:admission_rejections", "counter",
               "Number of admission attempts rejected by a queue limit, by reason.",
               [({"model_name": base["model_name"], "reason": reason}, count)
                for reason, count in self.admission_rejections.items()])
        for histogram in (self.prompt_tokens, self.generation_tokens, self.iteration_tokens,
                          self.max_generation_tokens, self.params_n, self.params_max_tokens,
                          self.ttft, self.itl, self.tpot, self.e2e, self.queue_time,
                          self.inference_time, self.prefill_time, self.decode_time,
                          self.num_preemptions, self.prefill_kv_computed):
            histogram.render(base, lines)
        for name, what in (("flops", "floating point operations"), ("read_bytes", "bytes read from"),
                           ("write_bytes", "bytes written to")):
            text = f"{what} memory" if "bytes" in name else what
            one(f"vllm:estimated_{name}_per_gpu", "counter",
                f"Estimated number of {text} per GPU (for Model Flops Utilization calculations).",
                0)
        family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [({**self.cache_config, "engine": "0"}, 1)])
        return "\n".join(lines) + "\n"
