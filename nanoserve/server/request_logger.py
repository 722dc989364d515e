"""vLLM's request log (--enable-log-requests): one INFO line per request the engine is given,
with its id, prompt length and sampling (or pooling) params. The prompt itself goes only to a
DEBUG line, cut to --max-log-len characters and token ids (None: all of it, vLLM's default)."""

from __future__ import annotations

import logging

from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger("nanoserve.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
    ) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            limit = self.max_log_len
            logger.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s.",
                request_id,
                prompt if prompt is None or limit is None else prompt[:limit],
                prompt_token_ids if limit is None else prompt_token_ids[:limit],
            )
        logger.info(
            "Received request %s: prompt_token_ids_len: %d, priority: %d, params: %s.",
            request_id,
            len(prompt_token_ids),
            priority,
            params,
        )
