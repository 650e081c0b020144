"""Multi-LoRA serving (adapter requests)."""

from paged_backend.lora.request import LoRARequest

__all__ = ["LoRARequest"]
