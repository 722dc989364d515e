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


# Rows up to which a quantized linear layer's Triton GEMM is the dequantize-in-registers GEMV
# (kernels/quant_triton.py's _quant_gemv_kernel: every weight read once, no tl.dot) rather than
# the tiled GEMM: a decode step's rows (one a sequence; a few with speculative verification).
GEMV_MAX_ROWS = 4


def gemv_rows(m: int) -> bool:
    """Whether m activation rows take the quantized GEMV (else the tiled dequantize-GEMM)."""
    return m <= GEMV_MAX_ROWS
