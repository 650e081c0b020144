"""The FP8 GEMV: decode's few rows of x, in the model's dtype, against fp8 weights ``[N, K]`` with a scale per output
channel (``quantization/fp8.py`` runs it at one row, where it beats the fp8 GEMM). At a few rows a product is bound
by reading the weights, which ``torch._scaled_mm`` (a GEMM tiled for many rows) does not do at the copy rate, and
the per-token quantization of x it needs is a kernel of its own. Here x stays as it is (weights only: fp8 values
times fp32 products are exact in registers, so this is the unquantized-activation product, closer to the model than
the fp8 GEMM's) and each program streams a few rows of weights along K against one row of x: ``VEC`` bytes of each
weight row a thread, the program's threads side by side along K, all its rows loaded before any is used. Small
programs, many of them, keep the most loads in flight. K is split over programs where there are few and K is long
(the last program of each tile adds the parts, ``kernels/arrival.py``).

The same kernel reads 16-bit weights without a scale (``gemv_triton(x, weight)``): a bf16 projection at one row is
as bound by the weight read, and ``benchmarks/fp8_linear.py`` (column ``bf16_gemv``) times it against cuBLAS's.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters, split_k_parts

GEMV_MAX_M = 4  # rows the kernel takes, a program for each
VEC = 8  # weights per thread and row per step: 8 bytes of fp8, and x's 8 values one 16-byte load in bf16
NUM_WARPS = 4
# The default launch (docs/benchmarks.md, "FP8 weights"): programs of 2 weight rows, 128 threads side by side along
# K (1,024 weights of each row a step), or 4 rows and 64 threads where 2 rows would make more than
# ``MAX_PROGRAMS_PER_SM`` programs (the 8B shape's gate/up). Few rows a program means many programs, which kept more
# loads in flight than more rows a program did on every projection of the 8B shape; past that count, the 4-row
# tiles were as fast or faster.
TILE = 2048  # BLOCK_N * LANES * VEC: weights a program reads per step
MAX_PROGRAMS_PER_SM = 64


def fp8_gemv_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8 (or 16-bit, without a scale)
    weight_scale: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] in x's dtype
    """Reference twin: ``x @ (W * s).T`` (``x @ W.T`` without a scale) in float32."""
    dequantized = weight.float() if weight_scale is None else weight.float() * weight_scale[:, None]
    return (x.float() @ dequantized.T).to(x.dtype)


if triton is not None:
    from paged_backend.kernels.arrival import add_parts, last_to_arrive

    @triton.jit
    def fp8_gemv_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K] fp8 (or 16-bit), rows ``stride_w`` apart
        scale_ptr,  # [N] float32 (HAS_SCALE only)
        out_ptr,  # [M, N] in x's dtype
        partial_ptr,  # [SPLIT_K, M, N] fp32 when K is split (programs along axis 2)
        counters_ptr,  # [M * tiles] int32 zeros (``kernels/arrival.py``)
        M,
        N,
        K,
        k_per_split,  # a multiple of LANES * VEC
        stride_w,
        BLOCK_N: tl.constexpr,
        LANES: tl.constexpr,  # threads side by side along K
        VEC: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_SCALE: tl.constexpr,
    ):
        """One row of x (program axis 0) against ``BLOCK_N`` weight rows. Tensors are ``[BN, LANES, VEC]`` from
        the pointers on, x's too (its row read again for each weight row, from L1): both loads then get one
        layout, ``VEC`` contiguous values in each thread, and nothing moves between threads in the loop (with x
        loaded once as ``[1, LANES, VEC]``, Triton 3.6 moved every tile through shared memory). The ``VEC``
        products are summed in the thread, the lanes once, at the end."""
        row = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        offs_k = (tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :])[None, :, :]  # [1, L, V]
        w_ptrs = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_w + k_start + offs_k  # [BN, L, V]
        x_ptrs = x_ptr + row * K + k_start + offs_k + (offs_n * 0)[:, None, None]  # [BN, L, V]
        acc = tl.zeros((BLOCK_N, LANES), dtype=tl.float32)
        for k0 in range(k_start, k_end, LANES * VEC):
            mask_k = k0 + offs_k < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None, None] & mask_k, other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
            acc += tl.sum(x * w, axis=2)
            w_ptrs += LANES * VEC
            x_ptrs += LANES * VEC
        y = tl.sum(acc, axis=1)[None, :]  # [1, BN]
        if HAS_SCALE:
            y *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        offs_m = row + tl.arange(0, 1)
        mask = (offs_m < M)[:, None] & mask_n[None, :]
        tile = offs_m[:, None] * N + offs_n[None, :]
        if SPLIT:
            tl.store(partial_ptr + pid_k * M * N + tile, y, mask=mask)
            if last_to_arrive(counters_ptr + row * tl.num_programs(1) + pid_n, tl.num_programs(2)):
                total = add_parts(partial_ptr, offs_m, offs_n, mask, M, N, tl.num_programs(2), 1, BLOCK_N)
                tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=mask)


def default_launch(n: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT_K, LANES) for ``n`` weight rows: 2 rows and 128 threads a program, 4 and 64 where that would
    be more than ``MAX_PROGRAMS_PER_SM`` programs an SM; SPLIT_K 0 (``fp8_gemv_triton`` picks)."""
    block_n = 2 if triton.cdiv(n, 2) <= MAX_PROGRAMS_PER_SM * sms else 4
    return block_n, 0, TILE // (block_n * VEC)


def fp8_gemv_triton(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K] fp8, rows contiguous
    weight_scale: torch.Tensor,  # [N] float32
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``fp8_gemv_torch`` in one kernel. ``launch`` is (BLOCK_N, SPLIT_K, LANES), by default ``default_launch``'s;
    a SPLIT_K of 0 splits K while fewer than 8 programs would run per SM and each part keeps 8 steps or more (a
    long K on a narrow projection: none on the 8B shape's)."""
    return gemv_triton(x, weight, weight_scale, launch)


def gemv_triton(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K] fp8 or 16-bit, rows contiguous
    weight_scale: torch.Tensor | None = None,  # [N] float32, or none (16-bit weights)
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``fp8_gemv_triton`` over any weights the kernel reads: fp8 with their scales, or 16-bit ones without."""
    m, k = x.shape
    n = weight.shape[0]
    if weight_scale is None and weight.element_size() != 2:
        raise ValueError(f"the GEMV reads {weight.dtype} weights with their scale only: 16-bit weights go without one")
    if m > GEMV_MAX_M or weight.stride(1) != 1 or (weight_scale is not None and weight_scale.stride(0) != 1):
        raise ValueError(
            f"the GEMV takes up to GEMV_MAX_M={GEMV_MAX_M} rows and weights with contiguous rows, got {m} rows "
            f"and strides {weight.stride()}"
        )
    sms = num_sms(x.device) if x.is_cuda else 132
    block_n, split_k, lanes = launch or default_launch(n, sms)
    if not split_k:
        split_k = split_k_parts(triton.cdiv(n, block_n), k, 8 * lanes * VEC, 8 * sms)
    step = lanes * VEC
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), step) * step
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (m, triton.cdiv(n, block_n), split_k)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    counters = arrival_counters(x.device, m * grid[1] if split_k > 1 else 0)
    if m:
        fp8_gemv_kernel[grid](
            x.contiguous(), weight, weight if weight_scale is None else weight_scale, out, partial, counters, m, n, k,
            k_per_split, weight.stride(0), BLOCK_N=block_n, LANES=lanes, VEC=VEC, SPLIT=split_k > 1,
            HAS_SCALE=weight_scale is not None, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
