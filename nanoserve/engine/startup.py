"""What the engine builds once, before it serves: the model's path, its tokenizer, its pooler
(a pooling model), the context length, and the frozen start-up heap."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import json
from dataclasses import dataclass
from pathlib import Path

from nanoserve.config import EngineConfig
from nanoserve.models.config import ModelConfig
from nanoserve.models.gguf.mmproj import attach_image_token
from nanoserve.models.gguf.model import check_quantization, find_gguf_file, gguf_tokenizer
from nanoserve.models.registry import (
    check_pipeline_support,
    check_vision_support,
    model_pooling_tasks,
)
from nanoserve.pooling import PoolerConfig
from nanoserve.tokenizer import Tokenizer


@dataclass(slots=True)
class ModelFiles:
    """The model as read from its files, before any weight is loaded."""

    model_dir: Path  # a directory, or a GGUF file
    model_config: ModelConfig
    tokenizer: Tokenizer
    pooler: PoolerConfig | None  # None: the model generates
    max_model_len: int  # as asked for; the KV cache may lower it
    # A pooling model's tasks (PoolingParams.task) and the one a request without one gets.
    pooling_tasks: tuple[str, ...] = ()
    default_task: str | None = None


def open_model(config: EngineConfig) -> ModelFiles:
    """Find the model, check that it can be served as asked, read its config and tokenizer."""
    model_dir = resolve_model_dir(config.model)
    check_quantization(config.quantization, model_dir)
    model_config = ModelConfig.from_dir(model_dir, config.model_overrides, config.mmproj)
    pooler = make_pooler(config, model_config, model_dir)
    tokenizer = load_tokenizer(config.tokenizer, model_dir)
    max_model_len = requested_max_model_len(config, model_config)
    if pooler is not None and config.max_model_len is None:
        max_model_len = min(
            max_model_len, sentence_transformers_max_length(model_dir) or max_model_len
        )
    check_pipeline_support(model_config, config.pipeline_parallel_size)
    speculative = config.speculative
    check_vision_support(
        model_config,
        config.tensor_parallel_size,
        speculative is not None and speculative.method == "draft_model",
    )
    if model_config.mmproj_file is not None:  # "<image>", or llama.cpp's "<__media__>"
        vision = attach_image_token(tokenizer, model_config.vision)
        model_config = dataclasses.replace(model_config, vision=vision)
    if model_config.vision is not None:  # chat templates render image parts as this text
        tokenizer.image_placeholder = "".join(  # Qwen2.5-VL's: its vision start and end too
            tokenizer.backend.id_to_token(i) for i in model_config.vision.placeholder_token_ids
        )
    tasks = model_pooling_tasks(model_config) if pooler is not None else ()
    default_task = tasks[0] if tasks else None
    if config.task in ("classify", "score") and "classify" in tasks:
        # (--task score on an embedding model scores by cosine: its prompts still embed)
        default_task = config.task
    return ModelFiles(
        model_dir, model_config, tokenizer, pooler, max_model_len, tasks, default_task
    )


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from nanoserve.models.gguf.importer import ensure_default_model

        return ensure_default_model()
    path = Path(model).expanduser()
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return gguf_file
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a directory or a GGUF file; nanoserve loads Hugging "
            "Face-layout directories (config.json, *.safetensors, tokenizer.json) and GGUF files, "
            "and never downloads from a hub"
        )
    return path


def load_tokenizer(tokenizer: str | None, model_path: Path) -> Tokenizer:
    """`--tokenizer` when given; else the model's: a GGUF file's metadata or the directory's files."""
    if tokenizer is not None:
        return Tokenizer.from_pretrained(tokenizer)
    if find_gguf_file(model_path) is not None:
        return gguf_tokenizer(model_path)
    return Tokenizer.from_pretrained(model_path)


def freeze_startup_heap() -> None:
    """Everything built by now (the model's modules, the tokenizer's tables, a GGUF file's
    metadata: ~185k objects) lives as long as the engine. gc.freeze moves it out of the cyclic
    collector's reach, as vLLM does after start-up; else each full collection walks it all again
    (40 ms on the default model, 85 ms on its GGUF file, whose vocabulary lists stay cached): an
    offline 64 x (128, 128) run went from ~1100 to ~1180 output tokens/s. What an earlier engine
    froze is unfrozen first, and shutting an engine down (LLMEngine.shutdown, AsyncLLMEngine.stop)
    unfreezes, so that an engine dropped, in reference cycles as it is, can still be collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once a process: frozen objects are never collected, not even as the interpreter exits
    (nanobind, under Triton, then reports its functions leaked); unfreeze before that."""
    atexit.register(gc.unfreeze)


def make_pooler(
    config: EngineConfig, model_config: ModelConfig, model_dir: Path
) -> PoolerConfig | None:
    """--runner pooling (or --task embed, or a headless checkpoint): how prompts become
    embeddings; None for a generating model."""
    if config.resolve_runner(model_config.pooling_only) == "generate":
        if model_config.encoder is not None:
            raise ValueError(
                f"{model_config.architecture} is an encoder: it does not generate text; serve "
                "it with --runner pooling"
            )
        if model_config.num_labels:
            raise ValueError(
                "sequence classifiers do not generate text: serve them with --runner pooling"
            )
        if model_config.headless:
            raise ValueError(
                f"{model_config.architecture.removesuffix('ForCausalLM')}Model checkpoints have no "
                "LM head: serve them with --runner pooling (or --task embed)"
            )
        return None
    if config.speculative is not None:
        raise ValueError("--speculative-config is for generating models, not --runner pooling")
    if config.pipeline_parallel_size > 1:
        raise ValueError("--runner pooling is not supported with pipeline parallelism")
    tasks = model_pooling_tasks(model_config)
    task = "embed" if config.task == "embedding" else config.task
    if task in ("embed", "classify", "score") and task not in tasks:
        raise ValueError(
            f"--task {task}: {model_config.architecture} does not support it (it supports "
            f"{', '.join(tasks)}{'; classify needs a sequence classifier' if task == 'classify' else ''})"
        )
    if model_config.encoder is not None and config.tensor_parallel_size > 1:
        raise ValueError("encoder models run on one rank: use --tensor-parallel-size 1")
    if model_config.num_labels and config.tensor_parallel_size > 1:
        raise ValueError("sequence classifiers run on one rank: use --tensor-parallel-size 1")
    # An encoder without sentence-transformers files pools its [CLS] row (vLLM's default).
    default_type = "CLS" if model_config.encoder is not None else "LAST"
    return PoolerConfig.for_model(model_dir, config.pooler_config, default_type)


def sentence_transformers_max_length(model_dir: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length: the length sentence-transformers cuts a
    prompt to, which vLLM serves such a model with (all-MiniLM-L6-v2: 256 of its 512)."""
    try:
        raw = json.loads((model_dir / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        return None
    length = raw.get("max_seq_length") if isinstance(raw, dict) else None
    return int(length) if isinstance(length, int) and length > 0 else None


def requested_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """--max-model-len, or the model's own limit; never past the model's positions."""
    max_len = model_config.max_position_embeddings
    requested = config.max_model_len
    if requested is not None:
        if requested > max_len:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's max_position_embeddings {max_len}"
            )
        max_len = requested
    return max_len
