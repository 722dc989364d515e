"""What one step runs: ModelInput (the batch tensors and attention metadata rank 0 builds), and
its wire format for the other ranks. The step's inputs travel as two broadcasts: a fixed-size
header and one flat int64 tensor holding every per-step array. A step that swaps KV blocks
between the device and the host pool sends its copies the same way first (CMD_SWAP)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import AttentionMetadata

# CPU layers whose weights our GEMM can't take (fp32, K not a multiple of 32, or
# NANOSERVE_CPU_GEMM=onednn): prompt rows are multiplied in oneDNN GEMMs of exactly this many rows
# (see AttentionMetadata.prefill_row_tile). Otherwise kernels/cpu/gemm*.cpp takes every row at
# any ISA level and nothing is padded. Measured on a 2,048-token prefill step of SmolLM2 (2 cores,
# AMX): the step's GEMMs took 3.1 / 2.5 / 2.05 / 1.96 s per 4 steps with tiles of 128 / 256 /
# 512 / 1,024 rows; 512 keeps most of that and pads a short prompt to at most 512 rows.
PREFILL_ROW_TILE = 512


def prefill_row_tile(device: torch.device) -> int:
    """AttentionMetadata.prefill_row_tile for a step on this device (0: no tiling, on CUDA)."""
    return PREFILL_ROW_TILE if device.type == "cpu" else 0


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampling_seqs: list[Sequence]  # the sequences that sample this step, in logits_indices order
    # A decode step loaded into DecodeGraphs' static buffers: the batch size it was padded to
    # (its first len(logits_indices) rows are real). 0: an eager step.
    graph_size: int = 0
    # Prompt logprobs, only for sequences that ask: their prompt rows follow the sampling rows in
    # logits_indices; (sequence, its number of rows) in that order, and each row's next prompt token.
    prompt_logprob_seqs: list[tuple[Sequence, int]] = field(default_factory=list)
    prompt_logprob_targets: torch.Tensor | None = None
    # Speculative decoding: sequences verifying proposed tokens, each with len(spec_token_ids) + 1
    # rows of logits after the sampled rows (and before the prompt-logprob rows), in this order.
    spec_seqs: list[Sequence] = field(default_factory=list)
    # LoRA (--enable-lora), only in a step with a row of some adapter: the adapter id each slot
    # holds (lora/manager.py) and each row's slot (-1: the base model).
    lora_slots: list[int] | None = None
    lora_rows: torch.Tensor | None = None

    @property
    def num_spec_rows(self) -> int:
        return sum(len(seq.spec_token_ids) + 1 for seq in self.spec_seqs)


# Slot 8: the number of LoRA slots the step's payload names (0: no LoRA rows). The last two
# slots, for pipeline parallelism: the step's virtual engine, and 1 when the last stage sends the
# greedy token ids instead of the logits (else 0, 0).
HEADER_SIZE = 11
CMD_STEP, CMD_STOP, CMD_SWAP, CMD_LORA = 1, 2, 3, 4


def pack_lora(
    adapter_id: int, path: str | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Register an adapter on every rank (its path's UTF-8 bytes), or with path None remove it."""
    data = list((path or "").encode())
    header = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
    header[:4] = torch.tensor([CMD_LORA, adapter_id, len(data), int(path is None)])
    return header, torch.tensor(data or [0], dtype=torch.long).to(
        device
    )  # never an empty broadcast


def unpack_lora(header: list[int], payload: torch.Tensor) -> tuple[int, str | None]:
    if header[3]:
        return header[1], None
    return header[1], bytes(payload[: header[2]].tolist()).decode()


def pack_swap(
    swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) block pairs copied out (device → host) and in (host → device)."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
    header[:3] = torch.tensor([CMD_SWAP, len(swap_out), len(swap_in)])
    pairs = [block for pair in swap_out + swap_in for block in pair]
    return header, torch.tensor(pairs, dtype=torch.long).to(device)


def unpack_swap(
    header: list[int], payload: torch.Tensor
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    num_out = header[1]
    blocks = payload.tolist()
    pairs = list(zip(blocks[0::2], blocks[1::2]))
    return pairs[:num_out], pairs[num_out:]


def pack_step(
    model_input: ModelInput,
    device: torch.device,
    virtual_engine: int = 0,
    tokens_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    metadata = model_input.metadata
    parts = [
        model_input.input_ids,
        model_input.positions,
        metadata.slot_mapping,
        metadata.block_table.flatten(),
        metadata.cu_seqlens_q,
        metadata.seq_lens,
        model_input.logits_indices,
    ]
    num_lora_slots = 0
    if model_input.lora_slots is not None:
        num_lora_slots = len(model_input.lora_slots)
        parts += [torch.tensor(model_input.lora_slots), model_input.lora_rows]
    num_seqs, max_blocks = metadata.block_table.shape
    header = torch.tensor(
        [
            CMD_STEP,
            model_input.input_ids.numel(),
            num_seqs,
            max_blocks,
            model_input.logits_indices.numel(),
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
            metadata.num_decode_seqs,
            num_lora_slots,
            virtual_engine,
            int(tokens_only),
        ],
        dtype=torch.long,
        device=device,
    )
    payload = torch.cat([p.to(device=device, dtype=torch.long) for p in parts])
    return header, payload


def _part_sizes(header: list[int]) -> list[int]:
    """Lengths of the payload's parts, in pack_step's order."""
    _, num_tokens, num_seqs, max_blocks, num_logits, _, _, _, num_lora_slots, _, _ = header
    sizes = [
        num_tokens,
        num_tokens,
        num_tokens,
        num_seqs * max_blocks,
        num_seqs + 1,
        num_seqs,
        num_logits,
    ]
    return sizes + [num_lora_slots, num_tokens] if num_lora_slots else sizes


def unpack_step(header: list[int], payload: torch.Tensor) -> ModelInput:
    (
        _,
        _,
        num_seqs,
        max_blocks,
        _,
        max_seqlen_q,
        max_seqlen_k,
        num_decode_seqs,
        num_lora_slots,
        _,
        _,
    ) = header
    input_ids, positions, slots, table, cu_seqlens, seq_lens, logits_indices, *lora = payload.split(
        _part_sizes(header)
    )
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_table=table.view(num_seqs, max_blocks).to(torch.int32),
        cu_seqlens_q=cu_seqlens.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_decode_seqs=num_decode_seqs,
        prefill_row_tile=prefill_row_tile(payload.device),
    )
    model_input = ModelInput(input_ids, positions, metadata, logits_indices, [])
    if num_lora_slots:
        model_input.lora_slots, model_input.lora_rows = lora[0].tolist(), lora[1]
    return model_input


def payload_size(header: list[int]) -> int:
    if header[0] == CMD_SWAP:
        return 2 * (header[1] + header[2])
    if header[0] == CMD_LORA:
        return max(1, header[2])
    return sum(_part_sizes(header))


def broadcast_stop(device: torch.device) -> None:
    """Tell every rank to leave its loop, and wait until all have read it: without the barrier
    rank 0 could tear its connections down before a peer has read the message."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
    header[0] = CMD_STOP
    dist.broadcast(header, src=0)
    dist.barrier()
