"""Rotary position embedding, rotate-half layout (as Hugging Face Llama), applied in place."""

from __future__ import annotations

import math

import torch

from nanoserve.kernels.triton_utils import (
    check_float_dtype,
    check_int_dtype,
    check_triton_device,
    lazy_jit,
    next_power_of_2,
)

tl = None  # triton.language, bound on the first Triton launch (see triton_utils)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
) -> torch.Tensor:
    """Returns fp32 [max_position, head_dim]: the first half is cos, the second half sin."""
    kind = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in ("longrope", "su"):
        return _longrope_cache(head_dim, max_position, base, rope_scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    attention = 1.0
    if kind == "yarn":
        inv_freq, attention = _yarn_inv_freq(inv_freq, head_dim, max_position, base, rope_scaling)
    elif rope_scaling is not None:
        inv_freq = _scale_inv_freq(inv_freq, rope_scaling)
    positions = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(positions, inv_freq)
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention).float()


def mrope_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, mrope_section: tuple[int, ...]
) -> torch.Tensor:
    """M-RoPE (Qwen2-VL, Qwen2.5-VL): [rows, rotary_dim], one cos/sin row per token, its
    frequencies split in sections (temporal, height, width: mrope_section, summing to
    rotary_dim / 2) each turned by the token's position of that section. positions: [3, rows].
    Given with positions 0..rows-1 to the rotary kernels, it rotates each row as its own."""
    half = cos_sin_cache.shape[1] // 2
    assert sum(mrope_section) == half and positions.shape[0] == len(mrope_section)
    rows = [cos_sin_cache.index_select(0, p) for p in positions.long()]  # [rows, 2 * half] each
    pieces, start = [], 0
    for section, size in enumerate(mrope_section):
        pieces.append((section, start, start + size))
        start += size
    cos = torch.cat([rows[i][:, a:b] for i, a, b in pieces], dim=1)
    sin = torch.cat([rows[i][:, half + a : half + b] for i, a, b in pieces], dim=1)
    return torch.cat([cos, sin], dim=1)


def _longrope_cache(
    head_dim: int, max_position: int, base: float, rope_scaling: dict
) -> torch.Tensor:
    """Phi-3 / Phi-4-mini's LongRoPE: per-frequency factors, `short_factor` for positions below
    original_max_position_embeddings and `long_factor` from there on (per position, so a token's
    rotation never depends on the batch; transformers picks one set for a whole forward by its
    longest position), and cos/sin scaled by the attention factor."""
    original = int(rope_scaling["original_max_position_embeddings"])
    factor = float(rope_scaling.get("factor") or max_position / original)
    attention = rope_scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    positions = torch.arange(max_position, dtype=torch.float64)
    halves = []
    for name in ("short_factor", "long_factor"):
        factors = torch.tensor(rope_scaling[name], dtype=torch.float64)
        if factors.shape != exponents.shape:
            raise ValueError(
                f"rope_scaling {name} has {factors.numel()} values, expected {exponents.numel()}"
            )
        halves.append(torch.outer(positions, 1.0 / (factors * base**exponents)))
    freqs = torch.where(positions[:, None] < original, halves[0], halves[1])
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * float(attention)).float()


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, max_position: int, base: float, rope_scaling: dict
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 / Qwen3 long context, gpt-oss, DeepSeek): frequencies that turn fewer than
    beta_slow times over the original context are divided by `factor`, those that turn more than
    beta_fast times are kept, a linear ramp (over the frequency index) between. Returns the
    frequencies and the attention factor cos and sin are multiplied by."""
    original = float(rope_scaling.get("original_max_position_embeddings") or max_position)
    factor = float(rope_scaling.get("factor") or max_position / original)
    attention = rope_scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(
        rotations: float,
    ) -> float:  # the dim whose wavelength fits `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(float(rope_scaling.get("beta_fast") or 32))
    high = correction_dim(float(rope_scaling.get("beta_slow") or 1))
    if rope_scaling.get("truncate", True):  # gpt-oss: false
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    # 0: kept (extrapolated), 1: divided by factor (interpolated)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, float(attention)


def _scale_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(rope_scaling.get("high_freq_factor", 4.0))
        original = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = original / low_freq_factor
        high_freq_wavelen = original / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope, yarn)"
    )


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half in place; math in fp32 (cos, sin: [tokens, 1, head_dim / 2])."""
    half = x.shape[-1] // 2
    # copy=True: for fp32 input .float() would alias x, and x1 is overwritten below.
    x1 = x[..., :half].to(torch.float32, copy=True)
    x2 = x[..., half:].to(torch.float32, copy=True)
    x[..., :half].copy_(x1 * cos - x2 * sin)
    x[..., half:].copy_(x2 * cos + x1 * sin)


