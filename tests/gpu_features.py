"""One end-to-end CUDA check per feature built since benchmarks/gpu/run3 (which ran only in
Triton's interpreter before), for scripts/gpu_check.sh; one process per feature, so that the
script gives each its own time limit:

    python3 -m tests.gpu_features FEATURE --work DIR [--smoke]

Each writes WORK/feature-<FEATURE>.json (`nanoserve.bench.gpu_report` reads it): `checks`
(name -> passed), `details` (what a failed check saw) and `figure` (one measured speed). The
models are the tests' tiny random checkpoints, written here by the tests' own writers; the oracle
is transformers (or peft) on the weights the file means, teacher-forced with the engine's greedy
tokens: each token's logprob within ATOL of the oracle's and the oracle's own argmax within ATOL
(a near-tie may go either way), or the engine's own CPU path where no transformers model holds
the feature (FP8 KV). The figures are of tiny models, launch-bound: they show the path runs at
the speed of its steps (and, on CUDA, in graphs); the issue-29 targets measure real shapes
(nanoserve/bench/gpu_big.py, gpu_e2e.py).

--smoke runs every check on a CPU instead of CUDA (the script's GPU_CHECK_WITHOUT_GPU=1): the
integer formats' CPU kernels round activations to int8 (kernels/quant.py), so the tolerance is
wide there (the smoke run proves the script, not the formats: their tests do), and the checks of CUDA graphs and Triton launches are left out.

Lives in tests/ because it reuses the tests' checkpoint writers (a package module may not import
tests); needs transformers (and peft for LoRA), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from nanoserve import LLM, LoRARequest, SamplingParams

ATOL_CUDA = (
    2e-3  # fp32 on both sides: only rounding separates them (tests/engine/test_gguf_cuda.py)
)
# --smoke: the CPU's integer GEMMs round the activations to int8 first (kernels/quant.py), which
# moves these tiny models' logprobs by up to about 0.4: there the check only exercises the script.
ATOL_CPU_INT8 = 0.5
NUM_TOKENS = 12


class Feature:
    """What one feature's check collected: checks, what failed checks saw, one figure."""

    def __init__(self, args):
        self.smoke = args.smoke
        self.device = "cpu" if args.smoke else "cuda"
        self.work = Path(args.work) / f"models-{args.feature}"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.checks: dict[str, bool] = {}
        self.details: dict[str, object] = {}
        self.figure: dict[str, object] = {}

    def count(self, wanted: int, smoke: int = 2) -> int:
        """`wanted` prompts or tokens, fewer under --smoke (a CPU runs the same checks smaller)."""
        return min(wanted, smoke) if self.smoke else wanted

    def check(self, name: str, passed: bool, detail=None) -> None:
        self.checks[name] = bool(passed)
        if detail is not None and not passed:
            self.details[name] = detail

    def engine(self, model, *, eager: bool = False, dtype: str = "float32", **kwargs) -> LLM:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("max_model_len", 256)
        kwargs.setdefault("max_num_seqs", 16)
        kwargs.setdefault("device", self.device)
        return LLM(model=str(model), dtype=dtype, enforce_eager=eager, seed=0, **kwargs)

    def graphs_ran(self, name: str, llm: LLM) -> None:
        """On CUDA: some decode step of `llm` went through its captured graphs."""
        if not self.smoke:
            graphs = llm.llm_engine.runner.decode_graphs
            self.check(name, graphs is not None and graphs.num_steps > 0)

    def result(self) -> dict:
        return {
            "checks": self.checks,
            "details": self.details,
            "figure": self.figure,
            "ok": bool(self.checks) and all(self.checks.values()),
        }


