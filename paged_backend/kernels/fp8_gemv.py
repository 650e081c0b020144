"""The FP8 GEMV: a few rows of fp8 activations against fp8 weights, for decode.

At one to four rows a matrix product is bound by reading the weights; ``torch._scaled_mm`` runs a GEMM tiled for
many rows there. This kernel streams each program's block of weight rows along K (contiguous bytes), converts
fp8 to fp32 in registers and keeps tile-shaped partial sums, reduced once at the end; the activation's per-row
and the weight's per-channel scales multiply the sum. ``y = (q_x · q_w) * s_x * s_w``: the twin computes the
same products, scaled first (``fp8_gemv_torch``).
"""

from __future__ import annotations

import torch

from paged_backend.kernels import tl, triton

GEMV_MAX_M = 4  # rows the GEMV takes; more go to the fp8 GEMM
BLOCK_K = 256  # weight columns a program loads per step (256 bytes of each row)
ROWS_X_COLUMNS = 16  # rows of x times weight rows per program: the partial sums' size, in BLOCK_K-wide vectors


def fp8_gemv_torch(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Reference twin: ``q`` [M, K] fp8 with ``q_scale`` [M, 1], ``weight`` [N, K] fp8 with ``weight_scale`` [N];
    the product in float32, returned in ``dtype``."""
    return ((q.float() * q_scale) @ (weight.float() * weight_scale[:, None]).T).to(dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["M", "N", "K", "stride_w"])
    def _fp8_gemv_kernel(
        q_ptr,  # [M, K] fp8, contiguous
        q_scale_ptr,  # [M] float32
        w_ptr,  # [N, K] fp8, rows ``stride_w`` apart
        w_scale_ptr,  # [N] float32
        out_ptr,  # [M, N]
        M,
        N,
        K,
        stride_w,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w  # [BN, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = k0 + offs_k < K
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = tl.load(
                q_ptr + offs_m[:, None] * K + k0 + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        dot = tl.sum(acc, axis=2)  # [BM, BN]
        x_scale = tl.load(q_scale_ptr + offs_m, mask=mask_m, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
        out = dot * x_scale[:, None] * w_scale[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemv_triton(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``fp8_gemv_torch`` for up to ``GEMV_MAX_M`` rows in one kernel (``q`` contiguous, ``weight``'s rows too)."""
    m, k = q.shape
    n = weight.shape[0]
    if m > GEMV_MAX_M or not q.is_contiguous() or weight.stride(1) != 1:
        raise ValueError(f"fp8 GEMV takes up to {GEMV_MAX_M} contiguous rows and row-major weights, got {m} rows")
    out = torch.empty((m, n), dtype=dtype, device=q.device)
    block_m = triton.next_power_of_2(max(m, 1))
    block_n = ROWS_X_COLUMNS // block_m
    if m:
        _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
            q, q_scale, weight, weight_scale, out, m, n, k, weight.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
    return out
