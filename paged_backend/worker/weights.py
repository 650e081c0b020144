"""The model's parameters where the engine last saw them. Packed sibling projections (``fuse_linears.py``) and
CUDA graphs read weights at fixed addresses: a parameter updated in place (``optimizer.step()``,
``param.data.copy_``) is seen by the next step as it is, but one replaced by a new tensor
(``load_state_dict(..., assign=True)``, a wrapper that swaps tensors) would leave them reading the old one. So
each step first checks that every parameter is where it was, and stops with an error that names the first one
that moved — never silently stale weights."""

from __future__ import annotations

from torch import nn


class WeightAddresses:
    """Each parameter's module, name and data address when recorded."""

    def __init__(self, model: nn.Module) -> None:
        self.entries = [
            (f"{prefix}.{name}" if prefix else name, module, name, param.data_ptr())
            for prefix, module in model.named_modules()
            for name, param in module._parameters.items()
            if param is not None
        ]

    def replaced(self) -> str | None:
        """The path of the first parameter replaced since the record, or ``None``."""
        for path, module, name, address in self.entries:
            param = module._parameters.get(name)
            if param is None or param.data_ptr() != address:
                return path
        return None

    def check(self) -> None:
        """Raise if a parameter was replaced since the record."""
        path = self.replaced()
        if path is not None:
            raise RuntimeError(
                f"the model's parameter {path} was replaced after the engine packed or captured it (e.g. by "
                "load_state_dict(..., assign=True)); the engine would read the old weights. Update parameters "
                "in place (optimizer.step(), param.data.copy_(new), load_state_dict without assign) or make a "
                "new LLM"
            )
