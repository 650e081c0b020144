"""Round-to-nearest 4-bit quantization, AutoAWQ's last step: per group of ``group_size`` inputs, a zero point
and an fp16 scale spanning the group's range. The AWQ quantizer rounds with it after scaling and clipping, and its
search scores candidates by the error it leaves."""

from __future__ import annotations

import torch

from paged_backend.kernels.awq_format import MAX_INT, pack


def quantize_rtn(
    weight: torch.Tensor,  # [N, K] (nn.Linear's layout)
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest with a zero point per group of ``group_size`` inputs, as AutoAWQ does: returns the int
    values ``q`` [K, N], zero points ``z`` [K / G, N] and fp16 scales ``s`` [K / G, N] (unpacked)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group_size={group_size} must divide in_features={in_features}")
    w = weight.detach().float().t().reshape(in_features // group_size, group_size, out_features)  # [K/G, G, N]
    w_max, w_min = w.amax(dim=1), w.amin(dim=1)  # [K/G, N]
    scales = ((w_max - w_min).clamp(min=1e-5) / MAX_INT).half()
    s = scales.float()
    zeros = (-torch.round(w_min / s)).clamp(0, MAX_INT)
    q = (torch.round(w / s[:, None]) + zeros[:, None]).clamp(0, MAX_INT)  # [K/G, G, N]
    return q.reshape(in_features, out_features).to(torch.int32), zeros.to(torch.int32), scales


def pack_linear(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rtn`` in the packed checkpoint layout: (qweight, qzeros, scales)."""
    q, z, s = quantize_rtn(weight, group_size)
    return pack(q), pack(z), s
