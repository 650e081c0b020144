"""When the user's model's weights changed, so that cached prefixes (KV computed with the old weights) are not
reused. Three signals, read before each step: the parameters' version counters, which in-place tensor operations
bump (``param.copy_``, ``load_state_dict``, non-fused optimizers); an optimizer step over any of the model's
parameters, which a fused optimizer (transformers' default ``adamw_torch_fused``) takes without bumping them;
and a parameter or submodule registered on one of the model's modules (``load_state_dict(..., assign=True)``,
``module.weight = nn.Parameter(...)``). A write through ``.data`` shows none: ``LLM.reset_prefix_cache()`` is
for that.

The parameters are listed once (and again after a registration): walking the module tree before every step
costs about half a millisecond on a 30-layer model, a third of a GPU decode step of a small one."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook


class WeightUpdates:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._list_parameters()
        self.version = self._version()
        self.stepped = False
        this = weakref.ref(self)  # the process-wide hooks must not keep the engine alive

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            watcher = this()
            if watcher is not None and any(
                id(param) in watcher.param_ids for group in optimizer.param_groups for param in group["params"]
            ):
                watcher.stepped = True

        def registered(module: nn.Module, name: str, value: Any) -> None:
            watcher = this()
            if watcher is not None and id(module) in watcher.module_ids:
                watcher.stepped = watcher.relist = True

        handles = [
            register_optimizer_step_post_hook(after_step),
            register_module_parameter_registration_hook(registered),
            register_module_module_registration_hook(registered),
        ]
        for handle in handles:
            weakref.finalize(self, handle.remove)

    def _list_parameters(self) -> None:
        # Inference tensors (a model made under torch.inference_mode) keep no version: they count as unchanged.
        params = list(self.model.parameters())
        self.param_ids = {id(param) for param in params}
        self.versioned = [param for param in params if not param.is_inference()]
        self.module_ids = {id(module) for module in self.model.modules()}
        self.relist = False

    def _version(self) -> int:
        return sum(param._version for param in self.versioned)

    def changed(self) -> bool:
        """Whether the weights may have changed since the last call."""
        if self.relist:
            self._list_parameters()
        version = self._version()
        changed = self.stepped or version != self.version
        self.version, self.stepped = version, False
        return changed
