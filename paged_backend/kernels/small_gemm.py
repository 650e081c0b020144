"""``y = x @ W.T + b`` for a handful of rows (single-stream decode), where a matrix product is a pure weight read.

cuBLAS reads weights at about 2.6 TB/s for 1-2 rows on an H200 (benchmarks/kernel_sweep.py) against 4.27 TB/s of
copy bandwidth. This kernel splits the output columns and, when there are too few column tiles to fill the GPU,
the reduction dimension too (partial sums in fp32, then a deterministic reduce). Not yet wired into the engine:
``benchmarks/kernel_sweep.py`` compares it with cuBLAS first.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import num_sms, tl, triton

MAX_ROWS = 16  # rows beyond this are cuBLAS's job


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference twin, accumulated in fp32: ``[M, K] x [N, K] -> [M, N]``."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["num_rows"])
    def _small_gemm_kernel(
        out_ptr,  # [S, M, N] fp32 partials, or [M, N] when SPLIT_K == 1
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        bias_ptr,
        num_rows,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_os,
        stride_om,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = split * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=(rows[:, None] < num_rows) & (ks[None, :] < k_hi),
                other=0.0,
            )  # [ROWS, BK]
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < k_hi),
                other=0.0,
            )  # [BK, BN]
            acc += tl.dot(x, w)
        mask = (rows[:, None] < num_rows) & (cols[None, :] < N)
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :], acc, mask=mask)


def linear_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
    out: torch.Tensor | None = None,  # [M, N], written in place when given
) -> torch.Tensor:
    """Triton twin of :func:`linear_torch`. ``split_k`` defaults to enough splits for two programs per SM."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"linear_triton takes at most {MAX_ROWS} rows, got {num_rows}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("linear_triton needs x and weight with a contiguous last dimension")
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    col_tiles = triton.cdiv(n, block_n)
    if split_k is None:
        target = 2 * num_sms(x.device) if x.is_cuda else 1
        split_k = max(1, min(triton.cdiv(k, block_k), triton.cdiv(target, col_tiles)))
    partial = out if split_k == 1 else torch.empty(split_k, num_rows, n, dtype=torch.float32, device=x.device)
    _small_gemm_kernel[(col_tiles, split_k)](
        partial,
        x,
        weight,
        bias if bias is not None else x,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        partial.stride(-2),
        ROWS=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        HAS_BIAS=bias is not None,
    )
    if split_k > 1:
        total = partial.sum(0)  # [M, N] fp32, a fixed order: deterministic
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out