def random_prompts(count: int, seed: int, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def greedy(llm: LLM, prompts, num_tokens: int = NUM_TOKENS, lora=None):
    """Per prompt: (greedy tokens, each token's logprob)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora
    )
    return [
        (list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
        for c in (o.outputs[0] for o in outputs)
    ]


@torch.inference_mode()
def against_oracle(models, prompts, answers, atol: float) -> list[dict]:
    """The engine's greedy answers teacher-forced through `models` (one transformers model, or
    one per prompt): where a token's logprob is more than `atol` from the oracle's, or the oracle's
    argmax more than `atol` above it. Empty: every token agrees."""
    found = []
    for index, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, answers)):
        model = models[index] if isinstance(models, list) else models
        rows = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)[
            len(prompt) - 1 : len(prompt) - 1 + len(tokens)
        ]
        for position, (row, token, ours) in enumerate(zip(rows, tokens, logprobs)):
            theirs, top = row[token].item(), row.max().item()
            if abs(ours - theirs) > atol or top - theirs > atol:
                found.append(
                    {"prompt": index, "position": position, "ours": ours, "oracle": theirs}
                )
                break
    return found


def cpu_teacher_forced(llm: LLM, prompts, answers, atol: float) -> list[dict]:
    """`against_oracle` with the engine's CPU path as the oracle (its prompt logprobs)."""
    found = []
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for index, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, answers)):
        output = llm.generate([{"prompt_token_ids": prompt + tokens}], params, use_tqdm=False)[0]
        steps = output.prompt_logprobs[len(prompt) : len(prompt) + len(tokens)]
        for position, (step, token, ours) in enumerate(zip(steps, tokens, logprobs)):
            theirs, top = step[token].logprob, max(entry.logprob for entry in step.values())
            if abs(ours - theirs) > atol or top - theirs > atol:
                found.append(
                    {"prompt": index, "position": position, "ours": ours, "oracle": theirs}
                )
                break
    return found


def decode_speed(feature: Feature, llm: LLM, lora=None) -> dict:
    """Output tok/s of 8 greedy requests of 32 tokens together, and the TPOT of one alone (after
    a warm-up): the feature's figure."""
    batch, num_tokens = feature.count(8), feature.count(32, 4)
    prompts = random_prompts(batch + 1, seed=99, vocab=min(380, llm_vocab(llm)))
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)

    def run(chosen):
        adapters = None if lora is None else [lora] * len(chosen)
        started = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in chosen],
            params,
            use_tqdm=False,
            lora_request=adapters,
        )
        return outputs, time.perf_counter() - started

    run(prompts[:2])  # warm-up
    outputs, elapsed = run(prompts[:batch])
    single, _ = run(prompts[batch:])
    metrics = single[0].metrics
    tpot = (metrics.last_token_time - metrics.first_token_time) / (num_tokens - 1)
    return {
        f"batch{batch}_output_tokens_per_s": round(batch * num_tokens / elapsed, 1),
        "batch1_tpot_ms": round(1e3 * tpot, 3),
    }


def llm_vocab(llm: LLM) -> int:
    return llm.llm_engine.model_config.vocab_size


def quantized_checks(
    feature: Feature, name: str, model, oracle, prompts, eager_too: bool = False
) -> LLM:
    """A quantized checkpoint on CUDA in fp32 (graphs; eager too if asked) against its oracle;
    the graphs engine, for the figure."""
    atol = ATOL_CPU_INT8 if feature.smoke else ATOL_CUDA
    modes = (True, False) if eager_too else (False,)
    llm = None
    for eager in modes:
        llm = feature.engine(model, eager=eager)
        found = against_oracle(
            oracle, prompts, greedy(llm, prompts, feature.count(NUM_TOKENS, 6)), atol
        )
        feature.check(f"{name} {'eager' if eager else 'graphs'} = oracle", not found, found)
    feature.graphs_ran(f"{name}: decode steps in CUDA graphs", llm)
    return llm


# ---- the features ---------------------------------------------------------------------------
def feature_gguf(feature: Feature) -> None:
    """A Q4_K_M GGUF as llama.cpp mixes it (Q4_K, Q6_K for some V / down projections, Q5_0 where
    rows are short) through the dequantize-GEMM (kernels/quant_triton.py), eager and graphs; the
    CPU path's tokens reported beside (int8 activations: not the same arithmetic)."""
    import nanoserve.kernels.quant_triton as quant_triton
    from tests.gguf_models import dequantized_transformers, write_quantized_gguf

    path = write_quantized_gguf(feature.work, "llama_cpp_q4_k_m", seed=28)
    prompts = random_prompts(feature.count(4), seed=1)
    launches = []
    real = quant_triton.quant_gemm_triton  # (kernels/quant.py looks it up at each call)
    quant_triton.quant_gemm_triton = lambda *a, **k: launches.append(1) or real(*a, **k)
    try:
        llm = quantized_checks(
            feature, "q4_k_m", path, dequantized_transformers(path), prompts, eager_too=True
        )
    finally:
        quant_triton.quant_gemm_triton = real
    if not feature.smoke:
        feature.check("the Triton dequantize-GEMM ran", bool(launches))
    feature.figure = decode_speed(feature, llm)
    num_tokens = feature.count(NUM_TOKENS, 6)
    ours = [tokens for tokens, _ in greedy(llm, prompts, num_tokens)]
    del llm
    cpu = feature.engine(path, eager=True, device="cpu")
    cpu_tokens = [tokens for tokens, _ in greedy(cpu, prompts, num_tokens)]
    same = sum(a == b for a, b in zip(ours, cpu_tokens))
    feature.figure["cpu_path_same_tokens"] = f"{same} of {len(prompts)} prompts"


