"""The periodic engine stats line, as vLLM's LoggingStatLogger prints it:

    Engine 000: Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 203.1 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

Throughputs are the engine's token counters' growth since the previous line over the time
between them. "Preemptions: N" joins the line when the interval had any, and so does "Prompt
image tokens: N (M images)" (a vision-language model's prompt images; the prompt throughput
counts their tokens too). A line whose interval and the one before it moved no tokens goes to
DEBUG, so an idle server stays quiet at INFO.
The KV cache is named "GPU KV cache" on every device, as vLLM's CPU backend names it too.
"""

from __future__ import annotations

import logging
import time

from nanoserve import envs
from nanoserve.engine.stats import EngineStats

logger = logging.getLogger("nanoserve.stats")


class LoggingStatLogger:
    def __init__(self, stats: EngineStats, engine_index: int = 0, now: float | None = None) -> None:
        self.engine_index = engine_index
        self.interval = envs.log_stats_interval()  # VLLM_LOG_STATS_INTERVAL
        self._mark(stats, time.monotonic() if now is None else now)
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0

    def _mark(self, stats: EngineStats, now: float) -> None:
        self.last_log_time = now
        self.prompt_tokens = stats.prompt_tokens_total
        self.generation_tokens = stats.generation_tokens_total
        self.preemptions = stats.num_preemptions_total
        self.images = stats.prompt_images_total
        self.image_tokens = stats.prompt_image_tokens_total
        self.spec = stats.spec_decoding

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> None:
        """Log when an interval has passed since the last line (the offline loop calls this
        after every step)."""
        now = time.monotonic() if now is None else now
        if now - self.last_log_time >= self.interval:
            self.log(stats, now)

    def log(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_log_time
        prompt = (stats.prompt_tokens_total - self.prompt_tokens) / elapsed if elapsed > 0 else 0.0
        generation = (
            (stats.generation_tokens_total - self.generation_tokens) / elapsed
            if elapsed > 0
            else 0.0
        )
        preemptions = stats.num_preemptions_total - self.preemptions
        images = stats.prompt_images_total - self.images
        image_tokens = stats.prompt_image_tokens_total - self.image_tokens
        previous_spec = self.spec
        self._mark(stats, now)
        idle = not any(
            (prompt, generation, self.last_prompt_throughput, self.last_generation_throughput)
        )
        self.last_prompt_throughput, self.last_generation_throughput = prompt, generation
        parts = [
            "Avg prompt throughput: %.1f tokens/s",
            "Avg generation throughput: %.1f tokens/s",
            "Running: %d reqs",
            "Waiting: %d reqs",
        ]
        args: list[float] = [prompt, generation, stats.num_running, stats.num_waiting]
        if preemptions > 0:
            parts.append("Preemptions: %d")
            args.append(preemptions)
        if images > 0:
            parts.append("Prompt image tokens: %d (%d images)")
            args += [image_tokens, images]
        queries = stats.prefix_cache_queries_total
        hit_rate = stats.prefix_cache_hits_total / queries if queries else 0.0
        parts += ["GPU KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"]
        args += [stats.kv_cache_usage * 100, hit_rate * 100]
        (logger.debug if idle else logger.info)(
            f"Engine {self.engine_index:03d}: " + ", ".join(parts), *args
        )
        if stats.spec_decoding is not None and not idle:
            self._log_spec(stats.spec_decoding, previous_spec)

    @staticmethod
    def _log_spec(now, before) -> None:
        """vLLM's SpecDecoding line over the interval: mean acceptance length, the drafted and
        accepted tokens, the acceptance rate at each proposal position and overall."""
        drafts = now.num_drafts - (before.num_drafts if before else 0)
        if drafts == 0:
            return
        drafted = now.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = now.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        per_pos = [
            (count - (before.accepted_per_pos[i] if before else 0)) / drafts
            for i, count in enumerate(now.accepted_per_pos)
        ]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
            "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
            "rate: %.1f%%",
            1 + accepted / drafts,
            accepted,
            drafted,
            ", ".join(f"{rate:.3f}" for rate in per_pos),
            100 * accepted / drafted if drafted else 0.0,
        )
