"""Block-wise FP8 checkpoints (``quant_method: "fp8"`` with ``weight_block_size``): the format of DeepSeek-V3,
Qwen3's ``-FP8`` releases and transformers' ``FineGrainedFP8Config``.

Each quantized linear stores ``weight`` [N, K] in float8_e4m3fn and ``weight_scale_inv`` [ceil(N / block_n),
ceil(K / block_k)] in float32 (the weight is ``weight * scale`` block by block, despite the name). Activations are
quantized at run time per token and per ``block_k`` inputs, as those models were trained and as transformers and
vLLM run them; the product is ``kernels/fp8_block_mm.py`` (cuBLAS's block-scaled GEMM for many rows on Hopper).
Which linears are quantized is read from the checkpoint itself (those with a ``weight_scale_inv``): producers leave
some in the model's dtype (the output embedding, the ``modules_to_not_convert``, shapes their blocks do not tile).
Dense models only: the experts of a mixture of experts (one fused module in transformers) are not read, and such a
checkpoint fails at load naming the tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.kernels import triton
from paged_backend.kernels.fp8_block_mm import fp8_block_mm_torch, fp8_block_mm_triton, quantize_per_group, step_k
from paged_backend.quantization.fp8 import FP8, has_fp8_matmul


def _unsupported(setting: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"fp8 checkpoint: quantization_config.{setting}={value!r} is not supported ({allowed})")


@dataclass(frozen=True)
class FP8BlockConfig:
    block_n: int  # output rows per weight scale
    block_k: int  # inputs per weight scale, and per activation scale

    @classmethod
    def from_hf(cls, quantization_config: Any) -> FP8BlockConfig:
        qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        method = qc.get("quant_method", "")
        if str(getattr(method, "value", method)).lower() != "fp8":  # transformers' configs hold an enum
            raise _unsupported("quant_method", method, "'fp8'")
        if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
            raise _unsupported("activation_scheme", qc.get("activation_scheme"), "'dynamic'")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _unsupported("fmt", qc.get("fmt"), "'e4m3'")
        if qc.get("scale_fmt") not in (None, "float"):
            raise _unsupported("scale_fmt", qc.get("scale_fmt"), "'float' or absent: float32 scales")
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            allowed = "two positive integers [block_n, block_k]: per-tensor fp8 checkpoints are not read"
            raise _unsupported("weight_block_size", block, allowed)
        try:
            step_k(block[1])
        except ValueError as exc:
            raise _unsupported("weight_block_size", block, str(exc)) from None
        return cls(block_n=block[0], block_k=block[1])


def fp8_block_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block_n: int,
    block_k: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x`` quantized per token and ``block_k`` inputs (by one kernel on a GPU with fp8 units), times the weight:
    ``fp8_block_mm``'s product (cuBLAS's or the kernel's on a GPU, the twin elsewhere)."""
    q, scale = quantize_per_group(x, block_k, kernel=x.is_cuda and triton is not None and has_fp8_matmul(x.device))
    return fp8_block_mm(q, scale, weight, weight_scale_inv, block_n, block_k, x.dtype)


def quantized_fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    """``fp8_block_linear`` written for a compiled graph: the quantization in torch ops, which inductor fuses into
    what produced ``x``, then one opaque ``fp8_block_mm`` (worker/fp8_activations.py puts it in place of
    ``fp8_block_linear_op``, after sibling layers' calls were fused into one). Where cuBLAS's product may run (a
    graph for any row count, or one of ``CUBLAS_MIN_ROWS`` rows or more) the rows are padded to a multiple of 4
    first, as it takes them (``fp8_block_mm_cublas``): the padding is then written by the quantization's kernel,
    not copied again inside the product; the padded rows are zeros, sliced off. A graph of fewer rows (dynamo
    specializes one row) goes to the kernel unpadded."""
    m = x.shape[0]
    if isinstance(m, torch.SymInt) or m >= CUBLAS_MIN_ROWS:
        x = F.pad(x, (0, 0, 0, -m % 4))
    q, scale = quantize_per_group(x, block_k)
    return fp8_block_mm_op(q, scale, weight, weight_scale_inv, block_n, block_k, x.dtype)[:m]


# One op in compiled graphs, so that sibling layers' calls fuse into one (worker/fuse_linears.py: q/k/v's weights and
# their scales back to back, where each sibling's outputs are whole blocks).
fp8_block_linear_op = torch.library.custom_op("paged_backend::fp8_block_linear", mutates_args=())(fp8_block_linear)


