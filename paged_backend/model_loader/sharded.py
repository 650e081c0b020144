"""One tensor-parallel rank's model: its slices only, on its own device.

The model is built on the meta device, each module is made on the rank's device and cut as soon as it exists,
then filled: from a local safetensors checkpoint, reading only the rank's slice of each planned linear (so neither
CPU memory nor a device ever holds more than one tensor beyond the rank's share: a 70B model over two GPUs loads
on a host with less memory than the checkpoint), or with ``load_format="dummy"`` by the architecture's own random
init (``dummy.py``). Checkpoints that cannot be read that way (a hub id, AWQ's packed tensors, names that
differ from the model's) load whole on the CPU, are cut there and then moved.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.model_loader import load_model, refuse_dummy_quantized
from paged_backend.model_loader.dummy import materialize, meta_model
from paged_backend.model_loader.hf import checkpoint_dtype, checkpoint_files, checkpoint_quantization, load_hf_config
from paged_backend.model_loader.tp_plan import (
    AllReduce,
    head_layout,
    set_local_heads,
    shard_linear,
    shard_model,
    tp_plan,
    tp_shard_of,
)
from paged_backend.quantization.fp8 import quantize_fp8

logger = logging.getLogger(__name__)


def check_tp_support(config: EngineConfig, name: str) -> None:
    """Refuse, before any worker starts, an architecture without a TP plan or head counts that do not divide."""
    hf_config = load_hf_config(config, name)
    head_layout(hf_config.get_text_config(), config.parallel_config.tensor_parallel_size)
    tp_plan(meta_model(hf_config, torch.float32, config.model_config.trust_remote_code))


def load_shard(
    config: EngineConfig, name: str, rank: int, device: torch.device, all_reduce: AllReduce | None
) -> PreTrainedModel:
    """Rank ``rank``'s shard of the model at ``name`` on ``device``; rowwise layers all-reduce their outputs
    through ``all_reduce`` (None: left as partial sums, for a check in one process)."""
    world_size = config.parallel_config.tensor_parallel_size
    hf_config = load_hf_config(config, name)
    dummy = config.model_config.load_format == "dummy"
    quantization = checkpoint_quantization(config, hf_config, name)  # the asked and the checkpoint's must agree
    if dummy:
        refuse_dummy_quantized(hf_config, quantization)
    files = None if dummy else _sliceable_files(config, name, quantization)
    model = meta_model(hf_config, checkpoint_dtype(config, hf_config, device), config.model_config.trust_remote_code)
    if not dummy and (files is None or not _covers(model, files)):  # read whole on the CPU, cut there
        if files is not None:
            logger.info("%s: checkpoint names differ from the model's; every rank reads it whole", name)
        model, _ = load_model(config, name, device, keep_on_cpu=True)
        shard_model(model, rank, world_size, all_reduce)
        return model.to(device)  # type: ignore[arg-type]  # transformers wraps to(): self unbound
    layout = head_layout(hf_config.get_text_config(), world_size)
    plan = tp_plan(model)

    def shard(module_name: str, module: torch.nn.Module) -> None:
        if module_name in plan:
            shard_linear(module_name, module, plan[module_name], layout, rank, all_reduce)

    materialize(model, device, config.model_config.seed, shard, init=files is None)
    if files is not None:
        read_slices(model, files, rank)
    if config.model_config.quantization == "fp8":  # dummy weights, quantized per rank (vLLM's online fp8)
        quantize_fp8(model)
    set_local_heads(model, layout)
    return model


def _sliceable_files(config: EngineConfig, name: str, quantization: str | None) -> list[str] | None:
    """The safetensors files of a local, unquantized checkpoint folder; None where the whole model must load
    (a hub id, another format such as GGUF, a quantized checkpoint's packed tensors)."""
    if config.model_config.gguf_file is not None or not os.path.isdir(name):
        return None
    if quantization is not None:
        return None
    try:
        return checkpoint_files(name)
    except FileNotFoundError:
        return None


def _checkpoint_keys(files: list[str]) -> dict[str, str]:
    from safetensors import safe_open

    keys = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            keys.update(dict.fromkeys(f.keys(), path))  # noqa: SIM118 - safe_open has keys(), not iteration
    return keys


def _covers(model: PreTrainedModel, files: list[str]) -> bool:
    """Whether the checkpoint holds every parameter under the model's own name (tied ones count once)."""
    keys = _checkpoint_keys(files)
    return all(name in keys for name, _ in model.named_parameters())


@torch.no_grad()
def read_slices(model: PreTrainedModel, files: list[str], rank: int) -> None:
    """Fill a sharded model's parameters from the checkpoint, reading only this rank's slice of each planned
    linear (``tp_shard``): a colwise layer's output rows, a rowwise layer's input columns (its bias on rank 0
    only; the others keep zeros). Other tensors are read whole. CPU memory holds one tensor at a time."""
    from safetensors import safe_open

    keys = _checkpoint_keys(files)
    modules = dict(model.named_modules())
    handles: dict[str, Any] = {}
    try:
        for name, param in model.named_parameters():
            module_name, _, attr = name.rpartition(".")
            shard = tp_shard_of(modules[module_name])
            if shard is not None and shard.style == "rowwise" and attr == "bias" and rank != 0:
                continue
            path = keys[name]
            if path not in handles:
                handles[path] = safe_open(path, framework="pt", device="cpu").__enter__()
            stored = handles[path].get_slice(name)
            if shard is None:
                tensor = stored[:]
            elif shard.style == "colwise":
                tensor = stored[shard.start : shard.stop]
            else:
                tensor = stored[:, shard.start : shard.stop] if attr == "weight" else stored[:]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint holds {tuple(tensor.shape)}, the model {tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
