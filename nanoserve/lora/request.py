"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: what outputs and the API call it; `lora_int_id`: a positive id, the adapter's
    identity in the engine (its prefix-cache entries are keyed by it: one id, one adapter);
    `lora_path`: the PEFT directory (adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r}: lora_path is empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