def feature_gptq_awq(feature: Feature) -> None:
    """GPTQ with activation order (inputs sorted by group at load) and AWQ, 4-bit, on CUDA."""
    from tests.gptq_awq_models import dequantized_transformers, write_quantized_llama

    prompts = random_prompts(feature.count(4), seed=2)
    for scheme in ("gptq-4bit-actorder", "awq-4bit-g128"):
        model_dir = write_quantized_llama(feature.work / scheme, scheme, seed=5)
        oracle = dequantized_transformers(model_dir)
        llm = quantized_checks(feature, scheme, model_dir, oracle, prompts)
        feature.figure[scheme] = decode_speed(feature, llm)
        del llm


def feature_fp8(feature: Feature) -> None:
    """FP8 (E4M3) weights, 128 x 128 block scales (Qwen3-FP8's) and 64 x 32, on CUDA."""
    from tests.fp8_models import dequantized_transformers, write_fp8_llama

    prompts = random_prompts(feature.count(4), seed=3)
    for scheme in ("fp8-block128", "fp8-block64x32"):
        model_dir = write_fp8_llama(feature.work / scheme, scheme, seed=6)
        oracle = dequantized_transformers(model_dir)
        # FP8 keeps the activations in float on every path (kernels/quant.py): the fp32 tolerance.
        llm = feature.engine(model_dir)
        found = against_oracle(
            oracle, prompts, greedy(llm, prompts, feature.count(NUM_TOKENS, 6)), ATOL_CUDA
        )
        feature.check(f"{scheme} graphs = oracle", not found, found)
        feature.graphs_ran(f"{scheme}: decode steps in CUDA graphs", llm)
        feature.figure[scheme] = decode_speed(feature, llm)
        del llm


def feature_moe_mxfp4(feature: Feature) -> None:
    """gpt-oss: MXFP4 experts through the fused-MoE kernel (kernels/fused_moe.py's Triton one on
    CUDA), attention sinks and alternating sliding windows, eager and graphs, against transformers
    on the experts the MXFP4 blocks mean."""
    from safetensors.torch import load_file, save_file

    import nanoserve.kernels.fused_moe as fused_moe
    from tests.engine.hf_oracle import load_hf
    from tests.models.moe_checkpoints import write_moe_checkpoint
    from tests.mxfp4_models import mxfp4_checkpoint

    float_dir = write_moe_checkpoint(feature.work / "float", "gpt_oss")
    quant_dir, oracle_dir = feature.work / "mxfp4", feature.work / "dequantized"
    meaning = mxfp4_checkpoint(float_dir, quant_dir)
    shutil.copytree(float_dir, oracle_dir)
    save_file(
        load_file(float_dir / "model.safetensors") | meaning, oracle_dir / "model.safetensors"
    )
    prompts = random_prompts(feature.count(4), seed=4)
    # Count the calls of the module's Triton launchers (fused_experts_triton, and any other
    # fused_experts*triton* a quantized-experts kernel adds) through the module's globals.
    launches = []
    launchers = {
        name: value
        for name, value in vars(fused_moe).items()
        if name.startswith("fused_experts") and "triton" in name and callable(value)
    }

    def counting(launcher):
        return lambda *a, **k: launches.append(1) or launcher(*a, **k)

    for name, launcher in launchers.items():
        setattr(fused_moe, name, counting(launcher))
    try:
        llm = quantized_checks(
            feature, "gpt-oss mxfp4", quant_dir, load_hf(oracle_dir), prompts, eager_too=True
        )
    finally:
        for name, launcher in launchers.items():
            setattr(fused_moe, name, launcher)
    if not feature.smoke:
        feature.check("fused-MoE Triton kernel launched", bool(launches))
    feature.check(
        "attention sinks loaded",
        any(
            getattr(module, "sinks", None) is not None
            for module in llm.llm_engine.runner.model.modules()
        ),
    )
    feature.figure = decode_speed(feature, llm)


