"""``load_format="dummy"``: the architecture from its ``config.json`` alone, with random weights made on the device.

Benchmarks need a model's shape, not its values, and a 70B-shaped checkpoint is too big to write to disk or to
build whole in one GPU: parameters are first created on the meta device (buffers such as RoPE's stay real), then
each module's are materialised and initialised by the model's own ``_init_weights`` (normal weights, norms at 1),
one module at a time. Every module draws from a generator seeded by ``seed`` and its name, so replicated weights
agree across tensor-parallel ranks and a rank's slice (``shard`` cuts it right after it is made) is the slice of
the same full model that one device would hold.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device (no memory, no init cost); buffers stay real."""
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]  # patched for the block only
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # restored


def meta_model(hf_config: PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """The architecture of ``hf_config`` with every parameter on the meta device."""
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)


@torch.no_grad()
def materialize(
    model: PreTrainedModel,
    device: torch.device,
    seed: int,
    shard: Callable[[str, nn.Module], None] | None = None,
    init: bool = True,
) -> PreTrainedModel:
    """Give ``model``'s meta parameters values on ``device``: the architecture's own random init, module by
    module (``init=False``: left uninitialised, for a caller that fills them). ``shard(name, module)`` runs on each
    module right after its parameters are made."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG state is left as it was
        for name, module in model.named_modules():
            params = list(module.named_parameters(recurse=False))
            if not params:
                continue
            for param_name, param in params:
                module._parameters[param_name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False
                )
            if init:
                torch.manual_seed(seed + zlib.crc32(name.encode()))
                model._init_weights(module)
            if shard is not None:
                shard(name, module)
    for module in model.modules():  # buffers (RoPE's) were made on the CPU; parameters may have been moved by shard
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffer.to(device)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    left = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if left:
        raise RuntimeError(f"load_format='dummy' left parameters without values: {left[:5]}")
    return model.eval()


def dummy_model(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The model of ``hf_config`` on ``device`` in ``dtype`` with the architecture's own random init."""
    return materialize(meta_model(hf_config, dtype, trust_remote_code), device, seed)
