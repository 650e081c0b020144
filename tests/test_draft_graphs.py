"""The draft model's graph paths (``worker/draft_runner.py``): on a GPU its catch-up forward replays a graph of rows
padded to ``catch_up_len`` tokens (k + 2, or a round's steps + 1) and its guessing forwards a decode graph. The
padding, the staging buffers' use and the rows read back are the runner's own; here stand-ins that run the draft
eagerly on exactly the inputs a graph would get check them on the CPU: a draft equal to the target still has every
guess taken."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.worker.cuda_graphs import fits_decode_graph, fits_verify_graph
from paged_backend.worker.step_inputs import StepInputs
from tests.conftest import assert_idle, hf_greedy, tiny_model
from tests.test_spec_decode import repetitive_prompts


class EagerGraph:
    """A ``CUDAGraphRunner``'s interface run eagerly: the same fit rules, every padded token's logits (q_len > 1)
    or one a row (decode)."""

    def __init__(self, draft, max_size: int, q_len: int = 1) -> None:
        self.draft, self.max_size, self.q_len = draft, max_size, q_len
        self.runs: list[tuple[int, int]] = []  # (rows, staging index)

    def can_run(self, inputs: StepInputs) -> bool:
        if self.q_len > 1:
            return fits_verify_graph(inputs, self.max_size, self.q_len)
        return fits_decode_graph(inputs, self.max_size)

    def run(self, inputs: StepInputs, input_ids: torch.Tensor | None = None, staging_index: int = 0) -> torch.Tensor:
        assert self.can_run(inputs)
        self.runs.append((inputs.num_seqs, staging_index))
        d = inputs.to(self.draft.device)
        if input_ids is not None:
            d.input_ids = input_ids
        return self.draft._graph_forward(d.input_ids, d.positions, d.metadata, d.logits_indices)


@pytest.mark.parametrize("k, steps", [(1, 1), (3, 1), (2, 6)], ids=["k1", "k3", "k2-rounds"])
def test_a_draft_equal_to_the_target_has_every_guess_taken_through_its_graph_paths(tokenizer, k, steps) -> None:
    """(With rounds of 6 steps where no row is proposed for: 4 rows, as the draft's rule allows up to 4.)"""
    model = tiny_model("llama")
    prompts = repetitive_prompts()
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 4}
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128, speculative_config=spec,
              num_scheduler_steps=steps, async_scheduling=steps > 1)  # fmt: skip
    draft = llm.llm_engine.executor.draft_runner
    assert draft.catch_up_len == max(k + 2, steps + 1)
    draft.guess_graphs = guess = EagerGraph(draft, 2)  # 4 rows, then 3, run eagerly; then 2 in the graphs
    draft.catch_up_graphs = catch_up = EagerGraph(draft, 2, q_len=draft.catch_up_len)
    lengths = [8, 14, 24, 24]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n)
    drafter = llm.llm_engine.scheduler.drafter
    assert drafter.num_draft_tokens > 0 and drafter.num_accepted_tokens == drafter.num_draft_tokens, vars(drafter)
    assert catch_up.runs
    if k > 1:
        assert guess.runs and {i for _, i in guess.runs} == set(range(k - 1))  # a staging buffer a guess
    else:
        assert not guess.runs  # one guess a row: the catch-up forward's
    assert_idle(llm)


def test_the_graphs_are_captured_after_the_targets_set_up_and_again_when_a_weight_moves(tokenizer, monkeypatch) -> None:
    """A draft that shares the target's weights sees them packed by the target's set-up: its graphs are captured
    after it, and again when a parameter is replaced (the old graphs would read the old tensor)."""
    from paged_backend.worker import cuda_graphs, worker

    captures = []
    monkeypatch.setattr(cuda_graphs.CUDAGraphRunner, "capture", lambda runner: captures.append(runner.q_len))
    monkeypatch.setattr(worker.DraftRunner, "__init__", _with_graphs(worker.DraftRunner.__init__))
    model = tiny_model("llama")
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64, speculative_config=spec)
    draft = llm.llm_engine.executor.draft_runner
    assert sorted(captures) == [1, draft.catch_up_len]  # the guessing forwards' graphs, the catch-up's
    params = SamplingParams(temperature=0, max_tokens=6)
    llm.generate({"prompt_token_ids": repetitive_prompts()[0]}, params, use_tqdm=False)
    assert len(captures) == 2
    norm = model.model.norm
    norm.weight.data = norm.weight.data.clone()  # the same values in a new tensor
    (out,) = llm.generate({"prompt_token_ids": repetitive_prompts()[1]}, params, use_tqdm=False)
    assert len(captures) == 4 and draft.weights.replaced() is None
    assert out.outputs[0].token_ids == hf_greedy(model, repetitive_prompts()[1], 6)


def _with_graphs(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "use_graphs": True})

    return patched
