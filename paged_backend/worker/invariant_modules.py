"""HF Llama's decoder layers, attentions and MLPs, and their copies (Mistral's and Qwen2's layers and MLPs; their
attentions pass a sliding window, other code), run outside ``BatchInvariantMode``.

Inside the mode every torch call, and every read of a tensor's attributes, is a Python call into the mode. A small
model's forward is bound by the host, which then pays for every op that the mode passes through untouched. These
modules' forwards, code for code HF Llama's, reach the functions the mode computes its own way only through their
children: plain linear layers (run as the mode runs ``F.linear``, their forward swapped for that), the RMSNorms the
mode already swaps, an activation, and each other. So the mode is switched off inside them, and nothing changes
but the host's time. Anything else keeps a module inside the mode: a hook, a forward set on the instance, a child
of another kind, a tensor subclass, an attention implementation other than the one the caller names, rotary
helpers that are not Llama's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import activations
from transformers.models.llama import modeling_llama as llama

# The forwards known to reach the mode's functions only through their children.
KNOWN = (llama.LlamaDecoderLayer.forward, llama.LlamaAttention.forward, llama.LlamaMLP.forward)
ATTENTION = llama.LlamaAttention.forward
ROTARY = ("apply_rotary_pos_emb", "rotate_half")  # the attention's helpers, looked up in its module's globals
# Elementwise activations (those this transformers version has)
_ELEMENTWISE = ("SiLUActivation", "GELUActivation", "GELUTanh")
ACTIVATIONS = (nn.SiLU, nn.GELU) + tuple(getattr(activations, n) for n in _ELEMENTWISE if hasattr(activations, n))


@functools.cache
def same_code(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions run the same code: their own, and that of what their decorators wrap. The verdict is
    kept for the pair of function objects (a class whose forward is patched has another function)."""
    codes = []
    for f in (a, b):
        code, inner = getattr(f, "__code__", None), getattr(inspect.unwrap(f), "__code__", None)
        if code is None or inner is None:
            return False
        codes.append([(c.co_code, c.co_consts, c.co_names) for c in (code, inner)])
    return codes[0] == codes[1]


def _hookless(module: nn.Module) -> bool:
    """No hook of its own and no forward set on the instance: its call is its class's forward."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


@functools.cache
def _known(forward: Callable[..., Any]) -> str | None:
    """Which of ``KNOWN`` ``forward`` is, by code: "attention", "other" or ``None`` (the verdict kept for the
    function object: a patched forward is another)."""
    if not any(same_code(forward, k) for k in KNOWN):
        return None
    return "attention" if same_code(forward, ATTENTION) else "other"


_LLAMA_ROTARY = {name: getattr(llama, name) for name in ROTARY}  # as imported, before anyone patches them


def _rotary_is_llamas(forward: Callable[..., Any]) -> bool:
    """Whether the rotary helpers an attention's forward finds in its module's globals (now) are Llama's."""
    helpers = inspect.unwrap(forward).__globals__
    return all(callable(helpers.get(n)) and same_code(helpers[n], f) for n, f in _LLAMA_ROTARY.items())


class _Finder:
    """Which of a model's modules run outside the mode, for the norms the mode swaps and the attention
    implementation the model's configs name."""

    def __init__(self, norms: list[nn.Module], attention: str) -> None:
        self.norms = {id(m) for m in norms}
        self.attention = attention

    def outside(self, module: nn.Module) -> bool:
        """Whether ``module`` may run outside the mode (its children too, or the kinds it may hold)."""
        forward = type(module).forward
        kind = _known(forward)
        if kind is None or not _hookless(module):
            return False
        if kind == "attention":  # Llama's rotary helpers and the caller's attention implementation
            config = getattr(module, "config", None)
            if not _rotary_is_llamas(forward) or getattr(config, "_attn_implementation", None) != self.attention:
                return False
        return all(self._child(c) for c in module.children())

    def _child(self, child: nn.Module) -> bool:
        if type(child) is nn.Linear:  # plain parameters: a subclass's torch function would be skipped
            plain = all(type(p) is nn.Parameter for p in child.parameters(recurse=False))
            return plain and _hookless(child)
        if type(child) in ACTIVATIONS:
            return _hookless(child)
        if id(child) in self.norms:
            return _hookless(child)
        return self.outside(child)


def modules_outside_the_mode(
    model: nn.Module, norms: list[nn.Module], attention: str
) -> tuple[list[nn.Module], list[nn.Linear]]:
    """(the outermost modules of ``model`` that run outside the mode, the linear layers inside them): ``norms``
    are the RMSNorms the mode swaps, ``attention`` the attention implementation the model runs. None where any
    global module hook is set (it would run inside those modules)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return [], []
    finder = _Finder(norms, attention)
    outermost: list[nn.Module] = []
    linears: list[nn.Linear] = []
    pending = [model]
    while pending:  # parents before their children; a module outside holds its subtree
        module = pending.pop()
        if finder.outside(module):
            outermost.append(module)
            linears += [m for m in module.modules() if type(m) is nn.Linear]
        else:
            pending += reversed(list(module.children()))
    return outermost, linears


def outside_the_mode() -> contextlib.AbstractContextManager[None]:
    """A context for a kernel's launch inside ``BatchInvariantMode`` with no function the mode computes its own
    way: the mode (any torch function override) sees none of the launch's tensor reads (every ``data_ptr``,
    ``stride`` and ``dtype`` of every argument would otherwise be a Python call into the mode, several times the
    launch's own cost where a small model's forward is bound by the host)."""
    return torch._C.DisableTorchFunction()


def hooks_made() -> int:
    """How many hooks (module, global, tensor) have been registered in the process so far."""
    return RemovableHandle.next_id


def run_outside_the_mode(module: nn.Module, hooks_seen: int, *args: Any, **kwargs: Any) -> Any:
    """``module``'s class forward outside the mode (the swapped forward of an outermost module). Inside it, as
    when it was found, where autograd records (a norm's own forward, which the mode computes by blocks, then runs
    in place of its kernel), where a hook was registered since ``hooks_seen`` (it would run inside the module),
    or where an input is a tensor subclass (whose own torch function must run)."""
    inputs = [*args, *kwargs.values()]
    inputs += [x for item in inputs if isinstance(item, (tuple, list)) for x in item]
    inside = (
        torch.is_grad_enabled()
        or hooks_made() != hooks_seen
        or any(isinstance(x, torch.Tensor) and type(x) is not torch.Tensor for x in inputs)
    )
    if inside:
        return type(module).forward(module, *args, **kwargs)
    with outside_the_mode():
        return type(module).forward(module, *args, **kwargs)
