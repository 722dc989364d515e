"""Pooling models (vLLM's `--runner pooling` / `--task embed`): how a prompt's hidden states
become one embedding, and the per-request options.

The pooling of a checkpoint comes from its sentence-transformers files, as vLLM reads them:
`modules.json` lists the modules (a `Pooling` module's folder holds `config.json` with
`pooling_mode_lasttoken` / `pooling_mode_mean_tokens` / `pooling_mode_cls_token`; a `Normalize`
module means unit-length output); without them a decoder embedder pools its last token and
normalizes (vLLM's default for decoder models). `--pooler-config` ('{"pooling_type": "MEAN",
"normalize": false}') overrides either field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.json_flags import json_object_flag
from nanoserve.pooling_params import PoolingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka models (config.json's is_matryoshka / matryoshka_dimensions) take a request's
    # `dimensions`: the embedding's first N components, normalized after the cut.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> dict:
        """--pooler-config's JSON (or a dict): the fields it sets, checked."""
        if value is None:
            return {}
        value = json_object_flag(value, "--pooler-config", {"pooling_type", "normalize"})
        fields = dict(value)
        if "pooling_type" in fields:
            fields["pooling_type"] = str(fields["pooling_type"]).upper()
            if fields["pooling_type"] not in POOLING_TYPES:
                raise ValueError(
                    f"--pooler-config: pooling_type must be one of {list(POOLING_TYPES)}, "
                    f"got {value['pooling_type']!r}"
                )
        if "normalize" in fields and not isinstance(fields["normalize"], bool):
            raise ValueError("--pooler-config: normalize must be true or false")
        return fields

    @classmethod
    def for_model(
        cls,
        model_dir: str | Path | None,
        override: str | dict | None = None,
        default_type: str = "LAST",
    ) -> PoolerConfig:
        """`default_type`: the pooling without sentence-transformers files (LAST for decoders,
        CLS for encoders, as vLLM)."""
        found = {"pooling_type": default_type}
        if model_dir is not None:
            found.update(_sentence_transformers_config(Path(model_dir)))
        if model_dir is not None:
            found.update(_matryoshka(Path(model_dir)))
        return cls(**{**found, **cls.parse(override)})

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """A request's `dimensions`: only for Matryoshka models, within the embedding (or one
        of the sizes the model lists). ValueError naming the field otherwise."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError(
                "Model does not support matryoshka representation, changing output "
                "dimensions will lead to poor results."
            )
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be from 1 to {hidden_size}, got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f"Model only supports {list(self.matryoshka_dimensions)} matryoshka "
                f"dimensions, use other output dimensions will lead to poor results."
            )


def _matryoshka(model_dir: Path) -> dict:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    dims = raw.get("matryoshka_dimensions")
    if raw.get("is_matryoshka") or dims:
        return {"matryoshka": True, "matryoshka_dimensions": tuple(dims) if dims else None}
    return {}


def _sentence_transformers_config(model_dir: Path) -> dict:
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return {}
    fields: dict = {"normalize": False}
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            fields["normalize"] = True
        elif kind.endswith("Pooling"):
            try:
                pooling = json.loads(
                    (model_dir / module.get("path", "") / "config.json").read_text()
                )
            except (OSError, ValueError):
                continue
            if pooling.get("pooling_mode_lasttoken"):
                fields["pooling_type"] = "LAST"
            elif pooling.get("pooling_mode_mean_tokens"):
                fields["pooling_type"] = "MEAN"
            elif pooling.get("pooling_mode_cls_token"):
                fields["pooling_type"] = "CLS"
            else:
                modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
                raise ValueError(f"{model_dir}: unsupported sentence-transformers pooling {modes}")
        elif not kind.endswith("Transformer"):
            # A Dense (or other) module after pooling changes the vector: refuse, rather than
            # serve embeddings that are not the model's.
            raise ValueError(f"{model_dir}: unsupported sentence-transformers module {kind!r}")
    return fields


class PoolingState:
    """One prompt's pooling, fed its final hidden states chunk by chunk (chunked prefill):
    a running fp32 sum for MEAN, the first row for CLS, the latest last row for LAST."""

    def __init__(self, config: PoolerConfig, params: PoolingParams) -> None:
        self.config, self.params = config, params
        self.kept: torch.Tensor | None = None
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        rows = rows.float()
        kind = self.config.pooling_type
        if kind == "MEAN":
            total = rows.sum(dim=0)
            self.kept = total if self.kept is None else self.kept + total
        elif kind == "LAST":
            self.kept = rows[-1].clone()
        elif self.kept is None:  # CLS
            self.kept = rows[0].clone()
        self.count += rows.shape[0]

    def result(self) -> torch.Tensor:
        if self.kept is None:
            raise ValueError("nothing was pooled")
        vector = self.kept / self.count if self.config.pooling_type == "MEAN" else self.kept
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        normalize = (
            self.config.normalize if self.params.normalize is None else self.params.normalize
        )
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector


def pool(hidden: torch.Tensor, config: PoolerConfig, params: PoolingParams) -> torch.Tensor:
    """One prompt's [tokens, hidden] final hidden states -> its embedding, float32."""
    state = PoolingState(config, params)
    state.add(hidden)
    return state.result()
