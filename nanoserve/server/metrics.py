"""Prometheus text exposition with vLLM's metric names (`vllm:*`, all labelled by model_name).

Gauges and engine counters are read from the engine's stats snapshot at scrape time; the
latency histograms are fed by the async engine as outputs arrive (`Observer` protocol).
"""
from __future__ import annotations

import bisect
import math

from nanoserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def render(self, labels: str, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help_text}")
        lines.append(f"# TYPE {self.name} histogram")
        cumulative = 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{{labels},le="{_number(bound)}"}} {float(cumulative)}')
        lines.append(f"{self.name}_count{{{labels}}} {float(cumulative)}")
        lines.append(f"{self.name}_sum{{{labels}}} {_number(self.sum)}")


class ServerMetrics:
    """Request-level metrics (an async engine Observer) plus rendering of everything."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{_escape(model_name)}"'
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", TOKEN_BUCKETS)
        self.finished = {reason: 0 for reason in FINISH_REASONS}

    # ---- Observer ----
    def on_first_token(self, request_id: str, seconds_since_arrival: float) -> None:
        self.ttft.observe(seconds_since_arrival)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, output: RequestOutput | None, reason: str, e2e_seconds: float,
                    num_generated: int) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(e2e_seconds)
        self.generation_tokens.observe(num_generated)
        if output is not None:
            self.prompt_tokens.observe(len(output.prompt_token_ids))
            metrics = output.metrics
            if metrics is not None and metrics.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))

    # ---- exposition ----
    def render(self, stats) -> str:
        labels = self.labels
        lines: list[str] = []

        def sample(name: str, kind: str, help_text: str, value: float) -> None:
            base = name[:-6] if kind == "counter" and name.endswith("_total") else name
            lines.append(f"# HELP {base} {help_text}")
            lines.append(f"# TYPE {base} {kind}")
            lines.append(f"{name}{{{labels}}} {_number(value)}")

        sample("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", stats.num_running)
        sample("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", stats.num_waiting)
        sample("vllm:kv_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        sample("vllm:num_preemptions_total", "counter",
               "Cumulative number of preemption from the engine.", stats.num_preemptions_total)
        sample("vllm:prompt_tokens_total", "counter",
               "Number of prefill tokens processed.", stats.prompt_tokens_total)
        sample("vllm:generation_tokens_total", "counter",
               "Number of generation tokens processed.", stats.generation_tokens_total)
        sample("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               stats.prefix_cache_queries_total)
        sample("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.",
               stats.prefix_cache_hits_total)
        lines.append("# HELP vllm:request_success Count of successfully processed requests.")
        lines.append("# TYPE vllm:request_success counter")
        for reason, count in self.finished.items():
            lines.append(f'vllm:request_success_total{{{labels},finished_reason="{_escape(reason)}"}}'
                         f" {float(count)}")
        for histogram in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens,
                          self.generation_tokens):
            histogram.render(labels, lines)
        return "\n".join(lines) + "\n"
