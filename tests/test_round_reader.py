"""Multi-step rounds handed out a step at a time to streams (``engine/round_reader.py``): every ``step()`` gives a
request at most one new token, where a round read whole gives up to ``num_scheduler_steps`` at once; the tokens,
texts and finish reasons are the synchronous engine's — with stops inside rounds, a backlog, preemption and
prefix-cache hits — and the round after the one being read is still queued ahead of it."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.engine.step_failures import StepError
from paged_backend.worker.async_output import PendingRound
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


def test_a_failed_read_redoes_the_round_s_requests_once(tokenizer, monkeypatch) -> None:
    """Reading a step of a round fails once: no request fails (each is redone alone, its failure counted once),
    and the outputs are the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)[:4]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4
    engine_kwargs = dict(num_kv_blocks=200, max_num_seqs=4, **STOPS)
    sync = LLM(tiny_model("llama"), tokenizer=tokenizer, async_scheduling=False, **engine_kwargs)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, async_scheduling=True, **engine_kwargs)
    read_step, calls = PendingRound.read_step, []

    def failing_once(self: PendingRound, step: int):
        calls.append(step)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return read_step(self, step)

    monkeypatch.setattr(PendingRound, "read_step", failing_once)
    engine, requests = llm.llm_engine, []
    add = engine.add_request

    def adding(request_id: str, *args, **kwargs) -> None:
        add(request_id, *args, **kwargs)
        requests.append(engine.requests[request_id])

    monkeypatch.setattr(engine, "add_request", adding)
    outputs, _ = stream(llm, prompts, params, finished_only=False)
    assert len(calls) > 3 and summary(outputs) == expected
    assert [r.num_failed_steps for r in requests] == [1, 1, 1, 1]  # counted once, not once more by step()
    assert_idle(llm)


def test_a_failed_read_of_a_lone_request_fails_it_once(tokenizer, monkeypatch) -> None:
    """A round of one request whose read fails: that request fails (``StepError`` naming it, caused by the read's
    own error), its failure counted once, and the engine goes on idle."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, async_scheduling=True, num_kv_blocks=200, **STOPS)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # rounds
    engine.add_request("0", {"prompt_token_ids": ragged_prompts(4, seed=7)[0]}, greedy)
    request = engine.requests["0"]
    read_step, firsts = PendingRound.read_step, []

    def failing(self: PendingRound, step: int):
        firsts.append(step == 0)
        if sum(firsts) == 2 and step == 0:  # the second round's first step: read in the step() that launched it
            raise RuntimeError("boom")
        return read_step(self, step)

    monkeypatch.setattr(PendingRound, "read_step", failing)
    with pytest.raises(StepError) as raised:
        while engine.has_unfinished_requests():
            engine.step()
    assert raised.value.request_ids == ["0"] and isinstance(raised.value.__cause__, RuntimeError)
    assert request.num_failed_steps == 1 and not engine.has_unfinished_requests()
    assert_idle(llm)
