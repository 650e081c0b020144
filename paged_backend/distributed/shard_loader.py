"""One tensor-parallel rank's model: its slices only, on its own device.

A checkpoint loads on the CPU, is cut down there and then moved, so a device never holds more than its share
(every rank reads the whole checkpoint into CPU memory meanwhile: per-slice reads are left to do). With
``load_format="dummy"`` each module is made on the device and cut as soon as it exists (``dummy_loader.py``), so
a model larger than one device (a 70B shape over two GPUs) never exists whole anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.distributed.tp_plan import head_layout, set_local_heads, shard_linear, shard_model, tp_plan
from paged_backend.dummy_loader import materialize, meta_model
from paged_backend.model_loader import checkpoint_dtype, load_hf_config, load_model

AllReduce = Callable[[torch.Tensor], torch.Tensor | None]


def check_tp_support(config: EngineConfig, name: str) -> None:
    """Refuse, before any worker starts, an architecture without a TP plan or head counts that do not divide."""
    hf_config = load_hf_config(config, name)
    head_layout(hf_config.get_text_config(), config.parallel_config.tensor_parallel_size)
    tp_plan(meta_model(hf_config, torch.float32, config.model_config.trust_remote_code))


def load_shard(
    config: EngineConfig, name: str, rank: int, device: torch.device, all_reduce: AllReduce
) -> PreTrainedModel:
    """Rank ``rank``'s shard of the model at ``name`` on ``device``; rowwise layers all-reduce their outputs."""
    world_size = config.parallel_config.tensor_parallel_size
    if config.model_config.load_format != "dummy":
        model, _ = load_model(config, name, device, keep_on_cpu=True)
        shard_model(model, rank, world_size, all_reduce)
        return model.to(device)
    hf_config = load_hf_config(config, name)
    layout = head_layout(hf_config.get_text_config(), world_size)
    model = meta_model(hf_config, checkpoint_dtype(config, hf_config, device), config.model_config.trust_remote_code)
    plan = tp_plan(model)

    def shard(module_name: str, module: torch.nn.Module) -> None:
        if module_name in plan:
            shard_linear(module_name, module, plan[module_name], layout, rank, all_reduce)

    materialize(model, device, config.model_config.seed, shard)
    set_local_heads(model, layout)
    return model
