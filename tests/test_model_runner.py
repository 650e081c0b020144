"""Step inputs and the padding that CUDA-graph buckets and compiled calls rely on (run here with the torch
twins; on a GPU the same padding feeds the Triton kernels)."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.kernels.ops import paged_attention_op, write_kv_cache_op
from paged_backend.worker.attention import KV_CACHE_ATTR
from paged_backend.worker.cuda_graphs import CUDAGraphRunner, capture_sizes, fits_decode_graph
from paged_backend.worker.step_inputs import build_step_inputs, pad_step_inputs
from tests.conftest import (
    assert_greedy_like_hf,
    assert_idle,
    before_each_step,
    capturing_backend,
    hf_greedy,
    ragged_prompts,
    replay_in_python,
    tiny_model,
)


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(2) == [1, 2]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))


def _observe_steps(engine, monkeypatch, check) -> None:
    """Call ``check(scheduler_output, inputs)`` on every step the engine runs, through its executor's entry."""

    def observed(scheduler_output):
        check(scheduler_output, build_step_inputs(scheduler_output.batch, engine.config.block_size))

    before_each_step(engine.executor, observed, monkeypatch)


def test_only_real_decode_steps_replay_graphs(tokenizer, monkeypatch) -> None:
    """With a budget of one token per sequence, a new prompt's first chunk is one token that does not sample:
    the step has one token per sequence but is not a decode step, and must not replay a decode graph."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=64, max_num_batched_tokens=3, max_num_seqs=3)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4)
    for i, prompt in enumerate([[5], [6], [7, 8, 9, 10]]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    seen = []
    last = []
    _observe_steps(
        engine,
        monkeypatch,
        lambda so, inputs: (
            seen.append(
                (inputs.decode_only, fits_decode_graph(inputs, 8), len(so.batch.sampling_rows) == inputs.num_seqs)
            )
            or last.append(inputs)
        ),
    )
    while engine.has_unfinished_requests():
        engine.step()
    assert (True, False, False) in seen  # the one-token chunk step happened and was kept off the graphs
    assert (True, True, True) in seen  # and real decode steps still fit
    assert not fits_decode_graph(last[-1], 0)  # larger than the largest bucket
    assert_idle(llm)


def test_step_inputs_and_padding_leave_real_rows_unchanged(tokenizer, monkeypatch) -> None:
    """A mixed step (prefills + decodes) and a decode-only step give the same logits with padding sequences
    appended, and padding writes no cache slot."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=64, max_num_batched_tokens=40)
    engine = llm.llm_engine
    runner = engine.executor.model_runner
    kv_caches = runner.cache_engine.kv_caches
    checked = []

    def check(so, inputs) -> None:
        positions = torch.cat(
            [
                torch.arange(s.num_computed_tokens, s.num_computed_tokens + n)
                for s, n in zip(so.seqs, so.batch.num_scheduled_tokens)
            ]
        )
        assert torch.equal(inputs.positions, positions)
        assert inputs.cu_seqlens_q[-1].item() == inputs.num_tokens == sum(so.batch.num_scheduled_tokens)
        caches_before = [k.clone() for k, _ in kv_caches]
        padded = pad_step_inputs(inputs, 3, min_logits=inputs.logits_indices.shape[0] + 2)
        assert padded.num_seqs == inputs.num_seqs + 3 and padded.slot_mapping[-3:].tolist() == [-1, -1, -1]
        padded_logits = runner.run(padded)
        written = [(k != before).flatten(0, 1).any(-1).any(-1) for (k, _), before in zip(kv_caches, caches_before)]
        allowed = torch.zeros_like(written[0])
        allowed[inputs.slot_mapping] = True
        assert all(not (w & ~allowed).any() for w in written)  # only the real tokens' slots
        logits = runner.run(inputs)
        assert padded_logits.shape[0] == logits.shape[0] + 2
        # Other shapes, other BLAS blockings: equal up to fp32 rounding.
        torch.testing.assert_close(padded_logits[: logits.shape[0]], logits, atol=1e-4, rtol=1e-4)
        checked.append(inputs.decode_only)

    _observe_steps(engine, monkeypatch, check)
    for i, prompt in enumerate(ragged_prompts(16)[:5]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert False in checked and True in checked  # mixed prefill + decode steps, then decode-only ones
    assert_idle(llm)


def test_custom_ops_schema_and_fake_kernels() -> None:
    """torch.compile sees the kernels only through these ops: their schemas, fake (meta) implementations and
    mutation declarations must be right."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8, generator=gen)
    q, k, v = (
        torch.randn(5, 4, 8, generator=gen),
        torch.randn(5, 2, 8, generator=gen),
        torch.randn(5, 2, 8, generator=gen),
    )
    slots = torch.tensor([0, 1, 2, 9, -1])
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    ctx = torch.tensor([3, 6], dtype=torch.int32)
    torch.library.opcheck(write_kv_cache_op, (k, v, k_cache, v_cache, slots, None, None))
    torch.library.opcheck(paged_attention_op, (q, k_cache, v_cache, tables, cu, ctx, 0.3, 0, 0.0, None, None))
    torch.library.opcheck(paged_attention_op, (q, k_cache, v_cache, tables, cu, ctx, 0.3, 2, 5.0, None, None))
    # An fp8 cache with a scale per KV head: the schema check compares mutations with arithmetic CPU torch lacks
    # for fp8, so the fake-tensor and AOT checks only (the schema is the one checked above).
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([1.5, 0.25])
    checks = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(write_kv_cache_op, (k, v, k8, v8, slots, k_scale, v_scale), test_utils=checks)
    args = (q, k8, v8, tables, cu, ctx, 0.3, 0, 0.0, k_scale, v_scale)
    torch.library.opcheck(paged_attention_op, args, test_utils=checks)


@pytest.mark.parametrize(
    ("arch", "max_graphs"), [("llama", 1), ("gpt2", 1), ("mixtral", 1), ("qwen2", 2), ("gemma3", 2)]
)
def test_regional_compile_shares_one_graph_across_layers(tokenizer, arch: str, max_graphs: int) -> None:
    """The decoder layer compiles once for every layer (twice where layers mix sliding and full attention), never
    again as batch shapes change, and greedy output still equals HF. Dynamo only (a counting backend), so it runs
    here; on a GPU the same graph goes to inductor."""
    model = tiny_model(arch)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_batched_tokens=40, max_model_len=128)
    graphs: list = []
    runner = llm.llm_engine.executor.model_runner
    runner.compile(capturing_backend(graphs))
    assert runner.regions is not None and len(runner.regions.layers) == model.config.num_hidden_layers
    after_warmup = len(graphs)
    assert 1 <= after_warmup <= max_graphs and runner.regions.num_graphs == after_warmup
    prompts = ragged_prompts(16)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert len(graphs) == after_warmup, "a batch shape triggered a recompile"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    assert_idle(llm)
    # Outside the engine's forward the user's model is untouched: no compiled forward, no cache attribute.
    assert all("forward" not in layer.__dict__ for layer in runner.regions.layers)
    assert not any(hasattr(m, KV_CACHE_ATTR) for m in model.modules())


def test_each_engine_compiles_its_own_graphs(tokenizer) -> None:
    """Dynamo allows 8 graphs per code object, and transformers' decoder layers share one forward wrapper: each
    engine compiles a fresh copy, so the ninth engine of a process still gets compiled layers."""
    for _ in range(9):
        llm = LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=16, max_model_len=64)
        runner = llm.llm_engine.executor.model_runner
        runner.compile(capturing_backend([]))
        assert runner.regions is not None and runner.regions.num_graphs == 1


def test_switch_and_regions_are_reentrant(tokenizer) -> None:
    """Entering twice is a no-op, and leaving restores the user's model exactly."""
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=16, max_model_len=64)
    runner = llm.llm_engine.executor.model_runner
    runner.compile(capturing_backend([]))
    before = model.config._attn_implementation
    with runner.switch, runner.regions:
        with runner.switch, runner.regions:
            assert model.config._attn_implementation == "paged_backend"
        assert hasattr(model.model.layers[0].self_attn, KV_CACHE_ATTR)
        assert "forward" in model.model.layers[0].__dict__
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, KV_CACHE_ATTR) or "forward" in m.__dict__ for m in model.modules())


