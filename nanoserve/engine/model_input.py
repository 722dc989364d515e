"""What one step runs: ModelInput (the batch tensors and attention metadata rank 0 builds), and
its wire format for the other ranks. The step's inputs travel as two broadcasts: a fixed-size
header and one flat int64 tensor holding every per-step array. A step that swaps KV blocks
between the device and the host pool sends its copies the same way first (CMD_SWAP). A step with
image rows (a vision-language model) sends their embeddings after its payload
(engine/image_broadcast.py), and with M-RoPE (Qwen2.5-VL) its rows' three positions in the
payload; any other step's rotary positions are `positions`, the sequences' position shifts
already added (engine/model_runner._HostRows.add)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from nanoserve.engine.image_broadcast import ImageEmbeds
from nanoserve.engine.step_input import ImageSlice, SeqInput
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.bert import EncoderBatch

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
    metadata: AttentionMetadata | EncoderBatch  # EncoderBatch: an encoder's whole prompts
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    # The sequences that sample this step, in logits_indices order (what the runner was given of
    # them: engine/step_input.py; never the live sequences).
    sampling_inputs: list[SeqInput]
    # A decode step loaded into DecodeGraphs' static buffers: the batch size it was padded to
    # (its first len(logits_indices) rows are real). 0: an eager step.
    graph_size: int = 0
    # Prompt logprobs, only for sequences that ask: their prompt rows follow the sampling rows in
    # logits_indices, each sequence's len(prompt_logprob_targets) rows in this order, and each
    # row's next prompt token.
    prompt_logprob_inputs: list[SeqInput] = field(default_factory=list)
    prompt_logprob_targets: torch.Tensor | None = None
    # Speculative decoding: sequences verifying proposed tokens, each with its proposal's length + 1
    # rows of logits after the sampled rows (and before the prompt-logprob rows), in this order.
    spec_inputs: list[SeqInput] = field(default_factory=list)
    # LoRA (--enable-lora), only in a step with a row of some adapter: the adapter id each slot
    # holds (lora/manager.py) and each row's slot (-1: the base model).
    lora_slots: list[int] | None = None
    lora_rows: torch.Tensor | None = None
    # Vision-language models: (the step row of a slice's first token, the image slice).
    image_rows: list[tuple[int, ImageSlice]] = field(default_factory=list)
    # M-RoPE (Qwen2.5-VL), only in a step with image rows: each row's (temporal, height, width)
    # positions [3, rows]; `positions` then stay the KV cache's. Without: `positions` are the
    # rotary ones (a text row's three M-RoPE positions are one).
    mrope_positions: torch.Tensor | None = None
    # Tensor parallelism: the image rows' embeddings as rank 0 sends them to every rank.
    image_embeds: ImageEmbeds | None = None

    @property
    def num_spec_rows(self) -> int:
        return sum(len(spec.proposal) + 1 for spec in self.spec_inputs)


HEADER_SIZE = 13  # int64 slots: the command, then its header's fields in order, zero-padded
CMD_STEP, CMD_STOP, CMD_SWAP, CMD_LORA = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class StepHeader:
    """A forward step: the sizes of its payload's parts, and what the payload cannot carry."""

    num_tokens: int
    num_seqs: int
    max_blocks: int  # the block table's width
    num_logits: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_decode_seqs: int
    num_lora_slots: int = 0  # the LoRA slots the payload names (0: no LoRA rows)
    virtual_engine: int = 0  # pipeline parallelism: the step's virtual engine
    tokens_only: bool = False  # pipeline: the last stage sends greedy token ids, not logits
    num_image_rows: int = 0  # rows that take image embeddings (their values follow the payload)
    mrope: bool = False  # the payload holds ModelInput.mrope_positions ([3, num_tokens])

    def part_sizes(self) -> list[int]:
        """Lengths of the payload's parts, in pack_step's order."""
        num_tokens, num_seqs = self.num_tokens, self.num_seqs
        sizes = [
            num_tokens,
            num_tokens,
            num_tokens,
            num_seqs * self.max_blocks,
            num_seqs + 1,
            num_seqs,
            self.num_logits,
        ]
        if self.num_lora_slots:
            sizes += [self.num_lora_slots, num_tokens]
        if self.mrope:
            sizes.append(3 * num_tokens)
        return sizes + [self.num_image_rows] if self.num_image_rows else sizes

    def payload_size(self) -> int:
        return sum(self.part_sizes())


@dataclass(frozen=True, slots=True)
class SwapHeader:
    """Block copies: the payload holds num_out (device → host) then num_in pairs."""

    num_out: int
    num_in: int

    def payload_size(self) -> int:
        return 2 * (self.num_out + self.num_in)


@dataclass(frozen=True, slots=True)
class LoRAHeader:
    """Register an adapter (its path's num_bytes UTF-8 bytes follow), or remove it."""

    adapter_id: int
    num_bytes: int
    remove: bool = False

    def payload_size(self) -> int:
        return max(1, self.num_bytes)  # never an empty broadcast


