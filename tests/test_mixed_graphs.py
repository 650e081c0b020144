"""Graphs of steps with prompt tokens (worker/mixed_graphs.py): the padded layout they replay gives every real
token the eager step's result. Graphs are replaced by re-running the forward on the static buffers, so this runs
on CPU; on a GPU the same buffers are captured (tests/test_model_runner.py's GPU engine test)."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.kernels.attention_twin import paged_attention_torch
from paged_backend.kernels.paged_attention import paged_attention_triton
from paged_backend.worker.mixed_graphs import MIXED_MAX_TOKENS, MIXED_STEP, MixedGraphRunner, mixed_capture_sizes
from paged_backend.worker.step_inputs import StepInputs
from tests.conftest import assert_greedy_like_hf, assert_idle, hf_greedy, ragged_prompts, replay_in_python, tiny_model
from tests.test_kernels import DEVICE, DTYPES, TOLERANCE, make_batch, relative_error


def test_mixed_capture_sizes() -> None:
    assert mixed_capture_sizes(3) == []  # a logit row or two: dynamo would specialise
    assert mixed_capture_sizes(40) == [40]
    assert mixed_capture_sizes(MIXED_STEP + 1) == [MIXED_STEP, MIXED_STEP + 1]  # never past the budget
    assert mixed_capture_sizes(2 * MIXED_STEP) == [MIXED_STEP, 2 * MIXED_STEP]
    assert mixed_capture_sizes(8192)[-1] == MIXED_MAX_TOKENS
    assert mixed_capture_sizes(8192, max_tokens=0) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_lens", "size", "sliding_window"), [
    ([5, 1, 1, 37, 1], 64, None),  # sequences without tokens and padding tokens
    ([30, 1, 1], 32, 6),  # the bucket's tokens exactly: a padding sequence without tokens
    ([3, 2, 1, 1, 3, 1, 1, 2], 16, None),  # as many sequences as the bucket holds
])  # fmt: skip
def test_the_kernel_on_the_padded_layout(dtype: torch.dtype, q_lens: list[int], size: int, sliding_window) -> None:
    """The Triton attention over a bucket's layout (as ``_fill`` lays it out) gives each real query the unpadded
    twin's result and each padding token zeros: sequences without tokens get no query, the padding sequence (context
    0) no key."""
    batch = make_batch(q_lens, [7 * i % 20 for i in range(len(q_lens))], 4, 2, 64, dtype, 16, seed=len(q_lens))
    t, b = sum(q_lens), len(q_lens)
    runner = MixedGraphRunner(lambda *args: torch.empty(0), [size], 8, batch["block_tables"].shape[1], DEVICE)
    step = StepInputs(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.zeros(t, dtype=torch.long),
        slot_mapping=torch.full((t,), -1, dtype=torch.long),
        block_tables=batch["block_tables"].cpu(),
        cu_seqlens_q=batch["cu_seqlens_q"].cpu(),
        context_lens=batch["context_lens"].long().cpu(),
        logits_indices=torch.arange(b),
    )
    runner._fill(size, step)
    rows = runner.rows[size]
    query = torch.cat([batch["query"], torch.randn(size - t, *batch["query"].shape[1:]).to(DEVICE, dtype)])
    scale = query.shape[-1] ** -0.5
    out = paged_attention_triton(
        query, batch["k_cache"], batch["v_cache"], runner.static_tables[: rows + 1],
        runner.static_ints[4, : rows + 2].to(torch.int32), runner.static_ints[3, : rows + 1], scale,
        sliding_window=sliding_window, out=torch.full_like(query, float("nan")),
    )  # fmt: skip
    ref = paged_attention_torch(
        batch["query"].float(), batch["k_cache"].float(), batch["v_cache"].float(), batch["block_tables"],
        batch["cu_seqlens_q"], batch["context_lens"], scale, sliding_window=sliding_window,
    )  # fmt: skip
    assert relative_error(out[:t], ref) < TOLERANCE[dtype]
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "qwen3"])
def test_mixed_graph_buffers_give_the_eager_result(tokenizer, arch: str) -> None:
    """Prefill chunks beside decodes, through buckets of 8 to 64 tokens (sequences without tokens and a padding
    sequence after the real ones; logit rows repeated), match HF greedy: padding writes no cache slot that a real
    sequence reads later, and changes no real row. Mistral's window and GPT-2's learned positions included."""
    model = tiny_model(arch)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, num_scheduler_steps=1,
              max_num_batched_tokens=40, max_num_seqs=6)  # fmt: skip
    runner = llm.llm_engine.executor.model_runner
    mixed = MixedGraphRunner(runner._model_forward, [8, 16, 32, 64], 8, 8, torch.device("cpu"))
    replay_in_python(mixed)
    used: list[tuple[int, int, int]] = []
    replay = mixed.run

    def run(inputs):
        used.append((mixed.bucket(inputs), inputs.num_tokens, inputs.num_seqs))
        return replay(inputs)

    mixed.run = run  # type: ignore[method-assign]
    runner.mixed_graphs = mixed
    assert_greedy_like_hf(llm, model, ragged_prompts(16)[:7], [3, 9, 5, 12, 4, 8, 6])
    buckets = {bucket for bucket, _, _ in used}
    assert len(buckets) >= 2, used  # several bucket sizes
    assert any(t < bucket for bucket, t, _ in used)  # padding tokens
    assert any(b < mixed.rows[bucket] for bucket, _, b in used)  # sequences without tokens
    assert_idle(llm)


def test_a_step_no_bucket_holds_runs_eagerly(tokenizer) -> None:
    """More tokens or sequences than the largest bucket: the eager forward, same tokens."""
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, num_scheduler_steps=1)
    runner = llm.llm_engine.executor.model_runner
    mixed = MixedGraphRunner(runner._model_forward, [8], 8, 8, torch.device("cpu"))
    replay_in_python(mixed)
    runner.mixed_graphs = mixed
    prompt = ragged_prompts(16)[4]  # 50 tokens: one step of 50 > 8
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 4)
    assert_idle(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graphs are captured on a GPU only")
def test_a_gpu_engine_replays_mixed_graphs(tokenizer) -> None:
    """Captured for real: prefill chunks beside decodes replay graphs of several buckets, with async scheduling, and
    the tokens equal HF greedy."""
    model = copy.deepcopy(tiny_model("llama")).cuda()
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=140,
              num_scheduler_steps=1, async_scheduling=True)  # fmt: skip
    runner = llm.llm_engine.executor.model_runner
    assert runner.mixed_graphs is not None and runner.mixed_graphs.sizes == [64, 128, 140]
    replays = []
    replay = runner.mixed_graphs.run
    mixed = runner.mixed_graphs
    runner.mixed_graphs.run = lambda inputs: replays.append(mixed.bucket(inputs)) or replay(inputs)  # type: ignore
    prompts = ragged_prompts(16) * 2
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    assert len(set(replays)) >= 2, replays  # consecutive steps in other buckets (one memory pool)
    assert_idle(llm)
