"""The batched LoRA delta: each token adds ``(x A[s]^T) B[s]^T`` of its own adapter slot ``s`` (-1: none), for a
batch that mixes adapters (shrink to rank r, then expand). The torch twin groups tokens by slot; the Triton
kernels gather each token's adapter (BGMV), which needs no host sync."""

from __future__ import annotations

import torch

from paged_backend.kernels import tl, triton


def lora_delta_torch(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R] (scaled)
    token_slots: torch.Tensor,  # [T] int64, -1 = no adapter
) -> torch.Tensor:  # [T, out]
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = token_slots == slot
        shrunk = x[rows] @ lora_a[slot].to(x.dtype).t()  # [t, R]
        out[rows] = shrunk @ lora_b[slot].to(x.dtype).t()
    return out


if triton is not None:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr,  # [T, K]
        a_ptr,  # [S, R, K]
        slots_ptr,  # [T]
        out_ptr,  # [T, R] fp32
        K,
        R,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t)
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        if slot >= 0:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + t * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)  # [BK]
                a = tl.load(
                    a_ptr + slot * R * K + offs_r[:, None] * K + offs_k[None, :],
                    mask=(offs_r[:, None] < R) & (offs_k[None, :] < K),
                    other=0.0,
                ).to(tl.float32)  # [BR, BK]
                acc += tl.sum(a * x[None, :], axis=1)
        tl.store(out_ptr + t * R + offs_r, acc, mask=offs_r < R)

    @triton.jit
    def _lora_expand_kernel(
        shrunk_ptr,  # [T, R] fp32
        b_ptr,  # [S, N, R]
        slots_ptr,  # [T]
        out_ptr,  # [T, N]
        N,
        R,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        slot = tl.load(slots_ptr + t)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if slot >= 0:
            y = tl.load(shrunk_ptr + t * R + offs_r, mask=offs_r < R, other=0.0)  # [BR]
            b = tl.load(
                b_ptr + slot * N * R + offs_n[:, None] * R + offs_r[None, :],
                mask=(offs_n[:, None] < N) & (offs_r[None, :] < R),
                other=0.0,
            ).to(tl.float32)  # [BN, BR]
            acc = tl.sum(b * y[None, :], axis=1)
        tl.store(out_ptr + t * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def lora_delta_triton(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    lora_b: torch.Tensor,  # [S, out, R]
    token_slots: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, out]
    """Per-token gathered matrix-vector products (BGMV): shrink to rank R, then expand. No host sync and fixed
    shapes, so it can run inside a CUDA graph."""
    x = x.contiguous()
    t, k = x.shape
    _, n, r = lora_b.shape
    block_r = max(16, triton.next_power_of_2(r))
    shrunk = torch.empty(t, r, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(t,)](x, lora_a, token_slots, shrunk, k, r, BLOCK_R=block_r, BLOCK_K=64)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block_n = 64
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](
        shrunk, lora_b, token_slots, out, n, r, BLOCK_R=block_r, BLOCK_N=block_n
    )
    return out


def lora_delta(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:  # [T, out]
    if x.is_cuda and triton is not None:
        return lora_delta_triton(x, lora_a, lora_b, token_slots)
    return lora_delta_torch(x, lora_a, lora_b, token_slots)


@torch.library.custom_op("paged_backend::lora_delta", mutates_args=())
def lora_delta_op(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:  # [T, out]
    """``lora_delta`` as one opaque op, so that a compiled decoder layer calls it as is (and a CUDA graph captures
    its kernels) instead of tracing into the twin's data-dependent grouping."""
    if token_slots.shape[0] != x.shape[0]:
        raise ValueError(f"token_slots holds {token_slots.shape[0]} slots for {x.shape[0]} tokens")
    return lora_delta(x, lora_a, lora_b, token_slots)


@lora_delta_op.register_fake
def _(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], lora_b.shape[1])
