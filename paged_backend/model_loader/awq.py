"""Reading an AWQ int4 checkpoint into ``AWQLinear`` layers, without autoawq or gptqmodel.

The model is built from its config with parameters on the meta device, every convertible ``nn.Linear`` (see
``quantization/awq.py``) becomes an empty ``AWQLinear``, and the safetensors files fill it, each tensor checked
against the shape the config implies: a checkpoint that disagrees with its own config fails naming the tensor,
instead of producing garbage. transformers itself is never asked to quantize. ``load_quantized_weights`` also
fills compressed-tensors checkpoints (``compressed_tensors.py``), whose tensors arrive converted to our layers'.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from paged_backend.model_loader.dummy import meta_model
from paged_backend.model_loader.hf import checkpoint_files
from paged_backend.model_structure import set_module_attribute
from paged_backend.quantization.awq import AWQConfig, AWQLinear, convertible_linears
from paged_backend.quantization.fp8 import FP8Linear
from paged_backend.quantization.fp8_block import FP8BlockLinear

logger = logging.getLogger(__name__)


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


def replace_quantized(
    model: nn.Module, names: set[str], make: Callable[[nn.Linear], nn.Module], part: str, fmt: str
) -> None:
    """Swap each named linear, whose quantized ``part`` the checkpoint holds, for ``make(linear)`` (an empty
    quantized layer on the meta device). A name that is no linear of the model fails naming it: ``fmt`` checkpoints
    of mixture-of-experts models (experts fused into one module in transformers) are not read."""
    for name in sorted(names):
        parent_name, _, child = name.rpartition(".")
        try:
            linear: nn.Module | None = model.get_submodule(name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            found = "no module" if linear is None else f"a {type(linear).__name__}"
            raise ValueError(
                f"{fmt} checkpoint: {name}.{part} names {found} of {type(model).__name__}, not a linear layer "
                "(mixture-of-experts experts are not read)"
            )
        try:
            layer = make(linear)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def _targets(model: nn.Module) -> tuple[dict[str, tuple[nn.Module, str]], set[str]]:
    """Every parameter and buffer by its state-dict key (with its module and attribute), and the keys a
    checkpoint must hold (parameters and persistent buffers)."""
    targets: dict[str, tuple[nn.Module, str]] = {}
    persistent: set[str] = set()
    for module_name, module in model.named_modules():
        for attr in list(module._parameters) + list(module._buffers):
            if getattr(module, attr, None) is None:
                continue
            key = f"{module_name}.{attr}" if module_name else attr
            targets[key] = (module, attr)
            if attr in module._parameters or attr not in module._non_persistent_buffers_set:
                persistent.add(key)
    return targets, persistent


def _store(
    module: nn.Module, attr: str, key: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    """Put one checkpoint tensor in place: a quantized layer's packed buffers as that layer checks them (shape and
    dtype), parameters in ``dtype``, other buffers as they are; a shape unlike the config's fails with the tensor's
    name."""
    if (
        isinstance(module, (AWQLinear, FP8Linear, FP8BlockLinear))
        and attr in module.expected_shapes()
        and attr != "bias"
    ):
        module.load_buffer(attr, tensor, key, device)
        return
    shape = tuple(getattr(module, attr).shape)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {shape}")
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
    else:
        module._buffers[attr] = tensor.to(device=device)


def checkpoint_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, by name, on the CPU, one at a time."""
    from safetensors import safe_open

    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                yield key, f.get_tensor(key)


@torch.no_grad()
def load_quantized_weights(
    model: PreTrainedModel, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> None:
    """Fill a meta-built model (with quantized layers) from a checkpoint's tensors on ``device``: packed buffers as
    their layers take them, everything else in ``dtype``. A tensor that is missing, unexpected or shaped unlike
    the config says fails with its name."""
    targets, persistent = _targets(model)
    loaded: set[str] = set()
    for key, tensor in tensors:
        if key not in targets:
            raise ValueError(f"checkpoint tensor {key} matches no parameter of {type(model).__name__}")
        module, attr = targets[key]
        _store(module, attr, key, tensor, dtype, device)
        loaded.add(key)
    tied = _tied_keys(model)
    missing = sorted(persistent - loaded - tied)
    if missing:
        raise ValueError(f"the checkpoint is missing tensor(s) {missing[:5]}")
    for module in model.modules():  # non-persistent buffers (RoPE's) were made on the CPU
        for attr, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                raise ValueError(f"the checkpoint is missing buffer {attr} of {type(module).__name__}")
            if buffer is not None:
                module._buffers[attr] = buffer.to(device)
    if tied:
        model.tie_weights()


def _tied_keys(model: PreTrainedModel) -> set[str]:
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
    hf_config: PretrainedConfig, name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The AWQ checkpoint at ``name`` on ``device``: ``AWQLinear`` modules for the quantized linears, everything
    else in ``dtype``."""
    awq = AWQConfig.from_hf(hf_config.quantization_config)
    plain = copy.deepcopy(hf_config)
    del plain.quantization_config  # transformers must not try to quantize (it would need gptqmodel)
    model = meta_model(plain, dtype, trust_remote_code)
    names = replace_linears(model, awq)
    load_quantized_weights(model, checkpoint_tensors(resolve_checkpoint_folder(name)), dtype, device)
    set_module_attribute(model, "awq_config", awq)
    logger.info("AWQ int4: %d linears, group size %d", len(names), awq.group_size)
    return model.eval()
