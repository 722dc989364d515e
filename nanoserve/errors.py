"""User-facing request errors raised below the server (engine, sampling params), and a failed
step's requests."""

from __future__ import annotations

from nanoserve.outputs import RequestOutput


class InvalidRequestError(ValueError):
    """A request the engine refuses. `param` names the request field to blame (the OpenAI error
    body's `param`); None when no single field is at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StepError(RuntimeError):
    """A step failed because of what the requests in it asked for (not a dead device or rank).
    Those requests were aborted; the engine serves on. `request_ids`: the requests that failed."""

    def __init__(
        self,
        request_ids: list[str],
        cause: BaseException,
        outputs: list[RequestOutput] | None = None,
    ) -> None:
        super().__init__(f"the request failed during a model step: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause
        self.outputs = outputs or []  # the failed requests' last state (finish reason "abort")


def is_device_fault(error: BaseException) -> bool:
    """A fault that leaves the device unusable for every request (a CUDA error poisons the
    context), as opposed to one request's bad input."""
    # Imported here: `import nanoserve` (errors.py among its modules) must not load torch before
    # the entry points set the OpenMP spin (envs.set_openmp_spin_default); a step has loaded it.
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return "CUDA error" in str(error) or "device-side assert" in str(error)
