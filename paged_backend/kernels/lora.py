"""The batched LoRA delta: each token adds ``(x A[s]^T) B[s]^T`` of the adapter at its LoRA index ``s`` (-1: none),
for a batch that mixes adapters (shrink to rank r, then expand). The torch twin groups tokens by index; the Triton
kernels run each block of tokens once per LoRA index its tokens use, with tiled dots, and need no host sync."""

from __future__ import annotations

import torch

from paged_backend.kernels import tl, triton


def lora_delta_torch(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R] (scaled)
    token_lora_indices: torch.Tensor,  # [T] int64, -1 = no adapter
) -> torch.Tensor:  # [T, out]
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for index in token_lora_indices.unique().tolist():
        if index < 0:
            continue
        rows = token_lora_indices == index
        shrunk = x[rows] @ lora_a[index].to(x.dtype).t()  # [t, R]
        out[rows] = shrunk @ lora_b[index].to(x.dtype).t()
    return out


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr,  # [T, K]
        a_ptr,  # [S, R, K]
        indices_ptr,  # [T]
        out_ptr,  # [T, S, R] fp32
        T,
        K,
        R,
        S,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,  # fp32 inputs: full-precision dots, not TF32
    ):
        """Tokens ``pid_m``'s block against index ``pid_s``'s A; rows of other indices are stored as zeros. A block
        no token of which uses the index skips the loop."""
        pid_m = tl.program_id(0)
        index = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        mask_m = offs_m < T
        token_lora_indices = tl.load(indices_ptr + offs_m, mask=mask_m, other=-1)  # [BM]
        mine = token_lora_indices == index
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                x = tl.load(
                    x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
                )  # [BM, BK]
                a = tl.load(
                    a_ptr + index * R * K + offs_r[None, :] * K + offs_k[:, None],
                    mask=(offs_r[None, :] < R) & mask_k[:, None],
                    other=0.0,
                ).to(x.dtype)  # [BK, BR]
                if IEEE:
                    acc += tl.dot(x, a, input_precision="ieee")
                else:
                    acc += tl.dot(x, a)
            acc = tl.where(mine[:, None], acc, 0.0)
        tl.store(
            out_ptr + offs_m[:, None] * S * R + index * R + offs_r[None, :],
            acc,
            mask=mask_m[:, None] & (offs_r[None, :] < R),
        )

    @triton.jit
    def _lora_expand_kernel(
        shrunk_ptr,  # [T, S, R] fp32, zero outside each token's index
        b_ptr,  # [S, N, R]
        indices_ptr,  # [T]
        out_ptr,  # [T, N]
        T,
        N,
        R,
        S,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Sums each index's ``shrunk @ B^T`` over the indices that the block's tokens use."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        mask_m = offs_m < T
        mask_n = offs_n < N
        token_lora_indices = tl.load(indices_ptr + offs_m, mask=mask_m, other=-1)  # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for index in range(0, S):
            if tl.max((token_lora_indices == index).to(tl.int32), axis=0) > 0:
                y = tl.load(
                    shrunk_ptr + offs_m[:, None] * S * R + index * R + offs_r[None, :],
                    mask=mask_m[:, None] & (offs_r[None, :] < R),
                    other=0.0,
                ).to(out_ptr.dtype.element_ty)  # [BM, BR]
                b = tl.load(
                    b_ptr + index * N * R + offs_n[None, :] * R + offs_r[:, None],
                    mask=mask_n[None, :] & (offs_r[:, None] < R),
                    other=0.0,
                ).to(out_ptr.dtype.element_ty)  # [BR, BN]
                if IEEE:
                    acc += tl.dot(y, b, input_precision="ieee")
                else:
                    acc += tl.dot(y, b)
        tl.store(
            out_ptr + offs_m[:, None] * N + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


def lora_delta_triton(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    token_lora_indices: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, out]
    """Tiled shrink and expand with ``tl.dot``: each block of tokens runs once per adapter index that one of its
    tokens uses, keeping only its own tokens' rows. Every weight tile is read once per block of 64 tokens (not once
    per token, as a gather per token would), no host sync and fixed shapes, so it runs inside a CUDA graph."""
    x = x.contiguous()
    t, k = x.shape
    s, n, r = lora_b.shape
    block_m, block_r = 64 if t > 16 else 16, max(16, triton.next_power_of_2(r))
    ieee = x.dtype == torch.float32
    shrunk = torch.empty(t, s, r, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(triton.cdiv(t, block_m), s)](
        x, lora_a, token_lora_indices, shrunk, t, k, r, s, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, IEEE=ieee
    )
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block_n = 128
    _lora_expand_kernel[(triton.cdiv(t, block_m), triton.cdiv(n, block_n))](
        shrunk,
        lora_b,
        token_lora_indices,
        out,
        t,
        n,
        r,
        s,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        IEEE=ieee,
    )
    return out


def lora_delta(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor
) -> torch.Tensor:  # [T, out]
    if x.is_cuda and triton is not None:
        return lora_delta_triton(x, lora_a, lora_b, token_lora_indices)
    return lora_delta_torch(x, lora_a, lora_b, token_lora_indices)


@torch.library.custom_op("paged_backend::lora_delta", mutates_args=())
def lora_delta_op(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor
) -> torch.Tensor:  # [T, out]
    """``lora_delta`` as one opaque op, so that a compiled decoder layer calls it as is (and a CUDA graph captures
    its kernels) instead of tracing into the twin's data-dependent grouping."""
    if token_lora_indices.shape[0] != x.shape[0]:
        raise ValueError(f"token_lora_indices holds {token_lora_indices.shape[0]} entries for {x.shape[0]} tokens")
    return lora_delta(x, lora_a, lora_b, token_lora_indices)


@lora_delta_op.register_fake
def _(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], lora_b.shape[1])
