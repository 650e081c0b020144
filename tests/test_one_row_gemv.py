"""One-row projections routed to the GEMV in the compiled decoder layer (worker/one_row_gemv.py). Dynamo-only
backends on CPU, where the op runs ``F.linear`` (outputs stay the modules' bit for bit): these check which calls
are routed in which graphs, not the GEMV's arithmetic, which tests/test_kernels.py checks against its twin; on a
Hopper GPU the op and an engine's whole path (inductor, the bucket-1 CUDA graph) run below."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paged_backend import LLM, SamplingParams
from paged_backend.worker import one_row_gemv
from paged_backend.worker.compile import RegionalCompile
from paged_backend.worker.cuda_graphs import CUDAGraphRunner
from paged_backend.worker.fuse_linears import PackingBackend
from paged_backend.worker.one_row_gemv import gemv_op, measured_on
from tests.conftest import build_tiny_model, capturing_backend, ragged_prompts, replay_in_python

GEMV = "paged_backend.gemv.default"


class Block(nn.Module):
    """q/k/v siblings (fused: twice as wide as their input), gate/up siblings (fused: three times), o and down
    (narrower than their input), and a biased projection."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, n, bias=False, dtype=dtype) for n in (16, 8, 8))
        self.o = nn.Linear(32, 16, bias=False, dtype=dtype)
        self.gate, self.up = (nn.Linear(16, 24, bias=False, dtype=dtype) for _ in range(2))
        self.down = nn.Linear(24, 16, bias=False, dtype=dtype)
        self.biased = nn.Linear(16, 16, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1))
        h = h + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.biased(h)


def routed(graphs: list) -> list[list[str]]:
    """Per graph, the modules whose weights its GEMV calls read (from dynamo's placeholder names, e.g.
    ``l_self_modules_o_parameters_weight_``: ``o``; fused siblings by their first: ``q``)."""

    def module(weight: torch.fx.Node) -> str:
        if weight.op == "call_function":  # fused siblings' packed weight: as_strided over the first's parameter
            weight = weight.args[0]  # type: ignore[assignment]
        return re.fullmatch(r"l_self_modules_(\w+)_parameters_weight_", weight.name).group(1)  # type: ignore[union-attr]

    return [sorted(module(node.args[1]) for node in gm.graph.nodes if str(node.target) == GEMV) for gm in graphs]


def compile_and_run(blocks: list[Block], rows: int, dtype: torch.dtype) -> tuple[list, RegionalCompile, list]:
    x = torch.randn(1, rows, 16, dtype=dtype)
    packer = PackingBackend(blocks)
    with torch.no_grad():
        with RegionalCompile(nn.ModuleList(blocks), packer):
            blocks[0](torch.randn(1, 5, 16, dtype=dtype))
        packer.finish()
        expected = [b(x) for b in blocks]
        graphs: list = []
        regions = RegionalCompile(nn.ModuleList(blocks), capturing_backend(graphs))
        with regions:
            got = [b(x) for b in blocks]
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    return graphs, regions, got


