"""Decode steps through DecodeGraphs' static buffers: the capture-size ladder, bucket choice,
padding, buffer reuse, and that the padded static-buffer step computes what the plain eager
step computes. Without a GPU the graphs are not captured (the same forward runs on the same
buffers); on CUDA the last tests replay real graphs."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.cli import build_parser, engine_config_from_args
from nanoserve.engine.cuda_graphs import MAX_CAPTURE_SIZE, PAD_SLOT, DecodeGraphs, capture_sizes
from nanoserve.engine.model_input import prefill_row_tile

pytest.importorskip("transformers", reason="the tiny_llama_dir fixture writes with transformers")

CPU = torch.device("cpu")


def vllm_ladder(max_num_seqs: int) -> list[int]:
    """vLLM's list (1, 2, 4, then every multiple of 8 to 512), cut after the first size that
    holds max_num_seqs."""
    ladder = [1, 2, 4] + [8 * i for i in range(1, 65)]
    cut = next((i for i, size in enumerate(ladder) if size >= max_num_seqs), len(ladder) - 1)
    return ladder[: cut + 1]


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 4, 5, 8, 9, 100, 256, 512, 513, 4096])
def test_capture_sizes_follow_vllms_ladder(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == vllm_ladder(max_num_seqs)
    assert sizes[-1] >= min(max_num_seqs, MAX_CAPTURE_SIZE) and sizes[-1] <= MAX_CAPTURE_SIZE


def test_capture_sizes_reject_zero():
    with pytest.raises(ValueError):
        capture_sizes(0)


def make_graphs(max_num_seqs=24, max_model_len=100, block_size=16) -> DecodeGraphs:
    return DecodeGraphs(
        torch.nn.Identity(), CPU, max_num_seqs, max_model_len, block_size, capture=False
    )


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    graphs = make_graphs()
    assert graphs.sizes == [1, 2, 4, 8, 16, 24]
    for batch in range(1, 25):
        assert graphs.bucket_for(batch) == min(s for s in graphs.sizes if s >= batch)
    assert graphs.bucket_for(25) is None and graphs.bucket_for(0) is None
    assert graphs.max_blocks_per_seq == 7  # ceil(100 / 16)
    assert graphs.fits(24, 7) and not graphs.fits(25, 1) and not graphs.fits(3, 8)


def test_capture_needs_cuda():
    with pytest.raises(ValueError):
        DecodeGraphs(torch.nn.Identity(), CPU, 4, 64, 16, capture=True)


def load_step(graphs: DecodeGraphs, batch: int, seed: int, width: int = 3):
    rng = random.Random(seed)
    columns = {
        "input_ids": [rng.randrange(1, 400) for _ in range(batch)],
        "positions": [rng.randrange(1, 40) for _ in range(batch)],
        "slot_mapping": [rng.randrange(0, 64) for _ in range(batch)],
        "seq_lens": [rng.randrange(2, 41) for _ in range(batch)],
    }
    rows = [[rng.randrange(1, 30) for _ in range(width)] for _ in range(batch)]
    size = graphs.load(
        columns["input_ids"],
        columns["positions"],
        columns["slot_mapping"],
        columns["seq_lens"],
        rows,
    )
    return size, columns, rows


def test_load_writes_rows_and_pads_up_to_the_bucket():
    graphs = make_graphs()
    pointers = [t.data_ptr() for t in (*graphs.static.vectors(), graphs.block_table)]
    padding = {"input_ids": 0, "positions": 0, "slot_mapping": PAD_SLOT, "seq_lens": 1}
    # 8 real rows, then 5 (padded to 8: rows 5..7 must not keep the earlier step's slots), then 3.
    for step, batch in enumerate((8, 5, 3, 24, 17)):
        size, columns, rows = load_step(graphs, batch, seed=step)
        assert size == graphs.bucket_for(batch)
        for name, values in columns.items():
            buffer = getattr(graphs.static, name)
            assert buffer[:batch].tolist() == values, name
            assert buffer[batch:size].tolist() == [padding[name]] * (size - batch), name
        assert graphs.block_table[:batch, :3].tolist() == rows
        # The same storage every step: a captured graph reads these addresses.
        assert [t.data_ptr() for t in (*graphs.static.vectors(), graphs.block_table)] == pointers
        input_ids, positions, metadata = graphs.inputs(size)
        assert input_ids.data_ptr() == pointers[0] and positions.data_ptr() == pointers[1]
        assert (
            metadata.slot_mapping.data_ptr() == pointers[2]
            and metadata.seq_lens.data_ptr() == pointers[3]
        )
        assert metadata.block_table.shape == (size, graphs.max_blocks_per_seq)
        assert metadata.cu_seqlens_q.tolist() == list(range(size + 1))
        assert (metadata.max_seqlen_q, metadata.max_seqlen_k, metadata.num_decode_seqs) == (
            1,
            100,
            size,
        )
    assert graphs.num_steps == 5


def test_load_refuses_what_does_not_fit():
    graphs = make_graphs()
    with pytest.raises(ValueError):
        load_step(graphs, 25, seed=0)
    with pytest.raises(ValueError):
        load_step(graphs, 2, seed=0, width=8)


def test_enforce_eager_flag_and_default():
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).enforce_eager is False
    assert (
        engine_config_from_args(parser.parse_args(["serve", "--enforce-eager"])).enforce_eager
        is True
    )


# ---- the engine on a tiny random Llama ------------------------------------------------------
GRAPH_BATCH = 4  # graphs for 1, 2 and 4 sequences; the engine runs up to 8 at once


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 45))] for _ in range(count)]


def generate(llm: LLM, prompts) -> list[list[int]]:
    # Different lengths: the decode batch shrinks from 7 to 1, through every bucket. The first
    # request, which gets the first blocks (block 0 included), lives longest.
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * (len(prompts) - i), ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def tiny_llm(tiny_llama_dir, dtype="float32", **kwargs) -> LLM:
    # A small token budget: long prompts are chunked, so prompt chunks share steps with decodes.
    return LLM(
        model=str(tiny_llama_dir),
        dtype=dtype,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        **kwargs,
    )


def attach_static_graphs(llm: LLM) -> DecodeGraphs:
    runner = llm.llm_engine.runner
    runner.decode_graphs = DecodeGraphs(
        runner.model,
        runner.device,
        GRAPH_BATCH,
        runner.max_model_len,
        runner.block_size,
        prefill_row_tile(runner.device),
        capture=False,
    )
    return runner.decode_graphs


def test_cpu_runs_eagerly_whatever_enforce_eager_says(tiny_llama_dir):
    for enforce_eager in (False, True):
        llm = tiny_llm(tiny_llama_dir, enforce_eager=enforce_eager, device="cpu")
        assert llm.llm_engine.runner.decode_graphs is None


# What a padded static-buffer step promises against the eager step of its real rows:
# - bf16 on the CPU: every op is row-invariant there (kernels/cpu/gemm*.cpp at every ISA level,
#   attention and norms per row), so padding rows changes no bit: exact equality.
# - float32 (oneDNN's GEMMs on the CPU, cuBLAS on CUDA): the library picks its kernel and
#   summation order from the row count, so 3 rows padded to 4 may move each sum by a few fp32
#   ulps (1.5e-5 seen on a Zen 5 EPYC); the logits agree to 1e-4 and the tokens exactly.
PADDING_PROMISES = {
    "bfloat16-cpu": dict(device="cpu", exact=True),
    "float32": dict(device=None, exact=False),
}


@pytest.mark.parametrize("promise", sorted(PADDING_PROMISES))
def test_static_buffer_steps_match_eager_steps(tiny_llama_dir, promise):
    """Each decode step that goes through the static buffers is also prepared and run eagerly
    on the same state: the same inputs, the same logits (see PADDING_PROMISES), the same
    tokens; and the whole generation equals one without graphs."""
    dtype = promise.split("-")[0]
    device, exact = PADDING_PROMISES[promise]["device"], PADDING_PROMISES[promise]["exact"]
    options = dict(dtype=dtype, **({"device": device} if device else {}))
    reference_llm = tiny_llm(tiny_llama_dir, **options)
    vocab = reference_llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(7, vocab, seed=5)
    reference = generate(reference_llm, prompts)

    llm = tiny_llm(tiny_llama_dir, **options)
    graphs = attach_static_graphs(llm)
    runner = llm.llm_engine.runner
    prepare, forward = runner.prepare, runner.forward
    steps = []  # (decode rows, prompt rows, graph size)
    eager_logits = {}

    def checked_prepare(scheduled):
        runner.decode_graphs = None
        eager = prepare(scheduled)
        runner.decode_graphs = graphs
        model_input = prepare(scheduled)
        decodes = eager.metadata.num_decode_seqs
        steps.append((decodes, eager.input_ids.shape[0] - decodes, model_input.graph_size))
        if model_input.graph_size:
            n = eager.input_ids.shape[0]
            assert torch.equal(model_input.input_ids[:n], eager.input_ids)
            assert torch.equal(model_input.positions[:n], eager.positions)
            got, want = model_input.metadata, eager.metadata
            assert torch.equal(got.slot_mapping[:n], want.slot_mapping)
            assert torch.equal(got.seq_lens[:n], want.seq_lens)
            width = want.block_table.shape[1]
            assert torch.equal(got.block_table[:n, :width], want.block_table)
            assert model_input.sampling_inputs == eager.sampling_inputs
            # The eager pass writes this step's K/V; the static pass overwrites the same slots.
            eager_logits[id(model_input)] = forward(eager)
        return model_input

    def checked_forward(model_input):
        logits = forward(model_input)
        if model_input.graph_size:
            want = eager_logits.pop(id(model_input))
            if exact:
                assert torch.equal(logits, want)
            else:
                torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
        return logits

    runner.prepare, runner.forward = checked_prepare, checked_forward
    assert generate(llm, prompts) == reference
    static_steps = [s for s in steps if s[2]]
    assert static_steps and graphs.num_steps == len(static_steps)
    for decodes, prompt_rows, size in steps:
        if prompt_rows:  # prompt and mixed steps never use the graphs
            assert size == 0
        else:  # decode-only: a bucket when one holds the batch, else eager
            assert size == (graphs.bucket_for(decodes) or 0)
    assert any(p for _, p, _ in steps) and any(d and p for d, p, _ in steps)
    assert {size for _, _, size in static_steps} == {1, 2, 4}
    assert any(d == 3 for d, _, _ in static_steps), "no step was padded (3 rows to 4)"
    assert any(d > GRAPH_BATCH and not p for d, p, _ in steps), (
        "no decode step above the largest bucket"
    )


def test_static_buffers_are_reused_across_steps(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    graphs = attach_static_graphs(llm)
    runner = llm.llm_engine.runner
    prepare = runner.prepare
    pointers = set()

    def recording_prepare(scheduled):
        model_input = prepare(scheduled)
        if model_input.graph_size:
            metadata = model_input.metadata
            pointers.add(
                (
                    model_input.input_ids.data_ptr(),
                    model_input.positions.data_ptr(),
                    metadata.slot_mapping.data_ptr(),
                    metadata.seq_lens.data_ptr(),
                    metadata.block_table.data_ptr(),
                    metadata.cu_seqlens_q.data_ptr(),
                )
            )
        return model_input

    runner.prepare = recording_prepare
    generate(llm, random_prompts(4, llm.llm_engine.model_config.vocab_size, seed=6))
    static = graphs.static
    assert pointers == {
        (
            static.input_ids.data_ptr(),
            static.positions.data_ptr(),
            static.slot_mapping.data_ptr(),
            static.seq_lens.data_ptr(),
            graphs.block_table.data_ptr(),
            graphs.cu_seqlens_q.data_ptr(),
        )
    }


# ---- CUDA: real graphs ----------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
def test_cuda_graph_replay_gives_the_eager_tokens(tiny_llama_dir):
    """fp32: the graphs' padded GEMMs and fixed split-KV count change only rounding."""

    def run(enforce_eager: bool):
        llm = LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            num_kv_blocks=128,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            enforce_eager=enforce_eager,
        )
        vocab = llm.llm_engine.model_config.vocab_size
        tokens = generate(llm, random_prompts(11, vocab, seed=7))
        return tokens, llm.llm_engine.runner

    eager, eager_runner = run(True)
    graphed, runner = run(False)
    assert eager_runner.decode_graphs is None
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    assert graphs.num_steps > 0 and runner.graph_capture.seconds > 0
    assert graphed == eager


