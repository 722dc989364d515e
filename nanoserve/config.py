"""EngineConfig: one dataclass built once (from CLI flags or LLM(**kwargs)) that flows down."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct, imported once)
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model dir
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB for the KV pool on CPU; None: sized automatically
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # override the pool size (tests)
    # GiB of host memory per rank for KV blocks of swapped-out sequences (vLLM's --swap-space);
    # allocated only with preemption_mode "swap".
    swap_space: float = 4.0
    # What preemption does when KV blocks run out: "recompute" frees the sequence's blocks and
    # computes its tokens again later; "swap" copies its blocks to the host pool and back (falling
    # back to recompute when the host pool is full). vLLM V0's --preemption-mode.
    preemption_mode: str = "recompute"
    num_swap_blocks: int | None = None  # override the host pool size (tests)
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    # Decoder layers split into this many contiguous stages (vLLM's --pipeline-parallel-size);
    # ranks = tensor_parallel_size x pipeline_parallel_size.
    pipeline_parallel_size: int = 1
    # CPU: torch / OpenMP threads per rank; None: the CPUs this process may use (affinity and
    # cgroup quota) shared among this machine's ranks.
    cpu_threads: int | None = None
    # CUDA: capture the decode steps as CUDA graphs at startup unless True (vLLM's flag). Steps
    # on a CPU, and with tensor parallelism, are always eager.
    enforce_eager: bool = False
    max_logprobs: int = 20
    max_n_sequences: int = 128  # most outputs per request (`n`), as vLLM's VLLM_MAX_N_SEQUENCES
    # "fcfs": arrival order, a request's priority must be 0; "priority": lower value first, then
    # arrival (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"
    # The periodic "Engine 000: Avg prompt throughput ..." line; on for a server, as `vllm serve`
    # (the offline LLM turns it off unless asked, as vLLM's LLM does).
    disable_log_stats: bool = False
    # Distributed rendezvous (multi-node); None = single host.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or >= 0, got "
                             f"{self.max_logprobs}")
        if self.max_n_sequences < 1:
            raise ValueError(f"max_n_sequences must be >= 1, got {self.max_n_sequences}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if (self.preemption_mode == "swap" and self.num_swap_blocks is None
                and self.swap_space == 0):
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 GiB")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.preemption_mode == "swap":
            raise ValueError("preemption_mode 'swap' is not supported with pipeline parallelism "
                             "(use the default, recompute)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


def nanoserve_home() -> Path:
    return Path(os.environ.get("NANOSERVE_HOME", Path.home() / ".cache" / "nanoserve"))
