"""Sibling projections fused in the compiled decoder layer (worker/fuse_linears.py). Dynamo-only backends, so
this runs on CPU; the GPU check (benchmarks/gpu_check.py) runs the same graphs through inductor."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._functorch._aot_autograd.autograd_cache import check_cacheable

from paged_backend import LLM, SamplingParams
from paged_backend.quantization.fp8 import FP8Linear, quantized_fp8_linear
from paged_backend.worker.compile import RegionalCompile
from paged_backend.worker.fuse_linears import PackingBackend, fuse_sibling_linears, is_packed
from tests.conftest import capturing_backend, hf_greedy, ragged_prompts, tiny_model

LINEAR = torch._C._nn.linear


class Block(nn.Module):
    """q/k/v with biases on one input, gate/up without on another, and a lone down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.gate, self.up, self.down = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False), nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.q(x), self.k(x) * 2, self.v(x).relu()], dim=-1)
        y = x + h[..., :8]
        return self.down(torch.sigmoid(self.gate(y)) * self.up(y))


def linear_inputs(graphs: list) -> list:
    return [n.args[0] for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR]


def compile_blocks(blocks: list[nn.Module], pack_first: bool) -> tuple[list, RegionalCompile]:
    graphs: list = []
    capture = capturing_backend(graphs)

    x = torch.randn(5, 8)
    if pack_first:
        packer = PackingBackend(blocks)
        with RegionalCompile(nn.ModuleList(blocks), packer):
            blocks[0](x)
        packer.finish()
    regions = RegionalCompile(nn.ModuleList(blocks), capture)
    with regions:
        blocks[0](x)
    return graphs, regions


def test_fused_graph_equals_the_modules_and_packs_every_layer() -> None:
    torch.manual_seed(0)
    blocks = [Block() for _ in range(3)]
    x = torch.randn(7, 8)
    with torch.no_grad():
        expected = [b(x) for b in blocks]
        graphs, regions = compile_blocks(blocks, pack_first=True)
        assert regions.num_fused_groups == 2
        inputs = linear_inputs(graphs)
        assert len(inputs) == 3 and len(set(inputs)) == 3  # qkv, gate_up, down: one call per input
        for block in blocks:
            assert is_packed([block.q.weight, block.k.weight, block.v.weight])
            assert is_packed([block.q.bias, block.k.bias, block.v.bias])
            assert is_packed([block.gate.weight, block.up.weight])
            assert block.q.weight.is_leaf and block.q.weight.requires_grad  # still the user's parameters
        with regions:
            for block, want in zip(blocks, expected):
                torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
        for block, want in zip(blocks, expected):  # the plain modules read the packed weights too
            torch.testing.assert_close(block(x), want, rtol=0, atol=0)


def test_groups_stay_separate_unless_packed_in_every_layer() -> None:
    blocks = [Block() for _ in range(2)]
    graphs, regions = compile_blocks(blocks, pack_first=False)
    assert regions.num_fused_groups == 0 and len(linear_inputs(graphs)) == 6
    blocks = [Block() for _ in range(2)]
    with RegionalCompile(nn.ModuleList(blocks), PackingBackend(blocks)):
        blocks[0](torch.randn(2, 8))
    blocks[1].k.weight = nn.Parameter(blocks[1].k.weight.detach().clone())  # one layer's q/k/v no longer packed
    graphs, regions = compile_blocks(blocks, pack_first=False)
    assert regions.num_fused_groups == 1  # gate/up only
    assert fuse_sibling_linears(graphs[0], blocks) == 0  # already rewritten: nothing left to fuse


