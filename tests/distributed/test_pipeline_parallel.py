"""Pipeline parallelism on the CPU with gloo: --pp 2 (alone and with --tp 2) gives pp=1's greedy
tokens; each rank holds only its stage's weights and KV; two micro-batches are in flight at once."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.distributed.pipeline import layer_partition
from tests.conftest import write_random_llama
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=7, logprobs=2, max_tokens=6, ignore_eos=True)
KV_GIB = 0.001  # a fixed KV budget: a stage holding half the layers holds twice the blocks


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """4 layers, tied embeddings: the last stage loads its LM head from the embedding's tensor."""
    return write_random_llama(tmp_path_factory.mktemp("tied-llama"), num_layers=4, tie=True, seed=5)


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(6, 300, seed=21)]


def run(model_dir, prompts, trace: bool = False, sampled: bool = False, **engine_args):
    """Greedy token ids, each rank's weight bytes, the KV blocks per stage, and (trace) the
    batches in flight after every step as [(virtual engine, its sequence ids, tokens only)]."""
    with LLM(
        model=str(model_dir), dtype="float32", kv_cache_memory=KV_GIB, cpu_threads=1, **engine_args
    ) as llm:
        engine = llm.llm_engine
        steps = []
        if trace:
            step = engine.step

            def traced_step():
                outputs = step()
                in_flight = [f for f in engine.in_flight if f is not None]
                assert all(
                    f.scheduler_output.virtual_engine == f.launched.virtual_engine
                    for f in in_flight
                )
                steps.append(
                    [
                        (
                            f.launched.virtual_engine,
                            {i.seq.seq_id for i in f.scheduler_output.scheduled_seqs},
                            f.launched.tokens_only,
                        )
                        for f in in_flight
                    ]
                )
                return outputs

            engine.step = traced_step
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        if sampled:  # the last stage sends the logits (not only the argmax): sampled at the driver
            outputs = llm.generate(prompts, SAMPLED, use_tqdm=False)
            tokens += [
                (o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs])
                for o in outputs
            ]
        return tokens, list(engine.runner.rank_weight_bytes), engine.runner.num_kv_blocks, steps


def test_layer_partition():
    assert layer_partition(4, 2) == [(0, 2), (2, 4)]
    assert layer_partition(30, 4) == [
        (0, 7),
        (7, 15),
        (15, 23),
        (23, 30),
    ]  # the remainder before the last
    assert layer_partition(5, 1) == [(0, 5)]
    assert layer_partition(6, 2, "1,5") == [(0, 1), (1, 6)]
    with pytest.raises(ValueError, match="more than the model's 2 decoder layers"):
        layer_partition(2, 3)
    with pytest.raises(ValueError, match="adding up to the model's 6 layers"):
        layer_partition(6, 2, "3,4")
    with pytest.raises(ValueError, match="comma-separated"):
        layer_partition(6, 2, "3;3")


def test_pp2_equals_pp1_with_two_batches_in_flight(tied_llama_dir, prompts):
    ref, (full_bytes,), ref_blocks, _ = run(tied_llama_dir, prompts, sampled=True)
    out, rank_bytes, blocks, steps = run(
        tied_llama_dir, prompts, trace=True, sampled=True, pipeline_parallel_size=2
    )
    assert out == ref
    print(
        f"\nrank weight bytes: pp1 {full_bytes}, pp2 {rank_bytes}; KV blocks pp1 {ref_blocks}, pp2 {blocks}"
    )
    # Each stage: 2 of the 4 layers plus the embedding (first) or the LM head (last, tied).
    assert len(rank_bytes) == 2 and all(0.5 * full_bytes < b < 0.6 * full_bytes for b in rank_bytes)
    assert blocks in (
        2 * ref_blocks,
        2 * ref_blocks + 1,
    )  # half the layers: twice the blocks (floored)
    # The micro-batch schedule: after some steps both virtual engines have a batch launched and
    # not yet sampled, with disjoint sequences (stage 1 runs one while stage 0 runs the other).
    both = [s for s in steps if len(s) == 2]
    assert both, steps
    for (engine_a, seqs_a, _), (engine_b, seqs_b, _) in both:
        assert {engine_a, engine_b} == {0, 1} and not seqs_a & seqs_b
    assert all(len(s) <= 2 for s in steps)
    # Greedy steps bring back token ids only; the seeded ones with logprobs bring the logits.
    assert {tokens_only for s in steps for _, _, tokens_only in s} == {True, False}


