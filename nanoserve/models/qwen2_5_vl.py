"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): a vision tower of any image
size (patches embedded by a linear map, 2D rotary, window attention with some blocks over the
whole image, RMSNorm + SwiGLU blocks, a merger of 2x2 patches into one token) and a Qwen2
language model whose rotary is M-RoPE: an image token's query and key turn by its (temporal,
height, width) positions, each on its own section of the frequencies (multimodal/mrope.py
computes the positions; kernels/rotary.mrope_cos_sin the rows the rotary kernels read).

Under tensor parallelism the language model splits as any Qwen2 does; the vision tower is whole
on rank 0 (its linear layers built with disable_tp) and absent from the other ranks, which
receive the image rows' embeddings and the step's M-RoPE positions with the step
(engine/image_broadcast.py, engine/model_input.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed import get_rank
from nanoserve.kernels import mrope_cos_sin, silu_and_mul
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from nanoserve.layers.norm import RMSNorm
from nanoserve.models.config import ModelConfig
from nanoserve.models.qwen2_5_vl_config import QwenVisionConfig
from nanoserve.models.vision_language import VisionLanguageForCausalLM

VISION_NORM_EPS = 1e-6


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d over (frames, patch, patch) with a stride of its kernel: on a
    patch row of the processor's it is one matrix product."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        shape = (config.hidden_size, config.in_channels, config.temporal_patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(
            torch.empty(*shape, config.patch_size, config.patch_size, dtype=dtype),
            requires_grad=False,
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return patches.to(weight.dtype) @ weight.reshape(weight.shape[0], -1).t()


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, hidden // config.num_heads
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, True, dtype, disable_tp=True)
        self.proj = RowParallelLinear(hidden, hidden, True, dtype, disable_tp=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        """x: one image's rows [n, hidden] in window order; each span of cu_seqlens (a window,
        or the whole image) attends within itself."""
        rows = x.shape[0]
        q, k, v = self.qkv(x).reshape(rows, 3, self.num_heads, self.head_dim).unbind(1)
        dtype = q.dtype
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, head_dim]
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            out[:, start:end] = F.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end], scale=self.head_dim**-0.5
            )
        return self.proj(out.transpose(0, 1).reshape(rows, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter] * 2, True, dtype, disable_tp=True
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, True, dtype, disable_tp=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.norm2 = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """ln_q on each patch, then an MLP over each 2x2 group of patches (one token)."""

    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, VISION_NORM_EPS, dtype)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(merged, merged, True, dtype, disable_tp=True),
            nn.GELU(),
            RowParallelLinear(merged, config.out_hidden_size, True, dtype, disable_tp=True),
        )
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


def vision_position_ids(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """[h * w, 2]: each patch's (row, column), patches ordered as the processor lays them
    out (each 2x2 merge group's patches together)."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1)


def window_index(
    grid_t: int, grid_h: int, grid_w: int, merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge groups (tokens) in window order (windows of `window` x `window` tokens, row
    by row, the last ones clipped at the image's edge), and the windows' bounds in patches."""
    llm_h, llm_w = grid_h // merge, grid_w // merge
    index = torch.arange(grid_t * llm_h * llm_w).reshape(grid_t, llm_h, llm_w)
    pad_h, pad_w = window - llm_h % window, window - llm_w % window
    windows_h, windows_w = (llm_h + pad_h) // window, (llm_w + pad_w) // window
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
    padded = padded.reshape(grid_t, windows_h, window, windows_w, window)
    padded = padded.permute(0, 1, 3, 2, 4).reshape(grid_t, windows_h * windows_w, window, window)
    sizes = (padded != -100).sum([2, 3]).reshape(-1)
    flat = padded.reshape(-1)
    bounds = [0]
    for size in (sizes * merge * merge).tolist():
        if size:  # a window wholly in the padding holds nothing
            bounds.append(bounds[-1] + size)
    return flat[flat != -100], bounds


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: QwenVisionConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, dtype)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(config, dtype)
        head_dim = config.hidden_size // config.num_heads
        spatial = head_dim // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponents, persistent=False)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, 1, head_dim]: the row's frequencies, then the column's, twice."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [n, 2, f]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, patches: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patch rows [t * h * w, patch_dim] -> its tokens [t * h * w / 4, out]."""
        config = self.config
        merge = config.spatial_merge_size
        unit = merge * merge
        grid_t, grid_h, grid_w = grid_thw
        device = patches.device
        window = config.window_size // merge // config.patch_size
        order, window_bounds = window_index(grid_t, grid_h, grid_w, merge, window)
        order = order.to(device)
        x = self.patch_embed(patches)
        rows = x.shape[0]
        x = x.reshape(rows // unit, unit, -1)[order].reshape(rows, -1)
        positions = vision_position_ids(grid_h, grid_w, merge).repeat(grid_t, 1).to(device)
        positions = positions.reshape(rows // unit, unit, 2)[order].reshape(rows, 2)
        cos, sin = self.rotary(positions)
        frames = [i * grid_h * grid_w for i in range(grid_t + 1)]  # each frame attends alone
        for index, block in enumerate(self.blocks):
            full = index in config.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else window_bounds)
        return self.merger(x)[torch.argsort(order)]


class Qwen2_5_VLForConditionalGeneration(VisionLanguageForCausalLM):
    # The step broadcast carries the M-RoPE positions beside the image rows (engine/model_input.py).
    # Checkpoint name prefixes -> ours, the first that matches: transformers 4.x (and 5's
    # save_pretrained) write model.* and visual.*; 5.x's modules are model.language_model.*
    # and model.visual.*; lm_head.* in both.
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    )

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(config, dtype)
        assert isinstance(config.vision, QwenVisionConfig)
        self.mrope_section = config.vision.mrope_section
        if get_rank() > 0:  # the encoder runs on rank 0 only: no tower here
            self.visual = None
            self.checkpoint_skips = ("visual.",)
            return
        self.visual = Qwen2_5_VisionTransformer(config.vision, dtype)

    def embed_image_list(
        self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Each image's tokens' embeddings [grid t * h * w / 4, hidden] (the encoder cache's
        call); the tower runs on each image alone, as its attention never crosses images."""
        return [self.visual(p, g) for p, g in zip(pixel_values, grids, strict=True)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate=None,
        inputs_embeds: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
    ):
        """`inputs_embeds`: the step's rows with the images' placed (engine/image_step.py).
        `mrope_positions` [3, rows]: a step with image rows; each row then gets its own cos/sin
        row (positions 0..rows-1 into them). Without, `positions` are the rotary positions."""
        cos_sin = self.cos_sin_cache
        if mrope_positions is not None:
            cos_sin = mrope_cos_sin(cos_sin, mrope_positions, self.mrope_section)
            positions = torch.arange(positions.shape[0], device=positions.device)
        return self.run_text_model(
            input_ids, positions, cos_sin, metadata, intermediate, inputs_embeds
        )
