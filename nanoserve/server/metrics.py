"""/metrics through prometheus_client (vLLM's choice) with vLLM 0.32's metric names, types,
labels and buckets.

Each server has its own CollectorRegistry, so several can live in one process. Every series
carries model_name and engine="0" (one engine), as vLLM's PrometheusStatLogger. The request
histograms and request counters are prometheus_client metrics fed by the async engine as
requests finish (the `Observer` protocol); gauges and engine counters are read from the
engine's stats snapshot at scrape time (`EngineStatsCollector`). Series that only exist with
features nanoserve lacks (LoRA, speculative decoding, KV connectors) are left out; the ones vLLM
always exports for them stay at 0. The `_created` series prometheus_client adds are left out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily

from nanoserve.engine.async_engine import FinishedRequestStats
from nanoserve.server.engine_metrics import EngineStatsCollector
from nanoserve.server.response_cache import ResponseCache

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
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


class _WithoutCreated:
    """The registry's families less prometheus_client's `_created` series (vLLM's dashboards
    do not use them; they doubled the scrape)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


class ResponseCacheCollector:
    """nanoserve:response_cache_{queries,hits}_total, read from the cache at scrape time (0
    without a cache). Queries count the requests looked up: those whose output their input
    determines."""

    def __init__(self, model_name: str, cache: ResponseCache | None) -> None:
        self.label_values = [model_name, "0"]
        self.cache = cache

    def collect(self):
        cache = self.cache
        queries, hits = (0, 0) if cache is None else (cache.queries, cache.hits)
        for name, documentation, value in (
            ("queries", "Response cache lookups, in requests.", queries),
            ("hits", "Requests answered from the response cache.", hits),
        ):
            family = CounterMetricFamily(
                f"nanoserve:response_cache_{name}", documentation, labels=["model_name", "engine"]
            )
            family.add_metric(self.label_values, value)
            yield family


class ServerMetrics:
    """Request-level metrics (an async engine Observer) plus the /metrics exposition."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 8192,
        cache_config: dict[str, object] | None = None,
        response_cache: ResponseCache | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._exposed = _WithoutCreated(self.registry)
        self.engine_stats = EngineStatsCollector(model_name)
        self.registry.register(self.engine_stats)
        self.registry.register(ResponseCacheCollector(model_name, response_cache))
        self._labels = {"model_name": model_name, "engine": "0"}
        tokens = token_buckets(max_model_len)
        counter = self._counter
        self.finished = counter(
            "request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            FINISH_REASONS,
            **self._labels,
        )
        self.admission_rejections = counter(
            "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            "reason",
            ADMISSION_REASONS,
            model_name=model_name,
        )
        self._make_token_histograms(tokens)
        self._make_latency_histograms()
        histogram = self._histogram
        self.num_preemptions = histogram(
            "request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        info = {key: str(value) for key, value in (cache_config or {}).items()}
        info["engine"] = "0"
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=self.registry,
        ).labels(**info).set(1)

    def _histogram(self, name: str, documentation: str, buckets) -> Histogram:
        labels = self._labels
        return Histogram(
            "vllm:" + name, documentation, list(labels), buckets=buckets, registry=self.registry
        ).labels(**labels)

    def _counter(self, name: str, documentation: str, label: str, values, **fixed) -> dict:
        family = Counter("vllm:" + name, documentation, [*fixed, label], registry=self.registry)
        return {value: family.labels(**fixed, **{label: value}) for value in values}

    def _make_token_histograms(self, tokens: list[float]) -> None:
        """Per-request and per-step token counts, and the request's parameters."""
        histogram = self._histogram
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )

    def _make_latency_histograms(self) -> None:
        """Per-request phases (vLLM's: queued, prefill, decode) and token latencies."""
        histogram = self._histogram
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    # ---- Observer ----
    def on_first_token(self, request_id: str, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_step(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self._count(self.finished, stats.finish_reason)
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
        self._count(self.admission_rejections, reason)

    @staticmethod
    def _count(counters: dict, key: str) -> None:
        counter = counters.get(key)
        if counter is not None:  # vLLM's label set is fixed; others are not exported
            counter.inc()

    # ---- exposition ----
    def render(self, stats) -> bytes:
        """The Prometheus text format (0.0.4) of everything, engine figures from `stats`."""
        self.engine_stats.stats = stats
        return generate_latest(self._exposed)
