"""AWQ int4 without autoawq or gptqmodel: the linear layer, the checkpoint's config, and which linears it covers.

A checkpoint's ``config.json`` carries ``quantization_config`` (``quant_method: awq``, ``bits: 4``, ``group_size``
32/64/128, ``zero_point: true``, ``version: gemm``, optionally ``modules_to_not_convert``). Every ``nn.Linear`` of
the decoder (not the LM head, nor a module listed as not converted) is quantized: the quantizer
(``awq_quantize.py``) writes those, and the loader (``model_loader/awq.py``) reads them into ``AWQLinear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils.quantization_config import QuantizationConfigMixin

from paged_backend.kernels.awq_format import PACK
from paged_backend.kernels.awq_gemm import awq_gemm, awq_gemm_op

GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class AWQConfig:
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any] | QuantizationConfigMixin) -> AWQConfig:
        """Validate a checkpoint's ``quantization_config``, naming the key and the supported values."""
        qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
        method = str(qc.get("quant_method", "")).lower()
        if method != "awq":
            raise ValueError(f"quantization_config.quant_method must be 'awq', got {qc.get('quant_method')!r}")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config.bits must be 4 (int4 AWQ), got {bits!r}")
        group_size = qc.get("group_size", qc.get("q_group_size"))
        if group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_config.group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
        if qc.get("zero_point", True) is not True:
            raise ValueError("quantization_config.zero_point must be true: symmetric AWQ checkpoints are not supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version must be 'gemm' (AutoAWQ's GEMM layout), got {version!r}")
        return cls(group_size, tuple(qc.get("modules_to_not_convert") or ()))

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` AutoAWQ writes (and transformers reads)."""
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(self.modules_to_not_convert) or None,
        }


class AWQLinear(nn.Module):
    """``nn.Linear``'s interface over packed int4 weights: ``y = x @ ((q - z) * s) + bias``."""

    in_features: int
    out_features: int
    group_size: int
    qweight: torch.Tensor  # [in, out / 8] int32, buffer
    qzeros: torch.Tensor  # [in / group_size, out / 8] int32, buffer
    scales: torch.Tensor  # [in / group_size, out] fp16 (AutoAWQ's; a compressed-tensors checkpoint's own float), buffer
    # [in] int64, buffer: the order the layer reads its input in (GPTQ's activation order: the rows of a group
    # made contiguous, quantization/gptq.py); None: as it comes
    input_order: torch.Tensor | None
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool,
        device: torch.device | str | None = None,
        input_order: bool = False,
    ) -> None:
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"group_size={group_size} must divide in_features={in_features}")
        if out_features % PACK:
            raise ValueError(f"out_features={out_features} must be a multiple of {PACK} to pack int4 weights")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.empty(in_features, out_features // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer("qzeros", torch.empty(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        order = torch.empty(in_features, dtype=torch.int64, device=device) if input_order else None
        self.register_buffer("input_order", order)
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        groups = self.in_features // self.group_size
        shapes: dict[str, tuple[int, ...]] = {
            "qweight": (self.in_features, self.out_features // PACK),
            "qzeros": (groups, self.out_features // PACK),
            "scales": (groups, self.out_features),
        }
        shapes |= {"input_order": (self.in_features,)} if self.input_order is not None else {}
        return shapes | ({"bias": (self.out_features,)} if self.bias is not None else {})

    def load_buffer(self, attr: str, tensor: torch.Tensor, key: str, device: torch.device) -> None:
        """A checkpoint's tensor for one of the packed buffers, checked against the layer's shape and dtype: packed
        ints as int32, scales in their own float dtype (AutoAWQ writes fp16; the kernels read any)."""
        expected = self.expected_shapes()[attr]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {expected}")
        if attr == "input_order":
            if sorted(tensor.tolist()) != list(range(self.in_features)):
                raise ValueError(f"{key} is not an order of the {self.in_features} input rows")
            self._buffers[attr] = tensor.to(device=device, dtype=torch.int64)
            return
        if (attr == "scales") != tensor.is_floating_point() or (attr != "scales" and tensor.dtype != torch.int32):
            raise ValueError(f"checkpoint tensor {key} has dtype {tensor.dtype}, expected int32 or a float for scales")
        self._buffers[attr] = tensor.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if self.input_order is not None:
            flat = flat.index_select(1, self.input_order)
        gemm = awq_gemm_op if torch.compiler.is_compiling() else awq_gemm
        y = gemm(flat, self.qweight, self.qzeros, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def convertible_linears(model: nn.Module, awq: AWQConfig) -> dict[str, nn.Linear]:
    """The linears a checkpoint quantizes: every ``nn.Linear`` except the output embedding and the modules named
    (by any part of their path, as transformers matches them) in ``modules_to_not_convert``."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output = get_output_embeddings() if callable(get_output_embeddings) else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not output
        and not any(skip in name for skip in awq.modules_to_not_convert)
    }