@pytest.fixture
def any_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass's device check passes on this CPU (the op then runs ``F.linear``)."""
    monkeypatch.setattr(one_row_gemv, "measured_on", lambda device: True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_graph_routes_projections_at_most_twice_as_wide_as_their_input(any_device, dtype) -> None:
    """In the one-row graph, the fused q/k/v (twice as wide as its input), o and down (narrower), none with a bias,
    go to the GEMV; the fused gate/up (three times as wide) and the biased projection stay ``linear``. Outputs
    stay the modules' bit for bit."""
    torch.manual_seed(0)
    blocks = [Block(dtype) for _ in range(2)]
    graphs, regions, _ = compile_and_run(blocks, 1, dtype)
    assert routed(graphs) == [["down", "o", "q"]] and regions.num_gemv_routed == 3


class BiasedSiblings(nn.Module):
    """Qwen2's q/k/v: siblings with biases (fused with their biases, and not routed: the GEMV adds none)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, n, dtype=torch.bfloat16) for n in (16, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def test_fused_siblings_with_biases_keep_linear(any_device) -> None:
    torch.manual_seed(0)
    blocks = [BiasedSiblings() for _ in range(2)]
    x = torch.randn(1, 1, 16, dtype=torch.bfloat16)
    packer = PackingBackend(blocks)
    with torch.no_grad():
        with RegionalCompile(nn.ModuleList(blocks), packer):
            blocks[0](torch.randn(1, 5, 16, dtype=torch.bfloat16))
        packer.finish()
        graphs: list = []
        regions = RegionalCompile(nn.ModuleList(blocks), capturing_backend(graphs))
        with regions:
            blocks[0](x)
    assert regions.num_fused_groups == 1 and regions.num_gemv_routed == 0


def test_graphs_of_several_rows_keep_linear(any_device) -> None:
    torch.manual_seed(0)
    graphs, regions, _ = compile_and_run([Block(torch.bfloat16) for _ in range(2)], 3, torch.bfloat16)
    assert routed(graphs) == [[]] and regions.num_gemv_routed == 0


def test_fp32_weights_are_not_routed(any_device) -> None:
    torch.manual_seed(0)
    graphs, regions, _ = compile_and_run([Block(torch.float32) for _ in range(2)], 1, torch.float32)
    assert regions.num_gemv_routed == 0


def test_nothing_is_routed_off_hopper() -> None:
    """The device check as shipped: a CPU is not where the GEMV was measured."""
    assert not measured_on(torch.device("cpu"))
    torch.manual_seed(0)
    _, regions, _ = compile_and_run([Block(torch.bfloat16) for _ in range(2)], 1, torch.bfloat16)
    assert regions.num_gemv_routed == 0


def test_op_keeps_leading_dimensions_and_equals_linear() -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(1, 1, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    out = gemv_op(x, weight)
    assert out.shape == (1, 1, 16)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=0, atol=0)
    for shape in ((1, 1, 32), (1, 32), (0, 32)):  # torch's own checks of the op's registration and fake impl
        torch.library.opcheck(gemv_op, (torch.randn(shape, dtype=torch.bfloat16), weight))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMV runs on CUDA")
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336), (576, 1536), (100, 200)])
def test_op_runs_the_gemv_on_the_gpu(n: int, k: int) -> None:
    """On CUDA the op is the GEMV: within bf16 rounding of the fp32 product, as cuBLAS's."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    reference = (x.float() @ weight.float().T).to(torch.bfloat16)
    out = gemv_op(x, weight)
    torch.testing.assert_close(out, reference, rtol=1.6e-2, atol=1e-2)
    assert not torch.equal(out, torch.zeros_like(out))


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="routed on Hopper GPUs"
)
def test_a_gpu_engine_routes_a_lone_sequences_decode_and_decodes_like_without(tokenizer, monkeypatch) -> None:
    """The whole path on a Hopper GPU: compile, inductor, the bucket-1 CUDA graph's capture and replay. A lone
    sequence's greedy tokens equal those of the same engine with routing off, up to a near tie that the GEMV's
    other order of sums may flip (a bf16 model: the first 8 tokens at least)."""
    prompt = ragged_prompts(16)[3]
    outputs, routed_calls = [], []
    for route in (True, False):
        if not route:
            monkeypatch.setattr(one_row_gemv, "measured_on", lambda device: False)
        model = build_tiny_model("llama").to(device="cuda", dtype=torch.bfloat16)
        llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
        params = SamplingParams(temperature=0, max_tokens=24)
        outputs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
        regions = llm.llm_engine.executor.model_runner.regions
        routed_calls.append(None if regions is None else regions.num_gemv_routed)
        llm.shutdown()
    assert routed_calls[0] is not None and routed_calls[0] >= 2 and routed_calls[1] == 0
    assert outputs[0][:8] == outputs[1][:8] and len(outputs[0]) == 24


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_routes_its_one_row_decode_graph_without_changing_greedy_output(tokenizer, monkeypatch, arch) -> None:
    """Through the engine's own compile and decode-graph runner (graphs replayed in Python, inside the compiled
    layers as a GPU's were captured), on a bf16 model: a lone sequence's decode (bucket 1) compiles a graph that
    routes the projections within the rule (below), the graph of several rows routes nothing,
    and greedy output equals the same engine's without routing (on a CPU the op is ``F.linear``: bit for bit)."""
    prompt = ragged_prompts(16)[3]
    outputs, counts = [], []
    for route in (False, True):
        monkeypatch.setattr(one_row_gemv, "measured_on", lambda device, route=route: route)
        model = build_tiny_model(arch).to(torch.bfloat16)  # its own: the session's tiny models stay fp32
        llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, num_scheduler_steps=1)
        runner = llm.llm_engine.executor.model_runner
        graphs: list = []
        runner.compile(capturing_backend(graphs))

        def compiled_forward(*args, runner=runner):
            with runner.regions:
                return runner._model_forward(*args)

        runner.graphs = CUDAGraphRunner(compiled_forward, 8, 8, torch.device("cpu"))
        replay_in_python(runner.graphs)
        params = SamplingParams(temperature=0, max_tokens=8)
        outputs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
        counts.append([len(names) for names in routed(graphs)])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    # the warm-up's graph (rows a symbol), then one row's: o, down and (llama's, twice as wide as its input; not
    # qwen3's, three times with heads of 32) the fused q/k/v
    assert counts[0] == [0, 0] and counts[1] == [0, {"llama": 3, "qwen3": 2}[arch]]
