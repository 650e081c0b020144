"""Where a Hugging Face causal LM keeps its decoder layers, found from the module tree alone.

Both the regional compiler (``worker/compile.py``) and the AWQ quantizer (``quantization/awq_quantize.py``) walk
the decoder layers, and architectures name their layer list differently (``model.layers``, ``transformer.h``,
``gpt_neox.layers``, ...). A leaf module, importing only torch, so that neither of them imports the other's
package for it.
"""

from __future__ import annotations

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
