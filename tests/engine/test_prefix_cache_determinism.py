"""Issue 19: a prompt's greedy answer must not depend on how its prompt was computed: cold
(prefix caching off), fully cached (the same prompt again), partly cached (another prompt shared
a long prefix first), or split across chunked-prefill steps at any boundary.

Each request runs alone (one request per generate call), so every decode step is one row and
only the prompt's computation varies between runs. The oracle is the same engine with prefix
caching off and the whole prompt in one step. Besides the token ids, the tiny-model runs ask for
the sampled token's logprob: the CPU path promises the same bits for a prompt row however the
prompt was split, so those floats must be equal too, which catches a divergence long before it
flips a greedy choice.

These are promises of the CPU path, so every engine here runs on the CPU, also on a GPU machine:
cuBLAS picks its GEMM kernels by row count, so on CUDA a prompt's logprobs move in the last bits
with its chunking and batch (the greedy tokens stayed the same in the H200 run of these tests;
scripts/gpu_check.sh compares CUDA's tokens with the CPU path's)."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from tests.conftest import write_random_llama

BLOCK_SIZE = 16
NUM_TOKENS = 24
DTYPES = ["float32", "bfloat16"]
# head_dim 64 and GQA as SmolLM2; weights not so large that greedy choices are never close.
MODEL_SHAPE = dict(
    hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=2
)
PROMPT_LENGTHS = {"long": 300, "mid": 150, "short": 40}  # > 256 rows, several key buckets, blocks
# Chunked-prefill token budgets: whole blocks, odd sizes, and ones that leave a single last row
# (39 for the short prompt, 149 for the mid one, 299 for the long one).
BUDGETS = [16, 39, 149, 299]
# How much of each prompt a donor prompt shares before the partly cached run: mid-block cuts.
SHARED_PREFIX = {"long": 290, "mid": 100, "short": 35}

GREEDY_WITH_LOGPROB = SamplingParams(
    temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0
)
PLAIN_GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("determinism-llama"), seed=19, **MODEL_SHAPE)


@pytest.fixture(scope="module")
def vocab_size(model_dir) -> int:
    from nanoserve.models.config import ModelConfig

    return ModelConfig.from_dir(model_dir).vocab_size


@pytest.fixture(scope="module")
def prompts(vocab_size) -> dict[str, list[int]]:
    rng = random.Random(19)
    return {
        name: [rng.randrange(3, vocab_size) for _ in range(length)]
        for name, length in PROMPT_LENGTHS.items()
    }


def donor_of(prompt: list[int], shared: int, vocab_size: int) -> list[int]:
    """A prompt equal to `prompt` for `shared` tokens, then different."""
    rng = random.Random(shared)
    tail = [rng.randrange(3, vocab_size) for _ in range(30)]
    tail[0] = (prompt[shared] + 1) % vocab_size if prompt[shared] + 1 < vocab_size else 3
    return prompt[:shared] + tail


def build(model_dir, dtype: str, *, caching: bool, budget: int = 2048) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=256,
        block_size=BLOCK_SIZE,
        device="cpu",
    )


def run(llm: LLM, prompt: list[int], params=GREEDY_WITH_LOGPROB):
    """(token ids, the logprob of each sampled token or None, cached prompt tokens)."""
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)
        ]
    assert len(completion.token_ids) == NUM_TOKENS
    return completion.token_ids, logprobs, output.num_cached_tokens


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_same(result, expected, what: str) -> None:
    tokens, logprobs, _ = result
    expected_tokens, expected_logprobs, _ = expected
    assert tokens == expected_tokens, (
        f"{what}: greedy tokens differ from the cold run from token {first_difference(tokens, expected_tokens)}"
    )
    assert logprobs == expected_logprobs, (
        f"{what}: same tokens but the logprob of token {first_difference(logprobs, expected_logprobs)} differs "
        f"({logprobs} vs {expected_logprobs})"
    )


@pytest.fixture(scope="module")
def cold(model_dir, prompts):
    """cold(dtype)[prompt name]: the oracle run (caching off, whole prompt in one step)."""
    runs: dict[str, dict[str, tuple]] = {}

    def get(dtype: str) -> dict[str, tuple]:
        if dtype not in runs:
            llm = build(model_dir, dtype, caching=False)
            runs[dtype] = {name: run(llm, prompt) for name, prompt in prompts.items()}
            assert all(result[2] == 0 for result in runs[dtype].values())
        return runs[dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_cached_same_as_cold(dtype, model_dir, prompts, cold):
    expected = cold(dtype)
    llm = build(model_dir, dtype, caching=True)
    for name, prompt in prompts.items():
        first = run(llm, prompt)
        assert first[2] == 0
        assert_same(first, expected[name], f"{name} prompt, first run with caching on")
        again = run(llm, prompt)
        # Every full block but the one holding the last token (always recomputed for its logits).
        assert again[2] == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert_same(again, expected[name], f"{name} prompt, fully cached ({again[2]} tokens)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_partly_cached_same_as_cold(dtype, model_dir, prompts, cold, vocab_size):
    expected = cold(dtype)
    llm = build(model_dir, dtype, caching=True)
    for name, prompt in prompts.items():
        shared = SHARED_PREFIX[name]
        donor = run(llm, donor_of(prompt, shared, vocab_size))
        assert donor[2] == 0
        result = run(llm, prompt)
        assert result[2] == shared // BLOCK_SIZE * BLOCK_SIZE, "the shared prefix was not reused"
        assert_same(
            result, expected[name], f"{name} prompt behind a cached {result[2]}-token prefix"
        )


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_same_as_cold(dtype, budget, model_dir, prompts, cold):
    expected = cold(dtype)
    llm = build(model_dir, dtype, caching=False, budget=budget)
    assert llm.llm_engine.schedulers[0].max_num_batched_tokens == budget
    for name, prompt in prompts.items():
        assert_same(run(llm, prompt), expected[name], f"{name} prompt in chunks of {budget} tokens")


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_behind_a_cached_prefix_same_as_cold(
    dtype, model_dir, prompts, cold, vocab_size
):
    """Both at once: the cached prefix ends mid-prompt and the rest arrives in odd-sized chunks."""
    expected = cold(dtype)
    llm = build(model_dir, dtype, caching=True, budget=37)
    for name, prompt in prompts.items():
        run(llm, donor_of(prompt, SHARED_PREFIX[name], vocab_size))
        result = run(llm, prompt)
        assert result[2] > 0
        assert_same(
            result, expected[name], f"{name} prompt, cached {result[2]} tokens, chunks of 37"
        )
        again = run(llm, prompt)
        assert_same(again, expected[name], f"{name} prompt, fully cached, chunks of 37")


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_greedy_path_same_cold_cached_chunked(dtype, model_dir, prompts):
    """Without logprobs the sampler takes the plain greedy path (the C++ argmax): same checks on
    tokens only."""
    prompt = prompts["long"]
    cold_tokens = run(build(model_dir, dtype, caching=False), prompt, PLAIN_GREEDY)[0]
    cached = build(model_dir, dtype, caching=True)
    run(cached, prompt, PLAIN_GREEDY)
    assert run(cached, prompt, PLAIN_GREEDY)[0] == cold_tokens
    assert (
        run(build(model_dir, dtype, caching=False, budget=299), prompt, PLAIN_GREEDY)[0]
        == cold_tokens
    )


@pytest.mark.parametrize("gemm", ["nanoserve", "onednn"])
def test_prompt_rows_padded_only_without_our_gemm(
    gemm, model_dir, prompts, vocab_size, monkeypatch, cpu_isa
):
    """With our GEMM (kernels/cpu/gemm*.cpp, at every ISA level) prompt rows are not padded; with
    oneDNN's (NANOSERVE_CPU_GEMM=onednn, or weights ours can't take) they are padded to
    PREFILL_ROW_TILE. Either way a cached or chunked prompt gives the cold run's bits."""
    from nanoserve.kernels.cpu import ops as cpu_ops

    if not cpu_ops.gemm_available():
        pytest.skip("the CPU kernels don't load here")
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", gemm)
    cold_llm = build(model_dir, "bfloat16", caching=False)
    runner = cold_llm.llm_engine.runner
    assert runner.pad_prompt_rows == (gemm == "onednn")
    prompt = prompts["mid"]
    expected = run(cold_llm, prompt)
    llm = build(model_dir, "bfloat16", caching=True, budget=37)
    run(llm, donor_of(prompt, SHARED_PREFIX["mid"], vocab_size))
    result = run(llm, prompt)
    assert result[2] > 0
    assert_same(
        result, expected, f"cached {result[2]} tokens, chunks of 37, {gemm} GEMM at {cpu_isa}"
    )


