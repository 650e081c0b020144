"""Matrix products whose rows do not depend on their neighbours: ``batch_invariant``'s linear layers.

A GPU's matrix product picks its kernel, and so the order it sums in, by its shape. The mode fixes the shape: a
product runs on blocks of exactly ``block`` rows (the last padded with zeros), so every row meets the one
kernel a ``block``-row product runs, whatever the batch.

Narrow products waste most of the GPU that way: a 256-row block of an 8B model's q projection fills 32 of an
H200's 132 multiprocessors. Where cuBLAS runs one product over many blocks with the kernel it runs on one block
(no split along K, tiles that do not mix rows), that product gives every row the same bits as its block, and it
is much faster. Which shapes and row counts it holds for is cuBLAS's choice, not something to assume: before the
first product of each (matrix layout, row count), random values in tensors of the same layouts are multiplied
both ways and compared bit for bit, and the verdict is kept for the process (``ONE_PRODUCT``). A kernel's choice
is a function of the shapes, strides, alignments, dtypes and math mode (TF32, reduced-precision reductions, the
BLAS library) in the key, never of the values, so the verdict holds for every later call with that key; a
different summation order flips some of the ~256 x N outputs' last bits in every block, which random values
show. The check is a host sync in its step, once per key. Inside a CUDA graph capture nothing is checked:
products there run on blocks, which are right by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# (block, rows' shape, matrix and bias layouts, math mode) -> whether one product over those rows gives each row
# its block's bits
ONE_PRODUCT: dict[tuple[object, ...], bool] = {}
CHECK_BYTES = 512 * 2**20  # the largest product (or matrix) a check makes; larger ones run on blocks
COPY_BYTES = 16 * 2**20  # the largest input copied whole to pad its last block (one product, not two)


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
    """``x`` [..., K] @ ``matrix`` [K, N] (+ ``bias``), every row with the bits of a ``block``-row product. The
    whole blocks run as one product where ``ONE_PRODUCT`` found that equal, else a product a block, each written
    straight into its rows of one fresh output. A last partial block is padded with zeros: up to ``COPY_BYTES``
    the input is copied whole with its padding, so that it too joins the one product; a larger one is read in
    place (made contiguous and 256-byte aligned where it is not) and only its last block copied. Blocks are
    sliced only where they run alone, and the host's operations are few: a trainer's packed forward makes
    hundreds of these calls, each bound by the host."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    rows = -(-n // block) * block
    tail = None  # the last block, padded, where it is not in ``flat``
    if rows != n and flat.numel() * flat.element_size() <= COPY_BYTES:
        flat = F.pad(flat, (0, 0, 0, rows - n))  # fresh and aligned: every block whole
    else:
        if not flat.is_contiguous() or flat.data_ptr() % 256:  # torch tells cuBLAS alignments up to 256 bytes
            flat = flat.clone(memory_format=torch.contiguous_format)
        if rows != n:
            tail = F.pad(flat[n - n % block :], (0, 0, 0, rows - n))
    full = rows if tail is None else rows - block
    if needs_grad(flat, matrix, bias) or torch.is_autocast_enabled(flat.device.type):
        # a trainer's forward: ``out=`` has no gradient and autocast skips it, so each block is its own product
        blocks = [flat[i : i + block] for i in range(0, full, block)] + ([] if tail is None else [tail])
        products = [torch.addmm(bias, part, matrix) if bias is not None else part @ matrix for part in blocks]
        return torch.cat(products)[:n].view(*x.shape[:-1], matrix.shape[1])
    out = torch.empty(rows, matrix.shape[1], dtype=flat.dtype, device=flat.device)
    done = full if full > block > 1 and _one_product(flat[:full], matrix, bias, out[:full], block) else 0
    for start in range(done, full, block):
        _mm(flat[start : start + block], matrix, bias, out[start : start + block])
    if tail is not None:
        _mm(tail, matrix, bias, out[full:])
    return out[:n].view(*x.shape[:-1], matrix.shape[1])


def _mm(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(rows, matrix, out=out)
    else:
        torch.addmm(bias, rows, matrix, out=out)


def _one_product(
    rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, block: int
) -> bool:
    """Whether ``rows`` (whole blocks) went into ``out`` as one product: where ``ONE_PRODUCT`` says, or its key is
    new and ``_same_bits`` finds it so (outside a CUDA graph capture, where nothing is checked)."""
    key = (block, rows.shape, _layout(matrix), None if bias is None else _layout(bias), _math_mode())
    verdict = ONE_PRODUCT.get(key)
    if verdict is None:
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        verdict = ONE_PRODUCT[key] = _same_bits(rows, matrix, bias, block)
    if verdict:
        _mm(rows, matrix, bias, out)
    return verdict


def _same_bits(rows: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, block: int) -> bool:
    """Whether one product over ``rows``' shape gives every row the bits of its block's product, tried on random
    values in tensors of the same layouts: a step's own rows may all be one row (a warm-up's padding) and a
    weight may be zeros, on which any summation order agrees. Bits, not values, are compared (a NaN equals its
    own bits; -0.0 is not 0.0). A check whose product would exceed ``CHECK_BYTES`` is not made: no."""
    n, width = rows.shape[0], matrix.shape[1]
    if n * width * rows.element_size() > CHECK_BYTES or matrix.numel() * matrix.element_size() > CHECK_BYTES:
        return False
    generator = torch.Generator(device=rows.device).manual_seed(0)
    sample, weights = _random_like(rows, generator), _random_like(matrix, generator)
    shift = None if bias is None else _random_like(bias, generator)
    whole, by_blocks = (torch.empty(n, width, dtype=rows.dtype, device=rows.device) for _ in range(2))
    _mm(sample, weights, shift, whole)
    for part, part_out in zip(sample.split(block), by_blocks.split(block)):
        _mm(part, weights, shift, part_out)
    return torch.equal(whole.view(torch.uint8), by_blocks.view(torch.uint8))


def _random_like(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Normal values in a tensor of ``t``'s shape, strides, dtype and device, at an address of ``t``'s alignment
    (modulo 256 bytes)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    flat = torch.empty(span + 256 // t.element_size(), dtype=t.dtype, device=t.device)
    offset = (t.data_ptr() - flat.data_ptr()) % 256 // t.element_size()
    return flat.normal_(generator=generator).as_strided(t.shape, t.stride(), offset)


def _math_mode() -> tuple[object, ...]:
    """The settings a product's kernel choice also follows (TF32, reduced-precision reductions and accumulation,
    the BLAS library): a process that changes them between steps gets verdicts of their own."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # reads what either API set (the legacy getter may raise)
    return (
        precision if precision is not None else matmul.allow_tf32,
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
        getattr(matmul, "allow_fp16_accumulation", None),
        torch.backends.cuda.preferred_blas_library(),
    )


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    """What of ``t`` a kernel's choice can see: shape, strides, dtype, device and its address's alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, min(256, t.data_ptr() & -t.data_ptr()))
