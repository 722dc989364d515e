"""LoRA adapters (--enable-lora) against peft's own model, and the engine's promises with them:
mixed adapters in one step, batch invariance, the prefix cache kept apart per adapter, the
--max-loras bound, adapters evicted and read again, and one-line errors for what can't be served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from nanoserve import LLM, LoRARequest, SamplingParams
from tests.engine.hf_oracle import hf_greedy, load_hf
from tests.lora_adapters import peft_oracle

PROMPTS = [
    [5, 17, 33, 90, 120, 7, 8, 9],
    [44, 2, 301, 12, 19, 250, 77, 3, 90, 91, 15, 16, 200, 4, 61, 8, 9, 10],
    [300, 1, 2, 3],
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def lora(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(adapters[name]))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_mixed_adapters_match_peft(tiny_llama_dir, lora_adapters):
    """The base model and three adapters (every projection; rsLoRA; per-module rank and alpha
    patterns) in the same steps give peft's greedy tokens, and logprobs within fp32 noise."""
    names = list(lora_adapters)
    requests = [(prompt, name) for prompt in PROMPTS for name in [None, *names]]
    with LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=len(names),
        device="cpu",
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests],
            GREEDY,
            use_tqdm=False,
            lora_request=[
                lora(lora_adapters, n, names.index(n) + 1) if n else None for _, n in requests
            ],
        )
    oracles = {
        None: load_hf(tiny_llama_dir),
        **{n: peft_oracle(tiny_llama_dir, lora_adapters[n]) for n in names},
    }
    distinct = set()
    for (prompt, name), output in zip(requests, outputs):
        expected = hf_greedy(oracles[name], prompt, GREEDY.max_tokens)
        assert output.outputs[0].token_ids == expected, name
        assert (output.lora_request is None) == (name is None)
        with torch.inference_mode():
            logits = oracles[name](torch.tensor([prompt + expected[:-1]])).logits[
                0, len(prompt) - 1 :
            ]
        reference = logits.float().log_softmax(-1)
        got = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, expected)]
        want = [float(reference[i, token]) for i, token in enumerate(expected)]
        assert got == pytest.approx(want, abs=2e-3), name
        distinct.add(tuple(expected))
    assert len(distinct) == len(requests)  # every adapter changes every answer


def test_batch_invariance_across_adapters(tiny_llama_dir, lora_adapters):
    """A request's tokens and logprobs have the same bits alone and beside other adapters' and
    the base model's requests (prompt rows and decodes), in bf16: every GEMM, the LoRA ones
    too, on our CPU GEMM, whose rows don't depend on the others (fp32 makes no such promise:
    its LM head is F.linear on the sampled rows)."""
    dtype = "bfloat16"
    names = list(lora_adapters)
    loras = [None] + [lora(lora_adapters, n, i + 1) for i, n in enumerate(names)]
    requests = [(prompt, which) for prompt in PROMPTS for which in loras]
    with LLM(
        model=str(tiny_llama_dir), dtype=dtype, enable_lora=True, max_loras=len(names), device="cpu"
    ) as llm:
        together = llm.generate(
            [{"prompt_token_ids": p} for p, _ in requests],
            GREEDY,
            use_tqdm=False,
            lora_request=[w for _, w in requests],
        )
        llm.llm_engine.reset_prefix_cache()
        for (prompt, which), mixed in zip(requests, together):
            alone = llm.generate(
                [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=which
            )[0]
            llm.llm_engine.reset_prefix_cache()
            assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
            assert [{k: v.logprob for k, v in e.items()} for e in alone.outputs[0].logprobs] == [
                {k: v.logprob for k, v in e.items()} for e in mixed.outputs[0].logprobs
            ]


def test_prefix_cache_is_kept_apart_per_adapter(tiny_llama_dir, lora_adapters):
    """The same 40-token prompt under the base model, then an adapter: the adapter finds no
    cached block (its K/V differ) and answers as with caching off; its repeat hits its own."""
    prompt = list(range(3, 43))
    a1 = lora(lora_adapters, "all-r8", 1)
    with LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        enable_lora=True,
        enable_prefix_caching=False,
        device="cpu",
    ) as llm:
        cold = tokens(
            llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=a1)
        )
    with LLM(model=str(tiny_llama_dir), dtype="float32", enable_lora=True, device="cpu") as llm:
        base = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        first = llm.generate(
            [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=a1
        )[0]
        again = llm.generate(
            [{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=a1
        )[0]
        base_again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and [first.outputs[0].token_ids] == cold
    assert (
        again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    )
    assert (
        base_again.num_cached_tokens == 32
        and base_again.outputs[0].token_ids == base.outputs[0].token_ids
    )
    assert base.outputs[0].token_ids != first.outputs[0].token_ids


def test_max_loras_bounds_the_adapters_of_a_step(tiny_llama_dir, lora_adapters):
    """--max-loras 1 with two adapters and the base model queued at once: no step holds two
    adapters (the others wait), and every answer is the one a roomy engine gives."""
    names = ["all-r8", "qv-down-r4-rslora"]
    loras = [None, lora(lora_adapters, names[0], 1), lora(lora_adapters, names[1], 2)] * 3
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(loras))]
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2, device="cpu"
    ) as llm:
        roomy = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=1, device="cpu"
    ) as llm:
        runner = llm.llm_engine.runner
        seen, prepare = [], runner.prepare

        def watch(scheduled, *args):
            seen.append({item.lora_id for item in scheduled if item.lora_id})
            return prepare(scheduled, *args)

        runner.prepare = watch
        bounded = tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert bounded == roomy
    assert max(len(ids) for ids in seen) == 1 and set().union(*seen) == {1, 2}


