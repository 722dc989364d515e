"""Tensor parallelism (gloo on CPU, 2 ranks) for the MoE families in both layouts: each expert's
intermediate dimension split (the default) and whole experts per rank (--enable-expert-parallel);
greedy tokens equal tp=1's, and each rank holds about half the weights. Pipeline parallelism
(2 stages) takes MoE layers too."""

from __future__ import annotations

import pytest

from tests.distributed.test_tensor_parallel import greedy_ids
from tests.helpers import random_prompts
from tests.models.moe_checkpoints import MOE_FAMILIES, write_moe_checkpoint


@pytest.fixture(scope="module")
def prompts():
    # Short and long (chunked at 32 tokens), several tokens per expert, experts without a token.
    return [
        {"prompt_token_ids": p}
        for p in random_prompts(2, 300, seed=31, min_len=4, max_len=12)
        + random_prompts(1, 300, seed=32, min_len=40, max_len=60)
    ]


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_tp2_both_layouts_equal_tp1_and_split_weights(family, prompts, tmp_path):
    model_dir = write_moe_checkpoint(tmp_path / family, family)
    args = dict(num_kv_blocks=32, max_num_batched_tokens=32)
    expected, (full_bytes,) = greedy_ids(model_dir, prompts, **args)
    for expert_parallel in (False, True):
        out, rank_bytes = greedy_ids(
            model_dir,
            prompts,
            tensor_parallel_size=2,
            enable_expert_parallel=expert_parallel,
            **args,
        )
        assert out == expected, (family, expert_parallel)
        assert len(rank_bytes) == 2
        for rank_total in rank_bytes:  # norms and routers replicated, everything else split in two
            assert rank_total <= 0.6 * full_bytes, (expert_parallel, rank_total, full_bytes)


def test_olmoe_tp4_norms_over_replicated_kv_heads(prompts, tmp_path):
    """2 KV heads on 4 ranks: each k slice lives on two ranks, and OLMoE's k norm (over all KV
    heads) must count it once."""
    model_dir = write_moe_checkpoint(tmp_path / "olmoe", "olmoe")
    expected, _ = greedy_ids(model_dir, prompts, num_kv_blocks=32)
    out, _ = greedy_ids(model_dir, prompts, num_kv_blocks=32, tensor_parallel_size=4)
    assert out == expected


def test_expert_parallel_needs_experts_divisible_by_ranks(tmp_path):
    from nanoserve.distributed import set_parallel_state
    from nanoserve.layers.fused_moe import FusedMoE

    set_parallel_state(0, 3)
    try:
        with pytest.raises(
            ValueError, match="8 experts are not divisible by tensor parallel size 3"
        ):
            FusedMoE(8, 2, 64, 48, True, dtype=None, expert_parallel=True)
        with pytest.raises(ValueError, match="intermediate size 32 is not divisible"):
            FusedMoE(8, 2, 64, 32, True, dtype=None)
    finally:
        set_parallel_state(0, 1)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_pp2_equals_pp1(family, prompts, tmp_path):
    model_dir = write_moe_checkpoint(tmp_path / family, family)
    expected, _ = greedy_ids(model_dir, prompts, num_kv_blocks=32)
    out, rank_bytes = greedy_ids(model_dir, prompts, num_kv_blocks=32, pipeline_parallel_size=2)
    assert out == expected
    assert len(rank_bytes) == 2


def test_expert_parallel_rank_loads_whole_experts_and_split_rank_loads_slices():
    import torch

    from nanoserve.distributed import set_parallel_state
    from nanoserve.layers.fused_moe import FusedMoE, expert_weight_target

    gate = {e: torch.randn(32, 64) for e in range(8)}
    down = {e: torch.randn(64, 32) for e in range(8)}
    set_parallel_state(1, 2)  # rank 1 of 2
    try:
        layers = {
            ep: FusedMoE(8, 2, 64, 32, True, torch.float32, expert_parallel=ep)
            for ep in (False, True)
        }
    finally:
        set_parallel_state(0, 1)
    for layer in layers.values():
        for e in range(8):
            for name, tensor in (
                (f"m.experts.{e}.gate_proj.weight", gate[e]),
                (f"m.experts.{e}.down_proj.weight", down[e]),
            ):
                target, shard = expert_weight_target(name)
                param = getattr(layer, target.rsplit(".", 1)[1])
                param.weight_loader(param, tensor, shard)
    whole = layers[True]
    assert whole.w13_weight.shape == (4, 64, 64) and whole.expert_map.tolist() == [-1] * 4 + [
        0,
        1,
        2,
        3,
    ]
    assert torch.equal(whole.w13_weight[0, :32], gate[4]) and torch.equal(
        whole.w2_weight[3], down[7]
    )
    split = layers[False]
    assert split.w13_weight.shape == (8, 32, 64) and split.expert_map is None
    assert torch.equal(split.w13_weight[2, :16], gate[2][16:]) and torch.equal(
        split.w2_weight[5], down[5][:, 16:]
    )


def test_enable_expert_parallel_flag():
    import argparse

    from nanoserve.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(
        parser.parse_args(["--enable-expert-parallel", "--tp", "2"])
    ).enable_expert_parallel
    assert not engine_config_from_args(parser.parse_args([])).enable_expert_parallel


@pytest.mark.parametrize(
    "family,edit,args,message",
    [
        (
            "mixtral",
            {"num_local_experts": 6},
            ["--tp", "4", "--enable-expert-parallel"],
            "--enable-expert-parallel: --tensor-parallel-size 4 does not divide the model's 6 experts",
        ),
        (
            "qwen2_moe",
            {"moe_intermediate_size": 30},
            ["--tp", "4"],
            "--tensor-parallel-size 4 does not divide the experts' intermediate size 30 (--enable-expert-parallel "
            "places whole experts instead)",
        ),
    ],
)
def test_cli_bad_moe_split_is_one_line(family, edit, args, message, tmp_path):
    import json
    import subprocess
    import sys

    model_dir = write_moe_checkpoint(tmp_path / family, family)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **edit}))
    result = subprocess.run(
        [sys.executable, "-m", "nanoserve", "generate", "--model", str(model_dir), *args, "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"nanoserve: error: {message}"]


def test_stacked_expert_tensors_load_as_per_expert_ones(prompts, tmp_path):
    """transformers 5's own layout (experts.gate_up_proj [experts, 2 * inter, hidden],
    experts.down_proj [experts, hidden, inter]) gives the per-expert checkpoint's tokens, at
    tp=1 and in both tp=2 layouts."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    model_dir = write_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    expected, _ = greedy_ids(model_dir, prompts, num_kv_blocks=32)
    tensors = load_file(str(model_dir / "model.safetensors"))
    stacked = {name: t for name, t in tensors.items() if ".experts." not in name}
    for layer in {re.sub(r"\.experts\..*", "", name) for name in tensors if ".experts." in name}:
        part = lambda e, p: tensors[f"{layer}.experts.{e}.{p}.weight"]  # noqa: E731
        stacked[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in range(8)]
        )
        stacked[f"{layer}.experts.down_proj"] = torch.stack(
            [part(e, "down_proj") for e in range(8)]
        )
    save_file(stacked, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    assert greedy_ids(model_dir, prompts, num_kv_blocks=32)[0] == expected
    for expert_parallel in (False, True):
        out, _ = greedy_ids(
            model_dir,
            prompts,
            num_kv_blocks=32,
            tensor_parallel_size=2,
            enable_expert_parallel=expert_parallel,
        )
        assert out == expected, expert_parallel
