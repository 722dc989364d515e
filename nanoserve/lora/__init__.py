"""LoRA adapters served beside the base model (vLLM's --enable-lora): see lora/manager.py."""

from nanoserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
