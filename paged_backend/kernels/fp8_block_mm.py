"""y = x @ W.T with both operands in fp8 and a scale per block: the block-wise FP8 of DeepSeek-V3 and Qwen3-FP8
(transformers' ``quant_method: "fp8"`` with ``weight_block_size``).

The weight [N, K] has one scale per ``block_n × block_k`` tile; each activation row one per ``block_k`` inputs
(``quantize_per_group``, at run time). A product over one block of inputs is therefore a plain fp8 dot whose result
both scales multiply: the kernel walks K a block at a time and accumulates ``dot(a, b) * a_scale * w_scale`` in
float32. The twin dequantizes both operands whole and multiplies in float32: the same sums in another order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from paged_backend.kernels import num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters, split_k_parts
from paged_backend.kernels.fp8_quant import FP8, FP8_MAX, MIN_SCALE, quantize_per_row, quantize_per_row_triton


def quantize_per_group(x: torch.Tensor, group: int, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as fp8 with a float32 scale per row and ``group`` inputs ([M, ceil(K / group)]): each group is
    a row of ``quantize_per_row`` (zeros pad the last, which changes no largest magnitude). ``kernel`` quantizes
    with its one-kernel twin where no padding is needed."""
    m, k = x.shape
    groups = -(-k // group)
    padded = x if groups * group == k else F.pad(x, (0, groups * group - k))
    quantize = quantize_per_row_triton if kernel and padded is x else quantize_per_row
    q, scale = quantize(padded.reshape(m * groups, group))
    return q.reshape(m, groups * group)[:, :k], scale.reshape(m, groups)


def quantize_per_block(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as fp8 with one float32 scale per ``block_n`` x ``block_k`` tile ([ceil(N / block_n),
    ceil(K / block_k)]; the edges' tiles may be short), each tile's largest magnitude mapped to fp8's largest: the
    layout transformers' ``FineGrainedFP8Config`` writes."""
    n, k = w.shape
    rows, cols = -(-n // block_n), -(-k // block_k)
    padded = F.pad(w.float(), (0, cols * block_k - k, 0, rows * block_n - n))
    amax = padded.unflatten(0, (rows, block_n)).unflatten(-1, (cols, block_k)).abs().amax(dim=(1, 3))
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    return (w.float() / expand_scales(scale, n, k, block_n, block_k)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """Per-block scales [ceil(rows / block_rows), ceil(cols / block_cols)] as one per element [rows, cols]."""
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def fp8_block_mm_torch(
    q: torch.Tensor,  # [M, K] fp8
    q_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """Reference twin: both operands dequantized in float32, one matmul."""
    (m, k), n = q.shape, weight.shape[0]
    x = q.float() * expand_scales(q_scale.float(), m, k, 1, block_k)
    w = weight.float() * expand_scales(weight_scale.float(), n, k, block_n, block_k)
    return (x @ w.T).to(out_dtype)


if triton is not None:
    from paged_backend.kernels.arrival import add_parts, last_to_arrive

    @triton.jit
    def _e4m3_as_fp16(bits):
        """float8_e4m3fn values (their bytes, uint8) as float16 times 2^-8: sign, exponent and mantissa moved into
        fp16's fields (the exponents' biases differ by 8; e4m3's subnormals land on fp16 subnormals), exact."""
        bits = bits.to(tl.uint16)
        fp16_bits = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.uint16)  # 16 bits whatever Triton promotes
        return fp16_bits.to(tl.float16, bitcast=True)

    @triton.jit(do_not_specialize=["M"])
    def _fp8_block_mm_kernel(
        a_ptr,  # [M, K] fp8 (UPCAST: its bytes, uint8), rows contiguous
        a_scale_ptr,  # [M, K_GROUPS] float32
        b_ptr,  # [N, K] fp8 (UPCAST: its bytes), rows contiguous
        b_scale_ptr,  # [ceil(N / BLOCK_SIZE_N), K_GROUPS] float32
        out_ptr,  # [M, N]
        partial_ptr,  # [SPLIT_K, M, N] fp32 when K is split (programs along axis 2)
        counters_ptr,  # [tiles] int32 zeros (``kernels/arrival.py``)
        M,
        N,
        K,
        stride_a,
        stride_b,
        K_GROUPS,
        k_per_split,  # a multiple of BLOCK_SIZE_K
        BLOCK_SIZE_N: tl.constexpr,  # the weight's scale blocks
        BLOCK_SIZE_K: tl.constexpr,
        BLOCK_M: tl.constexpr,  # the program's tile
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # divides BLOCK_SIZE_K: one scale per step
        UPCAST: tl.constexpr,  # no fp8 units (Triton has no fp8 type there): bytes decoded to fp16, an fp16 dot
        SPLIT: tl.constexpr,  # K split: fp32 parts, the last program of a tile adds them
    ):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < M, offs_n < N
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a
        b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_b
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for start in range(k_start, k_end, BLOCK_K):
            k = start + offs_k
            a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < k_end), other=0.0)  # [BM, BK]
            b = tl.load(b_cols + k[:, None], mask=(k[:, None] < k_end) & mask_n[None, :], other=0.0)  # [BK, BN]
            group = start // BLOCK_SIZE_K
            a_scale = tl.load(a_scale_ptr + offs_m * K_GROUPS + group, mask=mask_m, other=0.0)
            b_scale = tl.load(b_scale_ptr + (offs_n // BLOCK_SIZE_N) * K_GROUPS + group, mask=mask_n, other=0.0)
            if UPCAST:  # each operand 2^-8 of its value: the product's 2^16 goes with the scales
                a, b = _e4m3_as_fp16(a), _e4m3_as_fp16(b)
                a_scale = a_scale * 65536.0
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        if SPLIT:
            tl.store(partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
            if last_to_arrive(counters_ptr + pid_m * tl.num_programs(1) + pid_n, tl.num_programs(2)):
                acc = add_parts(partial_ptr, offs_m, offs_n, mask, M, N, tl.num_programs(2), BLOCK_M, BLOCK_N)
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def step_k(block_k: int) -> int:
    """The kernel's step along K: the largest power of two up to 128 that divides ``block_k`` (Triton's fp8 dot
    needs 32)."""
    step = 128
    while block_k % step:
        step //= 2
    if step < 32:
        raise ValueError(f"fp8 block-wise weights: block_k {block_k} must be a multiple of 32")
    return step


class BlockLaunch(NamedTuple):
    """The product's launch: a program's tile, how many ways K is split, Triton's warps and pipeline stages a
    program (a plain 3-tuple of the first three takes the defaults)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def launch_shape(m: int, n: int, k: int, granule: int, sms: int) -> BlockLaunch:
    """The launch for ``m`` rows, K split in parts of ``granule`` inputs or more: up to 64 rows
    (decode of a few sequences, which reads each weight once) narrow tiles and K split until about two programs
    run per SM (the last program of a tile adds the parts); more rows, wider tiles, split only where tiles are
    few. W1 and W2 of the 8B shape under either choice are in docs/benchmarks.md ("block-wise FP8 on the GPU")."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = (2 if m <= 64 else 1) * sms
    return BlockLaunch(block_m, block_n, split_k_parts(tiles, k, granule, programs))


def fp8_block_mm_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
    upcast: bool = False,
    launch: BlockLaunch | tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The kernel (``upcast``: the fp8 operands read as bytes and the dots in fp16, for devices without fp8
    units; ``launch``: a ``BlockLaunch`` or its first three, by default ``launch_shape``'s); other arguments as the
    twin's."""
    (m, k), n = q.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    q, weight = q.contiguous(), weight.contiguous()
    sms = num_sms(q.device) if q.is_cuda else 132
    granule = block_k if q_scale.shape[1] > 1 else step_k(block_k)  # a part's K: whole scale blocks, if several
    block_m, block_n_tile, split_k, num_warps, num_stages = (
        BlockLaunch(*launch) if launch is not None else launch_shape(m, n, k, granule, sms)
    )
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), granule) * granule
    split_k = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile), split_k)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=q.device)
    counters = arrival_counters(q.device, grid[0] * grid[1] if split_k > 1 else 0)  # unread when K is whole
    if upcast:
        q, weight = q.view(torch.uint8), weight.view(torch.uint8)
    _fp8_block_mm_kernel[grid](
        q,
        q_scale.contiguous(),
        weight,
        weight_scale.contiguous(),
        out,
        partial,
        counters,
        m,
        n,
        k,
        q.stride(0),
        weight.stride(0),
        q_scale.shape[1],
        k_per_split,
        BLOCK_SIZE_N=block_n,
        BLOCK_SIZE_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n_tile,
        BLOCK_K=step_k(block_k),
        UPCAST=upcast,
        SPLIT=split_k > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
