"""Tensor parallelism on the CPU with gloo: --tp N gives the same greedy tokens as --tp 1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import divide, qkv_heads_per_rank
from tests.conftest import write_random_llama
from tests.distributed.ports import rendezvous_port
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_ids(model_dir, prompts, **engine_args):
    with LLM(model=str(model_dir), dtype="float32", **engine_args) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        runner = llm.llm_engine.runner
        return [o.outputs[0].token_ids for o in outputs], list(runner.rank_weight_bytes)


@pytest.fixture(scope="module")
def tiny_prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(6, 300, seed=21)]


def test_tp2_equals_tp1_and_halves_rank_memory(tiny_llama_dir, tiny_prompts):
    ref, (full_bytes,) = greedy_ids(tiny_llama_dir, tiny_prompts, num_kv_blocks=128)
    out, rank_bytes = greedy_ids(
        tiny_llama_dir, tiny_prompts, num_kv_blocks=128, tensor_parallel_size=2
    )
    assert out == ref
    print(f"\nrank weight bytes: tp1 {full_bytes}, tp2 {rank_bytes}")
    assert len(rank_bytes) == 2
    for rank_total in rank_bytes:  # the norms are replicated, everything else split in two
        assert 0.45 * full_bytes <= rank_total <= 0.6 * full_bytes


def test_tp4_replicates_kv_heads(tmp_path, tiny_prompts):
    # 4 query heads, 2 KV heads: with 4 ranks each KV head lives on two ranks.
    model_dir = write_random_llama(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=3)
    ref, _ = greedy_ids(model_dir, tiny_prompts[:3], num_kv_blocks=64)
    out, _ = greedy_ids(model_dir, tiny_prompts[:3], num_kv_blocks=64, tensor_parallel_size=4)
    assert out == ref


def test_tp3_on_smollm2_equals_tp1(smollm2_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
    ref, (full_bytes,) = greedy_ids(smollm2_dir, prompts, num_kv_blocks=128, max_model_len=512)
    out, rank_bytes = greedy_ids(
        smollm2_dir, prompts, num_kv_blocks=128, max_model_len=512, tensor_parallel_size=3
    )
    assert out == ref
    print(f"\nSmolLM2 rank weight bytes: tp1 {full_bytes}, tp3 {rank_bytes}")
    assert all(b < 0.4 * full_bytes for b in rank_bytes)


@pytest.mark.parametrize(
    "tp,message",
    [
        (3, "does not divide the model's 4 attention heads"),
        (1000, "attention heads"),
    ],
)
def test_bad_tp_is_a_clear_error_before_loading(tiny_llama_dir, tp, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=tp)


def test_the_linear_layers_split_checks():
    """The checks the engine asks before starting any rank are the linear layers' own."""
    assert qkv_heads_per_rank(32, 8, 4) == (8, 2)
    assert qkv_heads_per_rank(32, 2, 4) == (8, 1)  # each KV head on two ranks
    with pytest.raises(
        ValueError, match="tensor parallel size 4 does not divide the model's 6 KV heads"
    ):
        qkv_heads_per_rank(8, 6, 4)
    with pytest.raises(ValueError, match="not a multiple of the model's 3 KV heads"):
        qkv_heads_per_rank(12, 3, 4)
    with pytest.raises(
        ValueError, match="tensor parallel size 4 does not divide the model's 10 MLP features"
    ):
        divide(10, 4, "the model's {} MLP features")


def test_cli_bad_tp_one_line(tiny_llama_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--tp",
            "3",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoserve: error: tensor parallel size 3 does not divide the model's 4 attention heads"
    ]


def test_two_nodes_on_loopback(tiny_llama_dir, tiny_prompts):
    """Rank 0 (node 0, offline API) and rank 1 (node 1, `nanoserve serve --node-rank 1`) as two
    separate launches joining through the standard rendezvous."""
    ref, _ = greedy_ids(tiny_llama_dir, tiny_prompts, num_kv_blocks=128)
    port = rendezvous_port()
    common = [
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "serve",
            *common,
            "--node-rank",
            "1",
            "--num-kv-blocks",
            "128",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    script = textwrap.dedent(f"""
        import json
        from nanoserve import LLM, SamplingParams
        if __name__ == "__main__":
            with LLM(model={str(tiny_llama_dir)!r}, dtype="float32", num_kv_blocks=128, tensor_parallel_size=2,
                     nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port={port}) as llm:
                outs = llm.generate({tiny_prompts!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    use_tqdm=False)
                print("RESULT " + json.dumps([o.outputs[0].token_ids for o in outs]))
    """)
    try:
        node0 = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
        )
        assert node0.returncode == 0, node0.stderr[-2000:]
        result = next(line for line in node0.stdout.splitlines() if line.startswith("RESULT "))
        assert json.loads(result[len("RESULT ") :]) == ref
        code = node1.wait(timeout=60)
        assert code == 0, node1.stdout.read()[-3000:]  # rank 0's shutdown stops the other node too
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_tp2_cuda_equals_tp1(tiny_llama_dir, tiny_prompts):
    ref, _ = greedy_ids(tiny_llama_dir, tiny_prompts, num_kv_blocks=128, device="cuda")
    out, _ = greedy_ids(
        tiny_llama_dir, tiny_prompts, num_kv_blocks=128, device="cuda", tensor_parallel_size=2
    )
    assert out == ref


def test_single_host_rendezvous_is_rank_zeros_bound_store(tiny_llama_dir):
    """Without --master-port the rendezvous is a store rank 0 made on a port the OS picked and
    has held bound since before the other ranks started (no pick-close-rebind window another
    process could use): the engine's topology names that port, and nothing else can bind it."""
    import socket

    with LLM(
        model=str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64
    ) as llm:
        topology = llm.llm_engine.topology
        assert topology.store_rendezvous and not topology.init_method.endswith(":0")
        port = int(topology.init_method.rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            with pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
