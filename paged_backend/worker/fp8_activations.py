"""FP8 layers' activation quantization moved into the compiled decoder layer, where inductor fuses it into what
produces the activation.

An FP8 layer with quantized activations (per token, or with a static scale) reads its input once to find the
row's largest magnitude and again to quantize it, in a kernel of its own after the kernel that wrote the input:
RMSNorm's before q/k/v and gate/up, SiLU·mul's before down. Written as torch ops in the graph instead, the
quantization joins that kernel, which then writes fp8 rows and their scales rather than bf16 rows for another
kernel to read back. This pass replaces each such ``paged_backend.fp8_linear`` call of the dynamo graph (fused
siblings included: ``fuse_linears.py`` runs first, so q/k/v quantize once) by ``quantized_fp8_linear``: the
quantization in torch ops, then one opaque ``paged_backend.fp8_scaled_mm``. The arithmetic is the op's own (the
same twins, the same fp8 products): what moves is where the quantization runs. Its bits are the op's too
once the graph compiles ``with divides_as_eager()``: inductor otherwise lowers an fp32 ``/`` to Triton's
approximate division, where eager CUDA and ``kernels/fp8_quant.py`` round it, and a scale one bit off moves
values across fp8's rounding boundaries.

Block-wise FP8 layers (``paged_backend.fp8_block_linear``) always quantize their input, per token and block of
inputs: each call becomes ``quantized_fp8_block_linear`` (torch ops, then the opaque ``fp8_block_mm``).

Left as they are: weight-only layers, and per-token calls on rows the fp8 GEMV takes (``GEMV_ROWS``: it
multiplies unquantized activations). With dynamic shapes dynamo specializes a size of 1, so a decode graph of
one row keeps its GEMV and a graph whose rows are a symbol (two or more) is rewritten.
"""

from __future__ import annotations

import contextlib

from torch import fx

from paged_backend.quantization.fp8 import GEMV_ROWS, quantized_fp8_linear
from paged_backend.quantization.fp8_block import quantized_fp8_block_linear

FP8_LINEAR = "paged_backend.fp8_linear.default"
FP8_BLOCK_LINEAR = "paged_backend.fp8_block_linear.default"  # quantization/fp8_block.py: always quantizes


def _quantizes(node: fx.Node) -> bool:
    """Whether an ``fp8_linear`` call quantizes its input at every row count its graph runs."""
    x, _, _, dynamic, *rest = node.args
    if rest and rest[0] is not None:  # a static input scale: quantized at every row count
        return True
    if not dynamic:  # weight-only
        return False
    example = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    rows = None if example is None else example.shape[0]
    return not (isinstance(rows, int) and rows <= GEMV_ROWS)  # a symbol: two rows or more


def quantize_fp8_activations(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: each ``fp8_linear`` call that quantizes its input becomes
    ``quantized_fp8_linear`` with the same arguments, each ``fp8_block_linear`` call ``quantized_fp8_block_linear``.
    Returns how many calls were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if str(node.target) == FP8_LINEAR and _quantizes(node):
            node.target = quantized_fp8_linear
            rewritten += 1
        elif str(node.target) == FP8_BLOCK_LINEAR:
            node.target = quantized_fp8_block_linear
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def divides_as_eager() -> contextlib.AbstractContextManager[object]:
    """Inductor's IEEE-rounded fp32 division (``div_rn``) while a graph compiles, where this torch has the
    setting; elsewhere nothing changes."""
    import torch._inductor.config as inductor_config

    numerics = getattr(inductor_config, "eager_numerics", None)
    if numerics is None or not hasattr(numerics, "division_rounding"):
        return contextlib.nullcontext()
    return inductor_config.patch({"eager_numerics.division_rounding": True})
