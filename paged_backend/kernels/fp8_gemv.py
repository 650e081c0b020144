"""The FP8 GEMV: decode's few rows of x, in the model's dtype, against fp8 weights ``[N, K]`` with a scale per output
channel (``quantization/fp8.py`` runs it at one row, where it beats the fp8 GEMM). At a few rows a product is bound
by reading the weights, which ``torch._scaled_mm`` (a GEMM tiled for many rows) does not do at the copy rate, and
the per-token quantization of x it needs is a kernel of its own. Here x stays as it is (weights only: fp8 values
times fp32 products are exact in registers, so this is the unquantized-activation product, closer to the model than
the fp8 GEMM's) and each program's rows of weights stream along K: ``VEC`` bytes of each row a thread, every thread
of the program side by side along K, all of a program's rows loaded before any is used, so many loads are in flight.
K is split over programs where there are few (the last program of each tile adds the parts, ``kernels/arrival.py``).
"""

from __future__ import annotations

import torch

from paged_backend.kernels import num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters, split_k_parts

GEMV_MAX_M = 4  # rows the kernel takes, all in one program
VEC = 8  # weights per thread and row per step: 8 bytes of fp8, and x's 8 values one 16-byte load in bf16
NUM_WARPS = 4
# Weight rows per program: each thread has one load of VEC bytes in flight per weight row and holds BLOCK_M x
# BLOCK_N partial sums; 8 was the fastest of 8, 16 and 32 on every projection of the 8B shape (docs/benchmarks.md).
BLOCK_N = 8


def fp8_gemv_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [M, N] in x's dtype
    """Reference twin: ``x @ (W * s).T`` in float32."""
    return (x.float() @ (weight.float() * weight_scale[:, None]).T).to(x.dtype)


if triton is not None:
    from paged_backend.kernels.arrival import add_parts, last_to_arrive

    @triton.jit
    def fp8_gemv_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K] fp8, rows ``stride_w`` apart
        scale_ptr,  # [N] float32
        out_ptr,  # [M, N] in x's dtype
        partial_ptr,  # [SPLIT_K, M, N] fp32 when K is split (programs along axis 2)
        counters_ptr,  # [tiles] int32 zeros (``kernels/arrival.py``)
        M,
        N,
        K,
        k_per_split,  # a multiple of LANES * VEC
        stride_w,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        LANES: tl.constexpr,  # threads of the program, side by side along K
        VEC: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Tensors are four-dimensional, ``[BM, BN, LANES, VEC]`` (1 where broadcast), from the pointers on: both
        loads then get one layout, ``VEC`` contiguous values in each thread, which every operation keeps; the
        ``VEC`` products are summed in the thread, the lanes once, at the end."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        offs_k = (tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :])[None, None, :, :]  # [1, 1, L, V]
        w_ptrs = w_ptr + offs_n[None, :, None, None].to(tl.int64) * stride_w + k_start + offs_k  # [1, BN, L, V]
        x_ptrs = x_ptr + offs_m[:, None, None, None] * K + k_start + offs_k  # [BM, 1, L, V]
        acc = tl.zeros((BLOCK_M, BLOCK_N, LANES), dtype=tl.float32)
        for k0 in range(k_start, k_end, LANES * VEC):
            mask_k = k0 + offs_k < k_end
            w = tl.load(w_ptrs, mask=mask_n[None, :, None, None] & mask_k, other=0.0).to(tl.float32)
            x = tl.load(x_ptrs, mask=mask_m[:, None, None, None] & mask_k, other=0.0).to(tl.float32)
            acc += tl.sum(x * w, axis=3)
            w_ptrs += LANES * VEC
            x_ptrs += LANES * VEC
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        y = tl.sum(acc, axis=2) * scale[None, :]  # [BM, BN]
        mask = mask_m[:, None] & mask_n[None, :]
        tile = offs_m[:, None] * N + offs_n[None, :]
        if SPLIT:
            tl.store(partial_ptr + pid_k * M * N + tile, y, mask=mask)
            if last_to_arrive(counters_ptr + pid_m * tl.num_programs(1) + pid_n, tl.num_programs(2)):
                total = add_parts(partial_ptr, offs_m, offs_n, mask, M, N, tl.num_programs(2), BLOCK_M, BLOCK_N)
                tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + tile, y.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemv_triton(
    x: torch.Tensor,  # [M, K], M <= GEMV_MAX_M
    weight: torch.Tensor,  # [N, K] fp8, rows contiguous
    weight_scale: torch.Tensor,  # [N] float32
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``fp8_gemv_torch`` in one kernel. ``launch`` is (BLOCK_N, SPLIT_K), by default ``BLOCK_N`` rows and K split
    while fewer than four programs run per SM."""
    m, k = x.shape
    n = weight.shape[0]
    if m > GEMV_MAX_M or weight.stride(1) != 1 or weight_scale.stride(0) != 1:
        raise ValueError(
            f"the fp8 GEMV takes up to GEMV_MAX_M={GEMV_MAX_M} rows and weights with contiguous rows, got {m} rows "
            f"and strides {weight.stride()}"
        )
    lanes = 32 * NUM_WARPS
    step = lanes * VEC
    block_m = triton.next_power_of_2(max(m, 1))
    block_n, split_k = launch or (BLOCK_N, 0)
    if not split_k:
        sms = num_sms(x.device) if x.is_cuda else 132
        split_k = split_k_parts(triton.cdiv(n, block_n), k, 2 * step, 4 * sms)  # parts of two steps or more
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), step) * step
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (1, triton.cdiv(n, block_n), split_k)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    if m:
        fp8_gemv_kernel[grid](
            x.contiguous(), weight, weight_scale, out, partial, arrival_counters(x.device, grid[1]),
            m, n, k, k_per_split, weight.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, LANES=lanes, VEC=VEC, SPLIT=split_k > 1, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