def test_max_cpu_loras_drops_and_reads_again(tiny_llama_dir, lora_adapters):
    """--max-cpu-loras 1: taking turns, each adapter evicts the other and is read from disk
    again when its turn comes back; the answers stay those of an engine holding both."""
    turns = [lora(lora_adapters, "all-r8", 1), lora(lora_adapters, "qv-down-r4-rslora", 2)] * 2
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2, device="cpu"
    ) as llm:
        roomy = [
            tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=t)) for t in turns
        ]
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", enable_lora=True, max_cpu_loras=1, device="cpu"
    ) as llm:
        manager = llm.llm_engine.runner.lora
        reads, add = [], manager.add
        manager.add = lambda adapter_id, path: (reads.append(adapter_id), add(adapter_id, path))
        tight = []
        for turn in turns:
            tight.append(tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=turn)))
            assert list(llm.llm_engine.loras) == [turn.lora_int_id] and list(manager.adapters) == [
                turn.lora_int_id
            ]
    assert tight == roomy and roomy[0] != roomy[1]
    assert reads == [1, 2, 1, 2]


def test_lora_errors(tiny_llama_dir, lora_adapters, tmp_path):
    a1 = lora(lora_adapters, "all-r8", 1)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    with LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu") as llm:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a1)
    with LLM(
        model=str(tiny_llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8, device="cpu"
    ) as llm:
        with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
            llm.generate(
                prompt, GREEDY, use_tqdm=False, lora_request=lora(lora_adapters, "patterns-r16", 3)
            )
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate(
                prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 4, str(tmp_path))
            )
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a1)
        with pytest.raises(ValueError, match="LoRA id 1 is already loaded from"):
            llm.generate(
                prompt,
                GREEDY,
                use_tqdm=False,
                lora_request=LoRARequest("other", 1, str(lora_adapters["qv-down-r4-rslora"])),
            )
        for field, value, message in [
            ("use_dora", True, "use_dora"),
            ("bias", "all", "bias 'all'"),
            ("modules_to_save", ["lm_head"], "modules_to_save"),
        ]:
            bad = tmp_path / field
            shutil.copytree(lora_adapters["all-r8"], bad)
            config = json.loads((bad / "adapter_config.json").read_text())
            config[field] = value
            (bad / "adapter_config.json").write_text(json.dumps(config))
            with pytest.raises(ValueError, match=f"{message}.* is not supported"):
                llm.generate(
                    prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest(field, 10, str(bad))
                )
        added = tmp_path / "added-tokens"
        shutil.copytree(lora_adapters["all-r8"], added)
        save_file(
            {"input_embeddings": torch.ones(2, 64)}, str(added / "new_embeddings.safetensors")
        )
        with pytest.raises(ValueError, match="new_embeddings.safetensors .* is not supported"):
            llm.generate(
                prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("added", 12, str(added))
            )
        head = tmp_path / "head"  # an LM-head adapter, written as peft lays one out
        shutil.copytree(lora_adapters["all-r8"], head)
        save_file(
            {
                "base_model.model.lm_head.lora_A.weight": torch.ones(4, 64),
                "base_model.model.lm_head.lora_B.weight": torch.ones(400, 4),
            },
            str(head / "adapter_model.safetensors"),
        )
        with pytest.raises(
            ValueError,
            match=r"targets lm_head, which nanoserve can't apply it to \(it serves "
            r"adapters on down_proj, gate_proj, k_proj, o_proj, q_proj, "
            r"up_proj, v_proj\)",
        ):
            llm.generate(
                prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("head", 11, str(head))
            )
        # Every refusal left the engine serving, with the adapter it had.
        assert tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a1))
    for bad in [dict(max_loras=0), dict(max_lora_rank=0), dict(max_loras=2, max_cpu_loras=1)]:
        with pytest.raises(ValueError, match="max_lora|max_cpu_loras"):
            LLM(model=str(tiny_llama_dir), enable_lora=True, **bad)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/tmp")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_adapters_is_exact(tiny_llama_dir, lora_adapters, method):
    """Verification rows run with their sequence's adapter (a draft model proposes without
    one): speculation gives the tokens of plain decoding for every adapter (greedy)."""
    repetitive = [PROMPTS[0] * 4, PROMPTS[1] * 3]
    loras = [None, lora(lora_adapters, "all-r8", 1), lora(lora_adapters, "qv-down-r4-rslora", 2)]
    requests = [(p, w) for p in repetitive for w in loras]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    speculative = (
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
        if method == "ngram"
        else {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    )
    for spec in (None, speculative):
        with LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            device="cpu",
            speculative_config=spec,
        ) as llm:
            results.append(
                tokens(
                    llm.generate(
                        [{"prompt_token_ids": p} for p, _ in requests],
                        params,
                        use_tqdm=False,
                        lora_request=[w for _, w in requests],
                    )
                )
            )
            if spec is not None:
                assert llm.llm_engine.speculation.stats.num_draft_tokens > 0
    assert results[0] == results[1]


