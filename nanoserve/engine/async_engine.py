"""AsyncLLMEngine: the one LLMEngine driven from an asyncio server.

Requests and aborts enter an asyncio.Queue (a constrained request once its grammar compiled, so
a large schema never holds up the step loop; while it waits for the compile it counts as waiting,
and past `compile_timeout` it is refused). One step coroutine owns the engine: between steps it
drains the queue into `add_request` / `abort_request`, then runs `engine.step()` on a worker
thread so the event loop keeps answering (torch releases the GIL in its kernels), and hands each
request's output to that request's `RequestStream`. With no work it sleeps on the queue. Reading a
LoRA adapter from disk (a request's, or `call_between_steps`) also runs on the step thread,
between two steps, never on the event loop.

A step that fails because of its requests (`StepError`) fails only those requests. Any other
failure (a dead rank, a device fault), or `MAX_CONSECUTIVE_STEP_ERRORS` failed steps in a row,
means the engine is dead: every stream gets the error and `is_dead` turns true.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from nanoserve.engine.llm_engine import LLMEngine, StepError
from nanoserve.engine.stat_logger import LoggingStatLogger
from nanoserve.errors import InvalidRequestError
from nanoserve.outputs import RequestOutput, RequestOutputKind
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger("nanoserve.engine")

# Steps failing one after another, each with other requests, point at the engine, not a request.
MAX_CONSECUTIVE_STEP_ERRORS = 8


class EngineDeadError(RuntimeError):
    """The engine failed during a step; no request can be served any more."""


# What clients are told (vLLM says as much): the cause is logged with its stack, never sent.
ENGINE_DEAD = "The engine failed and serves no more requests; the server's log has the cause."


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's life, for request-level metrics (vLLM's phases: queued from arrival to the
    first schedule, prefill until the first token, decode until the last one)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_seconds: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int  # all outputs together
    max_num_generation_tokens: int  # the longest of the n outputs
    n: int
    max_tokens: int | None  # the max_tokens in effect
    num_preemptions: int
    queued_seconds: float
    prefill_seconds: float
    decode_seconds: float
    inference_seconds: float
    time_per_output_token: float  # decode time per token after the first; 0 with one token


class Observer(Protocol):
    """Receives per-step and per-request figures (the server's metrics implement this)."""

    def on_first_token(self, request_id: str, seconds_since_arrival: float) -> None: ...
    def on_token_gap(self, seconds: float) -> None: ...
    def on_step(self, num_tokens: int) -> None: ...
    def on_finished(self, stats: FinishedRequestStats) -> None: ...


class RequestStream:
    """One request's mailbox. It holds one output: the newest cumulative one, or the deltas not
    yet read folded into one (DELTA), so a reader that falls behind (a slow SSE client) gets a
    larger delta next time instead of a growing queue."""

    __slots__ = (
        "request_id",
        "arrival_time",
        "latest",
        "error",
        "finished",
        "event",
        "first_token_time",
        "last_token_time",
        "num_generated",
        "params",
        "output_kind",
    )

    def __init__(
        self,
        request_id: str,
        arrival_time: float,
        params: SamplingParams | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.params = params
        self.output_kind = output_kind
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.event = asyncio.Event()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0  # tokens generated (all outputs) when the last output came

    def put(self, output: RequestOutput) -> None:
        if self.latest is not None and self.output_kind is RequestOutputKind.DELTA:
            self.latest.add(output)
        else:
            self.latest = output
        self.finished = output.finished
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finished = True
        self.event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while self.latest is None:
            if self.error is not None:
                raise self.error
            if self.finished:
                raise StopAsyncIteration
            self.event.clear()
            await self.event.wait()
        output, self.latest = self.latest, None
        return output


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    stream: RequestStream
    accepted: asyncio.Future
    output_kind: RequestOutputKind
    lora_request: Any = None  # nanoserve.lora.LoRARequest


@dataclass(slots=True)
class _Abort:
    request_id: str
    already_failed: bool = False  # its stream was failed and removed: only the engine is left


@dataclass(slots=True)
class _EngineCall:
    """Run `call(engine)` between two steps (loading a LoRA adapter on every rank)."""

    call: Any
    done: asyncio.Future


@dataclass(slots=True)
class _ResetPrefixCache:
    done: asyncio.Future


def new_step_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs torch for the engine. Build the engine on it too
    (`await loop.run_in_executor(executor, LLMEngine, config)`): on CPU, torch work from a second
    thread starts a second OpenMP team, and the two teams together made every step ~45% slower
    on a 2-core machine, even after the first thread went quiet."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        observer: Observer | None = None,
        overlap_streaming: bool | None = None,
        step_executor: concurrent.futures.ThreadPoolExecutor | None = None,
        log_stats: bool = False,
        compile_timeout: float | None = None,
    ) -> None:
        """`compile_timeout`: seconds a constrained request may wait for its grammar before it
        is refused (a 400 naming its field); None waits as long as the compile takes."""
        self.engine = engine
        self.compile_timeout = compile_timeout
        if overlap_streaming is None:
            overlap_streaming = engine.device.type != "cpu"
        # On an accelerator the handlers' work (JSON, socket writes) overlaps the next step. On
        # a CPU the forward pass already uses every core, and overlapping work slows it more
        # than running that work between steps costs (measured: ~5% of served throughput).
        self.overlap_streaming = overlap_streaming
        self.observer = observer
        self.intake: asyncio.Queue[_Add | _Abort | _ResetPrefixCache | _EngineCall] = (
            asyncio.Queue()
        )
        self.streams: dict[str, RequestStream] = {}
        self.dead_error: BaseException | None = None
        self.stats = engine.stats()
        self.num_queued_adds = 0
        self.num_compiling = 0  # requests waiting for their grammar, not yet queued
        self.consecutive_step_errors = 0
        self._step_thread = step_executor or new_step_executor()
        self._task: asyncio.Task | None = None
        # vLLM's periodic stats line (off with --disable-log-stats)
        self.stat_logger = LoggingStatLogger(self.stats) if log_stats else None
        self._stats_task: asyncio.Task | None = None

    # ---- public API -----------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: in the engine's queue, in the intake, or waiting for their
        grammar (so --max-waiting-requests bounds the compile queue too)."""
        return self.stats.num_waiting + self.num_queued_adds + self.num_compiling

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="engine-step-loop")
        if self.stat_logger is not None:
            self._stats_task = loop.create_task(self._log_stats(), name="engine-stats-log")

    async def stop(self) -> None:
        for task in (self._stats_task, self._task):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for stream in list(self.streams.values()):
            stream.fail(EngineDeadError("the server is shutting down"))
        self.streams.clear()
        self._step_thread.shutdown(wait=True)
        gc.unfreeze()  # the engine's objects back under the collector (startup.freeze_startup_heap)

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it (a pooling request,
        PoolingParams, ends with one PoolingRequestOutput; its prompt may be a cross-encoder's
        pair, nanoserve/inputs.py's TextPairPrompt or {"text", "text_pair"}). Raises
        InvalidRequestError (the engine's user-facing message) or EngineDeadError. The server
        asks for DELTA outputs: each one carries only what is new."""
        if self.dead_error is not None:
            raise EngineDeadError(ENGINE_DEAD)
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        arrival_time = time.time()
        if isinstance(params, SamplingParams):  # (a pooling request has no grammar)
            await self._compile_grammar(params)
        stream = RequestStream(request_id, arrival_time, params, output_kind)
        accepted = asyncio.get_running_loop().create_future()
        self.streams[request_id] = stream
        self.num_queued_adds += 1
        self.intake.put_nowait(
            _Add(request_id, prompt, params, priority, stream, accepted, output_kind, lora_request)
        )
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """A constrained request waits here, off the step loop, while its grammar compiles on
        the compiler's thread; a bad schema, regex or grammar, or a compile still unfinished at
        the deadline, raises InvalidRequestError naming the request's field before the engine
        sees the request."""
        spec = params.structured_outputs
        if spec is None:
            return
        future = self.engine.prepare_structured_output(params)
        if future is None:
            return
        try:
            if not future.done():
                await self._wait_for_compile(future, spec.field)
            future.result()  # a failed compile's InvalidRequestError
        finally:
            self.engine.release_structured_output(future)

    async def _wait_for_compile(self, future: concurrent.futures.Future, field: str) -> None:
        self.num_compiling += 1
        try:
            # Shielded: a client that goes away, or a deadline, must not cancel a compile that
            # other requests with the same grammar share (through the cache); `release` drops
            # it when no one waits any more.
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.compile_timeout
            )
        except TimeoutError:
            raise InvalidRequestError(
                f"{field}: the grammar was not compiled within {self.compile_timeout:g} s "
                "(--structured-outputs-compile-timeout); simplify it or retry later",
                field,
            ) from None
        finally:
            self.num_compiling -= 1

    def abort(self, request_id: str) -> None:
        """Abort a request that has not finished; freed within one step."""
        stream = self.streams.get(request_id)
        if stream is not None and not stream.finished:
            self.intake.put_nowait(_Abort(request_id))

    async def call_between_steps(self, call):
        """`call(engine)`'s result, run on the step loop while no step runs (what it raises is
        raised here). Raises EngineDeadError."""
        if self.dead_error is not None:
            raise EngineDeadError(ENGINE_DEAD)
        done = asyncio.get_running_loop().create_future()
        self.intake.put_nowait(_EngineCall(call, done))
        return await done

    async def reset_prefix_cache(self) -> bool:
        """Clear the engine's prefix cache between two steps (the step loop does it, never
        while a step runs). Raises EngineDeadError."""
        if self.dead_error is not None:
            raise EngineDeadError(ENGINE_DEAD)
        done = asyncio.get_running_loop().create_future()
        self.intake.put_nowait(_ResetPrefixCache(done))
        return await done

    async def _log_stats(self) -> None:
        """Every interval, one line from the latest stats snapshot (the step loop refreshes it
        after each step), as vLLM's API server does."""
        while True:
            await asyncio.sleep(self.stat_logger.interval)
            self.stat_logger.log(self.stats)

    # ---- the step loop --------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self.intake.empty() and not self.engine.has_unfinished_requests():
                    await self._take(await self.intake.get())
                while not self.intake.empty():
                    await self._take(self.intake.get_nowait())
                if not self.engine.has_unfinished_requests():
                    self.stats = self.engine.stats()
                    continue
                try:
                    outputs = await loop.run_in_executor(self._step_thread, self.engine.step)
                except StepError as error:
                    self.consecutive_step_errors += 1
                    if self.consecutive_step_errors >= MAX_CONSECUTIVE_STEP_ERRORS:
                        raise
                    self._fail_requests(
                        error.request_ids,
                        error,
                        "error",
                        {output.request_id: output for output in error.outputs},
                    )
                    self.stats = self.engine.stats()
                    continue
                self.consecutive_step_errors = 0
                self._dispatch(outputs)
                self.stats = self.engine.stats()
                if not self.overlap_streaming:
                    # Let the woken handlers send their chunks before the next step starts.
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine step failed; the engine is dead")
            self._die(exc)

    async def _take(self, item: _Add | _Abort | _ResetPrefixCache | _EngineCall) -> None:
        """Handle one intake item between steps. What may read files (an engine call, a
        request whose LoRA adapter the engine does not hold) runs on the step thread, so the
        event loop answers meanwhile; the next step waits for it."""
        if isinstance(item, _EngineCall):
            if not item.done.done():
                try:
                    result = await self._on_step_thread(item.call, self.engine)
                except Exception as error:  # the caller's to report
                    if not item.done.done():
                        item.done.set_exception(error)
                else:
                    if not item.done.done():
                        item.done.set_result(result)
            return
        if (
            isinstance(item, _Add)
            and item.lora_request is not None
            and not item.accepted.done()
            and item.lora_request.lora_int_id not in self.engine.loras
        ):
            try:  # read now; add_request then finds it held
                await self._on_step_thread(self.engine.add_lora, item.lora_request)
            except Exception as exc:  # a bad adapter: InvalidRequestError naming what is wrong
                self.num_queued_adds -= 1
                self.streams.pop(item.request_id, None)
                if not item.accepted.done():
                    item.accepted.set_exception(exc)
                return
        self._handle(item)

    async def _on_step_thread(self, fn, *args):
        """fn(*args) on the thread that runs the steps (torch's one thread: see
        new_step_executor); no step runs meanwhile, since the step loop awaits it."""
        return await asyncio.get_running_loop().run_in_executor(self._step_thread, fn, *args)

    def _handle(self, item: _Add | _Abort | _ResetPrefixCache) -> None:
        if isinstance(item, _ResetPrefixCache):
            if not item.done.done():
                item.done.set_result(self.engine.reset_prefix_cache())
            return
        if isinstance(item, _Abort):
            if item.already_failed:
                self.engine.abort_request(item.request_id)
                return
            stream = self.streams.pop(item.request_id, None)
            if stream is None or stream.finished:
                return
            aborted = self.engine.abort_request(item.request_id)
            stream.finished = True  # its reader (if still there) sees the stream end
            stream.event.set()
            self._observe_finished(stream, aborted[0] if aborted else None, "abort")
            return
        self.num_queued_adds -= 1
        if item.accepted.done():  # the caller gave up while queued (abort follows)
            self.streams.pop(item.request_id, None)
            return
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt,
                item.params,
                item.priority,
                arrival_time=item.stream.arrival_time,
                output_kind=item.output_kind,
                lora_request=item.lora_request,
            )
        except Exception as exc:  # user-facing validation errors
            self.streams.pop(item.request_id, None)
            item.accepted.set_exception(exc)
            return
        item.accepted.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        observer = self.observer
        step_tokens = 0  # prompt tokens computed by prefills that finished, plus new tokens
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            num_generated = output.metrics.num_generation_tokens  # whatever the output kind
            if num_generated > stream.num_generated:
                step_tokens += num_generated - stream.num_generated
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    step_tokens += len(output.prompt_token_ids) - output.num_cached_tokens
                    if observer is not None:
                        observer.on_first_token(output.request_id, now - stream.arrival_time)
                elif observer is not None:
                    observer.on_token_gap(now - stream.last_token_time)
                stream.last_token_time = now
                stream.num_generated = num_generated
            stream.put(output)
            if output.finished:
                del self.streams[output.request_id]
                generated = isinstance(output, RequestOutput) and output.outputs  # not pooled
                reason = (output.outputs[0].finish_reason if generated else None) or "stop"
                self._observe_finished(stream, output, reason, now)
        if observer is not None and step_tokens:
            observer.on_step(step_tokens)

    def _observe_finished(
        self,
        stream: RequestStream,
        output: RequestOutput | None,
        reason: str,
        now: float | None = None,
    ) -> None:
        if self.observer is None:
            return
        now = time.time() if now is None else now
        e2e = now - stream.arrival_time
        params = (
            stream.params if isinstance(stream.params, SamplingParams) else None
        )  # None: pooling
        n = params.n if params is not None else 1
        if output is None:  # never reached the engine
            self.observer.on_finished(
                FinishedRequestStats(
                    reason,
                    e2e,
                    0,
                    0,
                    0,
                    0,
                    n,
                    params.max_tokens if params else None,
                    0,
                    e2e,
                    0.0,
                    0.0,
                    0.0,
                    0.0,
                )
            )
            return
        num_prompt = len(output.prompt_token_ids)
        max_tokens = params.max_tokens if params is not None else None
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - num_prompt
        metrics = output.metrics
        scheduled = metrics.first_scheduled_time if metrics else None
        first = metrics.first_token_time if metrics else None
        last = metrics.last_token_time if metrics else None
        queued = (scheduled if scheduled is not None else now) - stream.arrival_time
        prefill = (first - scheduled) if first is not None and scheduled is not None else 0.0
        decode = (last - first) if last is not None and first is not None else 0.0
        inference = (last - scheduled) if last is not None and scheduled is not None else 0.0
        # The engine's counts: a DELTA output's token ids are the last delta's only.
        total = metrics.num_generation_tokens if metrics else 0
        generated = metrics.max_num_generation_tokens if metrics else 0
        self.observer.on_finished(
            FinishedRequestStats(
                reason,
                e2e,
                num_prompt,
                output.num_cached_tokens,
                total,
                generated,
                n,
                max_tokens,
                metrics.num_preemptions if metrics else 0,
                max(queued, 0.0),
                max(prefill, 0.0),
                max(decode, 0.0),
                max(inference, 0.0),
                decode / (generated - 1) if generated > 1 else 0.0,
            )
        )

    def _fail_requests(
        self,
        request_ids: list[str],
        error: BaseException,
        reason: str = "abort",
        outputs: dict[str, RequestOutput] | None = None,
    ) -> None:
        """The engine already dropped (or will drop) these requests; their readers get the
        error."""
        for request_id in request_ids:
            stream = self.streams.pop(request_id, None)
            if stream is None:
                continue
            stream.fail(error)
            self._observe_finished(stream, (outputs or {}).get(request_id), reason)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight (shutdown's grace period ran out); the engine drops them
        within one step."""
        request_ids = [rid for rid, stream in self.streams.items() if not stream.finished]
        self._fail_requests(request_ids, error)
        for request_id in request_ids:
            self.intake.put_nowait(_Abort(request_id, already_failed=True))

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        error = EngineDeadError(ENGINE_DEAD)  # the cause is in the log, not sent to clients
        while not self.intake.empty():
            item = self.intake.get_nowait()
            if isinstance(item, _Add) and not item.accepted.done():
                item.accepted.set_exception(error)
            elif isinstance(item, (_ResetPrefixCache, _EngineCall)) and not item.done.done():
                item.done.set_exception(error)
        for stream in self.streams.values():
            stream.fail(error)
        self.streams.clear()
