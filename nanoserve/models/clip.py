"""CLIP's vision tower (transformers' CLIPVisionModel) as LLaVA uses it: patches and a class
token, position embeddings, a pre-norm and the encoder layers up to the feature layer LLaVA
reads (its hidden state, not the pooled output). Projections on our linear layers, whole
(disable_tp: the tower runs on rank 0 only under tensor parallelism); attention is torch's (an
image's rows all see each other, no KV cache)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.models.llava_config import VisionConfig


def activation(name: str):
    """transformers' ACT2FN entries LLaVA's towers and projectors use."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r} (quick_gelu, gelu, gelu_pytorch_tanh)")


class CLIPEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            hidden,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
            dtype=dtype,
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, hidden, dtype=dtype)
        self.position_embedding.weight.requires_grad_(False)
        self.patch_embedding.weight.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, H, W] -> [images, 1 + patches, hidden]."""
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, heads, heads, True, dtype, disable_tp=True
        )
        self.out_proj = RowParallelLinear(hidden, hidden, True, dtype, disable_tp=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, rows, hidden = x.shape
        qkv = self.qkv_proj(x.reshape(images * rows, hidden))
        q, k, v = (
            t.reshape(images, rows, self.num_heads, self.head_dim).transpose(1, 2)
            for t in qkv.split(hidden, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(images * rows, hidden)
        return self.out_proj(out).reshape(images, rows, hidden)


class CLIPMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.fc1 = ColumnParallelLinear(hidden, intermediate, True, dtype, disable_tp=True)
        self.fc2 = RowParallelLinear(intermediate, hidden, True, dtype, disable_tp=True)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1]))))
        return out.reshape(shape)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        eps = config.layer_norm_eps
        self.self_attn = CLIPAttention(config, dtype)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(config, dtype) for _ in range(config.num_layers_used)
        )


class CLIPVisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = CLIPEmbeddings(config, dtype)
        # (sic: CLIP's checkpoints name it so)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(config, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The hidden state after the last layer built (LLaVA's feature layer)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class CLIPVisionModel(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.vision_model = CLIPVisionTransformer(config, dtype)

    def unused_checkpoint_prefixes(self, prefix: str) -> tuple[str, ...]:
        """Checkpoint tensors past the feature layer: later encoder layers, the post-norm."""
        layers = range(self.config.num_layers_used, self.config.num_hidden_layers)
        return (
            f"{prefix}vision_model.post_layernorm.",
            f"{prefix}vision_model.embeddings.position_ids",
            *(f"{prefix}vision_model.encoder.layers.{i}." for i in layers),
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixel_values)
