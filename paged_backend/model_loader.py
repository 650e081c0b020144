"""Load (or adopt) the user's HF model and tokenizer, on the right device and dtype."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from paged_backend.config import EngineConfig

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(config: EngineConfig, model: PreTrainedModel | None) -> torch.device:
    """``auto``: a given model's own device, else CUDA when present, else CPU."""
    name = config.device_config.device
    if name == "auto":
        if model is not None:
            return next(model.parameters()).device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device must be 'cpu' or 'auto' on a machine without CUDA, got {name!r}")
    return torch.device(name)


def resolve_dtype(config: EngineConfig, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` keeps the checkpoint's dtype, except fp32 checkpoints on a GPU run in bf16 (fp16 without bf16)."""
    name = config.model_config.dtype
    if name != "auto":
        return _DTYPES[name]
    dtype = checkpoint_dtype or torch.float32
    if device.type == "cuda" and dtype == torch.float32:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dtype


def _from_pretrained(loader: Any, name: str, **kwargs: Any) -> Any:
    """Prefer the local copy (a folder, or a hub id already in the cache) so nothing downloads needlessly."""
    if os.path.isdir(name):
        return loader.from_pretrained(name, **kwargs)
    try:
        return loader.from_pretrained(name, local_files_only=True, **kwargs)
    except OSError:
        return loader.from_pretrained(name, **kwargs)


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder (one file, or the shards its index names)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no model.safetensors (or its index) in {folder}: checkpoints load from safetensors")
    return [single]


def load_hf_config(config: EngineConfig, name: str) -> Any:
    return _from_pretrained(AutoConfig, name, trust_remote_code=config.model_config.trust_remote_code)


def quantization(config: EngineConfig, hf_config: Any, name: str) -> str | None:
    """``awq`` when asked for or when the checkpoint's ``quantization_config`` says so; None otherwise."""
    qc = getattr(hf_config, "quantization_config", None)
    method = None
    if qc is not None:
        method = str((qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method", "")).lower() or None
    asked = config.model_config.quantization
    if asked == "awq" and method != "awq":
        raise ValueError(
            f"quantization='awq' needs an AWQ checkpoint, but {name}'s config.json has "
            f"{'no quantization_config' if method is None else f'quant_method={method!r}'}"
        )
    if method == "awq" and asked is None:
        logger.info("%s is an AWQ checkpoint (quantization_config): loading it as quantization='awq'", name)
    return "awq" if method == "awq" else None


def checkpoint_dtype(config: EngineConfig, hf_config: Any, device: torch.device) -> torch.dtype:
    """The dtype to run in: the configured one, else the checkpoint's (see ``resolve_dtype``)."""
    stored = getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return resolve_dtype(config, stored, device)


def load_model(
    config: EngineConfig, model: str | PreTrainedModel, device: torch.device | None = None, keep_on_cpu: bool = False
) -> tuple[PreTrainedModel, torch.device]:
    """Return the model in eval mode on its device (``device``, else resolved from the config). A model object is
    adopted as is (no second copy); only an explicit ``dtype`` different from its own converts it in place. A path
    or hub id loads its checkpoint, or with ``load_format="dummy"`` only its config, with random weights.
    ``keep_on_cpu`` leaves a loaded checkpoint on the CPU, in the dtype it will run in on ``device``."""
    if isinstance(model, PreTrainedModel):
        if config.model_config.quantization is not None:
            raise ValueError(
                f"quantization={config.model_config.quantization!r} loads a quantized checkpoint: pass model as a "
                "path or hub id, not a loaded model"
            )
        if config.model_config.load_format != "auto":
            raise ValueError(
                f"load_format={config.model_config.load_format!r} needs model as a path or hub id, not a loaded model"
            )
        device = device or resolve_device(config, model)
        if config.model_config.dtype != "auto" and model.dtype != _DTYPES[config.model_config.dtype]:
            logger.info("converting the model from %s to %s in place", model.dtype, config.model_config.dtype)
            model.to(_DTYPES[config.model_config.dtype])
        if next(model.parameters()).device != device:
            model.to(device)
        return model.eval(), device
    if not isinstance(model, str):
        raise ValueError(
            f"model must be a path, a hub id or a transformers PreTrainedModel, got {type(model).__name__}"
        )
    device = device or resolve_device(config, None)
    hf_config = load_hf_config(config, model)
    dtype = checkpoint_dtype(config, hf_config, device)
    if quantization(config, hf_config, model) == "awq":
        from paged_backend.quantization.awq import load_awq_model

        if config.model_config.load_format == "dummy":
            raise ValueError("load_format='dummy' does not make AWQ weights: quantize a model with awq.quantize")
        awq_device = torch.device("cpu") if keep_on_cpu else device
        trust = config.model_config.trust_remote_code
        return load_awq_model(hf_config, model, dtype, awq_device, trust), device
    if config.model_config.load_format == "dummy":
        from paged_backend.dummy_loader import dummy_model

        seed = config.model_config.seed
        return dummy_model(hf_config, dtype, device, seed, config.model_config.trust_remote_code), device
    loaded = _from_pretrained(
        AutoModelForCausalLM, model, dtype=dtype, trust_remote_code=config.model_config.trust_remote_code
    )
    return (loaded if keep_on_cpu else loaded.to(device)).eval(), device


def load_tokenizer(config: EngineConfig, model: str | PreTrainedModel, tokenizer: Any) -> Any:
    """A tokenizer object is used as is; a name loads; with neither, try the model's own folder. With
    ``skip_tokenizer_init`` there is none."""
    if config.model_config.skip_tokenizer_init:
        return None
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    name = tokenizer if isinstance(tokenizer, str) else model if isinstance(model, str) else None
    if name is None:
        path = getattr(model.config, "_name_or_path", "")
        if not path or not os.path.isdir(path):
            logger.warning("no tokenizer given: only token-id prompts can be used (pass tokenizer=...)")
            return None
        name = path
    return _from_pretrained(AutoTokenizer, name, trust_remote_code=config.model_config.trust_remote_code)


def model_max_length(model: PreTrainedModel) -> int | None:
    cfg = model.config.get_text_config()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
