"""One request in the engine (vLLM v1's `Request`): its prompt, its sampling params, its n
sequences and its metrics. The engine's table of unfinished requests holds these; the output
processor turns them into RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.output_state import OutputState
from nanoserve.engine.sequence import Sequence
from nanoserve.lora.request import LoRARequest
from nanoserve.outputs import RequestMetrics, RequestOutputKind
from nanoserve.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    finished: bool = False
    prompt_counted: bool = False  # its prompt tokens are in the engine's totals
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA: characters of text held back until no stop string can start in them (a stop
    # string is cut from the text, so what went out must never be part of one).
    holdback: int = 0
    lora_request: LoRARequest | None = None
    # The output processor's state of each sequence (by index), made when it first needs it.
    output_states: list[OutputState] = field(default_factory=list)

    @property
    def all_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def record_scheduled(self, seq: Sequence, now: float) -> None:
        """The first time any of its sequences is scheduled: queueing ends, and the prefix
        cache's hits for the prompt are known."""
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
            self.metrics.num_cached_tokens = seq.num_cached_tokens

    def record_tokens(self, now: float) -> None:
        """A step appended tokens to it; marks it finished when every sequence is."""
        metrics = self.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        if self.all_finished:
            self.finished = True
            metrics.finished_time = now

    def update_counts(self) -> None:
        """The figures an output reports that the sequences hold: preemptions and the tokens
        generated so far (all outputs, and the longest one)."""
        metrics = self.metrics
        metrics.num_preemptions = sum(seq.num_preemptions for seq in self.seqs)
        lengths = [seq.num_output_tokens for seq in self.seqs]
        metrics.num_generation_tokens = sum(lengths)
        metrics.max_num_generation_tokens = max(lengths, default=0)


def stop_string_holdback(params: SamplingParams) -> int:
    """How many trailing characters a DELTA output holds back: one less than the longest stop
    string, unless the stop strings are kept in the output."""
    if params.stop and not params.include_stop_str_in_output:
        return max(len(stop) for stop in params.stop) - 1
    return 0
