"""vLLM's offline API: LLM(model=...).generate(prompts, sampling_params) and .chat(...)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from nanoserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.stat_logger import LoggingStatLogger
from nanoserve.inputs import TextPairPrompt, TextPrompt, TokensPrompt
from nanoserve.lora.request import LoRARequest
from nanoserve.multimodal.chat import chat_images, has_images
from nanoserve.multimodal.fetch import FetchPolicy
from nanoserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    RequestOutputKind,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

PROGRESS_BAR_MIN_PROMPTS = 8


class LLM:
    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **engine_args
    ):
        """`LLM(model=..., **EngineConfig fields)`, or `LLM(config=EngineConfig(...))` taken as
        it is (the command line builds one from its flags)."""
        if config is None:
            engine_args.setdefault("disable_log_stats", True)  # as vLLM's LLM: quiet unless asked
            config = EngineConfig.from_kwargs(model=model, **engine_args)
        elif model is not None or engine_args:
            raise TypeError("LLM takes either config= or model= and engine arguments, not both")
        self.llm_engine = LLMEngine(config)
        self.media_fetch = FetchPolicy.create(config.allowed_media_domains)
        self.image_limits = config.image_limits
        self._counter = itertools.count()
        self.stat_logger = (
            None
            if self.llm_engine.config.disable_log_stats
            else LoggingStatLogger(self.llm_engine.stats())
        )

    def shutdown(self) -> None:
        """Stop tensor-parallel worker ranks (a no-op with one rank)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None and engine.ranks.workers is not None:
            engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict, TextPrompt, TokensPrompt, TextPairPrompt)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return list(prompts)

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode` on a pooling model: each prompt's pooled result, as the params'
        `task` asks (or `pooling_task` over them; None: the model's default task);
        `outputs.data` holds it. A prompt is any prompt `generate` takes, or a pair for a
        cross-encoder: `TextPairPrompt(a, b)` or `{"text": a, "text_pair": b}`
        (nanoserve/inputs.py)."""
        if pooling_task is not None:
            pooling_params = _with_task(pooling_params, pooling_task)
        prompts = self._prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} pooling params for {len(prompts)} prompts"
                )
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(
                    request_id, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY
                )
                ids.append(request_id)
            return self._run(ids, use_tqdm and len(prompts) >= PROGRESS_BAR_MIN_PROMPTS)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` on a pooling model (--runner pooling / runner="pooling"): one
        embedding per prompt (prompts as in generate), pooled and normalized as the checkpoint
        says (nanoserve/pooling.py)."""
        outputs = self.encode(prompts, _with_task(pooling_params, "embed"), use_tqdm)
        return [
            EmbeddingRequestOutput(o.request_id, o.outputs, o.prompt_token_ids) for o in outputs
        ]

    def classify(
        self,
        prompts,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify` on a sequence classifier (`*ForSequenceClassification`): each
        prompt's class probabilities (`outputs.probs`; softmax over the labels, sigmoid for a
        one-label model, unless the params' `activation` is False). `id2label` of the model:
        `LLM.llm_engine.model_config.id2label`."""
        outputs = self.encode(prompts, _with_task(pooling_params, "classify"), use_tqdm)
        return [
            ClassificationRequestOutput(
                o.request_id, ClassificationOutput(o.outputs.data), o.prompt_token_ids
            )
            for o in outputs
        ]

    def score(
        self,
        text_1: str | Seq[str],
        text_2: str | Seq[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one score per (text_1, text_2) pair, pairing as vLLM does: one
        text_1 with each text_2 (1:N), or the lists item by item (N:N, equal lengths). A
        cross-encoder reads each pair as one prompt (its classifier's activated logit); an
        embedding model scores by the cosine of the two texts' embeddings."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if not firsts or not seconds:
            raise ValueError("score needs at least one text_1 and one text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise ValueError(
                f"text_1 and text_2 must have the same length (or text_1 one text), got "
                f"{len(firsts)} and {len(seconds)}"
            )
        params = pooling_params or PoolingParams()
        if "classify" in self.llm_engine.pooling_tasks:  # a cross-encoder
            pairs = [TextPairPrompt(a, b) for a, b in zip(firsts, seconds)]
            outputs = self.encode(pairs, _with_task(params, "score"), use_tqdm)
            return [
                ScoringRequestOutput(
                    o.request_id, ScoringOutput(o.outputs.data[0]), o.prompt_token_ids
                )
                for o in outputs
            ]
        embed_params = _with_task(params, "embed")
        embedded = self.encode(firsts + seconds, embed_params, use_tqdm)
        half = len(firsts)
        results = []
        for first, second in zip(embedded[:half], embedded[half:]):
            a = torch.tensor(first.outputs.data)
            b = torch.tensor(second.outputs.data)
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
            results.append(
                ScoringRequestOutput(
                    first.request_id,
                    ScoringOutput(cosine),
                    first.prompt_token_ids + second.prompt_token_ids,
                )
            )
        return results

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`prompts`: one prompt or a list of them, each a string, a list of token ids, a dict
        (`{"prompt_token_ids": [...]}` or `{"prompt": ...}`), a TextPrompt or a TokensPrompt.
        `lora_request`: the LoRA adapter every prompt runs with, or one (or None) per prompt
        (with enable_lora=True)."""
        prompts = self._prompt_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        for params in params_list:  # start every grammar compiling; a bad one raises here
            grammar = self.llm_engine.prepare_structured_output(params)
            if grammar is not None:
                grammar.result()
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority[i] if priority else 0,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    lora_request=loras[i],
                )
                ids.append(request_id)
            return self._run(ids, use_tqdm and len(prompts) >= PROGRESS_BAR_MIN_PROMPTS)
        except BaseException:
            self.llm_engine.abort_request(ids)
            raise

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = (
            tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
            if show_progress
            else None
        )
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
            if self.stat_logger is not None:
                self.stat_logger.maybe_log(self.llm_engine.stats())
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]

    def beam_search(
        self, prompts, params: BeamSearchParams, lora_request: LoRARequest | None = None
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, the `beam_width` best sequences (nanoserve/
        beam_search.py: transformers' beam search arithmetic). Each step sends every running beam
        of every prompt as one request for one token; the prefix cache shares their blocks.
        `text` is the whole sequence decoded (prompt and output), as vLLM's. `lora_request`: the
        adapter every beam runs with."""
        if isinstance(prompts, (str, dict, TextPrompt, TokensPrompt)):
            prompts = [prompts]
        tokenizer = self.llm_engine.tokenizer
        searches = [
            BeamSearch(self._prompt_ids(prompt), params, self.llm_engine.eos_token_ids)
            for prompt in prompts
        ]
        # Each beam's request carries its prompt's images (vLLM's multi_modal_data): the encoder
        # cache and the prefix cache (keyed by image) share their work across the beams.
        images = [
            prompt.get("multi_modal_data")
            if isinstance(prompt, dict)
            else getattr(prompt, "multi_modal_data", None)
            for prompt in prompts
        ]
        while True:
            work = [
                (search, TokensPrompt(tokens, multi_modal_data=data))
                for search, data in zip(searches, images)
                for tokens in search.pending()
            ]
            if not work:
                break
            step = SamplingParams(
                max_tokens=1, temperature=0, logprobs=searches[0].num_logprobs, ignore_eos=True
            )
            outputs = self.generate(
                [prompt for _, prompt in work],
                step,
                use_tqdm=False,
                lora_request=lora_request,
            )
            cursor = 0
            for search in searches:
                count = len(search.pending())
                if count:
                    search.advance(
                        [
                            {token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()}
                            for out in outputs[cursor : cursor + count]
                        ]
                    )
                    cursor += count
        results = [search.output() for search in searches]
        for result in results:
            for beam in result.sequences:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
        return results

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, TokensPrompt):
            return list(prompt.prompt_token_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = (
            prompt.prompt
            if isinstance(prompt, TextPrompt)
            else prompt["prompt"]
            if isinstance(prompt, dict)
            else prompt
        )
        return self.llm_engine.tokenizer.encode(text)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"}) or a list of them.
        `tools` (OpenAI's function tools) reach the template as `tools`, as in vLLM; the output
        is the model's text (the server's tool parsers read calls out of it)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **{**(chat_template_kwargs or {}), "tools": tools},
            )
            # The template already carries BOS where the model wants it.
            images = (
                chat_images(conversation, self.image_limits, self.media_fetch)
                if has_images(conversation)
                else None
            )
            prompts.append(
                TokensPrompt(
                    tokenizer.encode(text, add_special_tokens=False),
                    text,
                    multi_modal_data={"image": images} if images else None,
                )
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _with_task(
    params: PoolingParams | Seq[PoolingParams] | None, task: str
) -> PoolingParams | list[PoolingParams]:
    """The params (one, or one per prompt) asking for `task`."""
    if params is None or isinstance(params, PoolingParams):
        return dataclasses.replace(params or PoolingParams(), task=task)
    return [dataclasses.replace(p, task=task) for p in params]
