"""Sibling projections (q/k/v, gate/up) as one matrix product, by a pass over the decoder layer's dynamo graph.

HF modules call ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``) on the same hidden states:
separate GEMMs, each too narrow to fill the GPU at decode batch sizes (Llama-3-8B's k and v have 1,024 output
columns: 16 tiles of 64 for 132 SMs) and each paying its own launch and tail. vLLM rewrites the model with fused
``QKVParallelLinear`` layers; we keep HF's modules and rewrite the compiled graph instead:

1. find ``linear`` calls on one input whose weights (and biases) are parameters of the layer;
2. pack those parameters, in every layer the graph serves, into one buffer each (the parameters become views of
   it, so memory does not grow and HF's own eager forward still sees its weights): ``PackingBackend``, a
   dynamo trace of its own before the compiling one;
3. in the compiling trace, replace the calls by one ``linear`` over the packed weight, read as ``as_strided``
   from the first weight (its storage runs on into the others), and split the result back:
   ``fuse_sibling_linears``.

AWQ and FP8 layers' calls (one op of ours each, block-wise FP8's included) are fused the same way, their buffers
packed along the output.
Weights must not be replaced after packing (CUDA graphs already assume that); a group found unpacked in any
layer is left as separate calls.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch import fx, nn

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_SOURCE = re.compile(r"^L\['self'\]((?:\._modules\['[^']+'\])*)\._(parameters|buffers)\['([^']+)'\]$")


def parameter_path(node: fx.Node, kind: str = "parameters") -> str | None:
    """``self_attn.q_proj.weight`` for a placeholder that dynamo lifted from the layer's parameters (or, with
    ``kind="buffers"``, its buffers), else None."""
    if node.op != "placeholder" or node.meta.get("grapharg") is None:
        return None
    match = _SOURCE.match(node.meta["grapharg"].source.name)
    if match is None or match.group(2) != kind:
        return None
    modules = re.findall(r"\._modules\['([^']+)'\]", match.group(1))
    return ".".join([*modules, match.group(3)])


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
    by_input: dict[fx.Node, list[tuple[fx.Node, str, str | None]]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is not None:
            x, weight_path, bias_path = parts
            by_input[x].append((node, weight_path, bias_path))
    groups: list[Group] = []
    seen: set[str] = set()
    for calls in by_input.values():
        nodes = [node for node, _, _ in calls]
        paths = [(w, b) for _, w, b in calls]
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
        biases = None if paths[0][1] is None else [b for _, b in paths if b is not None]  # all or none have one
        groups.append(Group(nodes, [w for w, _ in paths], biases))
    return groups


def _parameter_lists(group: Group) -> list[list[str]]:
    return [group.weights] if group.biases is None else [group.weights, group.biases]


def is_packed(tensors: list[torch.Tensor], dim: int = 0) -> bool:
    """Whether ``tensors`` are, in order, the slices along ``dim`` of one contiguous buffer (as ``pack`` leaves
    them): back to back for ``dim=0`` (weights ``[out, in]``, biases), column slices for ``dim=1`` (AWQ's
    ``[in, out / 8]`` buffers)."""
    first = tensors[0]
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    strides = torch.empty(shape, device="meta").stride()  # the whole buffer's, row-major
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != offset
            or t.stride() != strides
        ):
            return False
        offset += t.shape[dim] * strides[dim]
    return True


def pack(tensors: list[torch.Tensor], dim: int = 0) -> None:
    """Copy ``tensors`` into one new buffer, concatenated along ``dim``, and make each a view of its slice (the old
    storage is freed)."""
    if is_packed(tensors, dim):
        return
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the user's model stays usable
        buffer = torch.cat([t.data for t in tensors], dim=dim)
        start = 0
        for t in tensors:
            t.data = buffer.narrow(dim, start, t.shape[dim])
            start += t.shape[dim]
    if buffer.is_cuda:
        # The old storages are free now, but each is smaller than the next layer's packed buffer: give them back
        # to the driver, or a large model fragments its way out of memory (70B with the KV cache allocated).
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- quantized layers
# AWQ and FP8 layers (quantization/awq.py, quantization/fp8.py) call one op of ours on their own buffers (the bias
# added after). Siblings are packed along the output: AWQ's [in, out / 8] buffers side by side (column slices,
# which the kernels read through their row stride), FP8's [out, in] weights and [out] scales back to back.


class QuantizedOp(NamedTuple):
    """An op of ours over one layer's buffers: their names in the call's order, the dimension their outputs run
    along, which of them gives each sibling's output width (its size along ``dim``; AWQ: the scales'), and where
    the call names how many outputs one row of a buffer covers (block-wise FP8's scales: ``block_n``), which every
    sibling's width but the last must be a multiple of (else the packed scales would not line up)."""

    tensors: tuple[str, ...]
    dim: int
    width_from: int
    block_arg: int | None = None


QUANTIZED_OPS = {
    "paged_backend.awq_gemm.default": QuantizedOp(("qweight", "qzeros", "scales"), dim=1, width_from=2),
    "paged_backend.fp8_linear.default": QuantizedOp(("weight", "weight_scale"), dim=0, width_from=0),
    "paged_backend.fp8_block_linear.default": QuantizedOp(("weight", "weight_scale_inv"), 0, 0, block_arg=3),
}


class QuantizedGroup(NamedTuple):
    """Sibling calls of one quantized op and the paths of their layers (modules) in the decoder layer."""

    nodes: list[fx.Node]
    modules: list[str]
    op: QuantizedOp


def _quantized_parts(node: fx.Node) -> tuple[Any, str, QuantizedOp] | None:
    """(a key for the call's input and settings, the layer's path, the op) of a quantized call on one layer's own
    buffers, else None. Each layer flattens the hidden states itself, so calls on the same reshape of the same
    input match; the op's other arguments (FP8's activation settings) must match too."""
    op = QUANTIZED_OPS.get(str(node.target)) if node.op == "call_function" and not node.kwargs else None
    if op is None:
        return None
    flat, tensors, settings = node.args[0], node.args[1 : 1 + len(op.tensors)], node.args[1 + len(op.tensors) :]
    found = [parameter_path(t, "buffers") if isinstance(t, fx.Node) else None for t in tensors]
    paths = [p for p in found if p is not None]
    if len(paths) != len(found):
        return None
    modules = {p.rsplit(".", 1)[0] for p in paths}
    if len(modules) != 1 or tuple(p.rsplit(".", 1)[1] for p in paths) != op.tensors:
        return None
    key: Any = flat
    if isinstance(flat, fx.Node) and flat.op == "call_method" and flat.target in ("reshape", "view"):
        key = (flat.args[0], *flat.args[1:])
    return (key, str(node.target), *settings), modules.pop(), op


def find_quantized_groups(gm: fx.GraphModule, layer: nn.Module) -> list[QuantizedGroup]:
    """Groups of two or more calls of one quantized op on one input whose layers' buffers have the same shapes
    but along the output, dtypes and device."""
    by_input: dict[Any, list[tuple[fx.Node, str, QuantizedOp]]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = _quantized_parts(node)
        if parts is not None:
            by_input[parts[0]].append((node, parts[1], parts[2]))
    groups = []
    for members in by_input.values():
        modules, op = [m for _, m, _ in members], members[0][2]
        if len(members) < 2 or len(set(modules)) != len(modules):
            continue
        siblings = _quantized_siblings(layer, modules, op)
        if any(len({_but_along(t, op.dim) for t in tensors}) != 1 for tensors in siblings):
            continue
        if op.block_arg is not None:
            block = members[0][0].args[op.block_arg]
            widths = [t.shape[op.dim] for t in siblings[op.width_from]]
            if not isinstance(block, int) or any(w % block for w in widths[:-1]):
                continue
        groups.append(QuantizedGroup([n for n, _, _ in members], modules, op))
    return groups


def _but_along(t: torch.Tensor, dim: int) -> tuple[Any, ...]:
    """What siblings' buffers share: shape but along ``dim``, dtype and device."""
    return (*t.shape[:dim], *t.shape[dim + 1 :], t.dtype, t.device)


def _quantized_siblings(layer: nn.Module, modules: list[str], op: QuantizedOp) -> list[list[torch.Tensor]]:
    """For each of the op's buffers, the sibling layers' ``modules``."""
    return [[layer.get_buffer(f"{m}.{name}") for m in modules] for name in op.tensors]


def _piece(graph: fx.Graph, split: fx.Node, i: int, replaced: fx.Node) -> fx.Node:
    """The ``i``-th piece of a fused product, standing for ``replaced``. It takes the node's example value (same
    shape and dtype; the piece's strides are the fused product's): AOTAutograd's cache only keeps graphs whose
    method calls are made on nodes known to be tensors, and without it every process would trace the layer again.
    Nothing else of the node's metadata (its module stack: a projection's) describes the piece."""
    piece = graph.call_function(operator.getitem, (split, i))
    if "example_value" in replaced.meta:
        piece.meta["example_value"] = replaced.meta["example_value"]
    return piece


def _fuse_quantized_group(graph: fx.Graph, group: QuantizedGroup, siblings: list[list[torch.Tensor]]) -> None:
    """One call over the packed buffers (read as ``as_strided`` from the first layer's), split back."""
    dim = group.op.dim
    widths = [t.shape[dim] for t in siblings[group.op.width_from]]
    first = group.nodes[0]
    with graph.inserting_before(first):
        tensors = []
        for node, members in zip(first.args[1 : 1 + len(siblings)], siblings):
            shape = list(members[0].shape)
            shape[dim] = sum(t.shape[dim] for t in members)
            strides = torch.empty(shape, device="meta").stride()
            tensors.append(graph.call_function(torch.as_strided, (node, tuple(shape), strides)))
        op = cast(Callable[..., Any], first.target)  # a call_function node's target is what it calls
        fused = graph.call_function(op, (first.args[0], *tensors, *first.args[1 + len(siblings) :]))
        split = graph.call_function(torch.split, (fused, widths), {"dim": -1})
        for i, node in enumerate(group.nodes):
            node.replace_all_uses_with(_piece(graph, split, i, node))
    for node in group.nodes:
        graph.erase_node(node)


class PackingBackend:
    """A dynamo backend that packs the sibling groups of the traced layer in every layer, then runs the graph as
    traced. Packing must come before the compiling trace: inductor's trace records each weight's storage offset,
    and packing moves them. AWQ siblings (packed along columns) change strides when packed, which dynamo would
    find against the guards of the frame being traced: they are packed by ``finish()``, after the trace."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.deferred: list[list[torch.Tensor]] = []
        # Each layer's packed groups: (weights, biases or None), in call order; one entry per group and layer.
        self.packed: dict[tuple[int, ...], tuple[list[nn.Parameter], list[nn.Parameter] | None]] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for group in find_sibling_groups(gm, self.layers[0]):
            for layer in self.layers:
                for paths in _parameter_lists(group):
                    pack([layer.get_parameter(p) for p in paths])
                weights = [layer.get_parameter(p) for p in group.weights]
                biases = None if group.biases is None else [layer.get_parameter(p) for p in group.biases]
                self.packed[tuple(map(id, weights))] = (weights, biases)
        for quantized in find_quantized_groups(gm, self.layers[0]):
            for layer in self.layers:
                for tensors in _quantized_siblings(layer, quantized.modules, quantized.op):
                    if quantized.op.dim == 0:  # strides unchanged: packed now, as parameters are
                        pack(tensors)
                    else:
                        self.deferred.append(tensors)
        return gm.forward

    def finish(self) -> None:
        for tensors in self.deferred:
            pack(tensors, dim=1)
        self.deferred.clear()


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
                node.replace_all_uses_with(_piece(graph, split, i, node))
        for node in group.nodes:
            graph.erase_node(node)
        fused_groups += 1
    for quantized in find_quantized_groups(gm, layers[0]):
        dim = quantized.op.dim
        if all(
            is_packed(t, dim) for layer in layers for t in _quantized_siblings(layer, quantized.modules, quantized.op)
        ):
            _fuse_quantized_group(graph, quantized, _quantized_siblings(layers[0], quantized.modules, quantized.op))
            fused_groups += 1
    if fused_groups:
        graph.lint()
        gm.recompile()
    return fused_groups
