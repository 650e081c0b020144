"""RMSNorm in one kernel, with each row summed by one program in an order set by the row's length alone.

``batch_invariant=True`` runs the layers eagerly, where HF's RMSNorm is seven kernels over fp32 copies of the
activations; this is one pass to sum the squares and one to scale, rounding where HF rounds (normalised in
fp32, rounded to the input's dtype, then multiplied by the weight) but summing in its own order. Like
``row_mean.py``, a row's sum adds fixed chunks of ``BLOCK`` columns and then sums them once: the same bits for
one row or a hundred thousand.
"""

from __future__ import annotations

import torch

from paged_backend.kernels import as_rows, tl, triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference twin: HF's ``LlamaRMSNorm.forward`` (and its copies in Mistral, Qwen2, Qwen3 and others)."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["stride_x", "stride_out", "n_cols"])
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + offsets, mask=start + offsets < n_cols, other=0.0)
            x = x.to(tl.float32)
            acc += x * x
        variance = tl.div_rn(tl.sum(acc, axis=0), n_cols.to(tl.float32))
        rstd = tl.rsqrt(variance + eps)
        for start in range(0, n_cols, BLOCK):
            mask = start + offsets < n_cols
            x = tl.load(x_ptr + row * stride_x + start + offsets, mask=mask, other=0.0)
            normed = (x.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            weight = tl.load(weight_ptr + start + offsets, mask=mask, other=0.0).to(tl.float32)
            out = (weight * normed).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * stride_out + start + offsets, out, mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` [..., K] normalised over its last dimension and scaled by ``weight`` [K]; the result's dtype is
    ``weight``'s and ``x``'s promoted, as HF's product gives."""
    flat, block = as_rows(x)
    out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](
            flat, weight.contiguous(), out, flat.stride(0), out.stride(0), flat.shape[1], float(eps), BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)