@pytest.mark.parametrize(("arch", "groups"), [("llama", 2), ("qwen2", 4), ("phi3", 0)])
def test_engine_fuses_hf_projections(tokenizer, arch: str, groups: int) -> None:
    """q/k/v (with Qwen2's biases) and gate/up fuse in HF's own modules, one pair per compiled graph (Qwen2's
    sliding and full layers compile apart); Phi-3 already fuses them in its checkpoint. Greedy output still
    equals HF generate, and the user's model gives the same logits as before packing."""
    model = tiny_model(arch)
    ids = torch.tensor([ragged_prompts(16)[4]])
    with torch.no_grad():
        before = model(ids).logits
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_batched_tokens=40, max_model_len=128)
    runner = llm.llm_engine.executor.model_runner
    graphs: list = []
    capture = capturing_backend(graphs)

    runner.compile(capture)
    assert runner.regions is not None and runner.regions.num_fused_groups == groups
    for gm in graphs:  # traced once (no float became an input, then a restart) and kept for the next process
        scalars = [n.name for n in gm.graph.find_nodes(op="placeholder") if _is_python_float(n)]
        assert not scalars, f"Python floats traced as graph inputs: {scalars}"
        with torch._inductor.config.patch(fx_graph_cache=True, freezing=False):  # the settings it also checks
            check_cacheable(gm)
    if groups:
        for layer in runner.regions.layers:
            attn = layer.self_attn
            assert is_packed([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    prompts = ragged_prompts(16)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)


def _is_python_float(node: torch.fx.Node) -> bool:
    """Dynamo wraps a float it does not specialize (an RMSNorm's eps, attention's scale) as a 0-d float64 input;
    the compile then restarts to specialize it, tracing the layer twice."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64


class AWQBlock(nn.Module):
    """q/k/v as AWQ int4 layers (k with a bias) on one input, and a lone AWQ down projection."""

    def __init__(self) -> None:
        from paged_backend.quantization.awq import AWQLinear
        from paged_backend.quantization.rtn import pack_linear

        super().__init__()
        layers = []
        for out_features, bias in ((64, False), (32, True), (32, False), (64, False)):
            layer = AWQLinear(64, out_features, 32, bias=bias)
            qweight, qzeros, scales = pack_linear(torch.randn(out_features, 64) * 0.1, 32)
            layer.qweight.copy_(qweight)
            layer.qzeros.copy_(qzeros)
            layer.scales.copy_(scales)
            if bias:
                layer.bias.data.normal_()
            layers.append(layer)
        self.q, self.k, self.v, self.down = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.q(x), self.k(x) * 2, self.v(x).relu()], dim=-1)
        return self.down(h[..., :64] + x)


def test_awq_siblings_fuse_into_one_call_over_column_packed_buffers() -> None:
    """AWQ's [in, out / 8] layout packs siblings side by side: each layer's buffers become column slices of one
    buffer (the kernels read them through their row stride) and the graph makes one AWQ call over all of it."""
    torch.manual_seed(0)
    blocks = [AWQBlock() for _ in range(2)]
    x = torch.randn(1, 5, 64)
    graphs: list = []
    capture = capturing_backend(graphs)

    with torch.no_grad():
        expected = [b(x) for b in blocks]
        packer = PackingBackend(blocks)
        with RegionalCompile(nn.ModuleList(blocks), packer):
            blocks[0](x)
        packer.finish()  # AWQ siblings are packed after the trace that found them
        regions = RegionalCompile(nn.ModuleList(blocks), capture)
        with regions:
            got = [b(x) for b in blocks]
    assert regions.num_fused_groups == 1
    calls = [n for gm in graphs for n in gm.graph.nodes if str(n.target) == "paged_backend.awq_gemm.default"]
    assert len(calls) == 2  # q/k/v as one, down alone
    for block in blocks:
        for name in ("qweight", "qzeros", "scales"):
            assert is_packed([getattr(layer, name) for layer in (block.q, block.k, block.v)], dim=1)
        assert not block.q.qweight.is_contiguous()
    for block, want, have in zip(blocks, expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)  # the plain modules read the views


class FP8Block(AWQBlock):
    """The same block in fp8 layers (quantization="fp8": per-channel weights, activations per token)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        layers = [nn.Linear(64, n, bias=bias) for n, bias in ((64, False), (32, True), (32, False), (64, False))]
        self.q, self.k, self.v, self.down = (FP8Linear.from_linear(layer) for layer in layers)


def test_fp8_siblings_fuse_into_one_call_over_row_packed_buffers() -> None:
    """FP8's [out, in] weights and [out] scales pack back to back, before the trace (their strides do not change),
    and the graph makes one fp8 call for q/k/v: the activations are quantized once for the three. Equal to the
    unfused layers (the same per-token activation scales: they depend on the input alone)."""
    torch.manual_seed(0)
    blocks = [FP8Block() for _ in range(2)]
    x = torch.randn(1, 5, 64)
    graphs: list = []
    capture = capturing_backend(graphs)

    with torch.no_grad():
        expected = [b(x) for b in blocks]
        packer = PackingBackend(blocks)
        with RegionalCompile(nn.ModuleList(blocks), packer):
            blocks[0](x)
        assert not packer.deferred
        regions = RegionalCompile(nn.ModuleList(blocks), capture)
        with regions:
            got = [b(x) for b in blocks]
    assert regions.num_fused_groups == 1
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is quantized_fp8_linear]  # fp8_activations.py
    assert len(calls) == 2  # q/k/v as one, down alone
    for block in blocks:
        for name in ("weight", "weight_scale"):
            assert is_packed([getattr(layer, name) for layer in (block.q, block.k, block.v)])
    for block, want, have in zip(blocks, expected, got):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(block(x), want, rtol=0, atol=0)  # the plain modules read the views


