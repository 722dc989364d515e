"""A command-line flag whose value is a JSON object (--speculative-config, --pooler-config), or
the same as a dict from LLM(...): parsed, and checked for fields nobody reads."""

from __future__ import annotations

import json
from typing import Any


def json_object_flag(value: str | dict[str, Any], flag: str, known: set[str]) -> dict[str, Any]:
    """`value` as a dict; a ValueError naming `flag` when it is not a JSON object or has a field
    outside `known`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{flag} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{flag}: unknown field(s) {unknown} (known: {sorted(known)})")
    return value
