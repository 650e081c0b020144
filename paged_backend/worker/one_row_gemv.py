"""A lone sequence's decode step: 16-bit projections at most twice as wide as their input run the GEMV, by a pass
over the decoder layer's dynamo graph.

A decode step of one sequence multiplies one row by every weight: bound by reading the weights. cuBLAS's one-row
kernels read the 8B shape's o projection (4,096 x 4,096), down projection (14,336 in, 4,096 out) and, on an H100,
the fused q/k/v (6,144 out) below the copy rate, where the GEMV that streams fp8 weights (``kernels/fp8_gemv.py``,
which reads 16-bit weights too) is faster; on the fused gate/up (28,672 out, seven times its input) cuBLAS is as
fast or faster (``benchmarks/fp8_linear.py``, column ``bf16_gemv``; docs/benchmarks.md). So a ``linear`` call of the
graph is routed to the GEMV when:

- its rows are the constant 1 (with dynamic shapes dynamo specializes a size of 1: the one-row decode graph is a
  graph of its own, and every other graph is left as it was);
- its weight is a 16-bit parameter of the layer, or the packed weight of fused siblings (worker/fuse_linears.py:
  an ``as_strided`` view over the first sibling's parameter), of its input's dtype, without a bias, with at most
  twice as many outputs as inputs;
- the weight lies on a GPU of the kind where this was measured (Hopper, compute capability 9.x).

The rule is by shape, not by name: other projections within it (a tensor-parallel rank's shard of down, a mixture
of experts' router) are routed too, though only the 8B shape's were timed.

The GEMV adds in fp32 in another order than cuBLAS: its outputs differ from cuBLAS's by bf16 rounding, as
another cuBLAS kernel's would. Batch-invariant engines never compile their layers, so they never meet this pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import fx

from paged_backend.kernels import triton
from paged_backend.kernels.fp8_gemv import GEMV_MAX_M, gemv_triton
from paged_backend.worker.fuse_linears import _LINEARS, _linear_parts, parameter_path


@torch.library.custom_op("paged_backend::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for 16-bit weights: the GEMV on CUDA up to ``GEMV_MAX_M`` rows, ``F.linear``
    elsewhere."""
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda and triton is not None and rows.shape[0] <= GEMV_MAX_M:
        out = gemv_triton(rows, weight)
    else:
        out = F.linear(rows, weight)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def measured_on(device: torch.device) -> bool:
    """Whether the GEMV's advantage was measured on ``device``'s kind of GPU (Hopper)."""
    return device.type == "cuda" and triton is not None and torch.cuda.get_device_capability(device)[0] == 9


MAX_WIDENING = 2  # outputs per input, at most: the fused q/k/v (1.5) is routed, gate/up (7) is not


def _weight(node: fx.Node) -> tuple[fx.Node, torch.Tensor, tuple[int, int], bool] | None:
    """(input, a tensor of the weight's dtype and device, the weight's (N, K), whether its rows are contiguous) of
    a bias-free ``linear`` on a layer parameter or on fused siblings' packed weight, else None."""
    parts = _linear_parts(node)
    if parts is not None:
        if parts[2] is not None:  # a bias
            return None
        value = cast(fx.Node, node.args[1]).meta.get("example_value")
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return None
        return parts[0], value, (value.shape[0], value.shape[1]), value.stride(1) == 1
    if node.op != "call_function" or node.target not in _LINEARS or node.kwargs or len(node.args) != 3:
        return None
    x, packed, bias = node.args
    if bias is not None or not isinstance(x, fx.Node) or not isinstance(packed, fx.Node):
        return None
    if packed.op != "call_function" or packed.target is not torch.as_strided or packed.kwargs:
        return None
    if len(packed.args) != 3:  # no storage offset: the view starts at the first sibling's weight
        return None
    first, size, stride = packed.args
    value = first.meta.get("example_value") if isinstance(first, fx.Node) and parameter_path(first) else None
    if not isinstance(value, torch.Tensor) or not isinstance(size, tuple) or not isinstance(stride, tuple):
        return None
    if len(size) != 2 or not all(isinstance(d, int) for d in (*size, *stride)):  # e.g. symbolic sizes
        return None
    n, k = cast(int, size[0]), cast(int, size[1])
    return x, value, (n, k), stride == (k, 1)


def _routed(node: fx.Node, on_device: Callable[[torch.device], bool]) -> bool:
    found = _weight(node)
    if found is None:
        return False
    x, w_value, (n, k), rows_contiguous = found
    x_value = x.meta.get("example_value")
    if not isinstance(x_value, torch.Tensor):
        return False
    leading = x_value.shape[:-1]
    if not all(isinstance(size, int) for size in leading) or math.prod(leading) != 1:
        return False  # a symbolic row count: the graph serves two rows or more
    return (
        w_value.dtype in (torch.bfloat16, torch.float16)
        and x_value.dtype == w_value.dtype
        and rows_contiguous
        and n <= MAX_WIDENING * k
        and on_device(w_value.device)
    )


def route_one_row_gemv(gm: fx.GraphModule, on_device: Callable[[torch.device], bool] | None = None) -> int:
    """Rewrite ``gm`` in place: each ``linear`` call the GEMV takes (see the module's docstring; ``on_device``
    says which devices, by default ``measured_on``) becomes ``paged_backend.gemv`` with the same input and weight.
    Returns how many calls were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if _routed(node, on_device or measured_on):
            node.target = torch.ops.paged_backend.gemv.default
            node.args = node.args[:2]
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
