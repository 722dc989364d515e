"""Shared fixtures: a small random Llama written to safetensors (fast), and the real SmolLM2."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from nanoserve import envs

# As nanoserve's entry points do, before the fixtures import torch (and libgomp): suites running
# side by side on shared cores must not spin-wait on each other (nanoserve/envs.py says why).
envs.set_openmp_spin_default()

pytest_plugins = ["tests.fixtures_models"]

# Hypothesis draws its cases from one fixed seed unless asked otherwise, in CI and in `make test`
# alike: two runs draw the same cases, and a failure in a log is reproduced by running the same
# test again (the seed is printed at the end of every run). No example database either: a run
# does not depend on what an earlier run on this machine stored. Wall-clock health checks are
# off (a shared, loaded machine is slow by luck, and the tests set deadline=None already).
# To explore new cases locally: `pytest --hypothesis-profile=explore` draws a fresh seed (printed,
# so `--hypothesis-seed=N` replays it) and keeps the example database; `--hypothesis-seed=N`
# alone runs any other fixed seed.
HYPOTHESIS_SEED = 0
_NO_CLOCK = {"deadline": None, "print_blob": True, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", database=None, **_NO_CLOCK)
settings.register_profile("explore", **_NO_CLOCK)
settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Runs before hypothesis' own pytest_configure, which installs the seed we choose here."""
    if config.getoption("hypothesis_seed", None) is None:
        explore = config.getoption("hypothesis_profile", None) == "explore"
        seed = random.SystemRandom().randrange(2**32) if explore else HYPOTHESIS_SEED
        config.option.hypothesis_seed = str(seed)


def _hypothesis_line(config: pytest.Config) -> str:
    profile = config.getoption("hypothesis_profile", None) or "ci"
    seed = config.getoption("hypothesis_seed", None)
    return (
        f"hypothesis: profile {profile!r}, seed {seed} (reproduce with "
        f"--hypothesis-profile={profile} --hypothesis-seed={seed})"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return _hypothesis_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Also at the end: `make test` runs with -q, which hides the header."""
    terminalreporter.write_line(_hypothesis_line(config))


@pytest.fixture(autouse=True)
def _forget_kernel_choice():
    """NANOSERVE_KERNELS is read once per process (nanoserve/kernels/choice.py): a test that
    sets it calls reset_kernel_choice(); after every test (and after monkeypatch has put the
    variable back) the next dispatch reads it again."""
    yield
    choice = sys.modules.get("nanoserve.kernels.choice")
    if choice is not None:
        choice.reset_kernel_choice()


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Café, naïve, résumé, über, 東京, 北京, 😀 🚀",
    "import torch\nx = torch.randn(3, 4)\nprint(x.sum())",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 400) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 512,
                "tokenizer_class": "GPT2Tokenizer",
            }
        )
    )
    return tokenizer.get_vocab_size()


def write_random_llama(
    out_dir: Path,
    *,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    tie=False,
    seed=0,
    dtype="float32",
    **extra,
) -> Path:
    """A random Llama checkpoint in Hugging Face layout, written by transformers itself."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out_dir)
    tokenizer_json = json.loads((out_dir / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=specials["<|im_start|>"],
        eos_token_id=specials["<|im_end|>"],
        pad_token_id=specials["<|endoftext|>"],
        **extra,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    # Larger-than-default weights make the random model's greedy choices decisive, not near-ties.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.5 if "embed" in name else 2.0 / param.shape[1] ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """tests/lora_adapters.ADAPTERS over the tiny Llama, written by peft: name -> directory."""
    from tests.lora_adapters import write_adapters

    return write_adapters(tiny_llama_dir, tmp_path_factory.mktemp("lora"))


def _cpu_isas() -> list:
    from nanoserve.kernels.cpu import ops as cpu_ops

    levels = cpu_ops.supported_isas()
    return levels or [
        pytest.param(None, marks=pytest.mark.skip(reason="the CPU kernels don't load here"))
    ]


@pytest.fixture(params=_cpu_isas())
def cpu_isa(request):
    """Each CPU kernel level this machine can run (kernels/cpu/isa.h: portable, avx2, avx512bf16,
    amx; the lower ones run on any machine that has a higher one), lowest first: every CPU
    kernel in this process runs at it during the test."""
    from nanoserve.kernels.cpu import ops as cpu_ops

    previous = cpu_ops.set_isa(request.param)
    yield request.param
    cpu_ops.set_isa(previous)
