"""A lone sequence's decode step: 16-bit projections no wider than their input run the GEMV, by a pass over the
decoder layer's dynamo graph.

A decode step of one sequence multiplies one row by every weight: bound by reading the weights. cuBLAS's one-row
kernels read the 8B shape's o projection (4,096 x 4,096) and down projection (14,336 in, 4,096 out) below the
copy rate, where the GEMV that streams fp8 weights (``kernels/fp8_gemv.py``, which reads 16-bit weights too) is
faster; on the wider q/k/v and gate/up products cuBLAS is as fast or faster (``benchmarks/fp8_linear.py``,
column ``bf16_gemv``; docs/benchmarks.md). So a ``linear`` call of the graph is routed to the GEMV when:

- its rows are the constant 1 (with dynamic shapes dynamo specializes a size of 1: the one-row decode graph is a
  graph of its own, and every other graph is left as it was);
- its weight is a 16-bit parameter of the layer, of its input's dtype, without a bias, with at most as many
  outputs as inputs (fused siblings read a view of a packed buffer, not a parameter, and stay cuBLAS's: q/k/v and
  gate/up are wider than their input on the models measured);
- the weight lies on a GPU of the kind where this was measured (Hopper, compute capability 9.x).

The rule is by shape, not by name: other projections no wider than their input (a tensor-parallel rank's shard of
down, a mixture of experts' router) are routed too, though only the 8B shape's o and down were timed.

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
from paged_backend.worker.fuse_linears import _linear_parts


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


def _routed(node: fx.Node, on_device: Callable[[torch.device], bool]) -> bool:
    parts = _linear_parts(node)
    if parts is None or parts[2] is not None:  # not a linear on the layer's parameters, or with a bias
        return False
    weight = cast(fx.Node, node.args[1])  # _linear_parts found it a placeholder of the layer's parameters
    x_value, w_value = parts[0].meta.get("example_value"), weight.meta.get("example_value")
    if not isinstance(x_value, torch.Tensor) or not isinstance(w_value, torch.Tensor) or w_value.dim() != 2:
        return False
    leading = x_value.shape[:-1]
    if not all(isinstance(size, int) for size in leading) or math.prod(leading) != 1:
        return False  # a symbolic row count: the graph serves two rows or more
    n, k = w_value.shape
    return (
        w_value.dtype in (torch.bfloat16, torch.float16)
        and x_value.dtype == w_value.dtype
        and w_value.stride(1) == 1
        and n <= k
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
