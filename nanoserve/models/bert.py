"""Encoder-only models, one module for both families: BERT (`BertModel`: all-MiniLM, bge, e5)
and XLM-RoBERTa (`XLMRobertaModel`: bge-m3's dense vector), and their sequence classifiers
(`*ForSequenceClassification`: cross-encoders such as ms-marco MiniLM and bge-reranker).

Word + absolute position + token type embeddings and a LayerNorm; post-LayerNorm layers of
bidirectional attention (kernels/encoder_attention.py: whole prompts, no KV cache) and a GELU
MLP. XLM-RoBERTa differs by its position ids, which count from padding_idx + 1, and by one
token type. The parameters are named as transformers names them, so a checkpoint loads
without renames (only q, k and v go into one fused projection).

The engine calls `model(input_ids, positions, batch)` with an EncoderBatch and pools the
hidden states it returns; a classifier's `classify(first_token_rows)` turns pooled rows into
logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.encoder_attention import encoder_attention
from nanoserve.layers.embedding import VocabParallelEmbedding
from nanoserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.models.config import ModelConfig


@dataclass(slots=True)
class EncoderBatch:
    """One step's prompts, packed: where each starts (`cu_seqlens`, then the total) and each
    token's type id (0 first text, 1 a pair's second)."""

    cu_seqlens: list[int]
    token_type_ids: torch.Tensor


# transformers' separate q, k, v tensors load into each layer's fused projection.
PACKED_QKV = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class LayerNorm(nn.Module):
    """transformers' LayerNorm, computed in float32 whatever the weights' dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        out = F.layer_norm(x.float(), shape, self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        encoder = config.encoder
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = nn.Embedding(
            encoder.position_table_size, config.hidden_size, dtype=dtype
        )
        self.token_type_embeddings = nn.Embedding(
            encoder.type_vocab_size, config.hidden_size, dtype=dtype
        )
        for table in (self.position_embeddings, self.token_type_embeddings):
            table.weight.requires_grad_(False)
        self.LayerNorm = LayerNorm(config.hidden_size, encoder.layer_norm_eps, dtype)
        self.position_offset = encoder.position_offset
        self.one_type = encoder.type_vocab_size == 1  # XLM-R: a pair's types are all 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.one_type:
            token_type_ids = torch.zeros_like(token_type_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions + self.position_offset)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    """transformers' `attention.self`: q, k, v fused (their checkpoint tensors load into it)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_heads, True, dtype
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        out = encoder_attention(q, k, v, batch.cu_seqlens, self.scale)
        return out.reshape(x.shape[0], self.num_heads * self.head_dim)


class DenseNorm(nn.Module):
    """transformers' `*.output`: dense, then LayerNorm of it plus the residual."""

    def __init__(self, config: ModelConfig, input_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, True, dtype)
        self.LayerNorm = LayerNorm(config.hidden_size, config.encoder.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = SelfAttention(config, dtype)  # transformers' name
        self.output = DenseNorm(config, config.num_attention_heads * config.head_dim, dtype)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class Intermediate(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, dtype)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for an encoder")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = Attention(config, dtype)
        self.intermediate = Intermediate(config, dtype)
        self.output = DenseNorm(config, config.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config, dtype) for _ in range(config.num_hidden_layers))


class Pooler(nn.Module):
    """BERT's pooler: tanh(dense(first token)); a classifier's input."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.hidden_size, True, dtype)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_rows))


class BertModel(nn.Module):
    """The encoder: hidden states of every token (the engine pools them). A checkpoint's pooler
    and masked-LM head are not loaded (an embedding model pools from modules.json)."""

    pooling_tasks = ("embed", "score")
    # Unused tensors, also under the prefix a checkpoint saved from a model with heads has
    # (BertForMaskedLM's "bert.", its "cls." head); that prefix is dropped.
    checkpoint_skips = tuple(
        prefix + name
        for prefix in ("", "bert.", "roberta.")
        for name in ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")
    ) + ("cls.", "lm_head.")
    checkpoint_renames = {"bert.": ""}

    def __init__(self, config: ModelConfig, dtype: torch.dtype, with_pooler: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, dtype)
        self.encoder = Encoder(config, dtype)
        self.pooler = Pooler(config, dtype) if with_pooler else None

    packed_modules = PACKED_QKV

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, batch.token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x


class XLMRobertaModel(BertModel):
    """The same encoder; its config sets the position offset and the single token type."""

    checkpoint_renames = {"roberta.": ""}


class BertForSequenceClassification(nn.Module):
    """BERT with its pooler and a linear classifier (ms-marco cross-encoders: one label)."""

    pooling_tasks = ("classify", "score")
    checkpoint_skips = ("bert.embeddings.position_ids",)

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.bert = BertModel(config, dtype, with_pooler=True)
        self.classifier = ColumnParallelLinear(config.hidden_size, config.num_labels, True, dtype)

    packed_modules = PACKED_QKV

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch
    ) -> torch.Tensor:
        return self.bert(input_ids, positions, batch)

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """[n, hidden] first-token hidden states (float32 from pooling) -> [n, num_labels]."""
        return self.classifier(self.bert.pooler(first_rows.to(self.dtype)))


class ClassificationHead(nn.Module):
    """XLM-RoBERTa's classifier: dense, tanh, out_proj (on the first token's hidden state)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.hidden_size, True, dtype)
        self.out_proj = ColumnParallelLinear(config.hidden_size, config.num_labels, True, dtype)

    def forward(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_rows)))


class XLMRobertaForSequenceClassification(nn.Module):
    """XLM-RoBERTa with its classification head (bge-reranker)."""

    pooling_tasks = ("classify", "score")
    checkpoint_skips = ("roberta.pooler.", "roberta.embeddings.position_ids")

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.roberta = XLMRobertaModel(config, dtype)
        self.classifier = ClassificationHead(config, dtype)

    packed_modules = PACKED_QKV

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch
    ) -> torch.Tensor:
        return self.roberta(input_ids, positions, batch)

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(first_rows.to(self.dtype))


ENCODER_CLASSES = {
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}