def test_adapters_over_a_gguf_model(tmp_path):
    """A GGUF model served as it is (Q8_0 layers, bf16 activations) with an adapter made for
    its checkpoint: the adapter changes the answers, and each answer has the same bits alone
    and in a step with the base model's rows (which alone take the fused decode step)."""
    from tests.gguf_models import write_quantized_gguf
    from tests.lora_adapters import write_peft_adapter

    gguf_file = write_quantized_gguf(tmp_path / "gguf", "q8_0")
    adapter = write_peft_adapter(
        gguf_file.parent / "hf", tmp_path / "adapter", 7, ["q_proj", "v_proj", "down_proj"], 8
    )
    which = [None, LoRARequest("a", 1, str(adapter))] * 2
    prompts = [{"prompt_token_ids": PROMPTS[i % 2]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    with LLM(model=str(gguf_file), dtype="bfloat16", enable_lora=True, device="cpu") as llm:
        assert llm.llm_engine.runner.fused_decode is not None
        together = llm.generate(prompts, params, use_tqdm=False, lora_request=which)
        for prompt, w, mixed in zip(prompts, which, together):
            llm.llm_engine.reset_prefix_cache()
            alone = llm.generate([prompt], params, use_tqdm=False, lora_request=w)[0]
            assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
            assert [{k: v.logprob for k, v in e.items()} for e in alone.outputs[0].logprobs] == [
                {k: v.logprob for k, v in e.items()} for e in mixed.outputs[0].logprobs
            ]
    assert together[0].outputs[0].token_ids != together[1].outputs[0].token_ids


def test_beam_search_with_an_adapter(tiny_llama_dir, lora_adapters):
    """LLM.beam_search(..., lora_request=...): every beam runs with the adapter, so with width 1
    the best beam is the adapter's greedy answer."""
    from nanoserve.beam_search import BeamSearchParams

    a1 = lora(lora_adapters, "all-r8", 1)
    with LLM(model=str(tiny_llama_dir), dtype="float32", enable_lora=True, device="cpu") as llm:
        greedy = tokens(
            llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=a1
            )
        )[0]
        base = tokens(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False))[0]
        beams = llm.beam_search(
            [{"prompt_token_ids": PROMPTS[0]}],
            BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True),
            lora_request=a1,
        )
    assert beams[0].sequences[0].tokens[len(PROMPTS[0]) :] == greedy != base


