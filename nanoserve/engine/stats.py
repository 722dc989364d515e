"""The engine's stats snapshot: what /metrics and the periodic log line read, taken between
steps from the schedulers, block managers and counters that own each figure."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Sequences
from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.output_processor import OutputProcessor
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode.metrics import SpecDecodingStats
from nanoserve.engine.swap import HostBlockPool
from nanoserve.lora.registry import LoRARegistry


@dataclass(slots=True)
class LoRAStats:
    """--enable-lora: vLLM's lora_requests_info gauge's labels."""

    max_loras: int
    waiting: list[str]  # the adapters of waiting requests, by name
    running: list[str]  # the adapters of running requests, by name


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_tokens_cached_total: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_images_total: int = 0  # vision-language models: the images of prompts
    prompt_image_tokens_total: int = 0  # and their tokens (counted in prompt_tokens_total too)
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_swapped: int = 0  # requests with a sequence swapped out to the host pool
    num_swap_outs_total: int = 0  # sequences swapped out
    cpu_cache_usage: float = 0.0  # fraction of the host pool's blocks in use
    spec_decoding: SpecDecodingStats | None = None  # with --speculative-config
    lora: LoRAStats | None = None  # with --enable-lora


def collect_stats(
    schedulers: Sequences[Scheduler],
    managers: Sequences[BlockManager],
    tokens: OutputProcessor,
    config: EngineConfig,
    host_pool: HostBlockPool | None,
    spec_stats: SpecDecodingStats | None,
    lora_registry: LoRARegistry | None,
) -> EngineStats:
    """Sums over the schedulers and block managers (one of each unless pipelined); the token
    counters are the output processor's."""
    num_blocks = sum(m.num_blocks for m in managers)
    return EngineStats(
        num_running=len({s.request_id for x in schedulers for s in x.running}),
        num_waiting=len({s.request_id for x in schedulers for s in x.waiting}),
        # (An encoder model holds no KV blocks.)
        kv_cache_usage=sum(m.num_used_blocks for m in managers) / num_blocks if num_blocks else 0.0,
        num_preemptions_total=sum(x.num_preemptions for x in schedulers),
        prefix_cache_queries_total=sum(m.prefix_cache_queries for m in managers),
        prefix_cache_hits_total=sum(m.prefix_cache_hits for m in managers),
        prompt_tokens_total=tokens.prompt_tokens_total,
        generation_tokens_total=tokens.generation_tokens_total,
        prompt_tokens_cached_total=tokens.prompt_tokens_cached_total,
        prompt_images_total=tokens.prompt_images_total,
        prompt_image_tokens_total=tokens.prompt_image_tokens_total,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_swapped=len({s.request_id for x in schedulers for s in x.swapped}),
        num_swap_outs_total=sum(x.num_swap_outs for x in schedulers),
        cpu_cache_usage=host_pool.usage if host_pool is not None else 0.0,
        spec_decoding=spec_stats.snapshot() if spec_stats is not None else None,
        lora=lora_stats(config.max_loras, schedulers, lora_registry)
        if lora_registry is not None
        else None,
    )


def lora_stats(
    max_loras: int, schedulers: Sequences[Scheduler], registry: LoRARegistry
) -> LoRAStats:
    """The adapters of the waiting and of the running requests, by name."""

    def names(seqs: Iterable[Sequence]) -> list[str]:
        return registry.names({seq.lora_id for seq in seqs if seq.lora_id})

    waiting = names(seq for x in schedulers for seq in x.waiting)
    running = names(seq for x in schedulers for seq in x.running)
    return LoRAStats(max_loras, waiting, running)
