"""Lazy Triton: kernels stay plain Python functions until their first launch.

Importing a kernel module must not import Triton: CPU users never pay for it, the GPU box may
carry an older Triton than the development venv, and tests set ``TRITON_INTERPRET=1`` before
the first launch (Triton decides between compiling and interpreting when ``triton.jit`` runs).
Each kernel module declares a module global ``tl = None``; on the first launch of any kernel of
that module, ``tl`` is bound to ``triton.language`` and the function is wrapped by ``triton.jit``.
Kernel parameters annotated ``tl.constexpr`` are strings under ``from __future__ import
annotations``, which Triton accepts.

Why not ``@triton.jit`` with ``import triton.language as tl`` at the top, as Triton readers
expect (measured for issue 14, triton 3.9, torch CPU venv, a 2-core shared machine, 8 runs
each): importing the server and engine (nanoserve.server.api_server + engine.llm_engine) took a
median 1.48 s lazily and 1.55 s with triton imported first; ``-X importtime`` puts triton at
~110 ms on top of torch. That alone (~5% of the import, less of the startup to /health, which
also loads the weights) would not pay for the indirection. What does: triton is a Linux-only
dependency (pyproject), so a top-level import would make the CPU path need a working triton it
never runs; and ``triton.jit`` picks interpreter or compiler when it decorates, so an eager
decorator would fix that choice at the first ``import nanoserve`` rather than the first launch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from nanoserve import envs
from nanoserve.kernels.kv_dtype import FP8_BITS, FP8_MAX

_lock = threading.Lock()


def import_triton():
    import triton
    import triton.language  # noqa: F401  (binds triton.language)

    return triton


class LazyKernel:
    """``kernel[grid](*args, num_warps=..)`` like a JITFunction, compiled on first use."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._jitted = None

    def jitted(self):
        if self._jitted is None:
            with _lock:
                if self._jitted is None:
                    triton = import_triton()
                    self.fn.__globals__["tl"] = triton.language
                    self._jitted = triton.jit(self.fn)
        return self._jitted

    def __getitem__(self, grid):
        return self.jitted()[grid]


def lazy_jit(fn: Callable) -> LazyKernel:
    return LazyKernel(fn)


def bind_helpers(namespace: dict, *names: str) -> None:
    """A kernel calls its @lazy_jit helpers by their global names: make those names the jitted
    functions (before the kernel's first compile)."""
    for name in names:
        if hasattr(namespace[name], "jitted"):
            namespace[name] = namespace[name].jitted()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_triton_device(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CPU only under the interpreter. Returns the device."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {device} and {t.device}")
    if device.type != "cuda" and not envs.triton_interpret():
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); on a CPU set TRITON_INTERPRET=1 "
            "before the first Triton kernel runs, or use NANOSERVE_KERNELS=reference"
        )
    return device


def check_kv_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, num_kv_heads, head_dim] with one shape and strides."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache must be the same 4-D shape [num_blocks, "
            f"block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)} "
            f"and {tuple(value_cache.shape)}"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int] | None:
    """(largest finite value, mantissa bits, exponent bias) of an fp8 cache dtype; None for others."""
    if dtype not in FP8_MAX:
        return None
    return (FP8_MAX[dtype], *FP8_BITS[dtype])


def check_cache_dtype(name: str, tensor: torch.Tensor) -> None:
    """A KV cache may also be fp8 (kernels/kv_dtype.py); what is written to it or read from it may not."""
    if fp8_format(tensor.dtype) is None and tensor.dtype not in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ):
        raise ValueError(
            f"{name} must be float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, "
            f"got {tensor.dtype}"
        )


def check_int_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")


_sm_counts: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """SM count of a CUDA device; a small stand-in for the interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]
