"""AWQ int4 checkpoints without autoawq or gptqmodel: the linear layer, the checkpoint's config, and loading.

A checkpoint's ``config.json`` carries ``quantization_config`` (``quant_method: awq``, ``bits: 4``, ``group_size``
32/64/128, ``zero_point: true``, ``version: gemm``, optionally ``modules_to_not_convert``). The model is built from
its config with parameters on the meta device, every ``nn.Linear`` of the decoder (not the LM head, nor a module
listed as not converted) becomes an ``AWQLinear``, and the safetensors files fill it, each tensor checked against
the shape the config implies. transformers itself is never asked to quantize.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_backend.kernels.awq_format import PACK
from paged_backend.model_loader import checkpoint_files

logger = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128)
AWQ_TENSORS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class AWQConfig:
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, quantization_config: Any) -> AWQConfig:
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

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, device: Any = None) -> None:
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
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        groups = self.in_features // self.group_size
        shapes = {
            "qweight": (self.in_features, self.out_features // PACK),
            "qzeros": (groups, self.out_features // PACK),
            "scales": (groups, self.out_features),
        }
        return shapes | ({"bias": (self.out_features,)} if self.bias is not None else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        from paged_backend.kernels.awq_gemm import awq_gemm, awq_gemm_op

        flat = x.reshape(-1, self.in_features)  # [M, K]
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
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not output
        and not any(skip in name for skip in awq.modules_to_not_convert)
    }


def replace_linears(model: nn.Module, awq: AWQConfig) -> list[str]:
    """Swap the convertible linears for empty ``AWQLinear`` modules (on the meta device); returns their names."""
    names = list(convertible_linears(model, awq))
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        try:
            quantized = AWQLinear(
                linear.in_features, linear.out_features, awq.group_size, linear.bias is not None, device="meta"
            )
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        setattr(parent, child, quantized)
    return names


@torch.no_grad()
def load_awq_weights(model: nn.Module, folder: str, dtype: torch.dtype, device: torch.device) -> None:
    """Fill a meta-built model (with ``AWQLinear`` modules) from the checkpoint's tensors on ``device``: packed
    tensors as stored (scales in fp16), everything else in ``dtype``. A tensor that is missing, unexpected or shaped
    unlike the config says fails with its name."""
    from safetensors import safe_open

    targets: dict[str, tuple[nn.Module, str]] = {}
    for module_name, module in model.named_modules():
        for attr in list(module._parameters) + list(module._buffers):
            if module._parameters.get(attr) is not None or module._buffers.get(attr) is not None:
                key = f"{module_name}.{attr}" if module_name else attr
                targets[key] = (module, attr)
    persistent = {
        f"{name}.{attr}" if name else attr
        for name, module in model.named_modules()
        for attr in list(module._parameters)
        + [b for b in module._buffers if b not in module._non_persistent_buffers_set]
        if getattr(module, attr, None) is not None
    }
    loaded: set[str] = set()
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if key not in targets:
                    raise ValueError(f"AWQ checkpoint tensor {key} matches no parameter of {type(model).__name__}")
                module, attr = targets[key]
                tensor = f.get_tensor(key)
                expected = module.expected_shapes().get(attr) if isinstance(module, AWQLinear) else None
                current = getattr(module, attr)
                shape = expected or tuple(current.shape)
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"AWQ checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {shape}")
                if attr in AWQ_TENSORS and isinstance(module, AWQLinear):
                    want = torch.int32 if attr != "scales" else torch.float16
                    if (attr != "scales" and tensor.dtype != torch.int32) or (
                        attr == "scales" and not tensor.is_floating_point()
                    ):
                        raise ValueError(f"AWQ checkpoint tensor {key} has dtype {tensor.dtype}, expected {want}")
                    module._buffers[attr] = tensor.to(device=device, dtype=want)
                elif attr in module._parameters:
                    module._parameters[attr] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
                else:
                    module._buffers[attr] = tensor.to(device=device)
                loaded.add(key)
    tied = _tied_keys(model)
    missing = sorted(persistent - loaded - tied)
    if missing:
        raise ValueError(f"AWQ checkpoint is missing tensor(s) {missing[:5]}")
    for module in model.modules():  # non-persistent buffers (RoPE's) were made on the CPU
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                raise ValueError(f"AWQ checkpoint is missing buffer {attr} of {type(module).__name__}")
            if buffer is not None:
                module._buffers[attr] = buffer.to(device)
    if tied:
        model.tie_weights()


def dequantized_copy(model: nn.Module, folder: str) -> nn.Module:
    """The dense fp32 model that the AWQ checkpoint in ``folder`` (written from ``model``) stands for: a copy of
    ``model`` with each quantized linear's weight replaced by its dequantization and every other stored tensor read
    back. The reference that the engine on the checkpoint must equal."""
    import copy
    import json

    from safetensors.torch import load_file

    from paged_backend.kernels.awq_format import dequantize

    with open(os.path.join(folder, "config.json")) as f:
        awq = AWQConfig.from_hf(json.load(f)["quantization_config"])
    tensors = {k: v for path in checkpoint_files(folder) for k, v in load_file(path).items()}
    reference = copy.deepcopy(model)
    for name, linear in convertible_linears(reference, awq).items():
        w = dequantize(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"], torch.float32)
        linear.weight.data.copy_(w.t())
        if linear.bias is not None:
            linear.bias.data.copy_(tensors[f"{name}.bias"].float())
    for name, param in reference.named_parameters():
        if name in tensors:  # the rest is stored in fp16
            param.data.copy_(tensors[name].float())
    return reference


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameters that alias another (a tied LM head), which a checkpoint stores once."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set()
    output = model.get_output_embeddings()
    names = [name for name, module in model.named_modules() if module is output]
    return {f"{name}.weight" for name in names}


def resolve_checkpoint_folder(name: str) -> str:
    """A local folder for ``name``: itself, or the hub snapshot (cached first, downloaded if missing)."""
    if os.path.isdir(name):
        return name
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(name, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: fetch it
        return snapshot_download(name, allow_patterns=patterns)


def load_awq_model(
    hf_config: Any, name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> Any:
    """The AWQ checkpoint at ``name`` on ``device``: ``AWQLinear`` modules for the quantized linears, everything
    else in ``dtype``."""
    import copy

    from paged_backend.dummy_loader import meta_model

    awq = AWQConfig.from_hf(hf_config.quantization_config)
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config  # transformers must not try to quantize (it would need gptqmodel)
    model = meta_model(plain, dtype, trust_remote_code)
    names = replace_linears(model, awq)
    load_awq_weights(model, resolve_checkpoint_folder(name), dtype, device)
    model.awq_config = awq
    logger.info("AWQ int4: %d linears, group size %d", len(names), awq.group_size)
    return model.eval()


def quantize(model: Any, tokenizer: Any, output_dir: str, calib_texts: Any, **kwargs: Any) -> None:
    """``awq.quantize(model, tokenizer, output_dir, calib_texts=[...], w_bit=4, group_size=128, zero_point=True)``:
    AWQ-quantize ``model`` and write the checkpoint (the algorithm lives in ``awq_quantize.py``)."""
    from paged_backend.quantization.awq_quantize import quantize as run

    run(model, tokenizer, output_dir, calib_texts, **kwargs)
