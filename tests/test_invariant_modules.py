"""HF Llama's layers run outside ``BatchInvariantMode`` (``worker/invariant_modules.py``): which modules do, and
that the model's bits do not change while the mode sees fewer calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_backend.worker import batch_invariant, invariant_modules, trainer_forward
from paged_backend.worker.batch_invariant import BatchInvariantMode, llama_rms_norms
from paged_backend.worker.invariant_modules import modules_outside_the_mode
from tests.fixtures.tiny_models import build_tiny_model

EXACT = trainer_forward.EXACT_ATTENTION


def names(model: torch.nn.Module, modules: list[torch.nn.Module]) -> list[str]:
    where = {id(m): n for n, m in model.named_modules()}
    return [where[id(m)] for m in modules]


def exact_attention(model: torch.nn.Module) -> torch.nn.Module:
    model.config._attn_implementation_internal = EXACT
    return model


def test_the_outermost_llama_modules_run_outside_and_anything_unknown_keeps_its_module_inside() -> None:
    """With the norms swapped, whole decoder layers run outside; without, their attentions and MLPs. A hook on a
    projection, another attention implementation, an unknown class (GPT-2's) keep theirs inside the mode."""
    model = exact_attention(build_tiny_model("llama", vocab_size=512))
    norms = llama_rms_norms(model)
    outermost, linears = modules_outside_the_mode(model, norms, EXACT)
    assert names(model, outermost) == ["model.layers.0", "model.layers.1"]
    assert len(linears) == 2 * 7 and model.lm_head not in linears  # the head is outside every layer: the mode's
    outermost, _ = modules_outside_the_mode(model, [], EXACT)
    assert names(model, outermost) == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn", "mlp")]

    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: None)
    outermost, linears = modules_outside_the_mode(model, norms, EXACT)
    assert names(model, outermost) == ["model.layers.0.mlp", "model.layers.1"]
    assert model.model.layers[0].self_attn.q_proj not in linears
    handle.remove()
    handle = model.model.layers[1].input_layernorm.register_forward_hook(lambda *_: None)  # a swapped norm's hook
    outermost, _ = modules_outside_the_mode(model, norms, EXACT)
    assert names(model, outermost) == ["model.layers.0", "model.layers.1.self_attn", "model.layers.1.mlp"]
    handle.remove()
    outermost, _ = modules_outside_the_mode(model, norms, "sdpa")
    assert names(model, outermost) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    gpt2 = exact_attention(build_tiny_model("gpt2", vocab_size=512))
    assert modules_outside_the_mode(gpt2, llama_rms_norms(gpt2), EXACT) == ([], [])
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:  # a global hook would run inside every module
        assert modules_outside_the_mode(model, norms, EXACT) == ([], [])
    finally:
        handle.remove()


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu_path", "gpu_path"])
@pytest.mark.parametrize("arch, share", [("llama", 0.5), ("qwen2", 0.99)])
def test_outside_the_mode_the_same_bits_with_fewer_calls_into_it(
    arch: str, share: float, gpu_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_invariant_forward`` with the layers outside the mode against it with every module inside: the same
    logits to the bit and the same functions computed the mode's own way (each but ``F.linear``, which the swapped
    linear layers compute as the mode does), the mode called fewer times (under half for Llama; Qwen2's attention
    passes its sliding window, other code than Llama's, so only its MLPs run outside); with autograd on, every
    module inside (a norm's own forward then computes its mean by the mode's blocks). Also the GPU's path driven
    on the CPU: blocks of 8 rows, the RMSNorms swapped for their kernel's torch twin. Every swapped forward is put
    back on leaving."""
    from paged_backend.kernels.rms_norm import rms_norm_torch

    if gpu_path:
        monkeypatch.setattr(batch_invariant, "block_rows", lambda x: 8)
        monkeypatch.setattr(batch_invariant, "rms_norm_triton", rms_norm_torch)
        monkeypatch.setattr(trainer_forward, "invariant_rms_norms", lambda model, _: llama_rms_norms(model))
    model = build_tiny_model(arch, vocab_size=512)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    calls: list[object] = []
    counting = BatchInvariantMode.__torch_function__

    def count(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls.append(func)
        return counting(self, func, types, args, kwargs)

    monkeypatch.setattr(BatchInvariantMode, "__torch_function__", count)

    def forward(grad: bool) -> tuple[torch.Tensor, list[object]]:
        calls.clear()
        with torch.set_grad_enabled(grad), trainer_forward.batch_invariant_forward(model):
            logits = model(ids).logits
        assert not any("forward" in m.__dict__ for m in model.modules())
        return logits.detach(), list(calls)

    outside = [forward(grad) for grad in (False, True)]
    monkeypatch.setattr(trainer_forward, "modules_outside_the_mode", lambda *_: ([], []))
    inside = [forward(grad) for grad in (False, True)]
    own_way = batch_invariant.INTERCEPTED - {F.linear}
    for grad, (ours, fewer), (theirs, more) in zip((False, True), outside, inside):
        assert torch.equal(ours, theirs)
        assert sorted(str(f) for f in fewer if f in own_way) == sorted(str(f) for f in more if f in own_way)
        if grad:  # every module inside: the mode sees every call but the swapped linear layers' ``F.linear``
            assert [f for f in fewer if f is not F.linear] == [f for f in more if f is not F.linear]
        else:
            assert len(fewer) < len(more) * share


def test_a_linear_layer_outside_the_mode_computes_as_the_mode_computes_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The swapped ``nn.Linear`` forward, called as it runs (torch functions off, inside a module outside the
    mode; its argument by name too), gives ``F.linear``'s bits under the mode and the product's values: on blocks
    of rows where the device runs blocks (driven here on the CPU with blocks of 8), a row at a time on a CPU; an
    empty input as torch gives it."""
    linear = torch.nn.Linear(16, 24)
    x = torch.randn(2, 13, 16)
    for block in (8, 1):
        monkeypatch.setattr(batch_invariant, "block_rows", lambda _, block=block: block)
        mode = BatchInvariantMode(outside=([], [linear]))
        with torch.no_grad(), mode:
            via_mode = torch.nn.functional.linear(x, linear.weight, linear.bias)
            with torch._C.DisableTorchFunction():
                swapped, by_name, empty = linear(x), linear(input=x), linear(x[:, :0])
        assert torch.equal(swapped, via_mode) and torch.equal(by_name, via_mode) and empty.shape == (2, 0, 24)
        torch.testing.assert_close(swapped, x @ linear.weight.detach().T + linear.bias.detach())
        assert "forward" not in linear.__dict__


def test_tensor_subclasses_keep_their_module_inside_the_mode() -> None:
    """A projection whose weight is a tensor subclass (its torch function must run) keeps its attention inside the
    mode; a call runs inside the mode where an input (or one in a tuple) is a subclass, where a hook was registered
    since the module was found, or where autograd records."""

    class Tagged(torch.Tensor):
        pass

    model = exact_attention(build_tiny_model("llama", vocab_size=512))
    norms = llama_rms_norms(model)
    proj = model.model.layers[0].self_attn.q_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().as_subclass(Tagged))
    outermost, _ = modules_outside_the_mode(model, norms, EXACT)
    assert names(model, outermost) == ["model.layers.0.mlp", "model.layers.1"]

    seen = []

    class Watch(torch.nn.Module):
        def forward(self, x: object) -> object:
            seen.append(torch._C._is_torch_function_enabled())
            return x

    watch = Watch()
    hooks = invariant_modules.hooks_made()
    with torch.no_grad():
        invariant_modules.run_outside_the_mode(watch, hooks, torch.zeros(2))
        invariant_modules.run_outside_the_mode(watch, hooks, torch.zeros(2).as_subclass(Tagged))
        invariant_modules.run_outside_the_mode(watch, hooks, (torch.zeros(2), torch.zeros(2).as_subclass(Tagged)))
        handle = watch.register_forward_hook(lambda *_: None)  # registered since the module was found
        invariant_modules.run_outside_the_mode(watch, hooks, torch.zeros(2))
        handle.remove()
    invariant_modules.run_outside_the_mode(watch, invariant_modules.hooks_made(), torch.zeros(2))  # autograd on
    assert seen == [False, True, True, True, True]
