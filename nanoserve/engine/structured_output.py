"""Structured outputs on xgrammar: grammars compiled off the step loop and cached by their text,
one matcher per sequence, and each step's token bitmask for the constrained rows.

xgrammar is imported here only, and only once a constrained request arrives: the engine, the
models and the kernels run without it. Compiling happens on this module's own thread; a request
whose grammar is not compiled yet waits in the scheduler's queue (Sequence.is_schedulable) while
the others decode. A compile no request waits for any more is dropped before it starts
(`release`); xgrammar cannot be stopped once it runs, so a deadline (the async engine's) answers
its requests and lets it finish into the cache.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# xgrammar compiles one grammar on several threads; the engine's step needs the cores too.
COMPILER_THREADS = 2
# "[18:17:38] /project/cpp/regex_converter.cc:94: " and "Check failed: (...) is false: "
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as error:  # an install without the runtime dependency
        raise InvalidRequestError(
            "structured outputs need the xgrammar package, which is not "
            f"installed on this server ({error})",
            None,
        ) from None
    return xgrammar


def _clean_message(error: BaseException) -> str:
    text = str(error).strip()
    return _NATIVE_PREFIX.sub("", text).strip() or type(error).__name__


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the given strings (JSON escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


class SequenceGrammar:
    """One sequence's matcher (n > 1: one each), built once its grammar is compiled. It lives
    with the sequence, so swapping keeps it, and preemption by recompute, which keeps the
    generated tokens, needs nothing rebuilt."""

    __slots__ = ("future", "_matcher")

    def __init__(self, future: Future) -> None:
        self.future = future
        self._matcher = None

    @property
    def is_ready(self) -> bool:
        """Compiled. A failed compile never becomes ready: the engine fails its request before
        the next schedule, so it can never reach a batch (and fail the others' step)."""
        future = self.future
        return future.done() and not future.cancelled() and future.exception() is None

    @property
    def failed(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            xgrammar = _import_xgrammar()
            self._matcher = xgrammar.GrammarMatcher(self.future.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class _Compile(Future):
    """One grammar's compile: the spec until the compile thread takes it, and how many
    requests wait for it (`compile` adds one, `release` takes one away)."""

    def __init__(self, spec: StructuredOutputsParams) -> None:
        super().__init__()
        self.spec: StructuredOutputsParams | None = spec
        self.waiters = 1


class StructuredOutputManager:
    """Compiles grammars for one tokenizer (on its own thread) and fills bitmasks."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_cached = max_cached
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiler = None  # built on the compile thread by the first compile
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_cancelled = 0  # compiles dropped before they started (release)

    # ---- compiling (any thread submits; the compile thread compiles) ------------------------
    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar for `spec`, as a future: from the cache when the same text was
        compiled (or is being compiled), else queued on the compile thread. A failed compile
        is not kept: the future raises InvalidRequestError naming spec.field. Each call counts
        as one waiter until `release`."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (
                future.cancelled() or (future.done() and future.exception() is not None)
            ):
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                future.waiters += 1
                return future
            future = _Compile(spec)
            work = self.executor.submit(self._run, future)
            # shutdown() cancels the queued work: its compile is then cancelled for its waiters
            work.add_done_callback(lambda work: work.cancelled() and future.cancel())
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self.num_compiles += 1
        return future

    def release(self, future: Future) -> None:
        """One waiter gave up on `future` (its deadline passed, its client left, or it got the
        grammar). With no waiter left, a compile that has not started is cancelled and its
        text dropped, so abandoned requests never leave a queue of compiles behind them; one
        already running cannot be stopped: it finishes and its grammar stays in the cache."""
        with self._lock:
            future.waiters -= 1
            if future.waiters > 0 or not future.cancel():
                return
            future.spec = None
            self.num_cancelled += 1
            for key, cached in self._cache.items():
                if cached is future:
                    del self._cache[key]
                    break

    def _run(self, future: _Compile) -> None:
        """The compile thread: skip a compile every waiter gave up on, else compile it."""
        if not future.set_running_or_notify_cancel():
            return
        spec, future.spec = future.spec, None
        try:
            future.set_result(self._compile(spec))
        except BaseException as error:  # InvalidRequestError, or the waiters' to see
            future.set_exception(error)

    def _tokenizer_info(self, xgrammar):
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        return xgrammar.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )

    def _get_compiler(self):
        if self._compiler is None:
            xgrammar = _import_xgrammar()
            self._compiler = xgrammar.GrammarCompiler(
                self._tokenizer_info(xgrammar), max_threads=COMPILER_THREADS
            )
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._get_compiler()
        try:
            if spec.json is not None:
                text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(
                    text, any_whitespace=not spec.disable_any_whitespace
                )
            if spec.json_object:
                return compiler.compile_builtin_json_grammar()
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            kind = spec.key[0].split("_any_whitespace")[0]
            raise InvalidRequestError(
                f"Invalid {kind} for {spec.field}: {_clean_message(error)}", spec.field
            ) from None

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- each step ----------------------------------------------------------------------------
    def constrain(self, sampling, inputs: list, device: torch.device) -> None:
        """Give a step's SamplingBatch the bitmask of its constrained rows, if it has any
        (`inputs`: the rows' SamplingInputs, engine/step_input.py, which imports this module)."""
        rows = [(row, item.grammar) for row, item in enumerate(inputs) if item.grammar is not None]
        if rows:
            sampling.token_bitmask, sampling.bitmask_rows = self.fill_bitmask(rows, device)

    def fill_bitmask(
        self, rows: list[tuple[int, SequenceGrammar]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One bitmask for the constrained rows of a step: ([C, words] int32, [C] their rows in
        the batch), on `device`."""
        words = -(-self.vocab_size // 32)
        bitmask = torch.empty(
            (len(rows), words), dtype=torch.int32, pin_memory=device.type == "cuda"
        )
        for index, (_, grammar) in enumerate(rows):
            grammar.matcher.fill_next_token_bitmask(bitmask, index)
        row_ids = torch.tensor(
            [row for row, _ in rows], dtype=torch.long, pin_memory=device.type == "cuda"
        )
        if device.type == "cpu":
            return bitmask, row_ids
        return bitmask.to(device, non_blocking=True), row_ids.to(device, non_blocking=True)


class GrammarCompiles:
    """The engine's structured outputs: the manager (made on the first constrained request, on
    whichever thread asks) and the compiles that requests already added still wait for."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.manager: StructuredOutputManager | None = None
        self.pending: dict[str, Future] = {}  # request id → its grammar
        self._lock = threading.Lock()

    def prepare(self, params: SamplingParams) -> Future | None:
        """Start compiling a constrained request's grammar (or find it in the cache); None for
        a free request. The future raises InvalidRequestError for a bad schema, regex or
        grammar. Callable from any thread."""
        if params.structured_outputs is None:
            return None
        with self._lock:
            if self.manager is None:
                self.manager = StructuredOutputManager(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
        return self.manager.compile(params.structured_outputs)

    def take_failed(self) -> tuple[list[str], BaseException | None]:
        """Forget the compiles that ended; the requests whose compile failed, and an error."""
        done = [rid for rid, future in self.pending.items() if future.done()]
        failed = [rid for rid in done if self.pending[rid].exception() is not None]
        errors = [self.pending.pop(rid).exception() for rid in done]
        return failed, next((e for e in errors if e is not None), None)

    def wait_for_one(self, timeout: float) -> None:
        """Only grammars to wait for: block until one compiles (not a busy loop)."""
        wait(list(self.pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