def record_verifications_in_graphs(runner) -> list[int]:
    """A list the runner's prepare fills with the graph size of each step that verifies
    proposals through the graphs' buffers."""
    prepare, recorded = runner.prepare, []

    def recording_prepare(scheduled):
        model_input = prepare(scheduled)
        if model_input.graph_size and model_input.spec_inputs:
            recorded.append(model_input.graph_size)
        return model_input

    runner.prepare = recording_prepare
    return recorded


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_verification_rides_the_static_buffers(tiny_llama_dir, dtype):
    """A verification's k + 1 rows are decode rows, so a step of decodes and verifications goes
    through the graphs' static buffers (on CUDA: replayed graphs of that many rows) and gives the
    tokens of plain decoding."""
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
    }
    rng = random.Random(9)
    prompts = [
        [rng.randrange(3, 300) for _ in range(4)] * 3 for _ in range(3)
    ]  # repeats: proposals
    reference = generate(tiny_llm(tiny_llama_dir, dtype=dtype, device="cpu"), prompts)
    llm = tiny_llm(tiny_llama_dir, dtype=dtype, device="cpu", speculative_config=ngram)
    graphs = attach_static_graphs(llm)
    verified_in_graphs = record_verifications_in_graphs(llm.llm_engine.runner)
    assert generate(llm, prompts) == reference
    assert verified_in_graphs and graphs.num_steps > 0


@cuda_only
def test_cuda_graphs_replay_speculative_verification(tiny_llama_dir):
    """On CUDA the verification rows go through captured graphs (a bucket of decode rows) and
    give the eager, non-speculative tokens (fp32: the graphs' padded GEMMs change only rounding)."""
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
    }
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(4)] * 3 for _ in range(5)]
    options = dict(
        dtype="float32",
        device="cuda",
        num_kv_blocks=128,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )
    plain = generate(LLM(model=str(tiny_llama_dir), enforce_eager=True, **options), prompts)
    llm = LLM(model=str(tiny_llama_dir), speculative_config=ngram, **options)
    runner = llm.llm_engine.runner
    replayed = record_verifications_in_graphs(runner)
    assert generate(llm, prompts) == plain
    assert replayed and runner.decode_graphs.num_steps > 0
