"""The paged KV cache tensors: per layer ``[num_blocks, block_size, Hkv, D]`` for k and for v."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """KV geometry read from the model config (GPT-2's ``n_head``/``n_embd`` map through ``attribute_map``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype: torch.dtype) -> KVCacheSpec:
        cfg = config.get_text_config()
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(cfg.num_hidden_layers, num_kv_heads, head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element


class CacheEngine:
    """Allocates the cache once and moves blocks for copy-on-write."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=spec.dtype, device=device),
                torch.zeros(shape, dtype=spec.dtype, device=device),
            )
            for _ in range(spec.num_layers)
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
