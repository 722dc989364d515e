"""A stand-in LLMEngine with the same interface: deterministic, with controllable step time,
batch size and failure, for testing the async engine and server without a model."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from nanoserve.engine.llm_engine import EngineStats
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FakeTokenizer:
    eos_token_id = 0
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [max(1, ord(c) % 256) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None,
                            continue_final_message=False, **kwargs) -> str:
        return "".join(f"{m['role']}:{m['content']}\n" for m in messages)


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    generated: list[int]
    arrival: float


class FakeEngine:
    """Runs up to `max_running` requests per step; each step appends one 'a' per request.
    A step burns `step_seconds` in torch (releasing the GIL, as the real forward pass does)."""

    def __init__(self, step_seconds: float = 0.0, max_running: int = 8, max_model_len: int = 256,
                 fail_on_step: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.served_model_name = "fake-model"
        self.model_path = "/fake/model"
        self.model_dir = None
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.max_running = max_running
        self.fail_on_step = fail_on_step
        self.requests: dict[str, _Request] = {}
        self.num_steps = 0
        self.aborted: list[tuple[str, int]] = []  # (request id, steps done when aborted)
        self.generation_tokens = 0
        self.thread_ids: set[int] = set()
        self._matrix = torch.randn(256, 256)

    def add_request(self, request_id, prompt, sampling_params, priority=0, arrival_time=None):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, your request has {len(ids)} input tokens. Please reduce "
                             "the length of the input messages.")
        max_tokens = sampling_params.max_tokens or (self.max_model_len - len(ids))
        self.requests[request_id] = _Request(request_id, list(ids), max_tokens, [],
                                             arrival_time or time.time())

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append((request_id, self.num_steps))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        running = min(len(self.requests), self.max_running)
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running,
                           kv_cache_usage=running / 100, num_preemptions_total=0,
                           prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                           prompt_tokens_total=0, generation_tokens_total=self.generation_tokens,
                           num_kv_blocks=100)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise RuntimeError("simulated device failure")
        deadline = time.perf_counter() + self.step_seconds
        while time.perf_counter() < deadline:
            torch.mm(self._matrix, self._matrix)
        outputs = []
        for request in list(self.requests.values())[: self.max_running]:
            request.generated.append(ord("a"))
            self.generation_tokens += 1
            finished = len(request.generated) >= request.max_tokens
            completion = CompletionOutput(0, "a" * len(request.generated), list(request.generated),
                                          finish_reason="length" if finished else None)
            outputs.append(RequestOutput(request.request_id, None, request.prompt_ids, [completion],
                                         finished, RequestMetrics(request.arrival)))
            if finished:
                del self.requests[request.request_id]
        return outputs
