"""``NANOSERVE_KERNELS``, read once: at the first dispatch, then cached for the process.

"auto" (the default): CUDA tensors run the Triton kernels, CPU tensors the torch references (and
the C++ CPU kernels); "triton" forces Triton (``TRITON_INTERPRET=1`` on a CPU); "reference"
forces the torch references. Code that changes the variable in a running process (tests) calls
``reset_kernel_choice()`` afterwards so that the next dispatch reads it again.
"""

from __future__ import annotations

from nanoserve import envs

CHOICES = envs.KERNEL_CHOICES

_choice: str | None = None


def kernel_choice() -> str:
    """The cached choice; the first call reads (and checks) the environment."""
    global _choice
    if _choice is None:
        _choice = envs.kernels()
    return _choice


def reset_kernel_choice() -> None:
    """Forget the cached choice: the next dispatch reads ``NANOSERVE_KERNELS`` again."""
    global _choice
    _choice = None
