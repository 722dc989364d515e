"""Errors carry their `param` from where they are raised, and map to HTTP statuses in one place
(`to_api_error`): no message text is read to find the field."""

from __future__ import annotations

import pytest

from nanoserve.engine.async_engine import EngineDeadError
from nanoserve.engine.llm_engine import StepError
from nanoserve.errors import InvalidRequestError
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.server.serving import to_api_error


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"seed": 2**70}, "seed"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ],
)
def test_sampling_params_errors_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param and isinstance(caught.value, ValueError)
    error = to_api_error(caught.value)
    assert (error.status, error.param, error.message) == (400, param, str(caught.value))


def test_structured_outputs_errors_name_the_request_field():
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(field="guided_regex", regex=5)
    assert caught.value.param == "guided_regex"


def test_statuses():
    assert to_api_error(InvalidRequestError("too long", "input_tokens")).status == 400
    assert to_api_error(EngineDeadError("gone")).status == 503
    assert to_api_error(StepError(["a"], RuntimeError("x"))).status == 500
    assert to_api_error(RecursionError()).status == 400
    # A plain ValueError is a bug somewhere, not the client's fault: no mapping (500).
    assert to_api_error(ValueError("context length")) is None