def feature_kv_fp8(feature: Feature) -> None:
    """--kv-cache-dtype fp8 (E4M3) and fp8_e5m2 on CUDA (Triton store and attention over FP8
    blocks) against the CPU path's C++ kernels over the same format, teacher-forced: both round K
    and V by kernels/kv_dtype.py's rule, from K / V that differ in fp32 rounding, hence 1e-2."""
    from tests.conftest import write_random_llama

    shape = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    model_dir = write_random_llama(feature.work / "llama", seed=8, num_layers=2, **shape)
    prompts = random_prompts(feature.count(4), seed=5)
    for kv in ("fp8",) if feature.smoke else ("fp8", "fp8_e5m2"):
        llm = feature.engine(model_dir, kv_cache_dtype=kv)
        answers = greedy(llm, prompts, feature.count(20, 6))
        expected = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
        feature.check(f"{kv}: pool dtype", llm.llm_engine.runner.kv_dtype == expected)
        feature.graphs_ran(f"{kv}: decode steps in CUDA graphs", llm)
        if kv == "fp8":
            feature.figure = decode_speed(feature, llm)
        del llm
        cpu = feature.engine(model_dir, kv_cache_dtype=kv, device="cpu", eager=True)
        found = cpu_teacher_forced(cpu, prompts, answers, 1e-2)
        feature.check(f"{kv}: = the CPU path (teacher-forced)", not found, found)
        del cpu


def feature_spec_graphs(feature: Feature) -> None:
    """N-gram speculative decoding with CUDA graphs: verification rows are decode rows, so a
    step with proposals replays the captured graphs; greedy tokens equal the engine's without
    speculation, and some steps verify inside the graphs."""
    from tests.conftest import write_random_llama
    from tests.spec_decode.test_spec_engine import NGRAM, repetitive_prompts

    model_dir = write_random_llama(feature.work / "llama")
    prompts = repetitive_prompts(8, seed=1)  # (fewer accept nothing on this model)
    num_tokens = 48
    # Graphs up to 48 rows: 8 sequences and their proposals (the graphs' sizes follow
    # max_num_seqs, not max_num_seqs x (1 + k): a step of more rows runs eager).
    plain = feature.engine(model_dir, max_num_seqs=48)
    expected = greedy(plain, prompts, num_tokens)
    plain_speed = decode_speed(feature, plain)
    del plain
    spec = feature.engine(model_dir, speculative_config=NGRAM, max_num_seqs=48)
    runner = spec.llm_engine.runner
    steps = []  # (graph size, verification rows) per step
    real_prepare = runner.prepare

    def prepare(*args, **kwargs):
        model_input = real_prepare(*args, **kwargs)
        steps.append((model_input.graph_size, model_input.num_spec_rows))
        return model_input

    runner.prepare = prepare
    got = greedy(spec, prompts, num_tokens)
    runner.prepare = real_prepare
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected)) if a[0] != b[0]]
    feature.check("greedy tokens = without speculation", not mismatches, mismatches)
    worst = max(abs(x - y) for a, b in zip(got, expected) for x, y in zip(a[1], b[1]))
    feature.check("logprobs within 1e-4 of without speculation", worst <= 1e-4, worst)
    stats = spec.llm_engine.stats().spec_decoding
    feature.check("proposals accepted", stats.num_drafts > 0 and stats.num_accepted_tokens > 0)
    verified_in_graphs = sum(1 for size, rows in steps if size and rows)
    if not feature.smoke:
        feature.check("verification steps replayed CUDA graphs", verified_in_graphs > 0)
    feature.figure = {
        "acceptance_rate": round(stats.num_accepted_tokens / max(1, stats.num_draft_tokens), 3),
        "verification_steps_in_graphs": f"{verified_in_graphs} of {len(steps)} steps",
        "with_speculation": decode_speed(feature, spec),
        "without": plain_speed,
    }