def _heads_side_by_side(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """When key's heads directly follow query's in the same rows (the model's fused QKV output),
    one [tokens, heads + kv_heads, head_dim] view covers both, so they rotate in one pass."""
    if query.dtype != key.dtype or query.stride(0) != key.stride(0):
        return None
    head_dim = query.shape[2]
    if query.stride()[1:] != (head_dim, 1) or key.stride()[1:] != (head_dim, 1):
        return None
    if key.data_ptr() != query.data_ptr() + query.shape[1] * head_dim * query.element_size():
        return None
    return query.as_strided(
        (query.shape[0], query.shape[1] + key.shape[1], head_dim), query.stride()
    )


def apply_rotary_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim];
    positions: [num_tokens] int. Rotates both in place."""
    head_dim = query.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    cos = cos_sin[:, None, : head_dim // 2]
    sin = cos_sin[:, None, head_dim // 2 :]
    both = _heads_side_by_side(query, key)
    if both is not None:
        _rotate_(both, cos, sin)
        return
    _rotate_(query, cos, sin)
    _rotate_(key, cos, sin)


@lazy_jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    positions_ptr,
    cos_sin_ptr,
    query_stride_token,
    query_stride_head,
    query_stride_dim,
    key_stride_token,
    key_stride_head,
    key_stride_dim,
    cos_sin_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
):
    # One program per token: all its query heads and key heads as [heads, head_dim / 2] tiles,
    # rotate-half layout; only the first half of cos and of sin is loaded.
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    dim_mask = dims < HALF
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + dims, mask=dim_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + dims, mask=dim_mask, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]

    heads = tl.arange(0, HEADS_PADDED)
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    first = (
        query_ptr
        + token * query_stride_token
        + heads[:, None] * query_stride_head
        + dims[None, :] * query_stride_dim
    )
    second = first + HALF * query_stride_dim
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(query_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(query_ptr.dtype.element_ty), mask=mask)

    kv_heads = tl.arange(0, KV_HEADS_PADDED)
    kv_mask = (kv_heads[:, None] < num_kv_heads) & dim_mask[None, :]
    first = (
        key_ptr
        + token * key_stride_token
        + kv_heads[:, None] * key_stride_head
        + dims[None, :] * key_stride_dim
    )
    second = first + HALF * key_stride_dim
    x1 = tl.load(first, mask=kv_mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=kv_mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(key_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(second, (x2 * cos + x1 * sin).to(key_ptr.dtype.element_ty), mask=kv_mask)


def apply_rotary_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Same contract as :func:`apply_rotary_reference`; query and key may be strided views."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query and key must be [num_tokens, heads, head_dim], got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous along head_dim")
    check_int_dtype("positions", positions)
    check_float_dtype("query", query)
    check_float_dtype("key", key)
    check_float_dtype("cos_sin_cache", cos_sin_cache)
    check_triton_device(query, key, positions, cos_sin_cache)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_sin_cache,
        *query.stride(),
        *key.stride(),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        HALF=half,
        HALF_PADDED=next_power_of_2(half),
        HEADS_PADDED=next_power_of_2(num_heads),
        KV_HEADS_PADDED=next_power_of_2(key.shape[1]),
        num_warps=4,
    )
