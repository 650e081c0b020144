"""y = x @ dequantize(qweight, qzeros, scales): the AWQ int4 GEMM. The torch twin dequantizes whole and multiplies
(the reference, and the CPU path). On a GPU the weights are dequantized in registers right before use, so a decode
step reads 4-bit weights instead of 16-bit ones: up to ``GEMV_MAX_M`` rows (decode of a few sequences) run a GEMV
kernel, up to ``FUSED_MAX_M`` rows a ``tl.dot`` kernel; both split K over several programs to fill the GPU (the
last program of each output tile adds the fp32 parts: ``kernels/arrival.py``). Larger batches (prefill)
dequantize once and use cuBLAS, where the GEMM's compute outweighs the extra pass over the weights. Every path
reads its tensors through one row stride, so sibling layers packed side by side (``worker/fuse_linears.py``) run
as one call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged_backend.kernels import compile_ahead, num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters, split_k_parts
from paged_backend.kernels.awq_format import dequantize

# Rows up to which the fused kernel runs; above, dequantize + cuBLAS, where the GEMM's compute outweighs the extra
# pass over the weights.
FUSED_MAX_M = 128
# Rows up to which the GEMV kernel (no tl.dot) runs, all rows in one program: decode at batch 1, padded to 2 by the
# CUDA graph buckets (``worker/cuda_graphs.py``), and 4.
GEMV_MAX_M = 4
# tl.dot's smallest tile: a launch with fewer rows a program is the GEMV kernel.
DOT_MIN_M = 16


def awq_gemm_torch(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / G, N / 8] int32
    scales: torch.Tensor,  # [K / G, N]
) -> torch.Tensor:  # [M, N]
    return x @ dequantize(qweight, qzeros, scales, x.dtype)


if triton is not None:
    from paged_backend.kernels.arrival import add_parts, last_to_arrive
    from paged_backend.kernels.awq_gemv import awq_gemv_kernel

    @triton.jit
    def _dequantize_tile(
        qweight_ptr,  # [K, N / 8] int32
        qzeros_ptr,  # [K / G, N / 8] int32
        scales_ptr,  # [K / G, N]
        offs_k,  # [BK] rows, all in group ``group``
        mask_k,
        group,
        pid_n,
        N,
        row_packs,  # int32 packs from one row of qweight or qzeros to the next (scales: 8 times as many elements)
        BLOCK_N: tl.constexpr,
        DTYPE: tl.constexpr,
    ):
        """The ``[BK, BN]`` weight tile ``(q - z) * s`` of rows ``offs_k`` and the ``pid_n``-th block of columns.
        Each int32 pack is read once (contiguous rows of packs), then repeated for its eight columns in
        registers; column j of a pack sits at bit 4 * position-of-j in AWQ's order [0, 2, 4, 6, 1, 3, 5, 7]. As
        in ``awq_gemv._nibble_floats``, q and z become floats ``2**23 + q * 2**B`` by an AND-OR, with no int-to-float
        conversion, and the scale times ``2**-B`` undoes the nibble's place."""
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_pack = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        mask_pack = offs_pack < N // 8
        j = tl.arange(0, BLOCK_N) % 8
        pos = (j // 2) * 4 + (j % 2) * 16  # == AWQ_SHIFTS[j]
        pre = tl.where(pos >= 20, 12, 0)  # nibbles above bit 19 move down, to fit the 23-bit mantissa
        nibble = 0xF << (pos - pre)  # [BN]
        packed = tl.load(
            qweight_ptr + offs_k[:, None] * row_packs + offs_pack[None, :],
            mask=mask_k[:, None] & mask_pack[None, :],
            other=0,
        )  # [BK, BN / 8]
        packed = tl.interleave(packed, packed)
        packed = tl.interleave(packed, packed)
        packed = tl.interleave(packed, packed)  # [BK, BN]: column c holds pack c // 8
        zeros = tl.load(qzeros_ptr + group * row_packs + offs_pack, mask=mask_pack, other=0)  # [BN / 8]
        zeros = tl.interleave(zeros, zeros)
        zeros = tl.interleave(zeros, zeros)
        zeros = tl.interleave(zeros, zeros)  # [BN]
        scales = tl.load(scales_ptr + group * row_packs * 8 + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        scales = scales * tl.exp2(-(pos - pre).to(tl.float32))  # [BN]
        q = (((packed >> pre[None, :]) & nibble[None, :]) | 0x4B000000).to(tl.float32, bitcast=True)
        z = (((zeros >> pre) & nibble) | 0x4B000000).to(tl.float32, bitcast=True)
        return ((q - z[None, :]) * scales[None, :]).to(DTYPE)

    @triton.jit
    def _awq_dequantize_kernel(
        qweight_ptr,  # [K, N / 8] int32
        qzeros_ptr,  # [K / G, N / 8] int32
        scales_ptr,  # [K / G, N]
        out_ptr,  # [K, N]
        N,
        K,
        group_size,
        row_packs,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # divides group_size
    ):
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_k = offs_k < K
        w = _dequantize_tile(
            qweight_ptr,
            qzeros_ptr,
            scales_ptr,
            offs_k,
            mask_k,
            pid_k * BLOCK_K // group_size,
            pid_n,
            N,
            row_packs,
            BLOCK_N,
            out_ptr.dtype.element_ty,
        )
        tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w, mask=mask_k[:, None] & (offs_n[None, :] < N))

    @triton.jit
    def _awq_gemm_kernel(
        x_ptr,  # [M, K]
        qweight_ptr,  # [K, N / 8] int32
        qzeros_ptr,  # [K / G, N / 8] int32
        scales_ptr,  # [K / G, N]
        out_ptr,  # [M, N] in x's dtype
        partial_ptr,  # [SPLIT_K, M, N] fp32 when K is split (programs along axis 2)
        counters_ptr,  # [tiles] int32 zeros (``kernels/arrival.py``)
        M,
        N,
        K,
        group_size,
        row_packs,  # packs per row of qweight and qzeros: N / 8, or more for a view into siblings' packed columns
        k_per_split,  # a multiple of BLOCK_K
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # divides group_size: one scale row per tile
        IEEE: tl.constexpr,  # fp32 inputs: full-precision dots, not TF32
        SPLIT: tl.constexpr,  # K split: fp32 parts, the last program of a tile adds them
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(
                x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )  # [BM, BK]
            w = _dequantize_tile(
                qweight_ptr,
                qzeros_ptr,
                scales_ptr,
                offs_k,
                mask_k,
                k0 // group_size,
                pid_n,
                N,
                row_packs,
                BLOCK_N,
                x.dtype,
            )  # [BK, BN]
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT:
            tl.store(partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
            if last_to_arrive(counters_ptr + pid_m * tl.num_programs(1) + pid_n, tl.num_programs(2)):
                acc = add_parts(partial_ptr, offs_m, offs_n, mask, M, N, tl.num_programs(2), BLOCK_M, BLOCK_N)
                tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _row_packs(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> int:
    """The kernels' row stride: rows contiguous, and one stride for all three tensors, as for whole tensors or for
    column slices of sibling layers packed side by side (``worker/fuse_linears.py``)."""
    row_packs = qweight.stride(0)
    if (
        qweight.stride(1) != 1
        or qzeros.stride() != (row_packs, 1)
        or scales.stride() != (8 * row_packs, 1)
        or row_packs < qweight.shape[1]
    ):
        raise ValueError(
            f"AWQ tensors must share one row stride with contiguous rows: qweight {qweight.stride()}, "
            f"qzeros {qzeros.stride()}, scales {scales.stride()}"
        )
    return row_packs


class Launch(NamedTuple):
    """A fused GEMM's launch: its tiles, how many ways K is split, and Triton's warps and pipeline stages a program
    (a plain 4-tuple of the first four takes the defaults)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4  # the GEMV's 256 x 4 tiles: one pack a thread
    num_stages: int = 3


def _launch_shape(m: int, n: int, k: int, group_size: int, sms: int) -> Launch:
    """The launch for ``m`` rows (4 warps, 3 stages); BLOCK_M below ``DOT_MIN_M`` is the GEMV kernel. A decode step
    reads each weight once, so the launch aims at many programs per SM, which keep enough loads in flight: up to
    ``GEMV_MAX_M`` rows the GEMV kernel, all rows in one program (each weight made once for all of them), 256
    columns by 4 rows a tile, K split up to 16 ways while programs stay under 6 per SM (the last program adds the
    parts, so a deeper split costs little); up to 16 rows 16 x 64 ``tl.dot`` tiles, above that 64 x 128, split where
    tiles are few. ``benchmarks/awq_sweep.py`` times the alternatives (docs/benchmarks.md)."""
    if m <= GEMV_MAX_M:  # one pack per thread of 4 warps: few registers, so many warps keep loads in flight
        split_k = split_k_parts(triton.cdiv(n, 256), k, group_size, 6 * sms)  # parts of one group or more
        return Launch(triton.next_power_of_2(m), 256, 4, split_k)
    if m <= 16:
        block_m, block_n, block_k, programs = 16, 64, min(group_size, 64), 12 * sms
    else:
        block_m, block_n, block_k, programs = 64, 128, min(group_size, 128), 2 * sms
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = split_k_parts(tiles, k, 4 * block_k, programs)  # parts of 4 tiles or more
    return Launch(block_m, block_n, block_k, split_k)


def awq_gemm_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / G, N / 8] int32
    scales: torch.Tensor,  # [K / G, N]
    launch: Launch | tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N]
    """The fused GEMM. ``launch`` is a ``Launch`` (or its first four: BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K), by default
    ``_launch_shape``'s for this GPU; the shape decides which kernel runs, so a given one runs either kernel at any
    size: BLOCK_M below ``DOT_MIN_M`` is the GEMV (BLOCK_M rows per program; BLOCK_K rows of weights per load; K
    split in whole groups), else the ``tl.dot`` kernel."""
    m, k = x.shape
    n = scales.shape[1]
    group_size = k // scales.shape[0]
    sms = num_sms(x.device) if x.is_cuda else 132
    block_m, block_n, block_k, split_k, num_warps, num_stages = (
        Launch(*launch) if launch is not None else _launch_shape(m, n, k, group_size, sms)
    )
    if group_size % block_k:
        raise ValueError(f"BLOCK_K={block_k} must divide group_size={group_size}: a tile reads one scale row")
    gemv = block_m < DOT_MIN_M
    step = group_size if gemv else block_k  # the GEMV loops over whole groups
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), step) * step
    split_k = triton.cdiv(k, k_per_split)
    out = _output(m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    # K split: fp32 parts, added by the last program of each tile (``kernels/arrival.py``)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    row_packs = _row_packs(qweight, qzeros, scales)
    tensors = (x.contiguous(), qweight, qzeros, scales, out, partial, arrival_counters(x.device, grid[0] * grid[1]))
    tuning = dict(num_warps=num_warps, num_stages=num_stages)
    if gemv:
        compile_ahead.launch(awq_gemv_kernel, grid)(
            *tensors,
            m,
            n // 8,
            k,
            k_per_split,
            0x4B000000,
            ROW_PACKS=row_packs,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_SIZE=group_size,
            SPLIT=split_k > 1,
            **tuning,
        )
    else:
        compile_ahead.launch(_awq_gemm_kernel, grid)(
            *tensors,
            m,
            n,
            k,
            group_size,
            row_packs,
            k_per_split,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            IEEE=x.dtype == torch.float32,
            SPLIT=split_k > 1,
            **tuning,
        )
    return out


def awq_dequantize_triton(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / G, N / 8] int32
    scales: torch.Tensor,  # [K / G, N]
    dtype: torch.dtype,
) -> torch.Tensor:  # [K, N]
    """The whole weight in ``dtype``, one pass (the twin, ``dequantize``, makes several over int32 copies)."""
    k = qweight.shape[0]
    n = scales.shape[1]
    group_size = k // scales.shape[0]
    block_k = min(group_size, 32)
    out = _output(k, n, dtype, qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, 128))
    row_packs = _row_packs(qweight, qzeros, scales)
    compile_ahead.launch(_awq_dequantize_kernel, grid)(
        qweight, qzeros, scales, out, n, k, group_size, row_packs, BLOCK_N=128, BLOCK_K=block_k
    )
    return out


def _output(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A launch's output; zeros while launches only compile (``compile_ahead``: no kernel writes it, and what
    reads it must not meet NaNs)."""
    if compile_ahead.deferring():
        return torch.zeros(rows, cols, dtype=dtype, device=device)
    return torch.empty(rows, cols, dtype=dtype, device=device)


def awq_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:  # [M, N]
    if x.is_cuda and triton is not None:
        if x.shape[0] <= FUSED_MAX_M:
            return awq_gemm_triton(x, qweight, qzeros, scales)
        return x @ awq_dequantize_triton(qweight, qzeros, scales, x.dtype)  # prefill: cuBLAS does the GEMM
    return awq_gemm_torch(x, qweight, qzeros, scales)


@torch.library.custom_op("paged_backend::awq_gemm", mutates_args=())
def awq_gemm_op(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return awq_gemm(x, qweight, qzeros, scales)


@awq_gemm_op.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales.shape[1])
