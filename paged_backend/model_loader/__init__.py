"""Loading the model and tokenizer an engine runs: one dispatcher over where the weights come from.

``load_model`` picks the source: the user's model object (``hf.py``, adopted as is), an AWQ checkpoint
(``awq.py``), a GPTQ one (``gptq.py``), a compressed-tensors one (``compressed_tensors.py``), a block-wise FP8 one
(``fp8_block.py``), random weights from
the config alone (``dummy.py``), or any other checkpoint through transformers (``hf.py``; with
``quantization="fp8"`` its linears quantized once loaded). One tensor-parallel rank's slice of a model is
``sharded.load_shard``, which cuts by ``tp_plan.py``.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.model_loader.awq import load_awq_model
from paged_backend.model_loader.compressed_tensors import load_compressed_tensors_model
from paged_backend.model_loader.dummy import dummy_model
from paged_backend.model_loader.fp8_block import load_fp8_block_model
from paged_backend.model_loader.gptq import load_gptq_model
from paged_backend.model_loader.hf import (
    adopt_model,
    causal_lm_class,
    checkpoint_dtype,
    checkpoint_quantization,
    load_hf_config,
    load_pretrained,
    load_tokenizer,
    looks_local,
    model_max_length,
    resolve_device,
)
from paged_backend.quantization.fp8 import quantize_fp8

__all__ = ["causal_lm_class", "load_hf_config", "load_model", "load_tokenizer", "looks_local", "model_max_length"]


def load_model(
    config: EngineConfig, model: str | PreTrainedModel, device: torch.device | None = None, keep_on_cpu: bool = False
) -> tuple[PreTrainedModel, torch.device]:
    """Return the model in eval mode on its device (``device``, else resolved from the config). A model object is
    adopted as is (no second copy); only an explicit ``dtype`` different from its own converts it in place. A path
    or hub id loads its checkpoint (AWQ when its config says so), or with ``load_format="dummy"`` only its config,
    with random weights. ``keep_on_cpu`` leaves a loaded checkpoint on the CPU, in the dtype it will run in on
    ``device``, for a caller that cuts it before moving it."""
    if isinstance(model, PreTrainedModel):
        return adopt_model(config, model, device)
    if not isinstance(model, str):
        raise ValueError(
            f"model must be a path, a hub id or a transformers PreTrainedModel, got {type(model).__name__}"
        )
    device = device or resolve_device(config, None)
    hf_config = load_hf_config(config, model)
    dtype = checkpoint_dtype(config, hf_config, device)
    dummy = config.model_config.load_format == "dummy"
    trust = config.model_config.trust_remote_code
    quantization = checkpoint_quantization(config, hf_config, model)
    if dummy:
        refuse_dummy_quantized(hf_config, quantization)
    if quantization is not None and getattr(hf_config, "quantization_config", None) is not None:
        load_device = torch.device("cpu") if keep_on_cpu else device
        loaders = {
            "awq": load_awq_model,
            "gptq": load_gptq_model,
            "compressed-tensors": load_compressed_tensors_model,
            "fp8": load_fp8_block_model,
        }
        load = loaders[quantization]
        return load(hf_config, model, dtype, load_device, trust), device
    if dummy:
        loaded = dummy_model(hf_config, dtype, device, config.model_config.seed, trust)
    else:
        loaded = load_pretrained(config, model, dtype, device, keep_on_cpu)
    if quantization == "fp8":  # an unquantized checkpoint, quantized once loaded
        quantize_fp8(loaded)
    return loaded, device


def refuse_dummy_quantized(hf_config: PretrainedConfig, quantization: str | None) -> None:
    """``load_format="dummy"`` makes random weights of the model's dtype from its config, not a checkpoint's
    quantized format: a config that carries one is refused (an unquantized one with ``quantization="fp8"`` is
    quantized as usual)."""
    if getattr(hf_config, "quantization_config", None) is not None:
        raise ValueError(
            f"load_format='dummy' does not make {quantization} weights (the checkpoint's format): load the "
            "checkpoint itself, or quantize a model (paged_backend.quantization.awq_quantize, llm-compressor)"
        )
