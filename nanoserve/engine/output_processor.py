"""What a step's sampled tokens do to their sequences, and the outputs that go back: logprob
entries, stop checks (ids, EOS, grammar, length, stop strings), incremental detokenizing, and
RequestOutputs as the request asked for them (cumulative, deltas, or the final one only).

A part of LLMEngine, kept in its own file: the methods read the engine's tokenizer, schedulers,
eos_token_ids, max_model_len and generation_tokens_total."""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import Request

logger = logging.getLogger(__name__)


class OutputProcessing:
    def _logprob_rows(self, result) -> list[tuple[int, list[int], list[float]]] | None:
        """Per sampled row: (rank of the sampled token, [sampled id, top ids...], [their logprobs])."""
        if result.logprobs is None:
            return None
        return list(zip(result.ranks.tolist(), result.logprob_token_ids.tolist(), result.logprobs.tolist()))

    @functools.cached_property
    def _token_text(self):
        """One token's text, as logprobs show it (decoded alone, special tokens kept); cached."""
        decode = self.tokenizer.decode
        return functools.lru_cache(maxsize=1 << 17)(
            lambda token: decode([token], skip_special_tokens=False))

    def _logprob_entry(self, rank: int, ids: list[int], values: list[float],
                       num_top: int) -> dict[int, Logprob]:
        """The given token first (as vLLM orders it), then the top `num_top` by rank."""
        text = self._token_text
        entry = {ids[0]: Logprob(values[0], rank, text(ids[0]))}
        for position in range(1, 1 + num_top):
            entry.setdefault(ids[position], Logprob(values[position], position, text(ids[position])))
        return entry

    def _append_prompt_logprobs(self, seqs: list[tuple[Sequence, int]], tensors) -> None:
        values, ids, ranks = tensors.logprobs.tolist(), tensors.token_ids.tolist(), tensors.ranks.tolist()
        row = 0
        for seq, num_rows in seqs:
            for r in range(row, row + num_rows):
                seq.prompt_logprobs.append(self._logprob_entry(ranks[r], ids[r], values[r],
                                                               seq.params.prompt_logprobs))
            row += num_rows

    def _append_token(self, seq: Sequence, token: int, logprob_row) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The grammar allowed nothing it could take (min_tokens or a logit bias had masked
            # its stop tokens): end the output where the grammar ended it.
            logger.warning("request %s: token %d does not fit its grammar; finishing it",
                           seq.request_id, token)
            seq.text += seq.detokenizer.flush()
            seq.finish_reason = "stop"
            self.schedulers[seq.virtual_engine].remove(seq)
            seq.status = SequenceStatus.FINISHED
            return
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        params = seq.params
        if logprob_row is not None and params.logprobs is not None:
            rank, ids, values = logprob_row
            seq.cumulative_logprob += values[0]
            seq.logprobs.append(self._logprob_entry(rank, ids, values, params.logprobs))
        num_out = seq.num_output_tokens
        reason = stop_reason = None
        if num_out >= params.min_tokens:
            if token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif not params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated:
            reason = "stop"  # the grammar is complete (it took a stop token)
        if reason is None and (num_out >= max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        delta = seq.detokenizer.step([token])
        if reason is not None:
            delta += seq.detokenizer.flush()  # text held back for an unfinished character
        seq.text += delta
        if params.stop and delta and num_out >= params.min_tokens:
            stop_reason_text, stop = self._check_stop_strings(seq, len(delta))
            if stop_reason_text is not None:
                reason, stop_reason = stop_reason_text, stop
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.schedulers[seq.virtual_engine].remove(seq)
            seq.status = SequenceStatus.FINISHED

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> tuple[str | None, str | None]:
        params = seq.params
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(seq.text) - delta_len - longest + 1)
        best = None
        for stop in params.stop:
            index = seq.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None, None
        index, stop = best
        seq.text = seq.text[: index + len(stop)] if params.include_stop_str_in_output else seq.text[:index]
        return "stop", stop

    def _make_output(self, request: Request, kind: RequestOutputKind | None = None) -> RequestOutput | None:
        """The request's output of its kind; None when there is nothing to send (FINAL_ONLY
        before the end, DELTA with nothing new)."""
        kind = request.output_kind if kind is None else kind
        if kind is RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        with_logprobs = request.params.logprobs is not None
        if kind is RequestOutputKind.DELTA:
            outputs = [output for seq in request.seqs
                       if (output := self._delta(seq, request.holdback, with_logprobs)) is not None]
            if not outputs and not request.finished:
                return None
        else:
            outputs = [
                CompletionOutput(
                    index=seq.index,
                    text=seq.text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
                    logprobs=list(seq.logprobs) if with_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason)
                for seq in request.seqs
            ]
        first = request.seqs[0]
        prompt_logprobs = None if first.needs_prompt_logprobs else first.prompt_logprobs
        request.metrics.num_preemptions = sum(seq.num_preemptions for seq in request.seqs)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, request.metrics, request.metrics.num_cached_tokens,
                             prompt_logprobs)

    @staticmethod
    def _delta(seq: Sequence, holdback: int, with_logprobs: bool) -> CompletionOutput | None:
        """What of one sequence is new since its last delta (None: nothing). Until it finishes,
        the last `holdback` characters stay back: a stop string may still begin in them."""
        if seq.finish_sent:
            return None
        finished = seq.finish_reason is not None
        num_output = seq.num_output_tokens
        text_end = len(seq.text) if finished else max(seq.num_chars_sent, len(seq.text) - holdback)
        if not finished and num_output == seq.num_tokens_sent and text_end == seq.num_chars_sent:
            return None
        sent = seq.num_tokens_sent
        output = CompletionOutput(
            index=seq.index,
            text=seq.text[seq.num_chars_sent:text_end],
            token_ids=seq.token_ids[seq.num_prompt_tokens + sent:],
            cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
            logprobs=seq.logprobs[sent:] if with_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason)
        seq.num_tokens_sent, seq.num_chars_sent, seq.finish_sent = num_output, text_end, finished
        return output
