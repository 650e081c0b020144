"""Sibling projections (q/k/v, gate/up) as one matrix product, by a pass over the decoder layer's dynamo graph.

HF modules call ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``) on the same hidden states:
separate GEMMs, each too narrow to fill the GPU at decode batch sizes (Llama-3-8B's k and v have 1,024 output
columns: 16 tiles of 64 for 132 SMs) and each paying its own launch and tail. vLLM rewrites the model with fused
``QKVParallelLinear`` layers; we keep HF's modules and rewrite the compiled graph instead:

1. find ``linear`` calls on one input whose weights (and biases) are parameters of the layer;
2. pack those parameters, in every layer the graph serves, into one buffer each (the parameters become views of
   it, so memory does not grow and HF's own eager forward still sees its weights): ``packing_backend``, a
   dynamo trace of its own before the compiling one;
3. in the compiling trace, replace the calls by one ``linear`` over the packed weight, read as ``as_strided``
   from the first weight (its storage runs on into the others), and split the result back:
   ``fuse_sibling_linears``.

Weights must not be replaced after packing (CUDA graphs already assume that); a group found unpacked in any
layer is left as separate calls.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx, nn

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_PARAMETER_SOURCE = re.compile(r"^L\['self'\]((?:\._modules\['[^']+'\])*)\._parameters\['([^']+)'\]$")


def parameter_path(node: fx.Node) -> str | None:
    """``self_attn.q_proj.weight`` for a placeholder that dynamo lifted from the layer's parameters, else None."""
    if node.op != "placeholder" or node.meta.get("grapharg") is None:
        return None
    match = _PARAMETER_SOURCE.match(node.meta["grapharg"].source.name)
    if match is None:
        return None
    modules = re.findall(r"\._modules\['([^']+)'\]", match.group(1))
    return ".".join([*modules, match.group(2)])


def _linear_parts(node: fx.Node) -> tuple[fx.Node, str, str | None] | None:
    """(input, weight path, bias path or None) of a ``linear`` call on layer parameters, else None."""
    if node.op != "call_function" or node.target not in _LINEARS or node.kwargs:
        return None
    x, weight, bias = (*node.args, None)[:3]
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node):
        return None
    weight_path = parameter_path(weight)
    bias_path = parameter_path(bias) if isinstance(bias, fx.Node) else None
    if weight_path is None or (bias is not None and bias_path is None):
        return None
    return x, weight_path, bias_path


class Group(NamedTuple):
    """Sibling ``linear`` calls and their parameters' paths in the layer (biases None when they have none)."""

    nodes: list[fx.Node]
    weights: list[str]
    biases: list[str] | None


def find_sibling_groups(gm: fx.GraphModule, layer: nn.Module) -> list[Group]:
    """Groups of two or more ``linear`` calls on one input, all with or all without a bias, whose contiguous
    2-D weights share dtype, device and input width. A parameter used by two groups is left alone."""
    by_input: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is not None:
            by_input[parts[0]].append(node)
    groups, seen = [], set()
    for nodes in by_input.values():
        paths = [_linear_parts(n)[1:] for n in nodes]
        weights = [layer.get_parameter(w) for w, _ in paths]
        if (
            len(nodes) < 2
            or len({b is None for _, b in paths}) != 1
            or any(w.dim() != 2 or not w.is_contiguous() for w in weights)
            or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1
        ):
            continue
        names = [p for pair in paths for p in pair if p is not None]
        if len(set(names)) != len(names) or seen.intersection(names):
            continue
        seen.update(names)
        biases = None if paths[0][1] is None else [b for _, b in paths]
        groups.append(Group(nodes, [w for w, _ in paths], biases))
    return groups


def _parameter_lists(group: Group) -> list[list[str]]:
    return [group.weights] if group.biases is None else [group.weights, group.biases]


def is_packed(params: list[torch.Tensor]) -> bool:
    """Whether ``params`` lie back to back, in order, in one storage (as ``pack`` leaves them)."""
    first = params[0]
    offset = first.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return all(p.is_contiguous() for p in params)


def pack(params: list[nn.Parameter]) -> None:
    """Copy ``params`` into one new buffer and make each a view of its slice (the old storage is freed)."""
    if is_packed(params):
        return
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the user's model stays usable
        buffer = torch.cat([p.data.reshape(-1) for p in params])
        start = 0
        for p in params:
            p.data = buffer[start : start + p.numel()].view(p.shape)
            start += p.numel()
    if buffer.is_cuda:
        # The old storages are free now, but each is smaller than the next layer's packed buffer: give them back
        # to the driver, or a large model fragments its way out of memory (70B with the KV cache allocated).
        torch.cuda.empty_cache()


def packing_backend(layers: list[nn.Module]) -> Callable[[fx.GraphModule, list[Any]], Callable]:
    """A dynamo backend that packs the sibling groups of the traced layer in every layer, then runs the graph as
    traced. Packing must come before the compiling trace: inductor's trace records each weight's storage
    offset, and packing moves them."""

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        for group in find_sibling_groups(gm, layers[0]):
            for layer in layers:
                for paths in _parameter_lists(group):
                    pack([layer.get_parameter(p) for p in paths])
        return gm.forward

    return backend


def fuse_sibling_linears(gm: fx.GraphModule, layers: list[nn.Module]) -> int:
    """Rewrite ``gm`` (the dynamo graph of ``layers[0]``'s forward) in place: each sibling group whose parameters
    are packed in every layer becomes one ``linear``. Returns how many groups fused."""
    fused_groups = 0
    graph = gm.graph
    for group in find_sibling_groups(gm, layers[0]):
        if not all(
            is_packed([layer.get_parameter(p) for p in paths]) for layer in layers for paths in _parameter_lists(group)
        ):
            continue
        first = group.nodes[0]
        sizes = [layers[0].get_parameter(w).shape[0] for w in group.weights]
        width = layers[0].get_parameter(group.weights[0]).shape[1]
        with graph.inserting_before(first):
            weight = graph.call_function(torch.as_strided, (first.args[1], (sum(sizes), width), (width, 1)))
            bias = None
            if group.biases is not None:
                bias = graph.call_function(torch.as_strided, (first.args[2], (sum(sizes),), (1,)))
            fused = graph.call_function(torch._C._nn.linear, (first.args[0], weight, bias))
            split = graph.call_function(torch.split, (fused, sizes), {"dim": -1})
            for i, node in enumerate(group.nodes):
                node.replace_all_uses_with(graph.call_function(operator.getitem, (split, i)))
        for node in group.nodes:
            graph.erase_node(node)
        fused_groups += 1
    if fused_groups:
        graph.lint()
        gm.recompile()
    return fused_groups
