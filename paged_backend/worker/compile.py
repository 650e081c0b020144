"""Regional compilation: ``torch.compile`` the decoder layer once and run every layer through it.

Compiling the whole forward of a 32-layer model with dynamic shapes takes minutes, because dynamo traces and
inductor compiles all 32 copies. The layers are instances of one class whose only differences are their weights
(graph inputs) and their KV caches (tensor attributes, also graph inputs: see ``attention.KV_CACHE_ATTR``), so
one compiled graph serves them all. Layers that really differ (sliding-window vs full attention in Gemma or
Qwen2) compile one graph per kind. The layers' ``forward`` is swapped only inside ``with``, so the user's own
calls to the model never see the compiled code.

Shapes are dynamic, with duck sizing off: otherwise dynamo would give two dimensions that happen to be equal
when it traces (say 2 logit rows and 2 KV heads) one symbol, and recompile when they differ. Floats (an RMSNorm's
eps, attention's scale) are constants: traced as inputs, dynamo would restart its trace to specialize them, so the
layer would be traced and handed to inductor twice. A float that differs from layer to layer (GPT-2's attention
scaled by the inverse layer index) gives a graph per value either way.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from paged_backend.config import EngineConfig
from paged_backend.worker.fp8_activations import divides_as_eager, quantize_fp8_activations
from paged_backend.worker.fuse_linears import PackingBackend, fuse_sibling_linears
from paged_backend.worker.one_row_gemv import route_one_row_gemv

logger = logging.getLogger(__name__)


def start_compile_workers(config: EngineConfig, device: torch.device) -> None:
    """Start inductor's compile workers now, while the weights load and the profile runs, when this engine will
    compile. Inductor starts them at its first call, after dynamo's trace of the layer, and until they are ready
    it compiles each kernel in the main process, one after another: in a fresh process that is most of the
    compile, since a trace ends long before workers that must import torch are ready."""
    if device.type != "cuda" or config.device_config.enforce_eager or config.model_config.batch_invariant:
        return  # batch_invariant: the layers stay eager (ModelRunner.compile), inductor never runs
    try:
        from torch._inductor.async_compile import maybe_warm_pool  # private, but what inductor's backend calls

        maybe_warm_pool()
    except Exception as exc:  # noqa: BLE001 - inductor starts them itself, later, or the compile falls back to eager
        logger.warning("could not start inductor's compile workers early (%s: %s)", type(exc).__name__, exc)


def _fresh_copy(fn: Callable[..., Any]) -> types.FunctionType:
    """The same function over a new code object. Dynamo keeps its compiled code, and its limit of 8 graphs, per
    code object, and transformers gives every decoder layer class one shared ``forward`` wrapper: without a copy,
    the engines of one process would share those 8 graphs and the later ones would silently run eagerly."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"regional compilation copies a decoder layer's forward function, not a {type(fn).__name__}")
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return copy


class RegionalCompile:
    """``with regions:`` routes every layer through the compiled forward; re-entering is a no-op."""

    def __init__(self, layers: nn.ModuleList, backend: Any = "inductor") -> None:
        self.layers = list(layers)
        self.num_graphs = 0
        self.num_fused_groups = 0  # sibling projections run as one matrix product (fuse_linears.py)
        self.num_fp8_quantized = 0  # FP8 calls whose activation quantization joined the graph (fp8_activations.py)
        self.num_gemv_routed = 0  # one-row projections routed to the GEMV (one_row_gemv.py)
        compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.num_graphs += 1
            if not isinstance(compiler, PackingBackend):  # the packer finds the groups in the graph as traced
                self.num_fused_groups += fuse_sibling_linears(gm, self.layers)
                self.num_gemv_routed += route_one_row_gemv(gm)
                quantized = quantize_fp8_activations(gm)
                self.num_fp8_quantized += quantized
                if quantized:  # the graph's quantization divides as the FP8 op's kernel does
                    with divides_as_eager():
                        return compiler(gm, example_inputs)
            return compiler(gm, example_inputs)

        forward = _fresh_copy(type(self.layers[0]).forward)
        compiled = torch.compile(forward, dynamic=True, backend=counting_backend)
        self.methods = [types.MethodType(compiled, layer) for layer in self.layers]
        self.previous: list[Any] = []
        self.depth = 0
        # torch's fx config module lacks the TYPE_CHECKING import of _config_typing that declares patch()
        self.no_duck_shapes = fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]
        self.constant_floats = torch._dynamo.config.patch(specialize_float=True)

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.no_duck_shapes.__enter__()
        self.constant_floats.__enter__()
        self.previous = [layer.__dict__.get("forward") for layer in self.layers]
        for layer, method in zip(self.layers, self.methods):
            layer.forward = method

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for layer, previous in zip(self.layers, self.previous):
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous
        self.constant_floats.__exit__(*exc)
        self.no_duck_shapes.__exit__(*exc)
