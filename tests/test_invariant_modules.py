"""HF Llama's layers run outside ``BatchInvariantMode`` (``worker/invariant_modules.py``): which modules do, and
that the model's bits do not change while the mode sees fewer calls."""

from __future__ import annotations

import pytest
import torch

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
    outermost, _ = modules_outside_the_mode(model, norms, "sdpa")
    assert names(model, outermost) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    gpt2 = exact_attention(build_tiny_model("gpt2", vocab_size=512))
    assert modules_outside_the_mode(gpt2, llama_rms_norms(gpt2), EXACT) == ([], [])
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:  # a global hook would run inside every module
        assert modules_outside_the_mode(model, norms, EXACT) == ([], [])
    finally:
        handle.remove()


@pytest.mark.parametrize("arch, share", [("llama", 0.5), ("qwen2", 0.99)])
def test_outside_the_mode_the_same_bits_with_fewer_calls_into_it(
    arch: str, share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_invariant_forward`` with the layers outside the mode against it with every module inside: the same
    logits to the bit (no-grad and with autograd), the mode called fewer times (under half for Llama; Qwen2's
    attention passes its sliding window, other code than Llama's, so only its MLPs run outside), every swapped
    forward put back on leaving."""
    model = build_tiny_model(arch, vocab_size=512)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = []
    counting = BatchInvariantMode.__torch_function__

    def count(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls.append(func)
        return counting(self, func, types, args, kwargs)

    monkeypatch.setattr(BatchInvariantMode, "__torch_function__", count)

    def forward(grad: bool) -> tuple[torch.Tensor, int]:
        calls.clear()
        with torch.set_grad_enabled(grad), trainer_forward.batch_invariant_forward(model):
            logits = model(ids).logits
        assert not any("forward" in m.__dict__ for m in model.modules())
        return logits.detach(), len(calls)

    outside = [forward(grad) for grad in (False, True)]
    assert invariant_modules.modules_outside_the_mode(model, [], EXACT)[0]  # (the attentions and MLPs)
    monkeypatch.setattr(trainer_forward, "modules_outside_the_mode", lambda *_: ([], []))
    inside = [forward(grad) for grad in (False, True)]
    for (ours, fewer), (theirs, more) in zip(outside, inside):
        assert torch.equal(ours, theirs)
        assert fewer < more * share


def test_a_linear_layer_outside_the_mode_computes_as_the_mode_computes_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The swapped ``nn.Linear`` forward and the mode's ``F.linear`` share one path: on blocks of rows where the
    device runs blocks (driven here on the CPU with blocks of 8), a row at a time on a CPU, an empty input as
    torch gives it."""
    monkeypatch.setattr(batch_invariant, "block_rows", lambda x: 8)
    linear = torch.nn.Linear(16, 24)
    x = torch.randn(2, 13, 16)
    mode = BatchInvariantMode(outside=([], [linear]))
    with torch.no_grad(), mode:
        swapped = linear(x)
        via_mode = torch.nn.functional.linear(x, linear.weight, linear.bias)
        empty = linear(x[:, :0])
    assert torch.equal(swapped, via_mode) and empty.shape == (2, 0, 24)
    assert "forward" not in linear.__dict__


def test_tensor_subclasses_keep_their_module_inside_the_mode() -> None:
    """A projection whose weight is a tensor subclass (its torch function must run) keeps its attention inside the
    mode; an input that is a subclass runs the layer inside the mode for that call."""

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
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch._C._is_torch_function_enabled())
            return x + 1

    watch = Watch()
    invariant_modules.run_outside_the_mode(watch, torch.zeros(2))
    invariant_modules.run_outside_the_mode(watch, torch.zeros(2).as_subclass(Tagged))
    assert seen == [False, True]
