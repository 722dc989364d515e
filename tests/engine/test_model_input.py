"""The step's wire format (engine/model_input.py): what rank 0 packs, a worker unpacks, exactly."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model_input import (
    CMD_STEP,
    CMD_SWAP,
    HEADER_SIZE,
    LoRAHeader,
    ModelInput,
    StepHeader,
    StopHeader,
    SwapHeader,
    header_tensor,
    pack_lora,
    pack_step,
    pack_swap,
    prefill_row_tile,
    read_header,
    unpack_lora,
    unpack_step,
    unpack_swap,
)
from nanoserve.layers.attention import AttentionMetadata


def test_a_step_round_trips():
    cpu = torch.device("cpu")
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([17, 40, 41, 42]),
        block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([18, 27], dtype=torch.int32),
        max_seqlen_q=3,
        max_seqlen_k=27,
        num_decode_seqs=1,
        prefill_row_tile=prefill_row_tile(cpu),
    )
    step = ModelInput(
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([17, 24, 25, 26]),
        metadata,
        torch.tensor([0, 3]),
        sampling_inputs=["not sent"],
    )
    header, payload = pack_step(step, cpu, virtual_engine=1, tokens_only=True)
    values = header.tolist()
    assert len(values) == HEADER_SIZE and values[0] == CMD_STEP and values[-4:] == [1, 1, 0, 0]
    received = read_header(header)
    assert received == StepHeader(4, 2, 2, 2, 3, 27, 1, 0, virtual_engine=1, tokens_only=True)
    assert received.tokens_only is True and received.payload_size() == payload.numel()
    got = unpack_step(received, payload)
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(step, name)), name
    for name in ("slot_mapping", "block_table", "cu_seqlens_q", "seq_lens"):
        assert torch.equal(getattr(got.metadata, name), getattr(metadata, name)), name
        assert getattr(got.metadata, name).dtype == getattr(metadata, name).dtype, name
    assert (
        got.metadata.max_seqlen_q,
        got.metadata.max_seqlen_k,
        got.metadata.num_decode_seqs,
        got.metadata.prefill_row_tile,
    ) == (3, 27, 1, prefill_row_tile(cpu))
    assert got.sampling_inputs == []  # rank 0 alone samples


def test_a_step_with_lora_mrope_and_image_rows_round_trips():
    """M-RoPE positions (tensor-parallel Qwen2.5-VL) and image rows follow the LoRA parts; the
    image rows' values travel apart."""
    from nanoserve.engine.image_broadcast import ImageEmbeds

    cpu = torch.device("cpu")
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1, 2]),
        block_table=torch.tensor([[0]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        max_seqlen_q=3,
        max_seqlen_k=3,
        num_decode_seqs=0,
        prefill_row_tile=0,
    )
    step = ModelInput(torch.tensor([5, 9, 9]), torch.arange(3), metadata, torch.tensor([2]), [])
    step.lora_slots, step.lora_rows = [7], torch.tensor([0, 0, -1])
    step.image_embeds = ImageEmbeds(torch.tensor([1, 2]), torch.ones(2, 4))
    step.mrope_positions = torch.tensor([[0, 1, 1], [0, 1, 2], [0, 2, 1]])
    header, payload = pack_step(step, cpu)
    received = read_header(header)
    assert received.num_image_rows == 2 and received.mrope is True
    assert received.payload_size() == payload.numel()
    got = unpack_step(received, payload)
    assert got.lora_slots == [7] and torch.equal(got.lora_rows, step.lora_rows)
    assert torch.equal(got.mrope_positions, step.mrope_positions)
    assert torch.equal(got.image_embeds.rows, torch.tensor([1, 2]))
    assert got.image_embeds.values is None  # a worker receives them next


def test_a_swap_round_trips():
    header, payload = pack_swap([(1, 0), (4, 2)], [(3, 7)], torch.device("cpu"))
    assert header.tolist()[:3] == [CMD_SWAP, 2, 1]
    received = read_header(header)
    assert received == SwapHeader(2, 1) and received.payload_size() == payload.numel()
    assert unpack_swap(received, payload) == ([(1, 0), (4, 2)], [(3, 7)])


def test_a_lora_message_round_trips():
    cpu = torch.device("cpu")
    header, payload = pack_lora(3, "/adapters/é", cpu)
    received = read_header(header)
    assert received == LoRAHeader(3, len("/adapters/é".encode())) and not received.remove
    assert received.payload_size() == payload.numel()
    assert unpack_lora(received, payload) == (3, "/adapters/é")
    header, payload = pack_lora(3, None, cpu)
    assert unpack_lora(read_header(header), payload) == (3, None) and payload.numel() == 1


def test_every_header_round_trips_and_an_unknown_command_raises():
    cpu = torch.device("cpu")
    for header in (StopHeader(), SwapHeader(0, 5), StepHeader(1, 1, 1, 1, 1, 1, 1)):
        assert read_header(header_tensor(header, cpu)) == header
    with pytest.raises(RuntimeError, match="unexpected command 9"):
        read_header(torch.tensor([9] + [0] * (HEADER_SIZE - 1)))
