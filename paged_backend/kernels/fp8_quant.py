"""Per-token fp8 quantization of activations (FP8 layers' dynamic activations) in one kernel.

``quantize_per_row`` in torch is eight kernels (abs, amax, casts, two divisions, clamps, the fp8 cast), run on
every FP8 linear call; at decode each is a launch and a few microseconds for a row of a few thousand values.
Here one program reads its row twice (largest magnitude, then the scaled values) and writes the fp8 row and its
scale, with IEEE divisions and fp8's round-to-nearest-even cast: the twin's values, bit for bit.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import as_rows, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, not NaN


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin: ``x`` [M, K] as fp8 with one float32 scale per row (``x ≈ q * scale``), the row's largest
    magnitude mapped to fp8's largest value. The divisor is a tensor on ``x``'s device (filled there, no copy from
    the host): CUDA divides by a Python number as a product with its reciprocal, which is not IEEE division (the
    kernel's, and a CPU's)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)  # [M, 1]
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


if triton is not None:

    @triton.jit(do_not_specialize=["stride_x", "n_cols"])
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + offsets < n_cols
            x = tl.load(x_ptr + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
        tl.store(scale_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + offsets < n_cols
            x = tl.load(x_ptr + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
            tl.store(q_ptr + row * n_cols + start + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_row_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_row`` in one kernel: (``q`` [M, K] fp8, contiguous; ``scale`` [M, 1] float32)."""
    x, block = as_rows(x)
    m, n_cols = x.shape
    q = torch.empty((m, n_cols), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, x.stride(0), n_cols, BLOCK=block, num_warps=4)
    return q, scale
