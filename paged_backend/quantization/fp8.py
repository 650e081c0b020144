"""FP8 linear layers: float8_e4m3fn weights with a scale per output channel; activations in the model's dtype,
quantized per token at run time (``dynamic_activations``, compressed-tensors' ``FP8_DYNAMIC``, vLLM's online
``quantization="fp8"``), or quantized with the checkpoint's one static scale (``input_scale``, compressed-tensors'
``FP8``: ``x`` as ``clamp(x / input_scale)`` in fp8, as the checkpoint was calibrated and as vLLM runs it).

On a GPU with fp8 matrix units (compute capability 8.9 or later), a lone row (decode of one sequence) runs the fp8
GEMV (``kernels/fp8_gemv.py``): bound by reading the weights, which it streams, it multiplies the activations as
they are (a product of fp8 weights and unquantized activations, closer to the model than the fp8 GEMM's). More
rows: the activation is quantized per token by one kernel (``kernels/fp8_quant.py``), then ``y = x @ W.T`` is a
product of fp8 operands with the activation's per-token and the weight's per-channel scales: up to
``KERNEL_MAX_ROWS`` rows our split-K kernel (``kernels/fp8_block_mm.py``, its scale blocks 1 x K; K a multiple of
32), above them one ``torch._scaled_mm`` (fast accumulation: the tensor cores' own sums); elsewhere its torch twin
(``fp8_linear_torch``) computes the same quantities in float32: the activation rounded through fp8 per token, the
weight dequantized. Weight-only checkpoints (no activation scheme) run the twin above one row on every device, and
so do models in float32, and float16 ones above ``KERNEL_MAX_ROWS`` rows (the fp8 GEMM's row-wise scales write
bfloat16). In the compiled decoder layer the quantization is torch ops of the graph instead
(``quantized_fp8_linear``, put in place by ``worker/fp8_activations.py``), which inductor fuses into the kernel
that produces the activation.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paged_backend.kernels import triton
from paged_backend.kernels.fp8_block_mm import fp8_block_mm_triton
from paged_backend.kernels.fp8_gemv import fp8_gemv_torch, fp8_gemv_triton
from paged_backend.kernels.fp8_quant import FP8, FP8_MAX, quantize_per_row, quantize_per_row_triton


def fp8_linear_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    dynamic_activations: bool,
    input_scale: torch.Tensor | None = None,  # [1] float32: a static activation scale
) -> torch.Tensor:  # [M, N] in x's dtype
    if input_scale is not None:
        q, scale = quantize_static(x, input_scale)
        return fp8_gemv_torch(q.float() * scale, weight, weight_scale).to(x.dtype)
    if dynamic_activations:
        q, scale = quantize_per_row(x)
        return fp8_gemv_torch(q.float() * scale, weight, weight_scale).to(x.dtype)
    return fp8_gemv_torch(x, weight, weight_scale)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as fp8 with one given scale (saturating), and that scale as every row's ([M, 1] float32)."""
    scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def has_fp8_matmul(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and _fp8_capable(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


GEMV_ROWS = 1  # rows up to which the fp8 GEMV runs (docs/benchmarks.md, "FP8 weights")
# Rows up to which the product of quantized activations runs the split-K fp8 kernel (kernels/fp8_block_mm.py with
# one scale per row and per output channel: blocks of 1 x K) rather than torch._scaled_mm, whose tiles read the
# weights far below the copy rate at a few rows. Placed from the same kernel over 128 x 128 blocks (the column
# ``fp8_block_kernel`` of benchmarks/fp8_linear.py; on an H200, 16 rows of the 8B shape's down projection: 23 µs,
# torch._scaled_mm 49, bf16 33; torch._scaled_mm the faster from 96 rows on; docs/benchmarks.md, "FP8 products
# by row count"); the 1 x K blocks have a column of their own there (``fp8_kernel``).
KERNEL_MAX_ROWS = 64


def fp8_scaled_mm(
    q: torch.Tensor,  # [M, K] fp8: activations already quantized
    scale: torch.Tensor,  # [M, 1] float32: their per-row scales
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N]
    """The product of quantized activations and fp8 weights on the GPU's fp8 units: up to ``KERNEL_MAX_ROWS``
    rows, K a multiple of 32 and a 16-bit output, the split-K kernel (fp32 sums); otherwise one
    ``torch._scaled_mm`` when the output is bfloat16 (its row-wise scales write bfloat16); elsewhere the twin's
    float32 over the dequantized operands. ``torch._scaled_mm`` with fast accumulation (the tensor cores' own
    accumulator, not promoted to fp32 every few K tiles), as torchao's and fbgemm's row-wise FP8 inference run it:
    the error stays the fp8 operands' and it is faster at 256 rows (both measured in docs/benchmarks.md, "FP8
    linear calls")."""
    (m, k), fp8_units = q.shape, q.is_cuda and has_fp8_matmul(q.device)
    kernel_takes = m <= KERNEL_MAX_ROWS and k % 32 == 0 and out_dtype in (torch.bfloat16, torch.float16)
    if fp8_units and triton is not None and kernel_takes:
        return fp8_block_mm_triton(q, scale, weight, weight_scale[:, None], 1, k, out_dtype)
    if fp8_units and out_dtype == torch.bfloat16:
        return torch._scaled_mm(
            q, weight.T, scale_a=scale, scale_b=weight_scale[None, :], out_dtype=out_dtype, use_fast_accum=True
        )
    return fp8_gemv_torch(q.float() * scale, weight, weight_scale).to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dynamic: bool,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [M, K] times the fp8 ``weight`` [N, K] (per-row ``weight_scale``). Where the device has fp8 units, the
    GEMV up to ``GEMV_ROWS`` rows (``x`` unquantized), above it ``x`` quantized per token by one kernel; with a
    static ``input_scale``, ``x`` quantized with it at every row count (the GEMV multiplies unquantized
    activations). Quantized activations go through ``fp8_scaled_mm``; weight-only layers above the GEMV's rows,
    and every layer without fp8 units, through the twins."""
    fp8_units = x.is_cuda and has_fp8_matmul(x.device) and triton is not None
    if input_scale is not None:
        return fp8_scaled_mm(*quantize_static(x, input_scale), weight, weight_scale, x.dtype)
    if fp8_units and x.shape[0] <= GEMV_ROWS:
        return fp8_gemv_triton(x, weight, weight_scale)
    if dynamic:
        q, scale = quantize_per_row_triton(x) if fp8_units else quantize_per_row(x)
        return fp8_scaled_mm(q, scale, weight, weight_scale, x.dtype)
    return fp8_linear_torch(x, weight, weight_scale, False)


def quantized_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dynamic: bool,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_linear`` where it quantizes ``x`` (per token, or with ``input_scale``), written for a compiled graph:
    the quantization in torch ops, which inductor fuses into what produced ``x``, then one opaque
    ``fp8_scaled_mm`` (worker/fp8_activations.py puts it in place of ``fp8_linear_op``)."""
    if input_scale is None and not dynamic:
        raise ValueError("quantized_fp8_linear: a weight-only layer does not quantize its activations")
    q, scale = quantize_per_row(x) if input_scale is None else quantize_static(x, input_scale)
    return fp8_scaled_mm_op(q, scale, weight, weight_scale, x.dtype)


# One op in compiled graphs, so that sibling layers' calls fuse into one (worker/fuse_linears.py; a static input
# scale is a buffer of each layer's own, so such calls are not siblings).
@torch.library.custom_op("paged_backend::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dynamic: bool,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return fp8_linear(x, weight, weight_scale, dynamic, input_scale)


@fp8_linear_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    dynamic: bool,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("paged_backend::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm_op(
    q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return fp8_scaled_mm(q, scale, weight, weight_scale, out_dtype)


@fp8_scaled_mm_op.register_fake
def _(
    q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    return q.new_empty(q.shape[0], weight.shape[0], dtype=out_dtype)


class FP8Linear(nn.Module):
    """``nn.Linear``'s interface over fp8 weights: ``y = x @ (W * s).T + bias``, ``x`` per token through fp8 when
    ``dynamic_activations``, through fp8 with the one ``input_scale`` when ``static_activations``."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn, buffer
    weight_scale: torch.Tensor  # [out] float32, buffer
    input_scale: torch.Tensor | None  # [1] float32, buffer (static activations only)
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dynamic_activations: bool,
        device: torch.device | str | None = None,
        static_activations: bool = False,
    ) -> None:
        super().__init__()
        if dynamic_activations and static_activations:
            raise ValueError("FP8Linear: activations are quantized per token at run time or statically, not both")
        self.in_features, self.out_features = in_features, out_features
        self.dynamic_activations = dynamic_activations
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        scale = torch.empty(1, dtype=torch.float32, device=device) if static_activations else None
        self.register_buffer("input_scale", scale)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, dynamic_activations: bool = True) -> FP8Linear:
        """``linear``'s weight quantized per output channel (vLLM's online ``quantization="fp8"``)."""
        device = linear.weight.device
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, dynamic_activations, device)
        q, scale = quantize_per_row(linear.weight.detach())
        layer._buffers["weight"], layer._buffers["weight_scale"] = q, scale[:, 0]
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.out_features, self.in_features), "weight_scale": (self.out_features,)}
        shapes |= {"input_scale": (1,)} if self.input_scale is not None else {}
        return shapes | ({"bias": (self.out_features,)} if self.bias is not None else {})

    def load_buffer(self, attr: str, tensor: torch.Tensor, key: str, device: torch.device) -> None:
        """A checkpoint's tensor for one of the packed buffers, checked against the layer's shape and dtype."""
        if tuple(tensor.shape) != self.expected_shapes()[attr]:
            expected = self.expected_shapes()[attr]
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {expected}")
        if attr == "weight" and tensor.dtype != FP8:
            raise ValueError(f"checkpoint tensor {key} has dtype {tensor.dtype}, expected {FP8}")
        self._buffers[attr] = tensor.to(device=device, dtype=FP8 if attr == "weight" else torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        linear = fp8_linear_op if torch.compiler.is_compiling() else fp8_linear
        if self.input_scale is None:
            y = linear(flat, self.weight, self.weight_scale, self.dynamic_activations)
        else:
            y = linear(flat, self.weight, self.weight_scale, False, self.input_scale)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dynamic = ", activations per token" if self.dynamic_activations else ""
        dynamic = ", activations with a static scale" if self.input_scale is not None else dynamic
        return f"in_features={self.in_features}, out_features={self.out_features}{dynamic}"


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> int:
    """vLLM's online ``quantization="fp8"``: every ``nn.Linear`` but the output embedding becomes an ``FP8Linear``
    (weights per output channel, activations per token at run time), in place; returns how many."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output = get_output_embeddings() if callable(get_output_embeddings) else None
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not output]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_linear(getattr(parent, child)))
    return len(names)
