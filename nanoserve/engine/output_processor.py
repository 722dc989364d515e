"""What a step's sampled tokens do to their sequences, and the outputs that go back: logprob
entries, stop checks (ids, EOS, grammar, length, stop strings), incremental detokenizing, and
RequestOutputs as the request asked for them (cumulative, deltas, or the final one only).

As vLLM v1's `OutputProcessor`, an object with its own state (the tokenizer's token texts, the
token totals, each sequence's OutputState: detokenizer, text, logprobs, what was sent) that
touches only the requests and sequences it is handed: `process` returns the sequences that
finished, and the engine frees them in their own virtual engine's scheduler.
The stop checks are plain functions (`check_stop`, `check_stop_strings`)."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from nanoserve.engine.output_state import OutputState
from nanoserve.engine.request import Request
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.layers.sampler import LogprobsTensors, SamplerOutput
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

# Per sampled row: (rank of the sampled token, [sampled id, top ids...], [their logprobs]).
LogprobRow = tuple[int, list[int], list[float]]


def check_stop(
    seq: Sequence, token: int, eos_token_ids: set[int], max_model_len: int
) -> tuple[str | None, int | None]:
    """Why `token`, just appended, ends `seq`, by id: (finish reason, stop reason) or
    (None, None). Stop strings are checked on the text afterwards (`check_stop_strings`)."""
    params = seq.params
    num_out = seq.num_output_tokens
    if num_out >= params.min_tokens:
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
    if seq.grammar is not None and seq.grammar.is_terminated:
        return "stop", None  # the grammar is complete (it took a stop token)
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    if num_out >= max_tokens or seq.num_tokens >= max_model_len:
        return "length", None
    return None, None


def check_stop_strings(
    state: OutputState, params: SamplingParams, delta_len: int
) -> tuple[str | None, str | None]:
    """The earliest stop string in the text the last `delta_len` characters could complete:
    ("stop", it), with the text cut at it (kept when the request says so); else (None, None)."""
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(state.text) - delta_len - longest + 1)
    best = None
    for stop in params.stop:
        index = state.text.find(stop, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None, None
    index, stop = best
    state.text = (
        state.text[: index + len(stop)] if params.include_stop_str_in_output else state.text[:index]
    )
    return "stop", stop


@dataclass(slots=True)
class ProcessedStep:
    """What one step's tokens did: the sequences that finished (to be freed by their
    scheduler), the requests whose every sequence finished (to leave the engine's table), and
    the outputs to hand back."""

    finished_seqs: list[Sequence] = field(default_factory=list)
    finished_requests: list[Request] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # Totals since start (the engine's stats).
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0
        self.generation_tokens_total = 0
        # Vision-language models: the images of prompts, and their tokens (in prompt_tokens too).
        self.prompt_images_total = 0
        self.prompt_image_tokens_total = 0

    def process(
        self,
        requests: dict[str, Request],
        sampling_seqs: list[Sequence],
        result: SamplerOutput | None,
        prompt_logprob_seqs: list[tuple[Sequence, int]],
        spec_seqs: list[Sequence] = (),
    ) -> ProcessedStep:
        """Append one step's sampled tokens (row i is `sampling_seqs[i]`), its prompt logprobs,
        and the tokens each verified sequence (`spec_seqs`, result.spec) emits, one at a time
        with every stop check, as if decoded one per step. A sequence finished before (aborted
        while its step was in flight under pipeline parallelism) is skipped."""
        step = ProcessedStep()
        if result is None:
            return step
        if result.prompt_logprobs is not None:
            self._append_prompt_logprobs(prompt_logprob_seqs, result.prompt_logprobs)
        token_ids = result.token_ids.tolist()
        logprob_rows = self._logprob_rows(result)
        progressed: dict[str, Request] = {}
        for row, seq in enumerate(sampling_seqs):
            if seq.is_finished:  # aborted while in flight
                continue
            request = requests[seq.request_id]
            self.count_prompt(request, seq)
            logprob_row = logprob_rows[row] if logprob_rows else None
            if self._append_token(request, seq, token_ids[row], logprob_row):
                step.finished_seqs.append(seq)
            progressed[seq.request_id] = request
        for seq, emitted in zip(spec_seqs, result.spec or ()):
            if seq.is_finished:
                continue
            request = requests[seq.request_id]
            for token, logprob_row in emitted:
                if self._append_token(request, seq, token, logprob_row):
                    step.finished_seqs.append(seq)
                    break
            progressed[seq.request_id] = request
        now = time.time()
        for request in progressed.values():
            request.record_tokens(now)
            if request.finished:
                step.finished_requests.append(request)
            output = self.make_output(request)
            if output is not None:
                step.outputs.append(output)
        return step

    def count_prompt(self, request: Request, seq: Sequence) -> None:
        """Its prompt tokens into the totals, once per request."""
        if not request.prompt_counted:
            request.prompt_counted = True
            self.prompt_tokens_total += seq.num_prompt_tokens
            self.prompt_tokens_cached_total += request.metrics.num_cached_tokens
            if seq.images:
                self.prompt_images_total += len(seq.images)
                self.prompt_image_tokens_total += sum(image.length for image in seq.images)

    # ---- logprobs ---------------------------------------------------------------------------
    @staticmethod
    def _logprob_rows(result: SamplerOutput) -> list[LogprobRow] | None:
        if result.logprobs is None:
            return None
        return list(
            zip(result.ranks.tolist(), result.logprob_token_ids.tolist(), result.logprobs.tolist())
        )

    @functools.cached_property
    def _token_text(self):
        """One token's text, as logprobs show it (decoded alone, special tokens kept); cached."""
        decode = self.tokenizer.decode
        return functools.lru_cache(maxsize=1 << 17)(
            lambda token: decode([token], skip_special_tokens=False)
        )

    def _logprob_entry(
        self, rank: int, ids: list[int], values: list[float], num_top: int
    ) -> dict[int, Logprob]:
        """The given token first (as vLLM orders it), then the top `num_top` by rank."""
        text = self._token_text
        entry = {ids[0]: Logprob(values[0], rank, text(ids[0]))}
        for position in range(1, 1 + num_top):
            entry.setdefault(
                ids[position], Logprob(values[position], position, text(ids[position]))
            )
        return entry

    def _append_prompt_logprobs(
        self, seqs: list[tuple[Sequence, int]], tensors: LogprobsTensors
    ) -> None:
        values, ids, ranks = (
            tensors.logprobs.tolist(),
            tensors.token_ids.tolist(),
            tensors.ranks.tolist(),
        )
        row = 0
        for seq, num_rows in seqs:
            for r in range(row, row + num_rows):
                seq.prompt_logprobs.append(
                    self._logprob_entry(ranks[r], ids[r], values[r], seq.params.prompt_logprobs)
                )
            row += num_rows

    # ---- one token ----------------------------------------------------------------------------
    def state(self, request: Request, seq: Sequence) -> OutputState:
        """`seq`'s output state, made (for every sequence of the request) when first needed."""
        if not request.output_states:
            request.output_states = [
                OutputState(
                    IncrementalDetokenizer(
                        self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
                    )
                )
                for _ in request.seqs
            ]
        return request.output_states[seq.index]

    def _append_token(
        self, request: Request, seq: Sequence, token: int, logprob_row: LogprobRow | None
    ) -> bool:
        """Append `token` to `seq`, with its text and logprobs; True when it finished `seq`."""
        state = self.state(request, seq)
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The grammar allowed nothing it could take (min_tokens or a logit bias had masked
            # its stop tokens): end the output where the grammar ended it.
            logger.warning(
                "request %s: token %d does not fit its grammar; finishing it", seq.request_id, token
            )
            state.text += state.detokenizer.flush()
            seq.finish_reason = "stop"
            seq.status = SequenceStatus.FINISHED
            return True
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        params = seq.params
        if logprob_row is not None and params.logprobs is not None:
            rank, ids, values = logprob_row
            state.cumulative_logprob += values[0]
            state.logprobs.append(self._logprob_entry(rank, ids, values, params.logprobs))
        reason, stop_reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
        if (
            reason == "stop"
            and not params.include_stop_str_in_output
            and (token in params.stop_token_ids or token in self.eos_token_ids)
        ):
            # A stop token's own text stays out of the output, as vLLM's (it shows when special
            # tokens are kept: a tool parser's, or skip_special_tokens=false).
            delta = state.detokenizer.flush()
        else:
            delta = state.detokenizer.step([token])
            if reason is not None:
                delta += state.detokenizer.flush()  # text held back for an unfinished character
        state.text += delta
        if params.stop and delta and seq.num_output_tokens >= params.min_tokens:
            stop_reason_text, stop = check_stop_strings(state, params, len(delta))
            if stop_reason_text is not None:
                reason, stop_reason = stop_reason_text, stop
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        return True

    # ---- outputs ------------------------------------------------------------------------------
    def make_output(
        self, request: Request, kind: RequestOutputKind | None = None
    ) -> RequestOutput | None:
        """The request's output of its kind; None when there is nothing to send (FINAL_ONLY
        before the end, DELTA with nothing new)."""
        kind = request.output_kind if kind is None else kind
        if kind is RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        with_logprobs = request.params.logprobs is not None
        if kind is RequestOutputKind.DELTA:
            outputs = [
                output
                for seq in request.seqs
                if (
                    output := _delta(seq, self.state(request, seq), request.holdback, with_logprobs)
                )
                is not None
            ]
            if not outputs and not request.finished:
                return None
        else:
            outputs = [
                _cumulative(seq, self.state(request, seq), with_logprobs) for seq in request.seqs
            ]
        first = request.seqs[0]
        prompt_logprobs = None if first.needs_prompt_logprobs else first.prompt_logprobs
        request.update_counts()
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            request.finished,
            request.metrics,
            request.metrics.num_cached_tokens,
            prompt_logprobs,
            lora_request=request.lora_request,
        )


def _cumulative(seq: Sequence, state: OutputState, with_logprobs: bool) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=state.text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=state.cumulative_logprob if with_logprobs else None,
        logprobs=list(state.logprobs) if with_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def _delta(
    seq: Sequence, state: OutputState, holdback: int, with_logprobs: bool
) -> CompletionOutput | None:
    """What of one sequence is new since its last delta (None: nothing). Until it finishes,
    the last `holdback` characters stay back: a stop string may still begin in them."""
    if state.finish_sent:
        return None
    finished = seq.finish_reason is not None
    num_output = seq.num_output_tokens
    text = state.text
    text_end = len(text) if finished else max(state.num_chars_sent, len(text) - holdback)
    if not finished and num_output == state.num_tokens_sent and text_end == state.num_chars_sent:
        return None
    sent = state.num_tokens_sent
    output = CompletionOutput(
        index=seq.index,
        text=text[state.num_chars_sent : text_end],
        token_ids=seq.token_ids[seq.num_prompt_tokens + sent :],
        cumulative_logprob=state.cumulative_logprob if with_logprobs else None,
        logprobs=state.logprobs[sent:] if with_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    state.num_tokens_sent, state.num_chars_sent, state.finish_sent = num_output, text_end, finished
    return output
