"""Where a Hugging Face causal LM keeps its decoder layers, found from the module tree alone.

Both the regional compiler (``worker/compile.py``) and the AWQ quantizer (``quantization/awq_quantize.py``) walk
the decoder layers, and architectures name their layer list differently (``model.layers``, ``transformer.h``,
``gpt_neox.layers``, ...). A leaf module, importing only torch, so that neither of them imports the other's
package for it.

Also typed access to what the loader, the quantizer and LoRA read off and record on a module: torch types every
attribute read of an ``nn.Module`` as ``Tensor | Module`` and every write as taking one, though a module stores any
object as a plain attribute.
"""

from __future__ import annotations

import torch
from torch import nn


def find_decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The longest ``ModuleList`` of one class whose members each hold a module with an int ``layer_idx``."""

    def has_layer_idx(module: nn.Module) -> bool:
        return any(isinstance(getattr(m, "layer_idx", None), int) for m in module.modules())

    best = None
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and len({type(m) for m in module}) == 1
            and all(has_layer_idx(m) for m in module)
            and (best is None or len(module) > len(best))
        ):
            best = module
    return best


def module_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``, a parameter or buffer, as the tensor it is; anything else there is a TypeError."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(value).__name__}, not a tensor")
    return value


def set_module_attribute(module: nn.Module, name: str, value: object) -> None:
    """Record a plain attribute (a count, a slice, a config) on ``module``, through ``nn.Module.__setattr__`` as an
    assignment would: its stub takes only tensors and modules, its body any object."""
    setattr(module, name, value)
