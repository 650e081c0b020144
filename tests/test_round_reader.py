"""Multi-step rounds handed out a step at a time to streams (``engine/round_reader.py``): every ``step()`` gives a
request at most one new token, where a round read whole gives up to ``num_scheduler_steps`` at once; the tokens,
texts and finish reasons are the synchronous engine's — with stops inside rounds, a backlog, preemption and
prefix-cache hits — and the round after the one being read is still queued ahead of it."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import assert_idle, ragged_prompts, tiny_model
from tests.test_async_scheduling import STOPS, count_continuations, stop_params, summary


def stream(llm: LLM, prompts: list[dict], params: list[SamplingParams], finished_only: bool) -> tuple[list, int]:
    """Drive the engine directly; (the final outputs in prompt order, the most new tokens a request got in one
    ``step()``)."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    seen: dict[str, int] = {}
    final: dict[str, object] = {}
    most = 0
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=finished_only):
            count = len(output.outputs[0].token_ids)
            most = max(most, count - seen.get(output.request_id, 0))
            seen[output.request_id] = count
            if output.finished:
                final[output.request_id] = output
    return [final[str(i)] for i in range(len(prompts))], most


@pytest.mark.parametrize(
    ("device", "num_kv_blocks"),
    [
        ("cpu", 200),
        ("cpu", 24),  # 24 blocks of 4 tokens: sequences are preempted
        pytest.param("cuda", 200, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU")),
    ],
)
def test_a_stream_gets_a_token_a_step_and_the_synchronous_tokens(device: str, num_kv_blocks: int, tokenizer) -> None:
    """On a GPU each step's tokens come from its own copy and event (``StepCopies``)."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]
    prompts.append(prompts[4])  # a prefix-cache hit once the first one's blocks are cached
    params = stop_params(tokenizer, prompts)
    engine_kwargs = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=4, **STOPS)
    model = copy.deepcopy(tiny_model("llama")).to(device)  # the shared model stays on the CPU
    sync = LLM(model, tokenizer=tokenizer, async_scheduling=False, **engine_kwargs)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    llm = LLM(model, tokenizer=tokenizer, async_scheduling=True, **engine_kwargs)
    continued = count_continuations(llm)
    outputs, most = stream(llm, prompts, params, finished_only=False)
    assert summary(outputs) == expected
    assert most == 1  # never a burst (a round read whole gives up to num_scheduler_steps at once)
    assert continued[0] > 0  # rounds were still queued behind the round being read
    assert_idle(llm)
