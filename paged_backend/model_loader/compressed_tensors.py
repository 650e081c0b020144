"""Reading a compressed-tensors checkpoint (llm-compressor's format) into ``AWQLinear`` (int4) or ``FP8Linear``
(fp8) layers: the model is built on the meta device, the scheme's linears are replaced by empty quantized layers,
and the checkpoint's tensors fill them as ``CompressedTensorsScheme.convert`` turns each linear's parts into our
layers' buffers. Needs the ``compressed-tensors`` package (``pip install paged-backend[quant]``) for int4.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.model_loader.awq import checkpoint_tensors, load_quantized_weights, resolve_checkpoint_folder
from paged_backend.model_loader.dummy import meta_model
from paged_backend.model_structure import set_module_attribute
from paged_backend.quantization.awq import AWQLinear
from paged_backend.quantization.compressed_tensors import KV_CACHE_SCALES_ATTR, CompressedTensorsScheme
from paged_backend.quantization.fp8 import FP8Linear

logger = logging.getLogger(__name__)


def _quantized_layer(scheme: CompressedTensorsScheme, name: str, linear: nn.Linear) -> nn.Module:
    bias = linear.bias is not None
    if scheme.format == "float-quantized":
        return FP8Linear(
            linear.in_features,
            linear.out_features,
            bias,
            scheme.dynamic_activations,
            device="meta",
            static_activations=scheme.static_activations,
        )
    try:
        return AWQLinear(linear.in_features, linear.out_features, scheme.group_size_of(linear), bias, device="meta")
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def _scales_by_layer(model: nn.Module, scales: dict[str, dict[str, torch.Tensor]]) -> dict[int, tuple[float, float]]:
    """Each attention layer's (k_scale, v_scale), by its ``layer_idx``; every layer must have both."""
    by_layer: dict[int, tuple[float, float]] = {}
    for module_name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int) or not hasattr(module, "k_proj"):
            continue
        found = scales.pop(module_name, {})
        if set(found) != {"k_scale", "v_scale"} or any(t.numel() != 1 for t in found.values()):
            raise ValueError(f"compressed-tensors checkpoint: {module_name} lacks a single k_scale and v_scale")
        by_layer[layer_idx] = (float(found["k_scale"]), float(found["v_scale"]))
    if scales or not by_layer:
        raise ValueError(f"compressed-tensors checkpoint: KV-cache scales of unknown modules {sorted(scales)[:3]}")
    return by_layer


def load_compressed_tensors_model(
    hf_config: PretrainedConfig, name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The compressed-tensors checkpoint at ``name`` on ``device``: quantized layers for the scheme's linears,
    everything else in ``dtype``."""
    scheme = CompressedTensorsScheme.from_hf(hf_config.quantization_config)
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config  # transformers must not try to quantize or decompress
    model = meta_model(plain, dtype, trust_remote_code)
    linears = scheme.quantized_linears(model)
    for module_name, linear in linears.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _quantized_layer(scheme, module_name, linear))
    kv_scales: dict[str, dict[str, torch.Tensor]] = {}
    tensors = scheme.convert(checkpoint_tensors(resolve_checkpoint_folder(name)), set(linears), kv_scales)
    load_quantized_weights(model, tensors, dtype, device)
    set_module_attribute(model, "compressed_tensors_scheme", scheme)
    if scheme.kv_cache_scales:
        set_module_attribute(model, KV_CACHE_SCALES_ATTR, _scales_by_layer(model, kv_scales))
    logger.info("compressed-tensors %s (%s): %d linears", scheme.format, scheme.strategy, len(linears))
    return model.eval()