@fp8_block_linear_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def fp8_block_mm(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The product of quantized activations and the weight: cuBLAS's where ``uses_cublas``; else on a GPU the
    kernel (its dots in fp8 where the device has fp8 units; elsewhere, where Triton has no fp8 type, the bytes
    decoded to fp16 in the kernel); the twin on other devices."""
    if uses_cublas(q, weight, block_n, block_k):
        return fp8_block_mm_cublas(q, q_scale, weight, weight_scale_inv, out_dtype)
    if q.is_cuda and triton is not None:
        upcast = not has_fp8_matmul(q.device)
        return fp8_block_mm_triton(q, q_scale, weight, weight_scale_inv, block_n, block_k, out_dtype, upcast)
    return fp8_block_mm_torch(q, q_scale, weight, weight_scale_inv, block_n, block_k, out_dtype)


# Rows from which cuBLAS's block-scaled product runs: with it at every row count W2 (one row) fell from 1.41x bf16
# to 1.09x while W1 was the same (docs/benchmarks.md, "NVIDIA H100, 2026-12-07, 04:00 UTC"); where between 1 and 256
# rows the two products cross, benchmarks/fp8_linear.py's columns fp8_block_kernel and fp8_block_cublas tell.
CUBLAS_MIN_ROWS = 65


def uses_cublas(q: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Whether cuBLAS's block-scaled fp8 product (DeepSeek's recipe: 1 x 128 activation scales, 128 x 128 weight
    scales) takes ``q``: on Hopper through torch's ``scaled_mm`` (torch 2.10 and later built with CUDA 12.9 and
    later: torch refuses the recipe below), for enough rows that its tiles fill the GPU; fewer rows read each
    weight once, which the kernel's split K does faster."""
    return (
        q.is_cuda
        and q.shape[0] >= CUBLAS_MIN_ROWS
        and (block_n, block_k) == (128, 128)
        and q.shape[1] % 128 == 0
        and weight.shape[0] % 128 == 0
        and _hopper_scaled_mm(q.device.index if q.device.index is not None else torch.cuda.current_device())
    )


@functools.cache
def _hopper_scaled_mm(index: int) -> bool:
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return hasattr(F, "scaled_mm") and cuda >= (12, 9) and torch.cuda.get_device_capability(index) == (9, 0)


def fp8_block_mm_cublas(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``fp8_block_mm`` in cuBLAS's layouts: the activation scales column-major with the rows a multiple of 4, the
    weight's scales with their K blocks a multiple of 4 (rows and blocks added are scaled by 1 and sliced off)."""
    m = q.shape[0]
    pad_m, pad_k = -m % 4, -weight_scale_inv.shape[1] % 4
    if pad_m:
        q = F.pad(q.view(torch.uint8), (0, 0, 0, pad_m)).view(FP8)
        q_scale = F.pad(q_scale, (0, 0, 0, pad_m), value=1.0)
    weight_scale = F.pad(weight_scale_inv, (0, pad_k), value=1.0) if pad_k else weight_scale_inv.contiguous()
    a_scale, b_scale, weight = q_scale.t().contiguous().t(), weight_scale.t(), weight.contiguous()
    recipe = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    out = F.scaled_mm(q, weight.t(), a_scale, recipe[0], b_scale, recipe[1], output_dtype=out_dtype)
    return out[:m]


fp8_block_mm_op = torch.library.custom_op("paged_backend::fp8_block_mm", mutates_args=())(fp8_block_mm)


@fp8_block_mm_op.register_fake
def _(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], weight.shape[0], dtype=out_dtype)


class FP8BlockLinear(nn.Module):
    """``nn.Linear``'s interface over block-wise fp8 weights: ``y = quantized(x) @ (W * s).T + bias``."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn, buffer
    weight_scale_inv: torch.Tensor  # [ceil(out / block_n), ceil(in / block_k)] float32, buffer
    bias: nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, block: FP8BlockConfig, device: torch.device | str
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_n, self.block_k = block.block_n, block.block_k
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        scales = (-(-out_features // block.block_n), -(-in_features // block.block_k))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": tuple(self.weight.shape), "weight_scale_inv": tuple(self.weight_scale_inv.shape)}
        return shapes | ({"bias": (self.out_features,)} if self.bias is not None else {})

    def load_buffer(self, attr: str, tensor: torch.Tensor, key: str, device: torch.device) -> None:
        """A checkpoint's tensor for one of the buffers, checked against the layer's shape and dtype."""
        expected = self.expected_shapes()[attr]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {expected}")
        if attr == "weight" and tensor.dtype != FP8:
            raise ValueError(f"checkpoint tensor {key} has dtype {tensor.dtype}, expected {FP8}")
        if attr == "weight_scale_inv" and not tensor.is_floating_point():
            raise ValueError(f"checkpoint tensor {key} has dtype {tensor.dtype}, expected a float")
        self._buffers[attr] = tensor.to(device=device, dtype=FP8 if attr == "weight" else torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        linear = fp8_block_linear_op if torch.compiler.is_compiling() else fp8_block_linear
        y = linear(flat, self.weight, self.weight_scale_inv, self.block_n, self.block_k)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.block_n}x{self.block_k}"