def feature_lora(feature: Feature) -> None:
    """Three PEFT adapters (every projection r8; rsLoRA; rank and alpha patterns) and the base
    model mixed in one batch on CUDA, against peft's own model."""
    from tests.conftest import write_random_llama
    from tests.engine.hf_oracle import load_hf
    from tests.lora_adapters import peft_oracle, write_adapters

    model_dir = write_random_llama(feature.work / "llama")
    adapters = write_adapters(model_dir, feature.work / "lora")
    names = [None, *adapters]
    base_prompts = random_prompts(feature.count(2), seed=6)
    prompts = [p for p in base_prompts for _ in names]
    requests = [
        None if name is None else LoRARequest(name, names.index(name), str(adapters[name]))
        for _ in base_prompts
        for name in names
    ]
    llm = feature.engine(model_dir, enable_lora=True, max_loras=len(adapters))
    answers = greedy(llm, prompts, feature.count(NUM_TOKENS, 6), lora=requests)
    oracles = {None: load_hf(model_dir)}
    oracles |= {name: peft_oracle(model_dir, path) for name, path in adapters.items()}
    models = [oracles[name] for _ in base_prompts for name in names]
    found = against_oracle(models, prompts, answers, ATOL_CUDA)
    feature.check("base + 3 adapters in one batch = peft", not found, found)
    distinct = {tuple(tokens) for tokens, _ in answers}
    feature.check("every adapter changes the answer", len(distinct) == len(prompts))
    feature.figure = {
        "with_adapter_all-r8": decode_speed(feature, llm, lora=requests[1]),
        "base": decode_speed(feature, llm),
    }


def feature_embed(feature: Feature) -> None:
    """A pooling model (--runner pooling, last-token pooling, normalized) on CUDA: embeddings
    against transformers' last hidden state, cosine > 0.9999."""
    from transformers import AutoModel

    from tests.conftest import write_random_llama

    model_dir = write_random_llama(feature.work / "llama")
    prompts = random_prompts(feature.count(8), seed=7)
    llm = feature.engine(model_dir, runner="pooling")
    results = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = 1.0
    with torch.inference_mode():
        for prompt, result in zip(prompts, results):
            hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
            reference = torch.nn.functional.normalize(hidden, dim=0)
            ours = torch.tensor(result.outputs.embedding)
            worst = min(worst, torch.nn.functional.cosine_similarity(ours, reference, dim=0).item())
    feature.check("embeddings = transformers (cosine > 0.9999)", worst > 0.9999, worst)
    many = random_prompts(feature.count(64, 8), seed=8)
    llm.embed([{"prompt_token_ids": p} for p in many[:4]], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.embed([{"prompt_token_ids": p} for p in many], use_tqdm=False)
    elapsed = time.perf_counter() - started
    feature.figure = {
        "embeddings_per_s_64_prompts": round(len(many) / elapsed, 1),
        "prompt_tokens_per_s": round(sum(map(len, many)) / elapsed, 1),
    }


FEATURES = {
    "gguf": feature_gguf,
    "gptq-awq": feature_gptq_awq,
    "fp8": feature_fp8,
    "moe-mxfp4": feature_moe_mxfp4,
    "kv-fp8": feature_kv_fp8,
    "spec-graphs": feature_spec_graphs,
    "lora": feature_lora,
    "embed": feature_embed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("feature", choices=list(FEATURES))
    parser.add_argument("--work", required=True, help="directory for feature-<name>.json")
    parser.add_argument("--smoke", action="store_true", help="on a CPU, to check the script")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("tests.gpu_features: no CUDA device (--smoke checks it on a CPU)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    feature = Feature(args)
    try:
        FEATURES[args.feature](feature)
        result = feature.result()
    except Exception:
        result = feature.result() | {"ok": False, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr)
    result |= {
        "stage": "feature",
        "name": args.feature,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    shutil.rmtree(feature.work, ignore_errors=True)
    out = Path(args.work) / f"feature-{args.feature}.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    failed = [name for name, passed in result["checks"].items() if not passed]
    print(
        f"feature {args.feature}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s; "
        f"failed: {failed or 'none'}; figure: {json.dumps(result['figure'], default=str)}",
        flush=True,
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
