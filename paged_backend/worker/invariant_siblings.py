"""Sibling projections (q/k/v, gate/up) as one product in ``batch_invariant`` mode, without compiling.

The mode runs linear layers on fixed blocks of 256 rows, one matrix product a block. A narrow projection (an 8B
model's k and v: 1,024 columns) then costs a launch and a tail per block for little work, three times a layer.
The compiled engine fuses siblings by rewriting its graph (``fuse_linears.py``); the invariant mode runs HF's
eager forward, so here the first sibling's call computes the whole group over the packed weights (the siblings
are slices of one buffer, ``fuse_linears.pack``) and the others' calls on the same input take their slice.

A row's bits stay the batch's own business: which calls fuse depends on the model's code alone (siblings called
on one input tensor), never on the batch. A sibling called on another input, or before the first, is computed
alone. Groups packed before (by an earlier engine) are found again by their shared buffer (``packed_siblings``):
an engine that does not pack itself (``enforce_eager``) and the trainer's forward (``trainer_forward.py``) then
compute them as the packing engine did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from paged_backend.worker.fuse_linears import is_packed

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (x, [K, N] matrix, bias)


class SiblingProducts:
    """Groups of packed sibling weights, and the slices their first member's call left for the others."""

    def __init__(self, groups: Iterable[tuple[list[nn.Parameter], list[nn.Parameter] | None]]) -> None:
        self.first: dict[int, tuple[list[nn.Parameter], list[nn.Parameter] | None]] = {}
        for weights, biases in groups:
            self.first[id(weights[0])] = (weights, biases)
        # id(weight) -> (the input it was computed for, its slice of the group's product)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = 0  # sibling calls answered from a group's product

    def __len__(self) -> int:
        return len(self.first)

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, product: Product
    ) -> torch.Tensor | None:
        """``F.linear(x, weight, bias)`` from its group's product, or ``None`` where ``weight`` leads no packed
        group and no slice waits for it (the caller then computes it alone)."""
        waiting = self.pending.pop(id(weight), None)
        if waiting is not None and waiting[0] is x:
            self.hits += 1
            return waiting[1]
        group = self.first.get(id(weight))
        if group is None or group[0][0] is not weight:
            return None
        weights, biases = group
        if (bias is None) != (biases is None) or (biases is not None and biases[0] is not bias):
            return None
        sizes = [w.shape[0] for w in weights]
        width = weight.shape[1]
        matrix = torch.as_strided(weight, (sum(sizes), width), (width, 1))  # the packed buffer runs on
        fused_bias = None if bias is None else torch.as_strided(bias, (sum(sizes),), (1,))
        parts = product(x, matrix.t(), fused_bias).split_with_sizes(sizes, dim=-1)
        for sibling, part in zip(weights[1:], parts[1:]):
            self.pending[id(sibling)] = (x, part)
        return parts[0]

    def clear(self) -> None:
        self.pending.clear()


def packed_siblings(model: torch.nn.Module) -> SiblingProducts:
    """The linear layers whose weights (and biases) the engine packed into one buffer (``fuse_linears.pack``), as
    the groups ``batch_invariant`` steps compute in one product: weights sharing a storage, back to back, in the
    buffer's order."""
    by_storage: dict[int, dict[int, torch.nn.Linear]] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            by_storage.setdefault(module.weight.untyped_storage().data_ptr(), {})[id(module.weight)] = module
    groups: list[tuple[list[torch.nn.Parameter], list[torch.nn.Parameter] | None]] = []
    for modules in by_storage.values():
        linears = sorted(modules.values(), key=lambda m: m.weight.storage_offset())
        weights = [cast(torch.nn.Parameter, m.weight) for m in linears]
        if len(linears) < 2 or not is_packed(list(weights)):
            continue  # one weight (a tied one too), or slices that are not one packed buffer
        biases = [m.bias for m in linears if m.bias is not None]
        if not biases:
            groups.append((weights, None))
        elif len(biases) == len(linears) and is_packed(list(biases)):
            groups.append((weights, biases))
    return SiblingProducts(groups)
