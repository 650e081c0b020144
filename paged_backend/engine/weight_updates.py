"""When the user's model's weights changed, so that cached prefixes (KV computed with the old weights) are not
reused. Two signals, read before each step: the parameters' version counters, which in-place tensor operations
bump (``param.copy_``, ``load_state_dict``, non-fused optimizers); and an optimizer step over any of the model's
parameters, which a fused optimizer (transformers' default ``adamw_torch_fused``) takes without bumping them.
A write through ``.data`` shows neither: ``LLM.reset_prefix_cache()`` is for that."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook


class WeightUpdates:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.param_ids = {id(param) for param in model.parameters()}
        self.version = self._version()
        self.stepped = False
        this = weakref.ref(self)  # the process-wide hook must not keep the engine alive

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            watcher = this()
            if watcher is not None and any(
                id(param) in watcher.param_ids for group in optimizer.param_groups for param in group["params"]
            ):
                watcher.stepped = True

        handle = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, handle.remove)

    def _version(self) -> int:
        # Inference tensors (a model made under torch.inference_mode) keep no version: they count as unchanged.
        return sum(param._version for param in self.model.parameters() if not param.is_inference())

    def changed(self) -> bool:
        """Whether the weights may have changed since the last call."""
        version = self._version()
        changed = self.stepped or version != self.version
        self.version, self.stepped = version, False
        return changed
