"""Beam search (LLM.beam_search) against transformers' generate(num_beams=...) on a small random
Llama in fp32: the same beams, in the same order, with the same scores. One checkpoint's EOS is
moved to a token the model likes, so beams finish early and the early-stopping heuristic is
exercised; the prefix cache must share the beams' blocks (counted, not timed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanoserve import LLM
from nanoserve.beam_search import BeamSearchParams
from tests.engine.hf_oracle import load_hf
from tests.helpers import random_prompts


@pytest.fixture(scope="module")
def eos_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with EOS set to the token its greedy continuation of PROMPT_WITH_EOS[0]
    writes third, so some beams end early."""
    path = tmp_path_factory.mktemp("tiny-llama-eos") / "model"
    shutil.copytree(tiny_llama_dir, path)
    model = load_hf(path)
    with torch.inference_mode():
        ids = model.generate(
            torch.tensor([PROMPT_WITH_EOS[0]]),
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    eos = int(ids[0, -1])
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    return path


PROMPT_WITH_EOS = [[5, 17, 42, 99, 7, 13]]


def hf_beams(
    model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    length_penalty: float,
    eos: list[int] | None,
):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            do_sample=False,
            early_stopping=False,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=-1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = row[len(prompt) :]
        ends = [i for i, token in enumerate(generated) if eos and token in eos]
        if ends:  # after EOS comes padding
            generated = generated[: ends[0] + 1]
        beams.append((generated, score))
    return beams


def check_equal(llm, model, prompts, params: BeamSearchParams, eos: list[int] | None):
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, result in zip(prompts, results):
        expected = hf_beams(
            model, prompt, params.beam_width, params.max_tokens, params.length_penalty, eos
        )
        got = [(beam.tokens[len(prompt) :], beam.score) for beam in result.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, ours), (_, theirs) in zip(got, expected):
            assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-4)
        for beam in result.sequences:
            assert beam.tokens[: len(prompt)] == prompt
            assert beam.cum_logprob == pytest.approx(sum(beam.logprobs), abs=1e-4)
    return results


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 1.0), (3, 0.5), (4, 2.0)])
def test_beams_equal_transformers_without_eos(tiny_llama_dir, width, length_penalty):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512)
    model = load_hf(tiny_llama_dir)
    prompts = random_prompts(3, llm.llm_engine.model_config.vocab_size, seed=width)
    params = BeamSearchParams(
        beam_width=width, max_tokens=10, ignore_eos=True, length_penalty=length_penalty
    )
    check_equal(llm, model, prompts, params, eos=None)


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_with_eos(eos_model_dir, width):
    llm = LLM(model=str(eos_model_dir), dtype="float32", num_kv_blocks=512)
    model = load_hf(eos_model_dir)
    # nanoserve stops on the generation config's EOS and the tokenizer's: give transformers both.
    eos = sorted(llm.llm_engine.eos_token_ids)
    assert json.loads((eos_model_dir / "generation_config.json").read_text())["eos_token_id"] in eos
    prompts = PROMPT_WITH_EOS + random_prompts(2, llm.llm_engine.model_config.vocab_size, seed=9)
    results = check_equal(
        llm, model, prompts, BeamSearchParams(beam_width=width, max_tokens=12), eos
    )
    finished_by_eos = [
        beam for result in results for beam in result.sequences if beam.finish_reason == "stop"
    ]
    assert finished_by_eos and all(beam.tokens[-1] in eos for beam in finished_by_eos)


def test_beams_share_blocks_through_the_prefix_cache(tiny_llama_dir):
    """Each step sends every beam as a new request; the full blocks of its parent (and of the
    prompt) come from the prefix cache, so a beam computes at most its last partial block and
    new token: far fewer tokens than beams x their lengths."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, block_size=16)
    prompt = random_prompts(
        1, llm.llm_engine.model_config.vocab_size, seed=3, min_len=70, max_len=70
    )[0]
    before = llm.llm_engine.stats()
    width, steps = 4, 12
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, steps, ignore_eos=True))
    after = llm.llm_engine.stats()
    queried = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    computed = queried - (after.prefix_cache_hits_total - before.prefix_cache_hits_total)
    requests = 1 + width * (steps - 1)
    assert queried >= requests * len(prompt)  # every request carries the whole sequence
    assert computed <= len(prompt) + (requests - 1) * (16 + 1)


def test_bad_params_are_refused():
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