def test_fused_decode_step_with_adapters_gives_the_modules_bits(
    tiny_llama_dir, lora_adapters, cpu_isa
):
    """Decode steps with LoRA rows (two adapters and the base model mixed) run in the fused CPU
    decode step (kernels/cpu/decode_layers.cpp adds each layer's delta as LoRALinear.add_to
    does): the same tokens and logprobs, bit for bit, as the modules' path, at every level."""
    from nanoserve.kernels.cpu import ops as cpu_ops

    if not cpu_ops.gemm_available():
        pytest.skip("the fused decode path needs the CPU kernels")
    loras = [
        None,
        lora(lora_adapters, "all-r8", 1),
        lora(lora_adapters, "qv-down-r4-rslora", 2),
    ] * 2
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(loras))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(
        model=str(tiny_llama_dir), dtype="bfloat16", enable_lora=True, max_loras=2, device="cpu"
    ) as llm:
        runner = llm.llm_engine.runner
        fused, calls = runner.fused_decode, []
        assert fused is not None
        run = fused.run

        def counted(input_ids, positions, metadata, lora=None):
            hidden = run(input_ids, positions, metadata, lora)
            calls.append(lora is not None and hidden is not None)
            return hidden

        fused.run = counted
        results = []
        for use_fused in (True, False):
            runner.fused_decode = fused if use_fused else None
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            results.append(
                [
                    (
                        o.outputs[0].token_ids,
                        [
                            sorted((t, lp.logprob) for t, lp in step.items())
                            for step in o.outputs[0].logprobs
                        ],
                    )
                    for o in outputs
                ]
            )
            llm.llm_engine.reset_prefix_cache()
    assert sum(calls) >= 10, "too few decode steps with LoRA rows took the fused path"
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "family, targets",
    [
        ("qwen3", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("gemma2", ["q_proj", "v_proj", "o_proj", "down_proj"]),
        (
            "phi3",
            ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        ),  # fused in Phi-3's own checkpoint
    ],
)
def test_other_families_match_peft(tmp_path, family, targets):
    """Qwen3 (q/k norms), Gemma 2 (sliding windows, soft-capping) and Phi-3 (whose checkpoint
    fuses qkv_proj and gate_up_proj, so its adapters target the fused matrices): an adapter's
    greedy tokens are peft's."""
    from tests.lora_adapters import write_peft_adapter
    from tests.models.family_checkpoints import write_random_checkpoint

    base = write_random_checkpoint(tmp_path / family, family)
    adapter = write_peft_adapter(base, tmp_path / "adapter", 11, targets, 8)
    prompt = PROMPTS[1]
    with LLM(model=str(base), dtype="float32", enable_lora=True, device="cpu") as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt}] * 2,
            GREEDY,
            use_tqdm=False,
            lora_request=[None, LoRARequest("a", 1, str(adapter))],
        )
    assert outputs[0].outputs[0].token_ids == hf_greedy(load_hf(base), prompt, GREEDY.max_tokens)
    expected = hf_greedy(peft_oracle(base, adapter), prompt, GREEDY.max_tokens)
    assert outputs[1].outputs[0].token_ids == expected != outputs[0].outputs[0].token_ids


def test_chunked_prompts_and_preemption_keep_the_adapter(tiny_llama_dir, lora_adapters):
    """Prompts split into chunks of 8 tokens beside other adapters' decodes, and a pool so small
    that sequences are preempted and recomputed: every answer is the roomy engine's."""
    loras = [
        None,
        lora(lora_adapters, "all-r8", 1),
        lora(lora_adapters, "qv-down-r4-rslora", 2),
    ] * 2
    prompts = [{"prompt_token_ids": (PROMPTS[i % 3] * 3)[:30]} for i in range(len(loras))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    answers = []
    for engine_args in ({}, {"max_num_batched_tokens": 8, "num_kv_blocks": 12}):
        with LLM(
            model=str(tiny_llama_dir),
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            device="cpu",
            **engine_args,
        ) as llm:
            answers.append(
                tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=loras))
            )
            preemptions = llm.llm_engine.stats().num_preemptions_total
    assert answers[0] == answers[1] and preemptions > 0
