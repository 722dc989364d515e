"""The request fields that constrain the output, as vLLM's OpenAI server accepts them, turned
into one StructuredOutputsParams: OpenAI's `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"schema": ...}}), vLLM's `structured_outputs` object
({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. Shape errors are 400s naming the field; a
schema, regex or grammar that does not compile is the engine's 400 (engine/structured_output.py).
"""

from __future__ import annotations

from typing import Any

from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.server.schemas import APIError, SamplingFields

STRUCTURED_OUTPUTS_KEYS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "disable_any_whitespace",
)
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param)


def _from_response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(
                "response_format of type json_schema needs a `json_schema` object",
                "response_format",
            )
        # OpenAI's field is `schema`; vLLM also takes `json_schema` inside it.
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, str)):
            raise _bad(
                "response_format.json_schema needs a `schema` (a JSON schema object)",
                "response_format",
            )
        return {"json": schema}
    raise _bad(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


def _from_structured_outputs(value: dict[str, Any]) -> dict[str, Any] | None:
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS))
    chosen = {
        key: item
        for key, item in value.items()
        if key in STRUCTURED_OUTPUTS_KEYS and item is not None
    }
    if unknown:
        raise _bad(
            f"structured_outputs supports {', '.join(STRUCTURED_OUTPUTS_KEYS)}; "
            f"{', '.join(unknown)} is not supported",
            "structured_outputs",
        )
    kinds = [
        key for key, item in chosen.items() if key != "disable_any_whitespace" and item is not False
    ]
    return chosen if kinds else None


def structured_outputs_params(request: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint the request asks for, or None; a 400 when it asks for several."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if request.response_format is not None:
        spec = _from_response_format(request.response_format)
        if spec is not None:
            sources.append(("response_format", spec))
    if request.structured_outputs is not None:
        spec = _from_structured_outputs(request.structured_outputs)
        if spec is not None:
            sources.append(("structured_outputs", spec))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            sources.append((name, {key: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise _bad(
            f"Only one kind of structured output may be requested, got {names}", sources[1][0]
        )
    field, spec = sources[0]
    try:
        return StructuredOutputsParams(field=field, **spec)
    except (TypeError, ValueError) as error:
        raise _bad(str(error), field) from None
