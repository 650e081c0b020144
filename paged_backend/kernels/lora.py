"""The batched LoRA delta: each token adds ``(x A[s]^T) B[s]^T`` of its own adapter slot ``s`` (-1: none), for a
batch that mixes adapters (shrink to rank r, then expand). The torch twin groups tokens by slot."""

from __future__ import annotations

import torch


def lora_delta_torch(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R] (scaled)
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
) -> torch.Tensor:  # [T, out]
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = token_slots == slot
        shrunk = x[rows] @ lora_a[slot].to(x.dtype).t()  # [t, R]
        out[rows] = shrunk @ lora_b[slot].to(x.dtype).t()
    return out
