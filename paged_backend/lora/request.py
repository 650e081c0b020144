"""LoRARequest, importable from ``paged_backend.lora.request`` like vLLM's ``vllm.lora.request``."""

from __future__ import annotations

from dataclasses import dataclass

from paged_backend.config import check_int


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder to apply to one request; ``lora_int_id`` must be unique and >= 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        check_int("lora_int_id", self.lora_int_id, 1)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
