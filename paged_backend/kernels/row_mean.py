"""Row mean: ``x.mean(-1)`` with each row summed by one program in an order set by the row's length alone.

``batch_invariant=True`` needs a norm's mean to give a row the same bits whatever the batch around it. torch's
reduction kernel splits a row over more threads when rows are few, so its order follows the batch; here every
row is one program that adds fixed chunks of ``BLOCK`` columns into a vector and sums that vector once: the
order depends on the row's length and nothing else, for one row or a hundred thousand.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import as_rows, tl, triton


def row_mean_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference twin: the mean over the last dimension in fp32, returned in ``x``'s dtype, keepdim."""
    return x.float().mean(-1, keepdim=True).to(x.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["stride_row", "n_cols"])
    def _row_mean_kernel(x_ptr, out_ptr, stride_row, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + offsets < n_cols
            acc += tl.load(x_ptr + row * stride_row + start + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.div_rn(tl.sum(acc, axis=0), n_cols.to(tl.float32))  # IEEE division
        tl.store(out_ptr + row, mean.to(out_ptr.dtype.element_ty))


def row_mean_triton(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] → its mean over the last dimension [..., 1] (keepdim), in ``x``'s dtype, summed in fp32."""
    flat, block = as_rows(x)
    out = torch.empty(flat.shape[0], dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        _row_mean_kernel[(flat.shape[0],)](flat, out, flat.stride(0), flat.shape[1], BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], 1)
