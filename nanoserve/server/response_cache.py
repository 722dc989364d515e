"""A cache of finished engine outputs, keyed by a hash of everything that determines them.

A request whose output is determined by its input (greedy, or sampled with a `seed`) stores the
engine's final `RequestOutput`s (one per prompt) under a hash of the model, the prompt token ids
and every `SamplingParams` field. A later identical request replays them through the usual
response code, so every response shape (stream or not, echo, token ids, logprob formats, usage)
comes out as for the original: fields that only shape the response stay out of the key.

Entries are msgpack bytes: their size is exact, and a hit decodes fresh objects that no handler
can share. LRU eviction by bytes; an entry older than the TTL is a miss (and is dropped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

# Every SamplingParams field, each of which may change the tokens, text, logprobs or finish
# reasons (tests/server/test_response_cache_unit.py fails when SamplingParams gains a field this
# list does not name). n: how many outputs; stop strings / ids and
# include_stop_str_in_output: where and how outputs end; skip_special_tokens and
# spaces_between_special_tokens: the detokenized text; logprobs / prompt_logprobs: the entries
# returned (echo and max_tokens=0 reach the key through prompt_logprobs and max_tokens);
# structured_outputs: the grammar, by its kind and text.
KEY_PARAMS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "structured_outputs",
)
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# Beyond an entry's two bytes objects: its OrderedDict slot and links, the (blob, expiry) tuple
# and the expiry float (measured with tracemalloc on CPython 3.11: ~185 bytes).
ENTRY_OVERHEAD = 192

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.Decoder(list[RequestOutput]).decode


def is_cacheable(params: SamplingParams) -> bool:
    """The output is a function of the input: greedy, or sampled from a seeded generator."""
    return params.temperature == 0.0 or params.seed is not None


def cache_key(model: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> bytes:
    values = []
    for name in KEY_PARAMS:
        value = getattr(params, name)
        if name in _FLOAT_PARAMS:
            value = float(value)  # 0 and 0.0 are the same setting
        elif name == "logit_bias" and value is not None:
            value = sorted((int(token), float(bias)) for token, bias in value.items())
        elif name == "structured_outputs" and value is not None:
            value = list(value.key)  # the grammar's kind and text
        values.append(value)
    payload = _encode([model, [list(p) for p in prompts], values])
    return hashlib.sha256(payload).digest()


def is_complete(outputs: Sequence[RequestOutput | None]) -> bool:
    """Finished normally: not aborted, not failed, every choice with its finish reason."""
    return bool(outputs) and all(
        output is not None
        and output.finished
        and output.outputs
        and all(choice.finish_reason not in (None, "abort", "error") for choice in output.outputs)
        for output in outputs
    )


class ResponseCache:
    def __init__(
        self, max_bytes: int, ttl_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_bytes < 0 or ttl_seconds <= 0:
            raise ValueError("the response cache needs max_bytes >= 0 and ttl_seconds > 0")
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self.entries: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()  # oldest use first
        self.size_bytes = 0
        self.queries = 0  # lookups of cacheable requests
        self.hits = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def entry_size(key: bytes, blob: bytes) -> int:
        return sys.getsizeof(key) + sys.getsizeof(blob) + ENTRY_OVERHEAD

    def get(self, key: bytes) -> list[RequestOutput] | None:
        self.queries += 1
        entry = self.entries.get(key)
        if entry is None:
            return None
        blob, expires = entry
        if self.clock() >= expires:
            self._remove(key)
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return _decode(blob)

    def put(self, key: bytes, outputs: Sequence[RequestOutput]) -> bool:
        """Store finished outputs, less what the repeat brings itself (request id, prompt text
        and ids) and timing metrics; False when not stored: a failed or aborted request, or one
        larger than the whole cache."""
        if not self.enabled or not is_complete(outputs):
            return False
        blob = _encode(
            [
                dataclasses.replace(
                    output, request_id="", prompt=None, prompt_token_ids=[], metrics=None
                )
                for output in outputs
            ]
        )
        size = self.entry_size(key, blob)
        if size > self.max_bytes:
            return False
        if key in self.entries:
            self._remove(key)
        self._drop_expired()
        while self.size_bytes + size > self.max_bytes:
            self._remove(next(iter(self.entries)))
        self.entries[key] = (blob, self.clock() + self.ttl_seconds)
        self.size_bytes += size
        return True

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        count = len(self.entries)
        self.entries.clear()
        self.size_bytes = 0
        return count

    def _drop_expired(self) -> None:
        """Expired entries at the cold end go first (cheap; the rest expire when looked up or
        leave by LRU order)."""
        now = self.clock()
        while self.entries:
            key, (_, expires) = next(iter(self.entries.items()))
            if now < expires:
                return
            self._remove(key)

    def _remove(self, key: bytes) -> None:
        blob, _ = self.entries.pop(key)
        self.size_bytes -= self.entry_size(key, blob)
