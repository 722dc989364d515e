"""The step's wire format (engine/model_input.py): what rank 0 packs, a worker unpacks, exactly."""

from __future__ import annotations

import torch

from nanoserve.engine.model_input import (
    CMD_STEP,
    CMD_SWAP,
    HEADER_SIZE,
    ModelInput,
    pack_step,
    pack_swap,
    payload_size,
    prefill_row_tile,
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
        sampling_seqs=["not sent"],
    )
    header, payload = pack_step(step, cpu, virtual_engine=1, tokens_only=True)
    values = header.tolist()
    assert len(values) == HEADER_SIZE and values[0] == CMD_STEP and values[-2:] == [1, 1]
    assert payload_size(values) == payload.numel()
    got = unpack_step(values, payload)
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
    assert got.sampling_seqs == []  # rank 0 alone samples


def test_a_swap_round_trips():
    header, payload = pack_swap([(1, 0), (4, 2)], [(3, 7)], torch.device("cpu"))
    values = header.tolist()
    assert values[0] == CMD_SWAP and payload_size(values) == payload.numel()
    assert unpack_swap(values, payload) == ([(1, 0), (4, 2)], [(3, 7)])
