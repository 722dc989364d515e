"""Everything add_request does before a request reaches a scheduler (vLLM v1's input
processor): the checks that depend on the engine, with vLLM's messages; tokenizing; and the
request with its sequences, each with its seeded generator and grammar matcher."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from pathlib import Path

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.request import Request, stop_string_holdback
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.startup import ModelFiles
from nanoserve.engine.structured_output import SequenceGrammar
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import PromptType, TextPairPrompt, TextPrompt, TokensPrompt, parse_prompt
from nanoserve.lora.request import LoRARequest
from nanoserve.models.gguf.mmproj import mmproj_image_processor
from nanoserve.models.llava_config import VisionConfig
from nanoserve.models.qwen2_5_vl_config import QwenVisionConfig
from nanoserve.multimodal.image import ImageLimits
from nanoserve.multimodal.inputs import ImagePromptBuilder, PromptImage
from nanoserve.multimodal.processor import ClipImageProcessor
from nanoserve.multimodal.qwen_processor import QwenVLImageProcessor
from nanoserve.outputs import RequestMetrics, RequestOutputKind
from nanoserve.pooling import PoolerConfig, PoolingState
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

# How a sequence classifier's prompt is pooled before its head: an encoder's first token's
# row, a decoder's last.
ENCODER_CLASSIFIER_POOLING = PoolerConfig(pooling_type="CLS", normalize=False)
DECODER_CLASSIFIER_POOLING = PoolerConfig(pooling_type="LAST", normalize=False)


class InputProcessor:
    def __init__(
        self, config: EngineConfig, model: ModelFiles, max_model_len: int, device: torch.device
    ) -> None:
        self.config, self.model_config = config, model.model_config
        self.tokenizer, self.pooler = model.tokenizer, model.pooler
        self.pooling_tasks, self.default_task = model.pooling_tasks, model.default_task
        self.encoder = self.model_config.encoder is not None
        self.max_model_len = max_model_len
        self.device = device  # where seeded requests' generators live
        self.max_prompt_chars = self._max_prompt_chars()
        vision = self.model_config.vision
        self.images = (  # a vision-language model's image placeholders and preprocessing
            None
            if vision is None
            else image_prompt_builder(
                vision,
                model.model_dir,
                config.image_limits,
                self.model_config.mmproj_file,
            )
        )
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def check_request(
        self,
        params: SamplingParams | PoolingParams,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> None:
        """What any request must satisfy before its prompt is read."""
        if priority != 0 and self.config.scheduling_policy != "priority":  # vLLM's message
            raise InvalidRequestError(
                f"Got priority {priority} but Priority scheduling is not enabled."
            )
        if lora_request is not None and (
            isinstance(params, PoolingParams) or self.pooler is not None
        ):
            raise InvalidRequestError(
                "LoRA adapters are served for generating models only, not --runner pooling"
            )

    def generation_inputs(
        self, prompt: PromptType, sampling_params: SamplingParams
    ) -> tuple[str | None, list[int], SamplingParams, tuple[PromptImage, ...]]:
        """A generating request's prompt text, token ids, checked params and images."""
        prompt = parse_prompt(prompt)
        prompt_text, token_ids = self._tokenize(prompt)
        token_ids, images = self._prompt_images(prompt, token_ids)
        self._check_prompt_tokens(token_ids)
        params = self._check_params(sampling_params, self.model_config.vocab_size)
        self._check_lengths(len(token_ids), params)
        return prompt_text, token_ids, params, images

    def model_token_ids(self, prompt: TokensPrompt) -> list[int]:
        """The prompt's token ids as the model reads them (/tokenize): each image placeholder
        expanded to its image's tokens, the images checked as a request's are."""
        return self._prompt_images(prompt, list(prompt.prompt_token_ids))[0]

    def _prompt_images(
        self, prompt: TextPrompt | TokensPrompt | TextPairPrompt, token_ids: list[int]
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt with each image placeholder expanded to its image's tokens, and the
        images; a text-only model refuses images."""
        data = getattr(prompt, "multi_modal_data", None) or {}
        if not isinstance(data, dict):
            raise InvalidRequestError(
                "multi_modal_data is a dict: {'image': a PIL image or a list of them}",
                "multi_modal_data",
            )
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise InvalidRequestError(
                f"multi_modal_data: only 'image' is served, not {unknown}", "multi_modal_data"
            )
        images = data.get("image")
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if self.images is None:
            if images:
                raise InvalidRequestError(
                    f"{self.model_config.architecture} is a text-only model: it takes no images",
                    "image_url",
                )
            return token_ids, ()
        if not images and self.images.image_token_id not in token_ids:
            return token_ids, ()
        return self.images.expand(token_ids, list(images), "image_url")

    def make_request(
        self,
        request_id: str,
        prompt_text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float | None,
        output_kind: RequestOutputKind,
        lora_request: LoRARequest | None,
        grammar: concurrent.futures.Future | None,
        images: tuple[PromptImage, ...] = (),
    ) -> Request:
        """The request with its n sequences, from what generation_inputs returned."""
        seqs = self._make_sequences(request_id, token_ids, params, priority, grammar, images)
        for seq in seqs:
            seq.lora_id = lora_request.lora_int_id if lora_request is not None else 0
        metrics = RequestMetrics(
            arrival_time=arrival_time if arrival_time is not None else time.time()
        )
        return Request(
            request_id,
            prompt_text,
            list(token_ids),
            params,
            seqs,
            metrics,
            output_kind=output_kind,
            holdback=stop_string_holdback(params),
            lora_request=lora_request,
        )

    def pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int,
        arrival_time: float | None,
    ) -> Request:
        """An embedding request: its prompt is run once and pooled (one sequence)."""
        if self.pooler is None:
            raise InvalidRequestError(
                "This model generates text; it does not embed (start a pooling model, "
                "--runner pooling, to embed)."
            )
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                "This model is served as a pooling model (--runner pooling): it embeds, "
                "it does not generate text."
            )
        params = self._pooling_task(params)
        try:
            self.pooler.check_dimensions(params.dimensions, self.model_config.hidden_size)
        except ValueError as error:
            raise InvalidRequestError(str(error), "dimensions") from None
        prompt_text, token_ids, token_types = self._tokenize_pooling(prompt, params)
        self._check_prompt_tokens(token_ids)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(token_ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input (or set truncate_prompt_tokens).",
                "input_tokens",
            )
        placeholder = SamplingParams(max_tokens=1)  # what the scheduler and outputs read
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            list(token_ids),
            len(token_ids),
            placeholder,
            priority,
            next(self._arrivals),
            token_type_ids=token_types,
        )
        # A classifier's head reads one row: an encoder's first, a decoder's last.
        pooler = self.pooler
        if params.task != "embed":
            pooler = ENCODER_CLASSIFIER_POOLING if self.encoder else DECODER_CLASSIFIER_POOLING
        seq.pooling = PoolingState(pooler, params)
        metrics = RequestMetrics(
            arrival_time=arrival_time if arrival_time is not None else time.time()
        )
        return Request(request_id, prompt_text, list(token_ids), placeholder, [seq], metrics)

    def _pooling_task(self, params: PoolingParams) -> PoolingParams:
        """The params with their task resolved (None: the model's default) and checked."""
        task = params.task or self.default_task
        if task not in self.pooling_tasks:
            raise InvalidRequestError(
                f"task {task!r} is not supported by this model "
                f"({self.model_config.architecture}: {', '.join(self.pooling_tasks)})",
                "task",
            )
        if task == "score" and "classify" not in self.pooling_tasks:
            raise InvalidRequestError(
                "an embedding model scores a pair by the cosine of the two embeddings: embed "
                "each text (LLM.score does)",
                "task",
            )
        if task == "embed" and params.activation is not None:
            raise InvalidRequestError(
                "activation is for classify and score, not embed", "activation"
            )
        return params if params.task == task else dataclasses.replace(params, task=task)

    def _tokenize_pooling(
        self, prompt: PromptType, params: PoolingParams
    ) -> tuple[str | None, list[int], list[int] | None]:
        """A pooling prompt's text, token ids and (encoders) token type ids, truncated to
        `truncate_prompt_tokens` (-1: the model's limit) as the tokenizer truncates: the
        specials stay; token ids given as such keep their last tokens, as vLLM's."""
        prompt = parse_prompt(prompt)
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens value ({limit}) is greater than max_model_len "
                f"({self.max_model_len}). Please, select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if isinstance(prompt, TextPairPrompt):
            if params.task == "embed":
                raise InvalidRequestError(
                    "a text pair is scored (task score), not embedded", "task"
                )
            if limit is None:  # (a truncated prompt may be as long as it likes)
                self.check_prompt_text(prompt.text + prompt.text_pair)
            ids, types = self.tokenizer.encode_with_types(prompt.text, prompt.text_pair, limit)
            return None, ids, types if self.encoder else None
        if isinstance(prompt, TextPrompt) and (self.encoder or limit is not None):
            if limit is None:
                self.check_prompt_text(prompt.prompt)
            ids, types = self.tokenizer.encode_with_types(prompt.prompt, None, limit)
            return prompt.prompt, ids, types if self.encoder else None
        prompt_text, token_ids = self._tokenize(prompt)
        types = prompt.token_type_ids if isinstance(prompt, TokensPrompt) else None
        if types is not None and len(types) != len(token_ids):
            raise InvalidRequestError(
                f"token_type_ids has {len(types)} entries for {len(token_ids)} tokens",
                "token_type_ids",
            )
        if limit is not None and len(token_ids) > limit:
            token_ids = token_ids[-limit:]
            types = types[-limit:] if types is not None else None
        return prompt_text, token_ids, types

    def _check_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        vocab = self.model_config.vocab_size
        for bad in (min(token_ids), max(token_ids)):  # vLLM's message
            if not 0 <= bad < vocab:
                raise InvalidRequestError(f"Token id {bad} is out of vocabulary", "prompt")

    def _check_params(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """Bounds that depend on the engine (SamplingParams checked the rest when it was made),
        with vLLM's messages. Returns the params with -1 (all) logprobs resolved to the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        params._validate()  # fields may have been assigned after construction
        if params.n > self.config.max_n_sequences:
            raise InvalidRequestError(
                f"n must be <= {self.config.max_n_sequences} (max_n_sequences), got {params.n}", "n"
            )
        max_logprobs = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name, what in (("logprobs", "sample logprobs"), ("prompt_logprobs", "prompt logprobs")):
            value = getattr(params, name)
            if value is not None and (vocab if value == -1 else value) > max_logprobs:
                raise InvalidRequestError(
                    f"Requested {what} of {vocab if value == -1 else value}, which is greater than "
                    f"max allowed: {max_logprobs}",
                    name,
                )
        for name, token_ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
        ):
            invalid = [t for t in token_ids if not 0 <= t < vocab]
            if invalid:
                raise InvalidRequestError(
                    f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}",
                    name,
                )
        if params.logprobs == -1 or params.prompt_logprobs == -1:
            params = params.clone()
            params.logprobs = vocab if params.logprobs == -1 else params.logprobs
            params.prompt_logprobs = (
                vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
            )
        return params

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> None:
        """The prompt and what it may generate fit in the context (vLLM's messages)."""
        max_len = self.max_model_len
        if num_prompt >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request "
                f"has {num_prompt} input tokens. Please reduce the length of the input messages.",
                "input_tokens",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > max_len:
            raise InvalidRequestError(  # vLLM blames the input too
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{max_len} tokens and your request has {num_prompt} input tokens "
                f"({params.max_tokens} > {max_len} - {num_prompt}).",
                "input_tokens",
            )
        if params.max_tokens is None and params.min_tokens > max_len - num_prompt:
            raise InvalidRequestError(
                f"min_tokens must be <= {max_len - num_prompt} (the context left after "
                f"{num_prompt} prompt tokens), got {params.min_tokens}"
            )

    def _make_sequences(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        grammar: concurrent.futures.Future | None,
        images: tuple[PromptImage, ...] = (),
    ) -> list[Sequence]:
        """The request's n sequences, each with its seeded generator and grammar
        matcher; the first scores the prompt when prompt logprobs are asked for."""
        arrival = next(self._arrivals)
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                index,
                list(token_ids),
                len(token_ids),
                params,
                priority,
                arrival,
                images=images,
            )
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
            if grammar is not None:  # one matcher per sequence, one compiled grammar per request
                seq.grammar = SequenceGrammar(grammar)
            seqs.append(seq)
        if (
            params.prompt_logprobs is not None
        ):  # once per request: the first sequence scores the prompt
            seqs[0].prompt_logprobs = [None]
        return seqs

    def check_prompt_text(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {len(text)} characters of input, more than any {self.max_model_len} "
                f"tokens can hold. Please reduce the length of the input messages.",
                "input_tokens",
            )

    def encode(self, text: str) -> list[int]:
        self.check_prompt_text(text)
        return self.tokenizer.encode(text)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        prompt = parse_prompt(prompt)
        if isinstance(prompt, TextPairPrompt):
            raise InvalidRequestError("a text pair is a prompt for a cross-encoder's score task")
        if isinstance(prompt, TextPrompt):
            return prompt.prompt, self.encode(prompt.prompt)
        return prompt.prompt, prompt.prompt_token_ids

    def _max_prompt_chars(self) -> int:
        """No text longer than this fits in the context: each token covers at most as many
        characters as the longest vocabulary entry. Checked before tokenizing, which is slow."""
        backend = self.tokenizer.backend
        longest = max(
            (len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1
        )
        return self.max_model_len * max(longest, 1)


def image_prompt_builder(
    vision: VisionConfig | QwenVisionConfig,
    model_dir: Path,
    limits: ImageLimits,
    mmproj_file: Path | None = None,
) -> ImagePromptBuilder:
    """The checkpoint's image processor (preprocessor_config.json; a GGUF mmproj's, --mmproj)
    and prompt expansion."""
    if isinstance(vision, QwenVisionConfig):  # each image's token count from its grid
        processor = QwenVLImageProcessor.from_dir(
            model_dir, vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
        )
        return ImagePromptBuilder(processor, vision.image_token_id, 0, limits)
    processor = (
        ClipImageProcessor.from_dir(model_dir, vision.image_size)
        if mmproj_file is None
        else mmproj_image_processor(mmproj_file)
    )
    return ImagePromptBuilder(
        processor,
        vision.image_token_id,
        vision.image_seq_length,
        limits,
        vision.image_fill_token_id,
    )