def test_tp2_pp2_equals_pp1(tied_llama_dir, prompts):
    ref, (full_bytes,), _, _ = run(tied_llama_dir, prompts[:3])
    out, rank_bytes, _, _ = run(
        tied_llama_dir, prompts[:3], tensor_parallel_size=2, pipeline_parallel_size=2
    )
    assert out == ref
    assert len(rank_bytes) == 4 and all(
        0.2 * full_bytes < b < 0.35 * full_bytes for b in rank_bytes
    )


@pytest.mark.slow  # 8 ranks in all on 2 cores: about 30 s
def test_pp2_and_tp3_pp2_on_smollm2_equal_pp1(smollm2_dir):
    """SmolLM2's 9 heads do not split in two: tensor parallelism with it is tp=3."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    args = dict(max_model_len=256, num_kv_blocks=64)
    ref, (full_bytes,), _, _ = run(smollm2_dir, prompts, **args)
    out, rank_bytes, _, _ = run(smollm2_dir, prompts, pipeline_parallel_size=2, **args)
    assert out == ref
    print(f"\nSmolLM2 rank weight bytes: pp1 {full_bytes}, pp2 {rank_bytes}")
    assert all(b < 0.75 * full_bytes for b in rank_bytes)
    out, rank_bytes, _, _ = run(
        smollm2_dir, prompts, tensor_parallel_size=3, pipeline_parallel_size=2, **args
    )
    assert out == ref
    assert len(rank_bytes) == 6 and all(b < 0.25 * full_bytes for b in rank_bytes)


def test_uneven_partition_from_the_environment_or_the_config(tied_llama_dir, prompts, monkeypatch):
    monkeypatch.setenv("NANOSERVE_PP_LAYER_PARTITION", "1,3")
    ref, (full_bytes,), _, _ = run(tied_llama_dir, prompts[:2])
    out, (first, last), _, _ = run(tied_llama_dir, prompts[:2], pipeline_parallel_size=2)
    assert out == ref and first < last
    # The config field (--pp-layer-partition) wins over the variable.
    out, (first, last), _, _ = run(
        tied_llama_dir, prompts[:2], pipeline_parallel_size=2, pp_layer_partition="3,1"
    )
    assert out == ref and first > last


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--pp", "5"],
            "--pipeline-parallel-size 5 is more than the model's 4 decoder layers "
            "(each stage needs at least one)",
        ),
        (["--pp", "0"], "pipeline_parallel_size must be >= 1, got 0"),
    ],
)
def test_cli_bad_pp_one_line(tied_llama_dir, args, message):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "generate",
            "--model",
            str(tied_llama_dir),
            *args,
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"nanoserve: error: {message}"]


def test_abort_while_in_flight(tied_llama_dir):
    """Requests aborted while their batch is in a later stage: the others finish with pp=1's
    tokens, and no KV block is left in use."""
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    with LLM(model=str(tied_llama_dir), dtype="float32", num_kv_blocks=64, cpu_threads=1) as llm:
        ref = [
            o.outputs[0].token_ids
            for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts[2:]], GREEDY, use_tqdm=False
            )
        ]
    with LLM(
        model=str(tied_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        cpu_threads=1,
        pipeline_parallel_size=2,
    ) as llm:
        engine = llm.llm_engine
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), {"prompt_token_ids": prompt}, GREEDY)
        assert [engine.requests[str(i)].seqs[0].virtual_engine for i in range(4)] == [0, 1, 0, 1]
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            finished.update(
                {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            )
            steps += 1
            if steps == 3:
                assert all(engine.in_flight)
                engine.abort_request(["0", "1"])  # one in each virtual engine, both in flight
        assert [finished.get("2"), finished.get("3")] == ref and "0" not in finished
        assert engine.stats().kv_cache_usage == 0.0


def test_pp2_chunked_prefill_and_preemption_equal_pp1(tied_llama_dir):
    """Prompts split into chunks (steps that sample nothing) and a pool small enough that each
    virtual engine preempts: still pp=1's tokens."""
    prompts = [
        {"prompt_token_ids": p} for p in random_prompts(8, 300, seed=4, min_len=20, max_len=40)
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    results = []
    for engine_args in (dict(num_kv_blocks=128), dict(num_kv_blocks=16, pipeline_parallel_size=2)):
        with LLM(
            model=str(tied_llama_dir),
            dtype="float32",
            cpu_threads=1,
            max_num_batched_tokens=32,
            **engine_args,
        ) as llm:
            results.append(
                [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            )
            stats = llm.llm_engine.stats()
    assert results[1] == results[0]
    assert stats.num_preemptions_total > 0 and stats.kv_cache_usage == 0.0


def shared_prefix_waves() -> list[list[list[int]]]:
    """Waves of prompts that share a 100-token prefix (six full 16-token blocks and a part),
    each with its own tail of full blocks. A wave's requests alternate between the two virtual
    engines (each goes to the one with fewer unfinished). The second wave sends every prompt of
    the first to the other virtual engine, so what one of them cached is asked of the other;
    the third mixes both, with one new prompt twice (once on each)."""
    rng = random.Random(26)
    prefix = [rng.randrange(3, 300) for _ in range(100)]
    prompts = [
        prefix + [rng.randrange(3, 300) for _ in range(rng.randint(20, 50))] for _ in range(6)
    ]
    order = [[0, 1, 2, 3], [1, 0, 3, 2, 4], [3, 4, 1, 5, 5, 0, 2]]
    return [[prompts[i] for i in wave] for wave in order]


def run_waves(model_dir, waves, **engine_args):
    """Each wave in one generate call: per request (token ids, each sampled token's logprob);
    and the tokens each virtual engine found in its prefix cache. In bfloat16, where the CPU
    path promises a row the same bits whatever its batch and however its prompt was split."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(
        model=str(model_dir), dtype="bfloat16", num_kv_blocks=256, cpu_threads=1, **engine_args
    ) as llm:
        results = []
        for wave in waves:
            outputs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
            results.append(
                [
                    (c.token_ids, [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                    for c in (o.outputs[0] for o in outputs)
                ]
            )
        return results, [m.prefix_cache_hits for m in llm.llm_engine.block_managers]


@pytest.fixture(scope="module")
def cold_pp1_waves(tied_llama_dir):
    """The waves at pp=1 with prefix caching off, per tensor-parallel size: the oracle for pp=2
    at the same size (tp=2 reduces a row's partial sums in another order than tp=1, and in
    bfloat16 a greedy choice of this random model flips with it)."""
    by_tp_size = {}

    def waves_at(tensor_parallel_size: int):
        if tensor_parallel_size not in by_tp_size:
            by_tp_size[tensor_parallel_size] = run_waves(
                tied_llama_dir,
                shared_prefix_waves(),
                tensor_parallel_size=tensor_parallel_size,
                enable_prefix_caching=False,
            )[0]
        return by_tp_size[tensor_parallel_size]

    return waves_at


@pytest.mark.parametrize("tensor_parallel_size", [1, 2], ids=["pp2", "tp2-pp2"])
def test_pp2_prefix_cache_shared_across_waves_equals_pp1_uncached(
    tied_llama_dir, cold_pp1_waves, tensor_parallel_size
):
    """Issue 26: each virtual engine indexes its own finished blocks, under its own block ids.
    Registered in another virtual engine's table, a later request there with the same prefix
    reads whatever that engine's pool holds at those ids: another sequence's KV. The stages
    hand over exact floats and the prefix cache changes no bit: the same tokens and logprobs."""
    out, hits = run_waves(
        tied_llama_dir,
        shared_prefix_waves(),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=2,
    )
    assert out == cold_pp1_waves(tensor_parallel_size)
    assert len(hits) == 2 and all(h >= 6 * 16 for h in hits), hits  # both reused cached blocks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_pp2_cuda_equals_pp1(tied_llama_dir, prompts):
    """The NCCL path: stage hand-offs and the last stage's results between GPUs."""
    ref, _, _, _ = run(tied_llama_dir, prompts, sampled=True, device="cuda")
    out, _, _, steps = run(
        tied_llama_dir, prompts, trace=True, sampled=True, device="cuda", pipeline_parallel_size=2
    )
    assert out == ref and any(len(s) == 2 for s in steps)
