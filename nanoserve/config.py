"""EngineConfig: one dataclass built once (from CLI flags or LLM(**kwargs)) that flows down."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from nanoserve.json_flags import json_object_flag
from nanoserve.multimodal.image import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, ImageLimits
from nanoserve.speculative_config import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # kernels/kv_dtype.py
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
HF_OVERRIDE_FIELDS = {
    "architectures",
    "num_labels",
    "id2label",
    "classifier_from_token",
    "is_original_qwen3_reranker",
}
POOLING_TASK_FLAGS = ("embed", "embedding", "classify", "score")
ASYNC_POOLING_REFUSAL = (
    "--async-scheduling is not supported with pooling models (they sample nothing)"
)


def arg(default=None, help: str = "", **cli):
    """A config field with its command-line help beside it. `cli` may name `flags` (the option
    strings, the first one long; default: --field-name), `choices`, or `env` (the flag's default
    is read from this environment variable when the parser is built)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(slots=True)
class EngineConfig:
    """Every engine default, written once; `nanoserve serve / generate` build their engine flags
    from these fields (nanoserve.cli.add_engine_args), `LLM(**kwargs)` takes the same names."""

    model: str | None = arg(
        None,
        "Hugging Face-layout model directory, or a GGUF file (or a directory holding one) "
        "served with its quantized weights as they are (default: SmolLM2-135M-Instruct, "
        "imported once into bf16)",
    )
    # llama-server's --mmproj: a LLaVA's CLIP tower and projector beside a GGUF text model.
    mmproj: str | None = arg(
        None,
        "GGUF mmproj file (llama.cpp's vision tower and projector, LLaVA-1.5's CLIP + mlp) served "
        "with a GGUF --model as one vision-language model",
    )
    served_model_name: str | None = arg(None, "model name reported by the API")
    tokenizer: str | None = arg(
        None, "tokenizer directory (default: the model's; for a GGUF file, its metadata's)"
    )
    # vLLM's --quantization; each value is implied by the model it goes with (checked against it).
    quantization: str | None = arg(
        None,
        "weight quantization: gguf (implied by a GGUF --model), compressed-tensors, gptq, awq or fp8 "
        "(implied by a checkpoint whose config.json has that quantization_config: int8 W8A16 / W8A8, "
        "int4 W4A16, FP8; GPTQ 4/8-bit; AWQ 4-bit gemm; FP8 E4M3 per tensor or block; gptq_marlin / "
        "awq_marlin name the same); fp8 on an unquantized checkpoint rounds its linear layers to FP8 "
        "at load (CPU); no other value is supported",
    )
    dtype: str = arg(
        "auto",
        "weights and activations dtype (a GGUF model: the activations'; its "
        "quantized layers keep their blocks)",
        choices=DTYPES,
    )
    device: str = arg("auto", "auto, cpu or cuda")  # "auto": cuda when available, else cpu
    # None: the model's max_position_embeddings
    max_model_len: int | None = arg(None, "context length (prompt + output)")
    max_num_seqs: int = arg(256, "sequences per step")
    max_num_batched_tokens: int = arg(2048, "tokens per step")
    block_size: int = arg(16, "tokens per KV cache block")
    # vLLM's --kv-cache-dtype: K/V stored in fp8 with a scale of 1.0 (kernels/kv_dtype.py).
    kv_cache_dtype: str = arg(
        "auto",
        "KV cache element type: auto (the activations' dtype), fp8 (= fp8_e4m3) or fp8_e5m2 "
        "(half the bytes of bf16; values saturate at the format's largest)",
        choices=KV_CACHE_DTYPES,
    )
    # None: sized automatically (engine/kv_allocation.py's DEFAULT_CPU_KV_*)
    kv_cache_memory: float | None = arg(
        None,
        "CPU: the KV cache pool in GiB (default: room for 4 sequences of the context length at "
        "the model's bytes a token, at most 2 GiB and a quarter of the memory available; its "
        "pages are taken as requests first write them)",
    )
    gpu_memory_utilization: float = arg(
        0.9, "fraction of GPU memory for weights, activations and KV cache"
    )
    num_kv_blocks: int | None = arg(None, argparse.SUPPRESS)  # override the pool size (tests)
    # GiB of host memory per rank for KV blocks of swapped-out sequences (vLLM's --swap-space);
    # allocated only with preemption_mode "swap".
    swap_space: float = arg(
        4.0,
        "GiB of host memory per rank for the KV blocks of swapped-out sequences (used with "
        "--preemption-mode swap)",
    )
    # What preemption does when KV blocks run out: "recompute" frees the sequence's blocks and
    # computes its tokens again later; "swap" copies its blocks to the host pool and back (falling
    # back to recompute when the host pool is full). vLLM V0's --preemption-mode.
    preemption_mode: str = arg(
        "recompute",
        "when KV blocks run out: recompute the preempted request later, or swap its "
        "blocks to host memory and back (recompute when that is full)",
        choices=PREEMPTION_MODES,
    )
    num_swap_blocks: int | None = arg(None, argparse.SUPPRESS)  # override the host pool (tests)
    enable_prefix_caching: bool = arg(True, "reuse the KV cache of shared prompt prefixes")
    seed: int = arg(0, "random seed")
    max_logprobs: int = arg(
        20, "most logprobs (sample or prompt) one request may ask for; -1: the whole vocabulary"
    )
    # As vLLM's VLLM_MAX_N_SEQUENCES.
    max_n_sequences: int = arg(128, "most outputs one request may ask for (n, and n x prompts)")
    # vLLM's --scheduling-policy.
    scheduling_policy: str = arg(
        "fcfs",
        "fcfs: first come, first served (a request's priority must be 0); priority: lower "
        "priority value first, then arrival",
        choices=SCHEDULING_POLICIES,
    )
    # vLLM's --async-scheduling (SGLang's overlap scheduler): step N+1 is scheduled and launched
    # before step N's tokens are collected, so scheduling, output processing and detokenizing run
    # while the device computes (engine/async_scheduling.py). Off by default, as vLLM's.
    async_scheduling: bool = arg(
        False,
        "schedule and launch each step before collecting the previous one's tokens, so host "
        "work (scheduling, stop checks, detokenizing) overlaps the device's step",
    )
    # The periodic "Engine 000: Avg prompt throughput ..." line; on for a server, as `vllm serve`
    # (the offline LLM turns it off unless asked, as vLLM's LLM does).
    disable_log_stats: bool = arg(
        False, "do not log the engine's throughput, queue and cache figures every few seconds"
    )
    # CPU: torch / OpenMP threads per rank; None: the CPUs this process may use (affinity and
    # cgroup quota) shared among this machine's ranks.
    cpu_threads: int | None = arg(
        None,
        "CPU threads per rank (default: the CPUs this process may use, from its affinity "
        "and cgroup quota, shared among the machine's ranks)",
    )
    # CUDA: capture the decode steps as CUDA graphs at startup unless True (vLLM's flag). Steps
    # on a CPU, and with tensor parallelism, are always eager.
    enforce_eager: bool = arg(
        False,
        "CUDA: run every step eagerly, without CUDA graphs for decode steps (a CPU always "
        "runs eagerly)",
    )
    tensor_parallel_size: int = arg(
        1, "number of tensor-parallel ranks", flags=("--tensor-parallel-size", "--tp", "-tp")
    )
    # MoE models: each rank holds whole experts (vLLM's --enable-expert-parallel) instead of a
    # slice of every expert's intermediate dimension; dense models ignore it.
    enable_expert_parallel: bool = arg(
        False,
        "MoE models with --tensor-parallel-size > 1: place whole experts on ranks instead of "
        "splitting every expert across them",
    )
    # Decoder layers split into this many contiguous stages (vLLM's --pipeline-parallel-size);
    # ranks = tensor_parallel_size x pipeline_parallel_size.
    pipeline_parallel_size: int = arg(
        1,
        "number of pipeline stages (the decoder layers split evenly, or as "
        "--pp-layer-partition says); ranks = tp x pp",
        flags=("--pipeline-parallel-size", "--pp", "-pp"),
    )
    # Decoder layers per stage, as vLLM's VLLM_PP_LAYER_PARTITION. None: what
    # $NANOSERVE_PP_LAYER_PARTITION (or vLLM's name) says, else an even split (the remainder to
    # the stages before the last). The flag wins over the variable, as every flag here does.
    pp_layer_partition: str | None = arg(
        None,
        "decoder layers per pipeline stage, comma-separated, e.g. '10,14' (default: "
        "$NANOSERVE_PP_LAYER_PARTITION, else an even split)",
    )
    # vLLM's --runner / --task: "pooling" serves embeddings (/v1/embeddings, LLM.embed) instead of
    # generating; "auto" picks pooling for a headless checkpoint (MistralModel, ...), else
    # generate. --task embed (or embedding) is vLLM's older spelling of --runner pooling;
    # --task classify / score also pool, and set the task a request without one gets (the
    # model must support it: classify and score need a sequence classifier or cross-encoder).
    runner: str = arg(
        "auto", "generate text, or pool hidden states into embeddings", choices=RUNNERS
    )
    task: str = arg(
        "auto",
        "vLLM's older flag: embed, classify or score = --runner pooling with that default "
        "task, generate = --runner generate",
        choices=TASKS,
    )
    # --pooler-config: '{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}' over what the
    # checkpoint's sentence-transformers files say (nanoserve/pooling.py).
    pooler_config: str | dict | None = arg(
        None,
        "pooling models: JSON overriding the checkpoint's pooling, e.g. "
        '\'{"pooling_type": "MEAN", "normalize": false}\'',
    )
    # vLLM's --hf-overrides: fields merged over the checkpoint's config.json before it is read;
    # the ones read here serve a causal LM as a classifier (models/sequence_classification.py):
    # '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
    # "yes"], "is_original_qwen3_reranker": true}' serves Qwen3-Reranker as vLLM does.
    hf_overrides: str | dict | None = arg(
        None,
        "JSON merged over the checkpoint's config.json (architectures, num_labels, id2label, "
        "classifier_from_token, is_original_qwen3_reranker)",
    )
    # vLLM's --speculative-config: JSON text (or a dict through LLM(...)), read by
    # speculative_config.py; None: no speculation.
    speculative_config: str | dict | None = arg(
        None,
        'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'',
    )
    # vLLM's --limit-mm-per-prompt: JSON text (or a dict through LLM(...)); images only.
    limit_mm_per_prompt: str | dict | None = arg(
        None,
        "vision-language models: items per prompt, as JSON: '{\"image\": 2}' (default: 1 image)",
    )
    # vLLM's --allowed-media-domains: the only hosts an http(s) image URL may name; a listed
    # host may resolve to a private address (multimodal/fetch.py). None: any public host.
    allowed_media_domains: list[str] | None = arg(
        None,
        "vision-language models: the only host names an http(s) image URL may name (default: "
        "any host with public addresses; a listed host may be an internal one)",
        nargs="+",
    )
    # One image's limits (multimodal/image.py's ImageLimits; vLLM has no flags for these).
    max_image_bytes: int = arg(
        MAX_IMAGE_BYTES,
        "vision-language models: the bytes one image's data may take (a data: URL's decoded "
        "base64, an http(s) URL's body); more is a 400",
    )
    max_image_pixels: int = arg(
        MAX_IMAGE_PIXELS,
        "vision-language models: the pixels (width x height) one image may have; more is a 400",
    )
    # vLLM's LoRA flags: adapters (PEFT directories) applied per request beside the base weights
    # (nanoserve/lora/). The server's --lora-modules names the ones it serves.
    enable_lora: bool = arg(
        False,
        "serve LoRA adapters: a request names one as its model (--lora-modules), or "
        "LLM.generate(..., lora_request=LoRARequest(...))",
    )
    max_loras: int = arg(1, "LoRA adapters in one step at most (requests of others wait)")
    max_lora_rank: int = arg(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = arg(
        None,
        "LoRA adapters kept in memory at most (default: "
        "max(--max-loras, the adapters --lora-modules names)); the least "
        "recently used one is read again from disk when needed",
    )
    # Distributed rendezvous (multi-node); None = single host.
    nnodes: int = arg(1, "machines the tp x pp ranks span")
    node_rank: int = arg(0, "this machine's rank among --nnodes")
    master_addr: str | None = arg(
        None, "rendezvous address of rank 0 (default: $MASTER_ADDR)", env="MASTER_ADDR"
    )
    master_port: int | None = arg(
        None, "rendezvous port on rank 0's host (default: $MASTER_PORT)", env="MASTER_PORT"
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 (the whole vocabulary) or >= 0, got {self.max_logprobs}"
            )
        if self.max_n_sequences < 1:
            raise ValueError(f"max_n_sequences must be >= 1, got {self.max_n_sequences}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if self.preemption_mode == "swap" and self.num_swap_blocks is None and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs swap_space > 0 GiB")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        pooling_task = self.task in POOLING_TASK_FLAGS
        if (
            self.runner != "auto"
            and self.task != "auto"
            and (self.runner == "pooling") != pooling_task
        ):
            raise ValueError(f"--runner {self.runner} and --task {self.task} disagree")
        if self.pooler_config is not None:
            from nanoserve.pooling import PoolerConfig

            PoolerConfig.parse(self.pooler_config)  # a bad one is one clear error here
        if self.hf_overrides is not None:
            json_object_flag(self.hf_overrides, "--hf-overrides", HF_OVERRIDE_FIELDS)
        self.max_images_per_prompt  # noqa: B018 (checked now, not at the first image)
        for name in ("max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        speculative = self.speculative
        if speculative is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding is not supported with pipeline parallelism")
        if (
            speculative is not None
            and speculative.method == "draft_model"
            and self.tensor_parallel_size > 1
        ):
            raise ValueError(
                "speculative decoding with a draft model is not supported with tensor "
                "parallelism (n-gram speculation is)"
            )
        if self.async_scheduling and speculative is not None:
            raise ValueError("--async-scheduling is not supported with speculative decoding")
        if self.async_scheduling and (self.runner == "pooling" or pooling_task):
            raise ValueError(ASYNC_POOLING_REFUSAL)
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ValueError(
                "--async-scheduling is not supported with pipeline parallelism (its stages "
                "already overlap the steps of its virtual engines)"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:  # vLLM's rule
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.pipeline_parallel_size > 1 and self.preemption_mode == "swap":
            raise ValueError(
                "preemption_mode 'swap' is not supported with pipeline parallelism "
                "(use the default, recompute)"
            )

    def resolve_runner(self, headless_checkpoint: bool) -> str:
        """ "generate" or "pooling": the flags', else pooling for a headless checkpoint."""
        if self.runner != "auto":
            return self.runner
        if self.task in POOLING_TASK_FLAGS:
            return "pooling"
        if self.task == "generate":
            return "generate"
        return "pooling" if headless_checkpoint else "generate"

    @property
    def model_overrides(self) -> dict | None:
        """--hf-overrides as a dict (checked), or None."""
        if self.hf_overrides is None:
            return None
        return json_object_flag(self.hf_overrides, "--hf-overrides", HF_OVERRIDE_FIELDS)

    @property
    def max_images_per_prompt(self) -> int:
        """--limit-mm-per-prompt's image count (1 when not given)."""
        if self.limit_mm_per_prompt is None:
            return 1
        limits = json_object_flag(self.limit_mm_per_prompt, "--limit-mm-per-prompt", {"image"})
        count = limits.get("image", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: 'image' must be a count >= 0, got {count!r}")
        return count

    @property
    def image_limits(self) -> ImageLimits:
        """--limit-mm-per-prompt's image count, --max-image-bytes and --max-image-pixels."""
        return ImageLimits(self.max_images_per_prompt, self.max_image_bytes, self.max_image_pixels)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (speculative_config.py's SpeculativeConfig), or None."""
        return SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
