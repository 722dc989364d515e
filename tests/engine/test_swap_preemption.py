"""Preemption by swapping (--preemption-mode swap): a KV pool far too small for the batch gives the
same tokens as a roomy pool and as preemption by recompute; swap-outs really happen; aborting a
swapped request frees its host blocks; the full-host-pool fallback to recompute stays correct;
nothing leaks."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sequence import SequenceStatus

NUM_TOKENS = 32
# Each sequence needs up to (40 + 32) / 16 = 5 blocks; 48 of them need ~220. Give ~a fifth.
SMALL = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def random_prompts(
    count: int, vocab: int, seed: int, min_len: int = 20, max_len: int = 40
) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def generate(llm: LLM, prompts, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_nothing_leaked(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.block_managers[0].num_used_blocks == 0
    assert sorted(engine.block_managers[0].free_blocks) == list(
        range(engine.block_managers[0].num_blocks)
    )
    if engine.host_pool is not None:
        assert engine.host_pool.num_used_blocks == 0
        assert sorted(engine.host_pool.free_blocks) == list(range(engine.host_pool.num_blocks))
    stats = engine.stats()
    assert stats.num_swapped == stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0 and stats.cpu_cache_usage == 0


@pytest.fixture(scope="module")
def prompts(roomy):
    return random_prompts(48, roomy.llm_engine.model_config.vocab_size, seed=3)


@pytest.fixture(scope="module")
def roomy(tiny_llama_dir):
    return LLM(
        model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=256, num_kv_blocks=512
    )


@pytest.fixture(scope="module")
def swap_llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), preemption_mode="swap", num_swap_blocks=256, **SMALL)


def test_swap_gives_the_roomy_pool_and_recompute_tokens(tiny_llama_dir, prompts, roomy, swap_llm):
    reference = generate(roomy, prompts)
    assert roomy.llm_engine.schedulers[0].num_preemptions == 0
    assert generate(swap_llm, prompts) == reference
    stats = swap_llm.llm_engine.stats()
    assert stats.num_swap_outs_total > 0
    # Host room for everything: every preemption was a swap.
    assert stats.num_preemptions_total == stats.num_swap_outs_total
    assert_nothing_leaked(swap_llm)
    recompute = LLM(model=str(tiny_llama_dir), **SMALL)
    assert generate(recompute, prompts) == reference
    assert recompute.llm_engine.schedulers[0].num_preemptions > 0
    assert recompute.llm_engine.stats().num_swap_outs_total == 0


def test_seeded_sampling_and_n_survive_swapping(prompts, roomy, swap_llm):
    params = SamplingParams(
        temperature=1.0, top_p=0.9, seed=7, n=2, max_tokens=NUM_TOKENS, ignore_eos=True
    )
    before = swap_llm.llm_engine.stats().num_swap_outs_total
    reference = generate(roomy, prompts[:24], params)
    assert generate(swap_llm, prompts[:24], params) == reference
    assert swap_llm.llm_engine.stats().num_swap_outs_total > before
    assert_nothing_leaked(swap_llm)


def test_swap_with_priority_scheduling(tiny_llama_dir, prompts, roomy):
    llm = LLM(
        model=str(tiny_llama_dir),
        preemption_mode="swap",
        num_swap_blocks=256,
        scheduling_policy="priority",
        **SMALL,
    )
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts[:32]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, priority=i % 3)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[int(output.request_id)] = output.outputs[0].token_ids
    assert [done[i] for i in range(32)] == [t[0] for t in generate(roomy, prompts[:32])]
    assert engine.stats().num_swap_outs_total > 0
    assert_nothing_leaked(llm)


def test_full_host_pool_falls_back_to_recompute(tiny_llama_dir, prompts, roomy):
    # Room for about one swapped sequence: most preemptions must recompute.
    llm = LLM(model=str(tiny_llama_dir), preemption_mode="swap", num_swap_blocks=5, **SMALL)
    assert generate(llm, prompts) == generate(roomy, prompts)
    stats = llm.llm_engine.stats()
    assert 0 < stats.num_swap_outs_total < stats.num_preemptions_total
    assert_nothing_leaked(llm)


def test_abort_of_a_swapped_request_frees_its_host_blocks(prompts, swap_llm):
    engine = swap_llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(500):
        if engine.schedulers[0].swapped:
            break
        engine.step()
    swapped = engine.schedulers[0].swapped[0]
    assert swapped.status is SequenceStatus.SWAPPED and swapped.host_block_table
    used = engine.host_pool.num_used_blocks
    held = len(swapped.host_block_table)
    stats = engine.stats()
    assert stats.num_swapped >= 1 and stats.cpu_cache_usage == used / engine.host_pool.num_blocks
    engine.abort_request(swapped.request_id)
    assert engine.host_pool.num_used_blocks == used - held
    assert (
        swapped not in engine.schedulers[0].swapped
        and swapped.is_finished
        and not swapped.host_block_table
    )
    engine.abort_request([f"abort-{i}" for i in range(len(prompts))])
    assert_nothing_leaked(swap_llm)


def test_engine_serves_on_after_aborting_swapped_requests(prompts, roomy, swap_llm):
    # Runs after the abort test on the same engine: same tokens as the roomy pool, nothing left.
    assert generate(swap_llm, prompts) == generate(roomy, prompts)
    assert_nothing_leaked(swap_llm)


def test_swap_mode_needs_swap_space(tiny_llama_dir):
    with pytest.raises(ValueError, match="preemption_mode 'swap' needs swap_space > 0 GiB"):
        LLM(model=str(tiny_llama_dir), preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap"):
        LLM(model=str(tiny_llama_dir), preemption_mode="spill")


def test_shared_prefix_blocks_survive_swapping(tiny_llama_dir, roomy):
    # Prompts share two cached blocks: swapping a sequence out leaves them cached for the others,
    # and swapping it in gives it fresh copies of its own.
    vocab = roomy.llm_engine.model_config.vocab_size
    prefix = random_prompts(1, vocab, seed=9, min_len=32, max_len=32)[0]
    prompts = [prefix + tail for tail in random_prompts(32, vocab, seed=10, min_len=4, max_len=12)]
    llm = LLM(model=str(tiny_llama_dir), preemption_mode="swap", num_swap_blocks=256, **SMALL)
    assert generate(llm, prompts) == generate(roomy, prompts)
    stats = llm.llm_engine.stats()
    assert stats.num_swap_outs_total > 0 and stats.prefix_cache_hits_total > 0
    assert_nothing_leaked(llm)