class StaticFP8Block(AWQBlock):
    """q/k/v with static activation scales (compressed-tensors' ``FP8``), and a weight-only down projection."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        layers = []
        for n, static in ((64, True), (32, True), (32, True), (64, False)):
            layer = FP8Linear(64, n, bias=False, dynamic_activations=False, static_activations=static)
            q, scale = FP8Linear.from_linear(nn.Linear(64, n, bias=False)).weight, torch.rand(n) * 1e-3 + 1e-4
            layer._buffers["weight"], layer._buffers["weight_scale"] = q, scale
            if static:
                layer._buffers["input_scale"] = torch.tensor([0.01])  # some activations saturate
            layers.append(layer)
        self.q, self.k, self.v, self.down = layers


def fp8_calls(graphs: list) -> tuple[int, int]:
    """(calls of the fp8 op, calls rewritten to quantize in the graph)."""
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    return (
        sum(str(n.target) == "paged_backend.fp8_linear.default" for n in nodes),
        sum(n.target is quantized_fp8_linear for n in nodes),
    )


@pytest.mark.parametrize(
    ("block_type", "rows", "expected"),
    [
        (FP8Block, 5, (0, 4)),  # per token above the GEMV's rows: every call quantizes in the graph
        (FP8Block, 1, (4, 0)),  # one row: the fp8 GEMV, which reads x unquantized, stays
        (StaticFP8Block, 1, (1, 3)),  # static scales quantize at every row count; weight-only down stays
    ],
)
def test_fp8_activation_quantization_joins_the_compiled_graph(block_type: type, rows: int, expected: tuple) -> None:
    """Calls that quantize their input become the quantization in torch ops (inductor fuses it into what made the
    input) and one ``fp8_scaled_mm``; the layer's output stays the op's, bit for bit."""
    torch.manual_seed(0)
    blocks = [block_type() for _ in range(2)]
    x = torch.randn(1, rows, 64) * 3
    graphs: list = []
    with torch.no_grad():
        expected_out = [b(x) for b in blocks]
        regions = RegionalCompile(nn.ModuleList(blocks), capturing_backend(graphs))
        with regions:
            got = [b(x) for b in blocks]
    assert fp8_calls(graphs) == expected and regions.num_fp8_quantized == expected[1]
    for want, have in zip(expected_out, got):
        torch.testing.assert_close(have, want, rtol=0, atol=0)


def test_quantized_fp8_linear_refuses_weight_only_layers() -> None:
    weight = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight-only"):
        quantized_fp8_linear(torch.randn(2, 8), weight, torch.ones(4), False)


@pytest.mark.parametrize(("block_type", "rows", "ieee"), [(FP8Block, 5, True), (FP8Block, 1, False), (Block, 5, False)])
def test_graphs_that_quantize_fp8_compile_with_ieee_division(block_type: type, rows: int, ieee: bool) -> None:
    """Inductor lowers fp32 ``/`` to Triton's approximate division unless told otherwise; a graph whose FP8 calls
    now quantize in torch ops compiles with the IEEE division of the quantization kernel (the scales' bits)."""
    import torch._inductor.config as inductor_config

    seen: list[bool] = []

    def backend(gm, example_inputs):
        seen.append(inductor_config.eager_numerics.division_rounding)
        return gm.forward

    blocks = [block_type() for _ in range(2)]
    width = 8 if block_type is Block else 64
    with torch.no_grad(), RegionalCompile(nn.ModuleList(blocks), backend):
        blocks[0](torch.randn(1, rows, width))
    assert seen == [ieee] and not inductor_config.eager_numerics.division_rounding
