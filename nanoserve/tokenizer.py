"""Tokenizer: a `tokenizers` wrapper for HF-layout model dirs, chat templates, incremental detokenizing."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from tokenizers import Tokenizer as BackendTokenizer


class ChatTemplateError(ValueError):
    """The chat template is missing, or refused to render these messages. `param`: the request
    field to blame, when one is (an unsupported content part: messages[i].content[j])."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_GIL_FREE_ENCODE_CHARS = 4096
# A rendered chat template, or any string or list a template builds, is capped at this many items
# (a template can otherwise build a gigabyte string from a few bytes of source).
MAX_TEMPLATE_OUTPUT = 64 * 1024 * 1024


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _load_chat_template(path: Path, tokenizer_config: dict) -> str | None:
    # Newer checkpoints keep the template in its own file; it then wins over tokenizer_config.json.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template


class Tokenizer:
    """Encode/decode and chat templates for one model directory (needs a tokenizer.json)."""

    def __init__(
        self,
        backend: BackendTokenizer,
        tokenizer_config: dict | None = None,
        generation_eos_token_ids: list[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        # A tokenizer.json may carry the padding and truncation it was trained with
        # (all-MiniLM-L6-v2's pads every text to 128): transformers turns both off and applies
        # what each call asks; so do we (encode_with_types truncates by itself).
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        # A vision-language model's image placeholder text ("<image>"): set where the model is
        # opened (engine/startup.py); None: image parts are refused.
        self.image_placeholder: str | None = None
        config = tokenizer_config or {}
        self.config = dict(config)  # tokenizer_config.json as read (GET /tokenizer_info shows it)
        self.truncation_side = (
            config.get("truncation_side")
            if config.get("truncation_side") in ("left", "right")
            else "right"
        )
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.chat_template = chat_template
        self._generation_eos_token_ids = list(generation_eos_token_ids or [])
        bos_id = self.bos_token_id
        # Some tokenizer.json post-processors (Llama 3) add BOS themselves; never add a second one.
        adds_bos_itself = bos_id is not None and backend.encode("", add_special_tokens=True).ids[
            :1
        ] == [bos_id]
        self._prepend_bos = (
            bool(config.get("add_bos_token", False)) and bos_id is not None and not adds_bos_itself
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (only fast-tokenizer model dirs are supported)"
            )
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        generation_config = _read_json(path / "generation_config.json")
        eos_source = (
            generation_config
            if "eos_token_id" in generation_config
            else _read_json(path / "config.json")
        )
        return cls(
            BackendTokenizer.from_file(str(tokenizer_file)),
            tokenizer_config,
            generation_eos_token_ids=_as_id_list(eos_source.get("eos_token_id")),
            chat_template=_load_chat_template(path, tokenizer_config),
        )

    # ------------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            # encode_batch releases the GIL (encode does not): a long text tokenized on a worker
            # thread then leaves the event loop free.
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_each(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text (the same ids), with the GIL released while each one
        tokenizes, short ones too: one encode_batch call per text, since a batch of several
        would tokenize on a thread per core, beside the engine's step."""
        result = []
        for text in texts:
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            if add_special_tokens and self._prepend_bos:
                ids.insert(0, self.bos_token_id)
            result.append(ids)
        return result

    def encode_with_types(
        self, text: str, text_pair: str | None = None, max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """One text, or a pair as one prompt, with the tokenizer.json's special tokens and
        token type ids (transformers' `tokenizer(text, text_pair)`: BERT's `[CLS] a [SEP] b
        [SEP]`, types 0 then 1; XLM-R's `<s> a </s></s> b </s>`). `max_length`: at most that
        many ids, specials included, cut as the tokenizers library's longest_first
        truncation cuts (the longer text first, from the right)."""
        backend = self._backend
        first = backend.encode(text, add_special_tokens=False)
        second = (
            backend.encode(text_pair, add_special_tokens=False) if text_pair is not None else None
        )
        if max_length is not None:
            specials = backend.num_special_tokens_to_add(second is not None)
            budget = max(0, max_length - specials - int(self._prepend_bos))
            if second is None:
                if len(first.ids) > budget:
                    first.truncate(budget)
            elif len(first.ids) + len(second.ids) > budget:
                # tokenizers' LongestFirst: the shorter keeps up to half, the longer the rest.
                first_longer = len(first.ids) > len(second.ids)
                small = min(len(second.ids) if first_longer else len(first.ids), budget // 2)
                large = budget - small
                first.truncate(large if first_longer else small)
                second.truncate(small if first_longer else large)
        encoding = backend.post_process(first, second, add_special_tokens=True)
        ids, types = list(encoding.ids), list(encoding.type_ids)
        if self._prepend_bos:
            ids.insert(0, self.bos_token_id)
            types.insert(0, 0)
        return ids, types

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(index) for index in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        if self.eos_token:
            return self._backend.token_to_id(self.eos_token)
        return self._generation_eos_token_ids[0] if self._generation_eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self._backend.token_to_id(self.pad_token) if self.pad_token else None

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's eos plus generation_config's list."""
        ids = set(self._generation_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    @property
    def all_special_ids(self) -> list[int]:
        ids = {
            index
            for index, token in self._backend.get_added_tokens_decoder().items()
            if token.special
        }
        for token in (self.bos_token, self.eos_token, self.pad_token, self.unk_token):
            index = self._backend.token_to_id(token) if token else None
            if index is not None:
                ids.add(index)
        return sorted(ids)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        deadline: float | None = None,
        **template_kwargs: Any,
    ) -> str:
        """`deadline` (time.monotonic()): rendering stops with ChatTemplateError once past it."""
        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); pass chat_template=... or use the completions API"
            )
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        parts = self.image_placeholder is not None and _reads_content_parts(template)
        messages = [
            _assistant_fields(
                _decode_tool_arguments(
                    _flatten_content(message, self.image_placeholder, parts, f"messages[{i}]")
                )
            )
            for i, message in enumerate(messages)
        ]
        # A marker after the last message's text shows where that text ends once rendered, so the
        # template's end-of-turn tokens after it can be cut off. It ends in a space: if the template
        # strips that, it strips the message's trailing whitespace too, and so do we (as transformers).
        continue_marker = "NANOSERVE_CONTINUE_FINAL_MESSAGE "
        if continue_final_message:
            _mark_final_text(messages, continue_marker)
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "tools": None,
            "documents": None,
            **template_kwargs,
        }
        try:
            rendered = _render(
                _compile_template(template),
                deadline,
                dict(messages=messages, add_generation_prompt=add_generation_prompt, **context),
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template failed to render: {error}") from error
        if continue_final_message:
            cut = rendered.rfind(continue_marker.rstrip())
            if cut < 0:
                raise ChatTemplateError(
                    "continue_final_message: the chat template dropped the final message's text"
                )
            trimmed = not rendered.startswith(continue_marker, cut)
            rendered = rendered[:cut].rstrip() if trimmed else rendered[:cut]
        return rendered


def _mark_final_text(messages: list[dict], marker: str) -> None:
    """The marker after the final message's text: its content string's, or (content parts, as
    LLaVA's template reads them) its last text part's, as transformers marks it."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, str):
        messages[-1]["content"] = content + marker
        return
    if isinstance(content, list):
        for index in range(len(content) - 1, -1, -1):
            part = content[index]
            if part.get("type") == "text":
                content[index] = {**part, "text": part["text"] + marker}
                return
    raise ChatTemplateError("continue_final_message needs a final message with text content")


# A template that reads a message's content as parts (LLaVA's: `for content in message['content']
# | selectattr('type', 'equalto', 'image')`), as vLLM's "openai" content format detects it.
_CONTENT_PARTS = re.compile(r"""for\s+\w+\s+in\s+message(\[['"]content['"]\]|\.content\b)""")


def _reads_content_parts(template: str) -> bool:
    return _CONTENT_PARTS.search(template) is not None


def _flatten_content(
    message: dict,
    image_placeholder: str | None = None,
    keep_parts: bool = False,
    field: str = "messages",
) -> dict:
    """A copy of the message whose content is a string: text parts are joined with newlines,
    an image part (a vision-language model's) is its placeholder where the part was. With
    `keep_parts` (a vision-language model's template that reads parts, as LLaVA's) the content is
    a list of parts instead, text ones and {"type": "image"}, a string becoming one text part."""
    message = dict(message)
    content = message.get("content")
    if keep_parts and isinstance(content, str):
        message["content"] = [{"type": "text", "text": content}]
    elif isinstance(content, (list, tuple)):
        texts, parts = [], []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict) and part.get("type", "text") == "text" and "text" in part:
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            elif (
                isinstance(part, dict)
                and part.get("type") in ("image_url", "image_pil")
                and image_placeholder
            ):
                texts.append(image_placeholder)
                parts.append({"type": "image"})
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                served = "text and image_url" if image_placeholder else "only text"
                raise ChatTemplateError(
                    f"unsupported message content part of type {kind!r}; this model takes "
                    f"{served} parts",
                    f"{field}.content[{j}]",
                )
        message["content"] = parts if keep_parts else "\n".join(texts)
    return message


def _assistant_fields(message: dict) -> dict:
    """An assistant message as the families' templates read it: a call without text has content
    "" (as vLLM renders it; gpt-oss's template tests `in message.content`, which fails on None),
    and its reasoning (`reasoning_content`, or `reasoning`) is also its `thinking`, the field
    gpt-oss's template renders as the analysis before a call."""
    if message.get("role") != "assistant":
        return message
    if message.get("content") is None and message.get("tool_calls"):
        message = {**message, "content": ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and "thinking" not in message:
        message = {**message, "thinking": reasoning}
    return message


def _decode_tool_arguments(message: dict) -> dict:
    """An assistant message's tool calls with their `arguments` JSON text read into objects, as
    vLLM hands them to templates: the families' templates write them with `tojson`, which would
    quote a string a second time."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    decoded = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"] or "{}")
            except ValueError:
                raise ChatTemplateError("a tool call's arguments are not valid JSON") from None
            call = {**call, "function": {**function, "arguments": arguments}}
        decoded.append(call)
    return {**message, "tool_calls": decoded}


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError("chat template rendering took too long")


def _render(template: jinja2.Template, deadline: float | None, context: dict) -> str:
    """Render piece by piece, so the output size and the time are bounded as it grows."""
    parts: list[str] = []
    size = 0
    with _deadline_scope(deadline):
        for part in template.generate(**context):
            size += len(part)
            if size > MAX_TEMPLATE_OUTPUT:
                raise ChatTemplateError(
                    f"the chat template's output exceeds {MAX_TEMPLATE_OUTPUT} characters"
                )
            _check_deadline(deadline)
            parts.append(part)
    return "".join(parts)


_render_deadline = threading.local()


class _deadline_scope:
    """Makes `deadline` visible to the sandbox hooks (range, operators) on this thread."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def __enter__(self) -> None:
        _render_deadline.value = self.deadline

    def __exit__(self, *exc) -> None:
        _render_deadline.value = None


def _current_deadline() -> float | None:
    return getattr(_render_deadline, "value", None)


def _bounded_range(*args: int):
    # The sandbox caps one range's length; nested loops still multiply, so check the clock too.
    for index, value in enumerate(safe_range(*args)):
        if index % 64 == 0:
            _check_deadline(_current_deadline())
        yield value


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, plus bounds on what `*`, `+` and `**` can build (a huge string or integer).
    Not a memory bound: `~` and filters (`center`, `format`) can still build large strings, which
    is why templates sent in requests are refused unless the operator trusts their senders."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_deadline(_current_deadline())
        if operator == "**":
            if (
                isinstance(right, int)
                and abs(right) > 64
                and not (isinstance(left, (int, float)) and abs(left) <= 1)
            ):
                raise ChatTemplateError("exponent too large in the chat template")
        elif isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if (
            operator == "+"
            and isinstance(left, (str, list, tuple))
            and isinstance(right, (str, list, tuple))
            and len(left) + len(right) > MAX_TEMPLATE_OUTPUT
        ):
            raise ChatTemplateError("the chat template builds a value that is too large")
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
            if len(left) * right > MAX_TEMPLATE_OUTPUT:
                raise ChatTemplateError("the chat template builds a value that is too large")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    # Chat templates come with downloaded models: untrusted code, so sandboxed. trim_blocks and
    # lstrip_blocks match transformers, which is what template authors test against.
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.globals["range"] = _bounded_range
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never end in half a UTF-8 character.

    Only a short window of ids is decoded per step: the ids already emitted just before (context,
    so that merges across token boundaries and leading-space rules come out as in a full decode)
    and the ids not yet emitted. The text covers the generated ids only, so the deltas concatenate
    to `tokenizer.decode(generated_ids)`; prompt_token_ids just mark where generation starts.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._num_prompt_tokens = len(prompt_token_ids)
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (already emitted context)
        self._read_offset = 0  # first id whose text has not been emitted yet
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (possibly "")."""
        self._token_ids.extend(new_token_ids)
        window_start = self._prefix_offset
        prefix_text = self._decode(self._token_ids[window_start : self._read_offset])
        new_text = self._decode(self._token_ids[window_start:])
        if new_text.endswith("\ufffd"):
            return ""  # the last ids end inside a multi-byte character: wait for the rest
        delta = new_text[len(prefix_text) :]
        if delta:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text_parts.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._text_parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return (
            self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
            if ids
            else ""
        )