@dataclass(frozen=True, slots=True)
class StopHeader:
    """Leave the worker loop (no payload)."""


Header = StepHeader | SwapHeader | LoRAHeader | StopHeader
_COMMANDS: dict[type, int] = {StepHeader: CMD_STEP, StopHeader: CMD_STOP}
_COMMANDS |= {SwapHeader: CMD_SWAP, LoRAHeader: CMD_LORA}
_HEADERS = {command: cls for cls, command in _COMMANDS.items()}


def header_tensor(header: Header, device: torch.device) -> torch.Tensor:
    """The one place a header becomes the fixed-size tensor every rank receives."""
    values = [_COMMANDS[type(header)]] + [int(getattr(header, f.name)) for f in fields(header)]
    values += [0] * (HEADER_SIZE - len(values))
    return torch.tensor(values, dtype=torch.long, device=device)


def empty_header(device: torch.device) -> torch.Tensor:
    """The buffer a worker receives headers into."""
    return torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)


def read_header(tensor: torch.Tensor) -> Header:
    """header_tensor's inverse (an unknown command raises: the ranks are out of step)."""
    command, *values = tensor.tolist()
    if command not in _HEADERS:
        raise RuntimeError(f"worker: unexpected command {command}")
    cls = _HEADERS[command]
    args = [bool(v) if f.type == "bool" else v for f, v in zip(fields(cls), values)]
    return cls(*args)


def pack_lora(
    adapter_id: int, path: str | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Register an adapter on every rank (its path's UTF-8 bytes), or with path None remove it."""
    data = list((path or "").encode())
    header = LoRAHeader(adapter_id, len(data), path is None)
    payload = torch.tensor(data or [0], dtype=torch.long).to(device)
    return header_tensor(header, device), payload


def unpack_lora(header: LoRAHeader, payload: torch.Tensor) -> tuple[int, str | None]:
    if header.remove:
        return header.adapter_id, None
    return header.adapter_id, bytes(payload[: header.num_bytes].tolist()).decode()


def pack_swap(
    swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) block pairs copied out (device → host) and in (host → device)."""
    header = SwapHeader(len(swap_out), len(swap_in))
    pairs = [block for pair in swap_out + swap_in for block in pair]
    return header_tensor(header, device), torch.tensor(pairs, dtype=torch.long).to(device)


def unpack_swap(
    header: SwapHeader, payload: torch.Tensor
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    blocks = payload.tolist()
    pairs = list(zip(blocks[0::2], blocks[1::2]))
    return pairs[: header.num_out], pairs[header.num_out :]


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
    mrope = model_input.mrope_positions
    if mrope is not None:
        parts.append(mrope.flatten())
    image_embeds = model_input.image_embeds
    if image_embeds is not None:
        parts.append(image_embeds.rows)
    num_seqs, max_blocks = metadata.block_table.shape
    header = StepHeader(
        num_tokens=model_input.input_ids.numel(),
        num_seqs=num_seqs,
        max_blocks=max_blocks,
        num_logits=model_input.logits_indices.numel(),
        max_seqlen_q=metadata.max_seqlen_q,
        max_seqlen_k=metadata.max_seqlen_k,
        num_decode_seqs=metadata.num_decode_seqs,
        num_lora_slots=num_lora_slots,
        virtual_engine=virtual_engine,
        tokens_only=tokens_only,
        num_image_rows=0 if image_embeds is None else image_embeds.rows.numel(),
        mrope=mrope is not None,
    )
    payload = torch.cat([p.to(device=device, dtype=torch.long) for p in parts])
    return header_tensor(header, device), payload


def unpack_step(header: StepHeader, payload: torch.Tensor) -> ModelInput:
    input_ids, positions, slots, table, cu_seqlens, seq_lens, logits_indices, *rest = payload.split(
        header.part_sizes()
    )
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_table=table.view(header.num_seqs, header.max_blocks).to(torch.int32),
        cu_seqlens_q=cu_seqlens.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        max_seqlen_q=header.max_seqlen_q,
        max_seqlen_k=header.max_seqlen_k,
        num_decode_seqs=header.num_decode_seqs,
        prefill_row_tile=prefill_row_tile(payload.device),
    )
    model_input = ModelInput(input_ids, positions, metadata, logits_indices, [])
    if header.num_lora_slots:
        (lora_slots, model_input.lora_rows), rest = rest[:2], rest[2:]
        model_input.lora_slots = lora_slots.tolist()
    if header.mrope:
        model_input.mrope_positions, rest = rest[0].view(3, header.num_tokens), rest[1:]
    if header.num_image_rows:  # the values come next (image_broadcast.receive_values)
        model_input.image_embeds = ImageEmbeds(rest[0], None)
    return model_input


def broadcast_stop(device: torch.device) -> None:
    """Tell every rank to leave its loop, and wait until all have read it: without the barrier
    rank 0 could tear its connections down before a peer has read the message."""
    dist.broadcast(header_tensor(StopHeader(), device), src=0)
    dist.barrier()
