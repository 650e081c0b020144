"""Matrix products whose rows do not depend on their neighbours: ``batch_invariant``'s linear layers.

A GPU's matrix product picks its kernel, and so the order it sums in, by its shape. The mode fixes the shape: a
product runs on blocks of exactly ``block`` rows (the last padded with zeros), so every row meets the one
kernel a ``block``-row product runs, whatever the batch.

Narrow products waste most of the GPU that way: a 256-row block of an 8B model's q projection fills 32 of an
H200's 132 multiprocessors. Where cuBLAS runs one product over many blocks with the kernel it runs on one block
(no split along K, tiles that do not mix rows), that product gives every row the same bits as its block, and it
is much faster. Which shapes and row counts it holds for is cuBLAS's choice, not something to assume: the first
product of each (matrix, row count) is computed both ways and compared bit for bit, and the verdict is kept for
the process (``ONE_PRODUCT``). A kernel's choice is a function of the shapes, strides, alignments, dtypes and
math mode (TF32, reduced-precision reductions) in the key, never of the values, so a verdict holds for every
later call with that key. Inside a CUDA graph capture (decode steps) nothing is checked: products there run on
blocks, which are right by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (row count, matrix, bias) layout -> whether one product over those rows gives each row its block's bits
ONE_PRODUCT: dict[tuple[object, ...], bool] = {}


def rows_in_blocks(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], block: int) -> torch.Tensor:
    """``product`` of ``x`` [..., K] by blocks of ``block`` rows (the last padded with zeros), stacked back to
    [..., N]."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if block > 1:  # always a fresh buffer: every block reaches the kernel with the same alignment and strides
        flat = torch.cat([flat, flat.new_zeros((-n) % block, flat.shape[1])])
    out = torch.cat([product(rows) for rows in flat.split(block)])[:n]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors`` (the kernels and ``out=`` have no gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def product_in_blocks(x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, block: int) -> torch.Tensor:
    """``x`` [..., K] @ ``matrix`` [K, N] (+ ``bias``), every row with the bits of a ``block``-row product. Each
    block is a view of ``x`` (made contiguous and 256-byte aligned) written straight into its rows of one fresh
    output; the whole blocks run as one product where ``ONE_PRODUCT`` found that equal; only the last partial
    block is copied, to pad it with zeros."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous() or flat.data_ptr() % 256:  # torch tells cuBLAS alignments up to 256 bytes
        flat = flat.clone(memory_format=torch.contiguous_format)
    n = flat.shape[0]
    full = n - n % block
    blocks = list(flat[:full].split(block)) if full else []  # (splitting no rows gives one block)
    if n % block:
        blocks.append(torch.cat([flat[full:], flat.new_zeros((-n) % block, flat.shape[1])]))
    if needs_grad(flat, matrix, bias) or torch.is_autocast_enabled(flat.device.type):
        # a trainer's forward: ``out=`` has no gradient and autocast skips it, so each block is its own product
        products = [torch.addmm(bias, rows, matrix) if bias is not None else rows @ matrix for rows in blocks]
        return torch.cat(products)[:n].view(*x.shape[:-1], matrix.shape[1])
    out = torch.empty(len(blocks) * block, matrix.shape[1], dtype=flat.dtype, device=flat.device)
    merged = full // block if full > block > 1 and _one_product(flat[:full], matrix, bias, out[:full], block) else 0
    for rows, rows_out in list(zip(blocks, out.split(block)))[merged:]:
        _mm(rows, matrix, bias, rows_out)
    return out[:n].view(*x.shape[:-1], matrix.shape[1])


def _mm(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(rows, matrix, out=out)
    else:
        torch.addmm(bias, rows, matrix, out=out)


def _one_product(
    rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, block: int
) -> bool:
    """Whether ``out`` now holds ``rows``' (whole blocks') products, made as one product. On a key's first call
    that product is also made by blocks and the two compared: where they differ, ``out`` takes the blocks' and
    the key answers no from then on."""
    key = (block, rows.shape, _layout(matrix), None if bias is None else _layout(bias), _math_mode())
    verdict = ONE_PRODUCT.get(key)
    if verdict is False or (verdict is None and rows.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    _mm(rows, matrix, bias, out)
    if verdict is None:
        by_blocks = torch.empty_like(out)
        for part, part_out in zip(rows.split(block), by_blocks.split(block)):
            _mm(part, matrix, bias, part_out)
        # bits, not values: a NaN equals its own bits, and -0.0 is not 0.0
        verdict = ONE_PRODUCT[key] = torch.equal(out.view(torch.uint8), by_blocks.view(torch.uint8))
        if not verdict:
            out.copy_(by_blocks)
    return True


def _math_mode() -> tuple[object, ...]:
    """The settings a product's kernel choice also follows (TF32, reduced-precision reductions): a process that
    changes them between steps gets verdicts of their own."""
    matmul = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    """What of ``t`` a kernel's choice can see: shape, strides, dtype, device and its address's alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, min(256, t.data_ptr() & -t.data_ptr()))
