"""vLLM's scheduler gauges and engine counters, read from the engine's stats snapshot when
/metrics is scraped (a prometheus_client custom collector: the engine owns these counts)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from nanoserve.engine.stats import EngineStats, LoRAStats

CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


class EngineStatsCollector:
    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.label_values = [model_name, engine]
        self.stats: EngineStats | None = None  # set before each scrape

    def _family(
        self,
        kind: str,
        name: str,
        documentation: str,
        values: float | dict[str, float],
        label: str | None = None,
    ) -> Metric:
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        labels = ["model_name", "engine"] + ([label] if label else [])
        family = family_type(name, documentation, labels=labels)
        if label is None:
            family.add_metric(self.label_values, values)
        else:
            for key, value in values.items():
                family.add_metric(self.label_values + [key], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        yield from self._scheduler_gauges(stats)
        yield from self._cache_metrics(stats)
        yield from self._engine_counters(stats)
        if stats.spec_decoding is not None:
            yield from self._spec_decode_counters(stats.spec_decoding)
        if stats.lora is not None:
            yield self._lora_info(stats.lora)

    @staticmethod
    def _lora_info(lora: LoRAStats) -> Metric:
        """vLLM's LoRA gauge: the adapters in use as labels, the time of the snapshot as value."""
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        labels = [str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)]
        family.add_metric(labels, time.time())
        return family

    def _spec_decode_counters(self, spec) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (with --speculative-config)."""
        family = self._family
        yield family(
            "counter",
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.",
            spec.num_drafts,
        )
        yield family(
            "counter",
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.",
            spec.num_draft_tokens,
        )
        yield family(
            "counter",
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            spec.num_accepted_tokens,
        )
        yield family(
            "counter",
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            {str(position): count for position, count in enumerate(spec.accepted_per_pos)},
            "position",
        )

    def _scheduler_gauges(self, stats: EngineStats) -> Iterator[Metric]:
        family = self._family
        yield family(
            "gauge",
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running,
        )
        yield family(
            "gauge",
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_waiting,
        )
        yield family(
            "gauge",
            "vllm:num_requests_swapped",
            "Number of requests swapped to CPU.",
            stats.num_swapped,
        )
        yield family(
            "gauge",
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting "
            "for scheduling capacity; 'deferred' = deferred by transient constraints "
            "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            {"capacity": stats.num_waiting, "deferred": 0},
            "reason",
        )
        yield family(
            "gauge",
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
            "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 "
            "means sleep level 2.",
            {"awake": 1, "weights_offloaded": 0, "discard_all": 0},
            "sleep_state",
        )

    def _cache_metrics(self, stats: EngineStats) -> Iterator[Metric]:
        family = self._family
        yield family(
            "gauge",
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage,
        )
        yield family(
            "gauge",
            "vllm:cpu_cache_usage_perc",
            "CPU KV-cache usage. 1 means 100 percent usage.",
            stats.cpu_cache_usage,
        )
        yield family(
            "counter",
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries_total,
        )
        yield family(
            "counter",
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits_total,
        )
        yield family(
            "counter",
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache "
            "sharing, in terms of number of queried tokens.",
            0,
        )
        yield family(
            "counter",
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            0,
        )
        yield family(
            "counter",
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
            0,
        )
        yield family(
            "counter",
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items.",
            0,
        )

    def _engine_counters(self, stats: EngineStats) -> Iterator[Metric]:
        family = self._family
        cached = stats.prompt_tokens_cached_total
        yield family(
            "counter",
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            stats.num_preemptions_total,
        )
        yield family(
            "counter",
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            stats.prompt_tokens_total,
        )
        yield family(
            "counter",
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            {
                "local_compute": stats.prompt_tokens_total - cached,
                "local_cache_hit": cached,
                "external_kv_transfer": 0,
            },
            "source",
        )
        yield family(
            "counter",
            "nanoserve:prompt_image_tokens",
            "Number of prompt tokens that stand for images (counted in vllm:prompt_tokens too).",
            stats.prompt_image_tokens_total,
        )
        yield family(
            "counter",
            "nanoserve:prompt_images",
            "Number of images in prompts.",
            stats.prompt_images_total,
        )
        yield family(
            "counter",
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            cached,
        )
        yield family(
            "counter",
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified. Counted at admission; sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            {
                source: stats.prefix_cache_hits_total if source == "device" else 0
                for source in CACHE_HIT_SOURCES
            },
            "source",
        )
        yield family(
            "counter",
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens_total,
        )
        for name, what in (
            ("flops", "floating point operations"),
            ("read_bytes", "bytes read from memory"),
            ("write_bytes", "bytes written to memory"),
        ):
            yield family(
                "counter",
                f"vllm:estimated_{name}_per_gpu",
                f"Estimated number of {what} per GPU (for Model Flops Utilization calculations).",
                0,
            )
