"""The KV cache's element type (``--kv-cache-dtype``, as vLLM names it).

``auto`` keeps K and V in the activations' dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store
them as torch's ``float8_e4m3fn`` / ``float8_e5m2`` with a scale of 1.0 (what vLLM uses when a
checkpoint carries no calibrated K/V scales): half the bytes of bf16, so twice the tokens in the
same memory and half the bytes for decode attention to read.

The arithmetic every kernel follows (the torch reference writes it in ``to_cache``): a value
stored is the input clamped to the format's largest finite value (saturation, as vLLM's CUDA
kernels convert with SATFINITE; NaN stays NaN), then rounded to nearest even. Attention reads a
stored value back into the query's dtype, which holds every fp8 value exactly, and then does
what it does on a bf16 (or fp32) cache: an fp8 kernel's output is, bit for bit, the same kernel's
on a cache in the query's dtype holding the same values.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_BITS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # mantissa bits, exponent bias
# The C++ kernels' code for a pool's elements (kernels/cpu/fp8.h): 0 the activations' dtype.
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def cache_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """The pool's torch dtype for a ``--kv-cache-dtype`` name; ValueError naming the supported
    ones for any other."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv_cache_dtype {name!r}; supported: {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name] or activation_dtype


def fused_decode_kv_format(dtype: torch.dtype) -> int | None:
    """kernels/cpu/decode_layers.cpp's kv_format for pools of `dtype` (0: bf16), None for another."""
    return 0 if dtype == torch.bfloat16 else FP8_CODES.get(dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: saturated and rounded to nearest even for an fp8 cache."""
    if dtype in FP8_DTYPES:
        limit = FP8_MAX[dtype]
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def from_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached values in ``dtype`` (exact from fp8 into bf16, fp16 or fp32)."""
    return cache if cache.dtype == dtype else cache.to(dtype)
