"""The command line: real subprocesses, one-line errors for user mistakes, exit codes."""

from __future__ import annotations

import subprocess
import sys

from nanoserve import LLM, SamplingParams


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_prints_the_greedy_completion(tiny_llama_dir):
    result = run_cli(
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
        "--num-kv-blocks",
        "64",
        "The quick brown fox",
        "def add(a, b):",
    )
    assert result.returncode == 0, result.stderr
    expected = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(
        ["The quick brown fox", "def add(a, b):"],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )
    assert result.stdout == "".join(f"### {o.prompt}\n{o.outputs[0].text}\n\n" for o in expected)


def test_missing_model_is_one_line(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "nope"), "hi")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("nanoserve: error: model ")
        and "not a directory" in lines[0]
    )


def test_bad_sampling_value_is_one_line(tiny_llama_dir):
    result = run_cli("generate", "--model", str(tiny_llama_dir), "--top-p", "7", "hi")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoserve: error: top_p must be in (0, 1], got 7.0"
    ]


def test_bad_engine_flag_is_one_line(tiny_llama_dir):
    result = run_cli("serve", "--model", str(tiny_llama_dir), "--block-size", "12")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoserve: error: block_size must be a positive power of two, got 12"
    ]


def test_help_lists_commands_and_vllm_flags():
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("serve", "generate", "bench", "import-model"):
        assert command in top.stdout
    serve = run_cli("serve", "--help")
    for flag in (
        "--model",
        "--tensor-parallel-size",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--gpu-memory-utilization",
        "--kv-cache-memory",
        "--enable-prefix-caching",
        "--dtype",
        "--seed",
        "--host",
        "--port",
        "--api-key",
        "--scheduling-policy",
        "--disable-log-stats",
        "--enable-log-requests",
        "--max-log-len",
    ):
        assert flag in serve.stdout, flag


def test_engine_flags_reach_the_config():
    from nanoserve.cli import build_parser, engine_config_from_args

    default = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert default.scheduling_policy == "fcfs" and default.disable_log_stats is False
    args = build_parser().parse_args(
        ["serve", "--scheduling-policy", "priority", "--disable-log-stats"]
    )
    config = engine_config_from_args(args)
    assert config.scheduling_policy == "priority" and config.disable_log_stats is True


def test_unknown_scheduling_policy_is_refused():
    result = run_cli("serve", "--scheduling-policy", "lifo")
    assert result.returncode == 2
    assert "argument --scheduling-policy: invalid choice: 'lifo'" in result.stderr
    assert "Traceback" not in result.stderr


def test_swap_flags_reach_the_config():
    from nanoserve.cli import build_parser, engine_config_from_args

    default = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert default.preemption_mode == "recompute" and default.swap_space == 4.0
    args = build_parser().parse_args(["serve", "--preemption-mode", "swap", "--swap-space", "0.5"])
    config = engine_config_from_args(args)
    assert config.preemption_mode == "swap" and config.swap_space == 0.5


def test_bad_swap_flags_are_one_line():
    result = run_cli("serve", "--swap-space", "-1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoserve: error: swap_space must be >= 0 GiB, got -1.0"
    ]
    result = run_cli("serve", "--preemption-mode", "swap", "--swap-space", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoserve: error: preemption_mode 'swap' needs swap_space > 0 GiB"
    ]
    result = run_cli("serve", "--preemption-mode", "spill")
    assert result.returncode == 2
    assert "argument --preemption-mode: invalid choice: 'spill'" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_with_swap_preemption(tiny_llama_dir):
    prompts = ["The quick brown fox", "def add(a, b):", "Paris is the capital"]
    common = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "40"]
    roomy = run_cli("generate", *common, "--num-kv-blocks", "64", *prompts)
    swap = run_cli(
        "generate",
        *common,
        "--num-kv-blocks",
        "5",
        "--preemption-mode",
        "swap",
        "--swap-space",
        "0.01",
        *prompts,
    )
    assert roomy.returncode == 0 and swap.returncode == 0, swap.stderr
    assert swap.stdout == roomy.stdout


def test_every_engine_flag_comes_from_a_config_field():
    """Defaults are written once, on EngineConfig: the parser's defaults are the fields' defaults."""
    import dataclasses

    from nanoserve.cli import build_parser, engine_config_from_args
    from nanoserve.config import EngineConfig

    parsed = engine_config_from_args(build_parser().parse_args(["serve"]))
    for item in dataclasses.fields(EngineConfig):
        if "env" not in item.metadata:
            assert getattr(parsed, item.name) == getattr(EngineConfig(), item.name), item.name
    args = build_parser().parse_args(
        ["serve", "-tp", "2", "--pp", "3", "--no-enable-prefix-caching"]
    )
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 3)
    assert args.enable_prefix_caching is False


def test_llm_takes_a_config(tiny_llama_dir):
    import pytest

    from nanoserve.config import EngineConfig

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(TypeError, match="not both"):
        LLM(model=str(tiny_llama_dir), config=config)
    with LLM(config=config) as llm:
        assert llm.llm_engine.config is config
        assert llm.stat_logger is not None  # a config is taken as it is: stats on, as configured
