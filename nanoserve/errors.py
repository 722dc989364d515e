"""User-facing request errors raised below the server (engine, sampling params)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses. `param` names the request field to blame (the OpenAI error
    body's `param`); None when no single field is at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
