"""PoolingParams: a pooling (embedding) request's options, as vLLM's (no torch here: clients
import it cheaply, as SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    """Per request: `dimensions` keeps the first N (Matryoshka) before normalizing; `normalize`
    None takes the model's."""

    dimensions: int | None = None
    normalize: bool | None = None
