"""AutoAWQ's GEMM layout, written from its description: 4-bit weights packed eight to an int32 along the output
dimension, per-group scales and zero points, ``W = (q - z) * s`` and ``y = x @ W``.

    qweight  int32 [in, out / 8]      nibble i (bits 4i..4i+3) of column c holds output 8c + AWQ_ORDER[i]
    qzeros   int32 [in / G, out / 8]  the same packing, zero points stored raw (no GPTQ-style -1)
    scales   fp16  [in / G, out]

The kernels (``awq_gemm.py``) unpack this layout in registers and ``dequantize`` is their torch twin, so the
layout lives beside them; the quantizer and the checkpoint loader import it from here.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The shift that brings output column j (mod 8) to the low nibble: 4 * (position of j in AWQ_ORDER).
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(j) for j in range(PACK))  # (0, 16, 4, 20, 8, 24, 12, 28)
MAX_INT = 15


def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] ints in [0, 15] -> [R, N / 8] int32
    """Pack eight 4-bit values per int32 in AWQ's nibble order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"the packed dimension must be a multiple of {PACK}, got {cols}")
    grouped = values.to(torch.int64).view(rows, cols // PACK, PACK)  # [R, N/8, 8]
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (4 * nibble)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's complement: bit 31 is the sign
    return packed.to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, N / 8] int32 -> [R, N] int32 in [0, 15]
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & MAX_INT).reshape(packed.shape[0], -1)


def dequantize(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / G, N / 8] int32
    scales: torch.Tensor,  # [K / G, N]
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [K, N]: y = x @ W
    group_size = qweight.shape[0] // scales.shape[0]
    q = unpack(qweight)  # [K, N]
    z = unpack(qzeros).repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.to(dtype or scales.dtype).repeat_interleave(group_size, dim=0)  # [K, N]
    return (q - z).to(s.dtype) * s
