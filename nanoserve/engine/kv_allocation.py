"""Sizing and allocating a ModelRunner's KV cache: the device pool (from --kv-cache-memory on a
CPU, from a profiled forward pass and --gpu-memory-utilization on CUDA, the same on every rank)
and the host pool that swapped-out sequences' blocks go to (preemption mode "swap")."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from nanoserve.distributed import get_pp_rank
from nanoserve.distributed.pipeline import real_layers
from nanoserve.engine.gpu_memory import kv_cache_budget
from nanoserve.engine.kv_swap import KVSwapper
from nanoserve.kernels.cpu.malloc import zeros_on_huge_pages
from nanoserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

GIB = 1 << 30
# The CPU pool's default (no --kv-cache-memory): room for DEFAULT_CPU_KV_SEQUENCES sequences of
# the context length served, at the model's bytes a token, at most DEFAULT_CPU_KV_CACHE_GIB and a
# quarter of the memory available at start. Its pages are resident only once written
# (cpu_malloc.zeros_on_huge_pages), so a lone user holds what the conversation has used.
DEFAULT_CPU_KV_CACHE_GIB = 2.0
DEFAULT_CPU_KV_SEQUENCES = 4


class KVCacheAllocation:
    """ModelRunner's KV-cache half (a mixin: it reads the runner's config, model, device, kv_dtype,
    block_size, world_size, weight_bytes and memory_at_start, and sets the pools on its layers)."""

    def _kv_bytes_per_block(self) -> int:
        layers = self.stage_layers()  # with pipeline parallelism, only this stage's layers
        attention = layers[0].self_attn
        element = self.kv_dtype.itemsize
        per_layer = 2 * self.block_size * attention.num_kv_heads * attention.head_dim * element
        return per_layer * len(layers)

    def stage_layers(self) -> list[torch.nn.Module]:
        return real_layers(self.model.model.layers)

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cpu":
            if self.config.kv_cache_memory:
                self.kv_sizing = "--kv-cache-memory"
                return int(self.config.kv_cache_memory * GIB)
            return self._default_cpu_kv_bytes()
        budget, self.memory_profile = kv_cache_budget(
            self.device, self.config.gpu_memory_utilization, self.memory_at_start, self.profile_run
        )
        return budget

    def _default_cpu_kv_bytes(self) -> int:
        """DEFAULT_CPU_KV_SEQUENCES x the context length, in bytes, within the caps; how it was
        reached goes into the start-up log line (self.kv_sizing)."""
        context = self.config.max_model_len or self.model_config.max_position_embeddings
        sequences = min(DEFAULT_CPU_KV_SEQUENCES, self.config.max_num_seqs)
        per_token = self._kv_bytes_per_block() / self.block_size
        wanted = int(sequences * context * per_token)
        caps = {f"{DEFAULT_CPU_KV_CACHE_GIB:g} GiB": int(DEFAULT_CPU_KV_CACHE_GIB * GIB)}
        available = available_memory_bytes()
        if available is not None:
            caps["a quarter of the memory available"] = available // 4
        cap_name, cap = min(caps.items(), key=lambda item: item[1])
        self.kv_sizing = (
            f"default: {sequences} sequences x {context} tokens x {per_token / 1024:.1f} KiB a token"
            + (f", capped at {cap_name}" if cap < wanted else "")
            + "; --kv-cache-memory GiB sets it"
        )
        return min(wanted, cap)

    def _host_blocks_wanted(self) -> int:
        if self.config.preemption_mode != "swap":
            return 0
        if self.config.num_swap_blocks is not None:
            return self.config.num_swap_blocks
        return int(self.config.swap_space * GIB) // self._kv_bytes_per_block()

    def _allocate_kv_cache(self) -> int:
        self.kv_sizing = (
            "num_kv_blocks" if self.config.num_kv_blocks else "--gpu-memory-utilization"
        )
        num_blocks = (
            self.config.num_kv_blocks or self._kv_budget_bytes() // self._kv_bytes_per_block()
        )
        self.num_swap_blocks = self._host_blocks_wanted()
        if self.world_size > 1:
            # Every rank must hold the same blocks (the min over stages too); also collect each
            # rank's weight bytes.
            local = torch.tensor(
                [num_blocks, self.weight_bytes, self.num_swap_blocks],
                dtype=torch.long,
                device=self.device,
            )
            gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local)
            num_blocks = min(int(g[0]) for g in gathered)
            self.rank_weight_bytes = [int(g[1]) for g in gathered]
            self.num_swap_blocks = min(int(g[2]) for g in gathered)
        if num_blocks < 1:
            raise ValueError(
                "the KV cache budget does not hold a single block; raise --kv-cache-memory"
            )
        for layer in self.stage_layers():
            attn = layer.self_attn.attn
            attn.key_cache = self._new_cache(num_blocks, attn.num_kv_heads, attn.head_dim)
            attn.value_cache = self._new_cache(num_blocks, attn.num_kv_heads, attn.head_dim)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s; %s)",
            num_blocks,
            self.block_size,
            num_blocks * self._kv_bytes_per_block() / GIB,
            str(self.kv_dtype).removeprefix("torch."),
            self.kv_sizing,
        )
        return num_blocks

    def _allocate_host_pool(self) -> KVSwapper | None:
        if self.config.preemption_mode != "swap":
            return None
        pools = []
        for layer in self.stage_layers():
            pools += [layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache]
        swapper = KVSwapper(pools, self.num_swap_blocks)
        logger.info(
            "swap space: %d blocks of %d tokens (%.2f GiB)",
            self.num_swap_blocks,
            self.block_size,
            swapper.host_bytes / GIB,
        )
        return swapper

    def _new_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """A [num_blocks, block_size, num_kv_heads, head_dim] cache. On CPU it is head-major
        underneath, so the torch path gathers each head's keys contiguously (no permuted copy
        per step); the kernels take any strides. Never-written slots are masked by attention,
        so the pool need not be zeroed. On CPU it lies on transparent huge pages where the kernel
        gives them (cpu_malloc.zeros_on_huge_pages)."""
        if self.device.type == "cpu":
            physical = zeros_on_huge_pages(
                (num_blocks, num_kv_heads, self.block_size, head_dim), self.kv_dtype
            )
            return physical.permute(0, 2, 1, 3)
        return torch.empty(
            (num_blocks, self.block_size, num_kv_heads, head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass over max_num_batched_tokens tokens without a KV cache write."""
        num_tokens = self.config.max_num_batched_tokens
        seq_len = min(num_tokens, self.model_config.max_position_embeddings)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        # A scratch cache big enough for the profiled batch; the real pool is sized after this.
        for layer in self.stage_layers():
            attn = layer.self_attn.attn
            shape = (blocks_per_seq, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.key_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            attn.value_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        tokens = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        block_table = torch.arange(blocks_per_seq, dtype=torch.int32, device=self.device).repeat(
            num_seqs, 1
        )
        metadata = AttentionMetadata(
            slot_mapping=torch.full((tokens.numel(),), -1, dtype=torch.long, device=self.device),
            block_table=block_table,
            cu_seqlens_q=torch.arange(0, num_seqs + 1, dtype=torch.int32, device=self.device)
            * seq_len,
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device),
            max_seqlen_q=seq_len,
            max_seqlen_k=seq_len,
        )
        intermediate = None
        if get_pp_rank() > 0:  # a later stage: the previous stage's (hidden, residual)
            zeros = torch.zeros(
                (tokens.numel(), self.model_config.hidden_size),
                dtype=self.dtype,
                device=self.device,
            )
            intermediate = (zeros, zeros.clone())
        hidden = self.model(tokens, positions, metadata, intermediate)
        if isinstance(hidden, torch.Tensor):  # the last stage (or the only one)
            self.model.compute_logits(hidden[-num_seqs:])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        del hidden


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
