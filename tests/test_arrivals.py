"""Requests that arrive while the engine steps (``LLMEngine.arrivals``): with async scheduling, nothing is queued
ahead of them, so a request waits for the step in flight only, never for a round queued behind it; the tokens are
those of the synchronous engine whatever the arrivals say, and the engine loop wires the predicate in and out."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.engine.async_steps import queue_following, queue_next
from paged_backend.engine.engine_loop import EngineLoop
from paged_backend.worker.async_output import last_steps_begin
from tests.conftest import assert_idle, ragged_prompts, tiny_model
from tests.test_async_scheduling import STOPS, count_continuations, stop_params, summary


def rounds_engine(tokenizer) -> LLM:
    return LLM(
        tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, num_scheduler_steps=4,
        async_scheduling=True,
    )  # fmt: skip


def calls_to_first_token(arrivals_flagged: bool, tokenizer) -> int:
    """A request decoding in rounds read whole (nobody streams: ``finished_only``), one more added: how many
    ``step()`` calls until its first token. With ``arrivals_flagged`` the step before the add is told that a
    request waits (as the engine loop tells it)."""
    engine = rounds_engine(tokenizer).llm_engine
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": ragged_prompts(4, seed=3)[0]}, long)
    for _ in range(4):  # its prefill, then rounds, each queued behind the one before
        engine.step(finished_only=True)
    assert engine._in_flight is not None and engine._in_flight[0].batch.prev_rows is not None
    flag = [arrivals_flagged]
    engine.arrivals = lambda: flag[0]
    engine.step(finished_only=True)
    flag[0] = False
    one = SamplingParams(temperature=0, max_tokens=1)  # finished at its first token: seen with finished_only
    engine.add_request("arrival", {"prompt_token_ids": ragged_prompts(4, seed=4)[1]}, one)
    for calls in range(1, 6):
        if any(o.request_id == "arrival" for o in engine.step(finished_only=True)):
            return calls
    raise AssertionError("the arrival got no token in five steps")


def test_an_arrival_waits_for_the_round_in_flight_only(tokenizer) -> None:
    """Told of the arrival, the engine queues no round behind the one in flight: the request's prefill is the next
    step. Not told, it runs the round already queued first."""
    assert calls_to_first_token(True, tokenizer) == 1
    assert calls_to_first_token(False, tokenizer) == 2


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU"))]
)
def test_random_arrivals_keep_the_synchronous_tokens(device: str, tokenizer) -> None:
    """Stops inside rounds, a backlog, preemption: whatever the predicate answers at each step, the outputs equal
    the synchronous engine's, and both ways of planning happen. On a GPU the host waits on each round's mark
    before its last forwards (``wait_for_last_steps``)."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]
    params = stop_params(tokenizer, prompts)
    engine_kwargs = dict(num_kv_blocks=40, max_num_seqs=4, **STOPS)
    model = copy.deepcopy(tiny_model("llama")).to(device)  # the shared model stays on the CPU
    sync = LLM(model, tokenizer=tokenizer, async_scheduling=False, **engine_kwargs)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    llm = LLM(model, tokenizer=tokenizer, async_scheduling=True, **engine_kwargs)
    rng = random.Random(0)
    answers: list[bool] = []

    def arrivals() -> bool:
        answers.append(rng.random() < 0.5)
        return answers[-1]

    llm.llm_engine.arrivals = arrivals
    continued = count_continuations(llm)
    assert summary(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert continued[0] > 0 and any(answers) and not all(answers)
    assert_idle(llm)


class Pending:
    """A queued step's output that records the calls made to it."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait_for_last_steps(self) -> None:
        self.calls.append("wait")

    def get_output(self):  # pragma: no cover - never read here
        raise AssertionError


def test_the_queueing_functions_ask_before_they_plan(tokenizer) -> None:
    """``queue_next`` waits for the round's last forwards, then asks; ``queue_following`` asks first. Neither
    schedules while requests wait to be added."""
    engine = rounds_engine(tokenizer).llm_engine
    calls: list[str] = []
    scheduler = engine.scheduler
    scheduler.schedule_continuation = lambda in_flight, read=0: calls.append("plan")  # type: ignore[method-assign]
    scheduler.schedule = lambda: calls.append("schedule")  # type: ignore[method-assign]

    def asked(answer: bool):
        return lambda: calls.append("ask") or answer

    round_output = object()
    assert queue_next(scheduler, engine.executor, (round_output, Pending(calls)), asked(True)) is None  # type: ignore[arg-type]
    assert calls == ["wait", "ask"]
    calls.clear()
    queue_next(scheduler, engine.executor, (round_output, Pending(calls)), asked(False))  # type: ignore[arg-type]
    assert calls == ["wait", "ask", "plan"]
    calls.clear()
    assert queue_following(scheduler, engine.executor, asked(True)) is None
    assert calls == ["ask"]


def test_the_engine_loop_tells_of_adds_only(tokenizer) -> None:
    """While the loop is busy, a queued add makes ``arrivals`` true and other calls do not; the loop clears the
    predicate when it stops, unless a later loop on the same engine has set its own."""
    engine = rounds_engine(tokenizer).llm_engine
    assert engine.arrivals is None
    loop = EngineLoop(engine)
    assert engine.arrivals is not None and engine.arrivals() is False
    busy, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=loop.call_sync, args=(lambda _: busy.set() or release.wait(30),))
    holder.start()
    assert busy.wait(30)
    loop.abort("nobody")
    assert engine.arrivals() is False  # an abort queued: no arrival
    params = SamplingParams(temperature=0, max_tokens=2)
    adder = threading.Thread(target=loop.add_sync, args=([("late", {"prompt_token_ids": [5, 6, 7]})], params))
    adder.start()
    for _ in range(3000):  # until the adding thread has queued its call (30 s at most)
        if engine.arrivals():
            break
        time.sleep(0.01)
    assert engine.arrivals() is True
    release.set()
    holder.join(30)
    adder.join(30)
    assert engine.arrivals() is False
    later = EngineLoop(engine)
    loop.shutdown()
    assert engine.arrivals == later._adds_waiting
    later.shutdown()
    assert engine.arrivals is None


def test_a_round_marks_its_last_forwards() -> None:
    assert [last_steps_begin(k) for k in (1, 2, 3, 8)] == [0, 0, 1, 6]
