"""Hugging Face checkpoints and the user's own objects: device and dtype, the checkpoint's config, a plain
``from_pretrained`` load, a model or tokenizer passed in, and what the checkpoint says about itself
(quantization, context length)."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any, Protocol, TypeVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from paged_backend.config import EngineConfig
from paged_backend.model_loader.gguf import (
    GGUFSource,
    as_plain_model,
    gguf_config,
    gguf_source,
    model_kwargs,
    require_gguf,
    unreadable,
)
from paged_backend.paths import looks_local

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

_Loaded = TypeVar("_Loaded", covariant=True)


class _Pretrained(Protocol[_Loaded]):
    """A transformers ``Auto*`` class: anything that loads from a folder or a hub id."""

    def from_pretrained(self, pretrained_model_name_or_path: str, **kwargs: Any) -> _Loaded: ...


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


def _from_pretrained(loader: _Pretrained[_Loaded], name: str, **kwargs: Any) -> _Loaded:
    """Prefer the local copy (a folder, or a hub id already in the cache) so nothing downloads needlessly. A
    path that does not exist is named as such at once, before transformers asks the hub about it (offline that
    takes its retries, and ends in an error about a malformed repo id)."""
    if looks_local(name) and not os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(errno.ENOENT, "no such file or folder", name)
    name = os.path.expanduser(name) if looks_local(name) else name
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


def model_gguf(config: EngineConfig, name: str) -> GGUFSource | None:
    """The GGUF file the model ``name`` is (``model="x.gguf"``) or holds (``gguf_file=``); None: another format."""
    return gguf_source(name, config.model_config.gguf_file)


def load_hf_config(config: EngineConfig, name: str) -> PretrainedConfig:
    source = model_gguf(config, name)
    if source is not None:
        return gguf_config(source, config.model_config.trust_remote_code)
    return _from_pretrained(AutoConfig, name, trust_remote_code=config.model_config.trust_remote_code)


# quantization a checkpoint carries (in its config); "fp8" also names the online quantization of an unquantized one
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors", "fp8")


def checkpoint_quantization(config: EngineConfig, hf_config: PretrainedConfig, name: str) -> str | None:
    """The quantization to load with: ``awq``, ``gptq``, ``compressed-tensors`` or ``fp8`` when asked for or when
    the checkpoint's ``quantization_config`` says so (the two must agree), ``fp8`` also when asked for on an
    unquantized checkpoint; None otherwise. A checkpoint quantized by another method fails, naming it."""
    qc = getattr(hf_config, "quantization_config", None)
    method = None
    if qc is not None:
        method = str((qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method", "")).lower() or None
    asked = config.model_config.quantization
    if method is not None and method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"{name}'s config.json has quantization_config.quant_method={method!r}: supported are "
            f"{list(CHECKPOINT_METHODS)}"
        )
    if asked is not None and asked != (method or "fp8"):
        raise ValueError(
            f"quantization={asked!r} does not match {name}'s config.json, which has "
            f"{'no quantization_config' if method is None else f'quant_method={method!r}'}"
            + (" (quantization='fp8' quantizes an unquantized checkpoint, or loads an fp8 one)" * (asked == "fp8"))
        )
    if method is not None and asked is None:
        logger.info("%s is a %s checkpoint (quantization_config): loading it as such", name, method)
    return method or asked


def checkpoint_dtype(config: EngineConfig, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The dtype to run in: the configured one, else the checkpoint's (see ``resolve_dtype``)."""
    stored = getattr(hf_config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return resolve_dtype(config, stored, device)


def adopt_model(
    config: EngineConfig, model: PreTrainedModel, device: torch.device | None
) -> tuple[PreTrainedModel, torch.device]:
    """The user's model object as is (no second copy), in eval mode on ``device`` (else its own); only an explicit
    ``dtype`` different from its own converts it, in place."""
    if config.model_config.quantization is not None:
        raise ValueError(
            f"quantization={config.model_config.quantization!r} loads a quantized checkpoint: pass model as a "
            "path or hub id, not a loaded model"
        )
    if config.model_config.load_format != "auto":
        raise ValueError(
            f"load_format={config.model_config.load_format!r} needs model as a path or hub id, not a loaded model"
        )
    if config.model_config.gguf_file is not None:
        raise ValueError("gguf_file names a file to load: pass model as its folder or hub id, not a loaded model")
    device = device or resolve_device(config, model)
    if config.model_config.dtype != "auto" and model.dtype != _DTYPES[config.model_config.dtype]:
        logger.info("converting the model from %s to %s in place", model.dtype, config.model_config.dtype)
        model.to(_DTYPES[config.model_config.dtype])  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    if next(model.parameters()).device != device:
        model.to(device)  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    return model.eval(), device


def load_pretrained(
    config: EngineConfig, name: str, dtype: torch.dtype, device: torch.device, keep_on_cpu: bool = False
) -> PreTrainedModel:
    """The checkpoint at ``name`` through transformers, in ``dtype``, on ``device`` (``keep_on_cpu``: left where
    transformers loads it, for a caller that cuts it first). A GGUF file is dequantized to ``dtype`` as it loads."""
    trust = config.model_config.trust_remote_code
    source = model_gguf(config, name)
    if source is None:
        loaded = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, trust_remote_code=trust)
    else:
        require_gguf()
        try:
            loaded = _from_pretrained(
                AutoModelForCausalLM, source.folder, dtype=dtype, trust_remote_code=trust, **model_kwargs(source)
            )
        except (ValueError, NotImplementedError) as exc:
            raise unreadable(source, exc) from exc
        as_plain_model(loaded)
    if not keep_on_cpu:
        loaded.to(device)  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    return loaded.eval()


def load_tokenizer(
    config: EngineConfig, model: str | PreTrainedModel, tokenizer: str | PreTrainedTokenizerBase | None
) -> PreTrainedTokenizerBase | None:
    """A tokenizer object is used as is; a name loads; with neither, try the model's own folder. With
    ``skip_tokenizer_init`` there is none."""
    if config.model_config.skip_tokenizer_init:
        return None
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    if isinstance(tokenizer, str):
        name = tokenizer
    elif isinstance(model, str):
        name = model
    else:
        name = getattr(model.config, "_name_or_path", "")
        if not name or not os.path.isdir(name):
            logger.warning("no tokenizer given: only token-id prompts can be used (pass tokenizer=...)")
            return None
    trust = config.model_config.trust_remote_code
    source = model_gguf(config, name) if name == model else gguf_source(name, None)
    if source is not None:  # the file's own vocabulary and chat template
        require_gguf()
        return _from_pretrained(AutoTokenizer, source.folder, gguf_file=source.file, trust_remote_code=trust)
    return _from_pretrained(AutoTokenizer, name, trust_remote_code=trust)


def causal_lm_class(hf_config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """The class transformers builds for this config's causal LM, without building it (None: not one of
    transformers' own, e.g. remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    return model_class if isinstance(model_class, type) else None


def model_max_length(model: PreTrainedModel | PretrainedConfig) -> int | None:
    """The context length the model's config declares, under whichever name its architecture uses."""
    cfg = (model if isinstance(model, PretrainedConfig) else model.config).get_text_config()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