# ---- SmolLM2, the report -----------------------------------------------------------

CHAT = [
    {
        "role": "user",
        "content": (
            "I am planning a week-long trip through the north of Italy in late spring, starting in Milan "
            "and ending in Venice, travelling only by train. I like museums, old churches, food markets and "
            "short walks, but I do not enjoy crowds or long queues. Suggest a day-by-day plan, with one or "
            "two places to eat each day, and explain briefly why you chose each stop."
        ),
    }
]
CHAT_PARAMS = SamplingParams(temperature=0, max_tokens=120)


def smollm2(model_dir, **kwargs) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="bfloat16",
        num_kv_blocks=256,
        max_model_len=2048,
        device="cpu",
        **kwargs,
    )


def test_smollm2_bf16_three_identical_chats_with_prefix_caching(smollm2_dir):
    """Issue 19's report: one message, max_tokens=120, three identical LLM.chat calls with
    prefix caching on; the first answer used to differ from the next two."""
    llm = smollm2(smollm2_dir, enable_prefix_caching=True)
    outputs = [llm.chat(CHAT, CHAT_PARAMS, use_tqdm=False)[0] for _ in range(3)]
    texts = [o.outputs[0].text for o in outputs]
    assert outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 4 * BLOCK_SIZE for o in outputs[1:]), [
        o.num_cached_tokens for o in outputs
    ]
    for i in (1, 2):
        assert texts[i] == texts[0], (
            f"call {i + 1} (with {outputs[i].num_cached_tokens} cached prompt tokens) differs from the first "
            f"from character {first_difference(texts[i], texts[0])}"
        )
    uncached = smollm2(smollm2_dir, enable_prefix_caching=False).chat(
        CHAT, CHAT_PARAMS, use_tqdm=False
    )[0]
    assert uncached.outputs[0].text == texts[0], (
        f"caching off differs from caching on from character {first_difference(uncached.outputs[0].text, texts[0])}"
    )
    chunked = smollm2(smollm2_dir, enable_prefix_caching=False, max_num_batched_tokens=48)
    chunked_text = chunked.chat(CHAT, CHAT_PARAMS, use_tqdm=False)[0].outputs[0].text
    assert chunked_text == texts[0], (
        f"chunked prefill (48 tokens a step) differs from character {first_difference(chunked_text, texts[0])}"
    )