def test_graph_runner_buffers_give_the_eager_logits(tokenizer) -> None:
    """The decode-graph path (staging, padding rows, static block tables wider than needed, bucket choice) feeds
    the forward the same step as the eager path, and its padding rows touch no real sequence's cache: decoding
    through it matches HF greedy while requests finish and the batch shrinks through buckets 8, 4, 2 and 1. Graphs
    are replaced by re-running the forward on the static buffers, so this runs on CPU."""
    model = tiny_model("llama")
    # One step at a time, so that the batch shrinks as each request finishes.
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, num_scheduler_steps=1)
    engine = llm.llm_engine
    runner = engine.executor.model_runner
    graph_runner = CUDAGraphRunner(runner._model_forward, 8, 8, torch.device("cpu"))
    replay_in_python(graph_runner)
    sizes_used = set()
    replay = graph_runner.run

    def run(inputs, *args):
        sizes_used.add(next(s for s in graph_runner.sizes if s >= inputs.num_seqs))
        return replay(inputs, *args)

    graph_runner.run = run
    runner.graphs = graph_runner  # decode steps go through it; prefills stay eager
    assert_greedy_like_hf(llm, model, ragged_prompts(16)[:5], [3, 7, 12, 16, 20])
    assert {8, 4, 2, 1} <= sizes_used
    assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="engines compile and capture graphs on a GPU only")
@pytest.mark.parametrize("fp8", [False, True])
def test_a_gpu_engine_compiles_and_captures(tokenizer, fp8: bool) -> None:
    """A compile failure falls back to eager layers with only a warning: here it is an error, fp8 calibration
    (whose flag the warm-ups read) included."""
    fp8_args = {"kv_cache_dtype": "fp8", "calculate_kv_scales": True} if fp8 else {}
    model = copy.deepcopy(tiny_model("llama")).cuda()  # the shared model stays on the CPU
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, **fp8_args)
    runner = llm.llm_engine.executor.model_runner
    assert runner.regions is not None and runner.regions.num_graphs >= 1
    assert runner.graphs is not None
