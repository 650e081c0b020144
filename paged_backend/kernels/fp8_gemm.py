"""The FP8 GEMM for many rows (prefill, batched decode): ``y = (q * q_scale) @ (W * w_scale).T`` with fp8 operands,
a scale per row of the quantized activation and per output channel, on Hopper's tensor cores. Tiles come in by TMA
(the GPU's tensor-memory copy engine, ``TensorDescriptor``), persistent programs (one per SM at most) walk the
output tiles in groups of rows that share weight tiles in L2, and both scales (and a bias) are applied to the
fp32 accumulator before the one rounding to the output dtype. cuBLAS's kernel for these scales
(``torch._scaled_mm`` with row-wise scales) was slower on every shape of the 8B model on an H200 (docs/benchmarks.md,
"FP8 weights"), most of all where its 128 x 128 tiles leave SMs idle. TMA needs compute capability 9.0 and
16-byte-aligned rows; ``quantization/fp8.py`` takes ``_scaled_mm`` elsewhere.
"""

from __future__ import annotations

import functools

import torch

from paged_backend.kernels import num_sms, tl, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), largest first: the launch takes the largest whose tiles
# number at least half the SMs (fewer leave SMs idle; a smaller tile re-reads more). From the sweep in
# docs/benchmarks.md (8B shape, 256 to 8,192 rows).
TILES = ((128, 256, 128, 3, 8), (128, 128, 128, 4, 4), (64, 128, 128, 4, 4))
GROUP_M = 8  # tile rows walked together, so that their programs share weight tiles in L2


def fp8_gemm_torch(
    q: torch.Tensor,  # [M, K] fp8 (or any float)
    q_scale: torch.Tensor,  # [M] float32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """Reference twin: the scaled product in float32, the bias added, one rounding."""
    y = (q.float() * q_scale[:, None]) @ (weight.float() * weight_scale[:, None]).T
    return (y if bias is None else y + bias.float()).to(out_dtype)


def launch_tiles(m: int, n: int, sms: int) -> tuple[int, int, int, int, int]:
    """The largest of ``TILES`` whose output tiles number at least half of ``sms``, else the smallest."""
    for tile in TILES:
        if triton.cdiv(m, tile[0]) * triton.cdiv(n, tile[1]) * 2 >= sms:
            return tile
    return TILES[-1]


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read these 2-D tensors: on a CUDA device of compute capability 9.0 or later, unit column
    stride, rows and base 16-byte aligned."""
    return all(
        t.is_cuda
        and _has_tma(t.device.index if t.device.index is not None else torch.cuda.current_device())
        and t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        for t in tensors
    )


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def fp8_gemm_kernel(
        a_desc,  # q [M, K], blocks [BM, BK]
        b_desc,  # weight [N, K], blocks [BN, BK]
        c_desc,  # out [M, N], blocks [BM, BN]
        a_scale_ptr,  # [M] float32
        b_scale_ptr,  # [N] float32
        bias_ptr,  # [N], read when HAS_BIAS
        M,
        N,
        K,
        num_programs,  # at most one per SM, each walking tiles num_programs apart
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_in_group = GROUP * num_pid_n
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=True):
            first_m = (tile // tiles_in_group) * GROUP
            group_rows = tl.minimum(num_pid_m - first_m, GROUP)
            off_m = (first_m + tile % group_rows) * BLOCK_M
            off_n = ((tile % tiles_in_group) // group_rows) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):  # TMA zero-fills past the edges
                acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([off_n, k]).T, acc)
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            acc *= tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
            acc *= tl.load(b_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))  # clipped to [M, N]


def fp8_gemm_triton(
    q: torch.Tensor,  # [M, K] fp8, rows 16-byte aligned
    q_scale: torch.Tensor,  # [M] float32
    weight: torch.Tensor,  # [N, K] fp8, rows 16-byte aligned (a view into packed siblings is fine)
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    launch: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N]
    """``fp8_gemm_torch`` in one kernel. ``launch`` is (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), by
    default ``launch_tiles``'s."""
    m, k = q.shape
    n = weight.shape[0]
    sms = num_sms(q.device) if q.is_cuda else 4
    block_m, block_n, block_k, stages, warps = launch or launch_tiles(m, n, sms)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    programs = min(sms, triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    fp8_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(q, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]),
        q_scale, weight_scale, weight_scale if bias is None else bias, m, n, k, programs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M, HAS_BIAS=bias is not None,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out