# ---- batching -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_shaped_dir(tmp_path_factory):
    """SmolLM2's layer shapes (hidden 576, 9 heads / 3 KV heads, MLP 1536), two layers: shapes on
    which oneDNN's per-row results do change with the number of rows."""
    return write_random_llama(
        tmp_path_factory.mktemp("batching-llama"),
        seed=23,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        num_layers=2,
    )


def test_decode_rows_do_not_depend_on_the_batch(smollm2_shaped_dir, prompts, vocab_size, cpu_isa):
    """With our GEMM every op of a CPU step is row-invariant at every ISA level, decode rows
    included: a prompt answered alone and answered among other requests that come and go gives
    the same tokens and the same logprob bits."""
    from nanoserve.kernels.cpu import ops as cpu_ops

    if not cpu_ops.gemm_available():
        pytest.skip(
            "the CPU kernels don't load here: decode rows are one oneDNN GEMM of the batch's size"
        )
    llm = build(smollm2_shaped_dir, "bfloat16", caching=False)
    alone = {name: run(llm, prompt) for name, prompt in prompts.items()}
    rng = random.Random(7)
    fillers = [
        {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randrange(5, 120))]}
        for _ in range(40)
    ]
    filler_params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(1, 2 * NUM_TOKENS), ignore_eos=True)
        for _ in fillers
    ]
    batch = [{"prompt_token_ids": p} for p in prompts.values()] + fillers
    outputs = llm.generate(
        batch, [GREEDY_WITH_LOGPROB] * len(prompts) + filler_params, use_tqdm=False
    )
    for (name, expected), output in zip(alone.items(), outputs):
        completion = output.outputs[0]
        logprobs = [
            entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)
        ]
        assert_same(
            (completion.token_ids, logprobs, expected[2]),
            expected,
            f"{name} prompt among {len(batch) - 1} other requests",
        )
