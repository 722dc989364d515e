"""Builds the per-step SamplingBatch tensors from the sequences that sample this step, as the
step's SamplingInputs describe them (engine/step_input.py; never the live sequences).
Tensors that no sequence needs stay None, so the common case (greedy or plain temperature)
costs nothing extra."""

from __future__ import annotations

import torch

from nanoserve.engine.model_input import ModelInput
from nanoserve.engine.step_input import SamplingInput
from nanoserve.engine.structured_output import GrammarCompiles
from nanoserve.layers.sampler import SamplingBatch


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device. To CUDA through pinned memory and a non-blocking copy, so
    building a batch never waits for the forward pass queued before it."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _token_matrix(rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[S, V] float counts of each token per row, built with one scatter_add."""
    counts = torch.zeros(len(rows), vocab_size)
    width = max((len(r) for r in rows), default=0)
    if width:
        index = torch.zeros(len(rows), width, dtype=torch.long)
        ones = torch.zeros(len(rows), width)
        for i, row in enumerate(rows):
            index[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            ones[i, : len(row)] = 1
        counts.scatter_add_(1, index, ones)
    return counts


def _logit_bias(
    inputs: list[SamplingInput], vocab_size: int, eos_token_ids: set[int]
) -> torch.Tensor | None:
    """[rows, vocab] additive biases: each request's logit_bias, and -inf on its stop and EOS
    tokens until min_tokens are out. The entries are gathered by list extends (no Python work
    per entry) and written by two index_put_ calls for the whole batch: one tensor store per
    entry cost ~6 ms a step for a 300-entry logit_bias."""
    rows, cols, values, blocked_rows, blocked_cols = [], [], [], [], []
    for row, item in enumerate(inputs):
        p = item.params
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
        if item.num_output_tokens < p.min_tokens:
            blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))
            blocked_rows += [row] * len(blocked)
            blocked_cols += blocked
    if not rows and not blocked_rows:
        return None
    logit_bias = torch.zeros(len(inputs), vocab_size)
    for index_rows, index_cols, value in ((rows, cols, values), (blocked_rows, blocked_cols, None)):
        if not index_rows:
            continue
        row_ids = torch.tensor(index_rows, dtype=torch.long)
        col_ids = torch.tensor(index_cols, dtype=torch.long)
        keep = (col_ids >= 0) & (col_ids < vocab_size)  # the engine refused others; kept safe
        if value is None:
            logit_bias[row_ids[keep], col_ids[keep]] = float("-inf")
        else:
            biases = torch.tensor(value, dtype=torch.float32)[keep]
            logit_bias.index_put_((row_ids[keep], col_ids[keep]), biases, accumulate=True)
    return logit_bias


def build_sampling_batch(
    inputs: list[SamplingInput],
    device: torch.device,
    vocab_size: int,
    eos_token_ids: set[int],
    default_generator: torch.Generator,
) -> SamplingBatch | None:
    if not inputs:
        return None
    params = [item.params for item in inputs]
    temperature = [p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temperature)
    use_top_p = not all_greedy and any(p.top_p < 1.0 for p in params)
    use_top_k = not all_greedy and any(p.top_k > 0 for p in params)
    use_min_p = not all_greedy and any(p.min_p > 0.0 for p in params)
    use_presence = any(p.presence_penalty != 0.0 for p in params)
    use_frequency = any(p.frequency_penalty != 0.0 for p in params)
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)

    output_counts = prompt_mask = None
    if use_presence or use_frequency or use_repetition:
        output_counts = _to_device(
            _token_matrix([item.output_token_ids for item in inputs], vocab_size), device
        )
    if use_repetition:
        prompt_mask = _to_device(
            _token_matrix([item.prompt_token_ids for item in inputs], vocab_size) > 0,
            device,
        )

    logit_bias = _logit_bias(inputs, vocab_size, eos_token_ids)
    max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    return SamplingBatch(
        temperature=_column(temperature, torch.float32, device),
        top_p=_column([p.top_p for p in params], torch.float32, device) if use_top_p else None,
        top_k=_column([p.top_k for p in params], torch.long, device) if use_top_k else None,
        min_p=_column([p.min_p for p in params], torch.float32, device) if use_min_p else None,
        presence_penalty=_column([p.presence_penalty for p in params], torch.float32, device)
        if use_presence
        else None,
        frequency_penalty=_column([p.frequency_penalty for p in params], torch.float32, device)
        if use_frequency
        else None,
        repetition_penalty=_column([p.repetition_penalty for p in params], torch.float32, device)
        if use_repetition
        else None,
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        logit_bias=_to_device(logit_bias, device) if logit_bias is not None else None,
        generators=[item.generator for item in inputs],
        default_generator=default_generator,
        all_greedy=all_greedy,
        max_logprobs=max_logprobs,
    )


class SamplingBatches:
    """The engine's sampler batches, with its defaults: for any rows (one per sequence given),
    or for a step's sampling rows with the bitmask of its constrained ones."""

    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: set[int],
        generator: torch.Generator,
        grammars: GrammarCompiles,
    ) -> None:
        self.device, self.vocab_size, self.eos_token_ids = device, vocab_size, eos_token_ids
        self.generator, self.grammars = generator, grammars

    def rows(self, inputs: list[SamplingInput]) -> SamplingBatch | None:
        return build_sampling_batch(
            inputs, self.device, self.vocab_size, self.eos_token_ids, self.generator
        )

    def step(self, model_input: ModelInput) -> SamplingBatch | None:
        """The constrained rows' matchers only advance when this step's tokens are appended,
        so the batch may be built at launch (pipeline parallelism)."""
        inputs = [item.sampling for item in model_input.sampling_inputs]
        sampling = self.rows(inputs)
        if sampling is not None and self.grammars.manager is not None:
            self.grammars.manager.constrain(sampling, inputs, self.device)
        return sampling
