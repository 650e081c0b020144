"""A compressed-tensors W4A16 checkpoint (``pack-quantized``, symmetric int4, groups along the input) written from
a model's own weights, as llm-compressor's ``W4A16`` scheme lays it out: ``weight_packed`` (int32, eight values a
word, the compressed-tensors package's ``pack_to_int32``), ``weight_scale`` [out, groups] and ``weight_shape``; the
LM head and everything that is not a decoder linear stay as they are. Round to nearest with absmax / 7.5 scales
(llm-compressor's min-max observer): the benchmarks time it, quality is irrelevant there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

VERSION_WRITTEN = "0.20.1"  # the compressed-tensors release whose layout this follows


def quantization_config(group_size: int) -> dict[str, object]:
    """config.json's ``quantization_config``, as llm-compressor writes it for ``W4A16``."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": group_size, "num_bits": 4,
        "observer": "memoryless_minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int",
    }  # fmt: skip
    group = {"format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"]}
    return {
        "config_groups": {"group_0": {**group, "weights": weights}},
        "format": "pack-quantized",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "version": VERSION_WRITTEN,
    }


@torch.no_grad()
def pack_w4a16(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One linear's ``weight`` [out, in] as the checkpoint stores it (on the CPU)."""
    from compressed_tensors.compressors import pack_to_int32

    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-8).to(weight.dtype)  # [out, groups]
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).reshape(out_features, in_features)
    return {
        "weight_packed": pack_to_int32(q, 4).cpu(),
        "weight_scale": scale.cpu(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }


def write_ct_w4a16(model: PreTrainedModel, output_dir: Path, group_size: int = 128) -> None:
    """Save ``model`` as a compressed-tensors W4A16 checkpoint in ``output_dir`` (config.json, model.safetensors)."""
    tensors: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head":
            if module.in_features % group_size:
                raise ValueError(f"{name}: in_features {module.in_features} is not a multiple of {group_size}")
            tensors |= {f"{name}.{k}": v for k, v in pack_w4a16(module.weight, group_size).items()}
            quantized.add(f"{name}.weight")
    storages: set[int] = set()
    for key, tensor in model.state_dict().items():
        if key in quantized or tensor.untyped_storage().data_ptr() in storages:
            continue  # a tied LM head is stored once, as transformers does
        storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor.detach().contiguous().cpu()
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(group_size)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
