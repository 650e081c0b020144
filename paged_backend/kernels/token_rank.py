"""Per row of logits: its logsumexp, its first argmax, and the rank of a given token (1 + how many logits are
larger) — what prompt logprobs need of each prompt position. The torch twin upcasts a slice of rows to fp32 and
makes four passes over it; the Triton kernel reads each row once in its own dtype, as ``kernels/greedy.py`` does
(running maximum, its first index, an online sum of exponentials), counting the logits above the given token's.
A scored prompt has one row per token, so rows are many and each row gets one program.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import tl, triton

ROWS_PER_SLICE = 256  # the twin's float32 copy of [256, 128k] logits is 128 MiB


def token_rank_torch(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N, V], [N] -> lse [N] fp32, ranks [N], argmax [N]
    lse, ranks, argmax = [], [], []
    for start in range(0, logits.shape[0], ROWS_PER_SLICE):
        rows = logits[start : start + ROWS_PER_SLICE].float()  # [S, V]
        chosen = rows.gather(1, targets[start : start + ROWS_PER_SLICE, None])  # [S, 1]
        lse.append(rows.logsumexp(dim=-1))
        ranks.append((rows > chosen).sum(-1) + 1)
        argmax.append(rows.argmax(dim=-1))
    if not lse:
        empty = logits.new_empty(0, dtype=torch.long)
        return logits.new_empty(0, dtype=torch.float32), empty, empty
    return torch.cat(lse), torch.cat(ranks), torch.cat(argmax)


if triton is not None:

    @triton.jit
    def _token_rank_kernel(
        logits_ptr,  # [N, V]
        row_stride,
        targets_ptr,  # [N] int64
        lse_ptr,  # [N] fp32
        ranks_ptr,  # [N] int64
        argmax_ptr,  # [N] int64
        V,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        row_start = logits_ptr + row.to(tl.int64) * row_stride  # 64-bit: rows x a large vocabulary pass 2**31
        chosen = tl.load(row_start + tl.load(targets_ptr + row)).to(tl.float32)
        offs = tl.arange(0, BLOCK_V)
        best = tl.full((), float("-inf"), tl.float32)
        best_index = tl.full((), 0, tl.int64)
        total = tl.full((), 0.0, tl.float32)  # sum of exp(logit - best)
        above = tl.full((), 0, tl.int64)  # logits larger than the chosen one
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row_start + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            block_best, block_index = tl.max(x, axis=0, return_indices=True)  # the maximum's first index
            new_best = tl.maximum(best, block_best)
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # all masked so far: no inf - inf
            total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
            if block_best > best:  # strictly: an earlier block keeps a tie, as torch.argmax does
                best_index = (v0 + block_index).to(tl.int64)
            best = new_best
            above += tl.sum((x > chosen).to(tl.int64), axis=0)
        tl.store(lse_ptr + row, best + tl.log(total))
        tl.store(ranks_ptr + row, above + 1)
        tl.store(argmax_ptr + row, best_index)

    def token_rank_triton(
        logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N, V], [N] -> lse [N] fp32, ranks [N], argmax [N]
        """Triton twin of :func:`token_rank_torch`."""
        n, v = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        ranks = torch.empty(n, dtype=torch.long, device=logits.device)
        argmax = torch.empty(n, dtype=torch.long, device=logits.device)
        if n:
            _token_rank_kernel[(n,)](
                logits, logits.stride(0), targets, lse, ranks, argmax, v, BLOCK_V=2048, num_warps=8
            )  # fmt: skip
        return lse, ranks, argmax


def token_rank(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's logsumexp (fp32), the rank of ``targets[i]`` in row i, and the row's first argmax; on the
    device, without a host sync."""
    if logits.is_cuda and triton is not None:
        return token_rank_triton(logits, targets.contiguous())
    return token_rank_torch(logits, targets)
