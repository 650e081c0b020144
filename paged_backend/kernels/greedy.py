"""Greedy decoding's token and its log-probability, ``argmax(logits)`` and ``logits[argmax] - logsumexp(logits)``
per row. The torch twin upcasts the whole ``[N, V]`` logits to fp32 and makes four passes over them, which at a
large batch and vocabulary is a visible part of a decode step; the Triton kernel reads each row once in its own
dtype, keeping a running maximum, its first index and an online sum of exponentials. When rows are few (decode of
one sequence), one program per row would leave most of the GPU idle while it walks a long row, so each row is cut
into slices read by programs of their own, merged by the last to finish.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import num_sms, tl, triton
from paged_backend.kernels.arrival import arrival_counters


def greedy_tokens_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V] -> [N], [N]
    logits = logits.float()  # [N, V]
    tokens = logits.argmax(dim=-1)
    return tokens, logits.gather(1, tokens[:, None])[:, 0] - logits.logsumexp(dim=-1)


if triton is not None:
    from paged_backend.kernels.arrival import last_to_arrive

    @triton.jit
    def _greedy_kernel(
        logits_ptr,  # [N, V]
        row_stride,
        tokens_ptr,  # [N] int64
        logprobs_ptr,  # [N] fp32
        best_ptr,  # [N, SPLITS] fp32: each slice's maximum (SPLITS > 1 only)
        index_ptr,  # [N, SPLITS] int64: its first index
        total_ptr,  # [N, SPLITS] fp32: its sum of exp(logit - maximum)
        counters_ptr,  # [N] int32 zeros (``kernels/arrival.py``)
        V,
        v_per_split,  # a multiple of BLOCK_V
        BLOCK_V: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """Program (row, s) reads slice s of the row; with several slices the last one to finish merges them."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        row_start = logits_ptr + row.to(tl.int64) * row_stride  # 64-bit: rows x a large vocabulary pass 2**31
        offs = tl.arange(0, BLOCK_V)
        best = tl.full((), float("-inf"), tl.float32)
        best_index = tl.full((), 0, tl.int64)
        total = tl.full((), 0.0, tl.float32)  # sum of exp(logit - best)
        v_start = split * v_per_split
        for v0 in range(v_start, tl.minimum(V, v_start + v_per_split), BLOCK_V):
            mask = v0 + offs < V
            x = tl.load(row_start + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32)
            block_best, block_index = tl.max(x, axis=0, return_indices=True)  # the maximum's first index
            new_best = tl.maximum(best, block_best)
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # all masked so far: no inf - inf
            total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
            if block_best > best:  # strictly: an earlier block keeps a tie, as torch.argmax does
                best_index = (v0 + block_index).to(tl.int64)
            best = new_best
        if SPLITS == 1:
            tl.store(tokens_ptr + row, best_index)
            tl.store(logprobs_ptr + row, -tl.log(total))  # logits[best] - (best + log(total))
        else:
            tl.store(best_ptr + row * SPLITS + split, best)
            tl.store(index_ptr + row * SPLITS + split, best_index)
            tl.store(total_ptr + row * SPLITS + split, total)
            if last_to_arrive(counters_ptr + row, SPLITS):
                offs_s = row * SPLITS + tl.arange(0, SPLITS)
                bests = tl.load(best_ptr + offs_s, cache_modifier=".cg")  # [SPLITS]
                indices = tl.load(index_ptr + offs_s, cache_modifier=".cg")
                totals = tl.load(total_ptr + offs_s, cache_modifier=".cg")
                best = tl.max(bests, axis=0)
                # a tie across slices: the first index (an empty or all -inf slice has total 0 and weighs nothing)
                best_index = tl.min(tl.where(bests == best, indices, V), axis=0)
                shift = tl.where(best == float("-inf"), 0.0, best)
                scale = tl.where(totals > 0, tl.exp(bests - shift), 0.0)
                tl.store(tokens_ptr + row, best_index)
                tl.store(logprobs_ptr + row, -tl.log(tl.sum(totals * scale, axis=0)))

    def greedy_tokens_triton(
        logits: torch.Tensor, splits: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V] -> [N], [N]
        """``splits`` slices a row (a power of two; default: enough programs to fill the GPU when rows are few,
        at least four blocks a slice)."""
        n, v = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        if not n:
            return tokens, logprobs
        block_v = 2048
        if splits is None:
            programs = 2 * (num_sms(logits.device) if logits.is_cuda else 132)
            splits = 1
            while n * splits * 2 <= programs and v >= splits * 2 * 4 * block_v:
                splits *= 2
        if splits < 1 or splits & (splits - 1):
            raise ValueError(f"splits must be a power of two (1, 2, 4, ...), got {splits}")
        v_per_split = triton.cdiv(triton.cdiv(v, splits), block_v) * block_v
        best = torch.empty(n, splits, dtype=torch.float32, device=logits.device)  # each slice's part
        index = torch.empty(n, splits, dtype=torch.long, device=logits.device)
        total = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
        _greedy_kernel[(n, splits)](
            logits,
            logits.stride(0),
            tokens,
            logprobs,
            best,
            index,
            total,
            arrival_counters(logits.device, n),
            v,
            v_per_split,
            BLOCK_V=block_v,
            SPLITS=splits,
            num_warps=8,
        )
        return tokens, logprobs


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V] -> [N], [N]
    """Argmax of each row and its log-probability, on the device, without a host sync."""
    if logits.is_cuda and triton is not None:
        return greedy_tokens_triton(logits)
    return greedy_tokens_torch(logits)
