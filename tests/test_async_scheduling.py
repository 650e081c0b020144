"""Async scheduling: a multi-step round queued before the host reads the round in front of it gives exactly the
tokens, text and finish reasons of the synchronous engine and of HF ``generate`` — with stop tokens and stop
strings inside the round in flight, preemption, prefix-cache hits and a request aborted while its round runs.

On CPU a queued round is computed before the one in front of it is read, so these tests see the bookkeeping,
not the overlap; the GPU check runs the same engine on CUDA (benchmarks/gpu_check.py)."""

from __future__ import annotations

import os

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.config import EngineConfig, FieldError
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.multi_step import plan_continuation
from paged_backend.core.sequence import Request, Sequence, SequenceStatus
from paged_backend.engine.llm_engine import StepError
from paged_backend.entrypoints.openai.cli_args import parse_args
from tests.conftest import assert_idle, hf_greedy, ragged_prompts, tiny_model


def count_continuations(llm: LLM) -> list[int]:
    """How many queued rounds continued the round in front of them (``[n]``, updated as the engine runs)."""
    executor = llm.llm_engine.executor
    launch, count = executor.execute_model_async, [0]

    def counting(scheduler_output):
        count[0] += scheduler_output.batch.prev_rows is not None
        return launch(scheduler_output)

    executor.execute_model_async = counting  # type: ignore[method-assign]
    return count


def summary(outputs) -> list[tuple]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        for o in outputs
    ]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_greedy_matches_hf_generate(arch: str, tokenizer) -> None:
    """Ragged prompts, rows that end at EOS or at different lengths inside a round in flight."""
    model = tiny_model(arch)
    prompts = ragged_prompts(4, seed=11)
    lengths = [13, 24, 5, 31, 17, 9, 28, 20]
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, num_scheduler_steps=4, async_scheduling=True)
    continued = count_continuations(llm)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, n, output in zip(prompts, lengths, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, n)
    assert continued[0] > 3
    assert_idle(llm)


def count_dead_rows(llm: LLM) -> list[int]:
    """How many rows of read rounds belonged to sequences that had ended before the read (``[n]``): a queued
    round's rows that a stop in the round in front of it made void."""
    scheduler = llm.llm_engine.scheduler
    update, count = scheduler.update_from_output, [0]

    def counting(output, runner_output):
        count[0] += sum(seq.status.finished for seq in output.sampling_seqs)
        return update(output, runner_output)

    scheduler.update_from_output = counting  # type: ignore[method-assign]
    return count


def generate_both(tokenizer, prompts, params, **engine_kwargs) -> tuple[list, list, dict[str, int]]:
    """(synchronous outputs, async outputs, the async engine's counts and stats)."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(tiny_model("llama"), tokenizer=tokenizer, async_scheduling=async_scheduling, **engine_kwargs)
        continued, dead = count_continuations(llm), count_dead_rows(llm)
        results.append(summary(llm.generate(prompts, params, use_tqdm=False)))
        assert_idle(llm)
    return results[0], results[1], {"continued": continued[0], "dead": dead[0], **llm.stats()}


STOPS = dict(block_size=4, max_model_len=40, num_scheduler_steps=8)


def stop_params(tokenizer, prompts) -> list[SamplingParams]:
    """Stop tokens, a stop string, min_tokens and max_model_len, each landing inside a multi-step round."""
    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    reference, _, _ = generate_both(tokenizer, prompts, plain, num_kv_blocks=200, **STOPS)
    params = list(plain)
    params[0] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference[0][0][12]])
    params[1] = SamplingParams(temperature=0, max_tokens=30, stop=[reference[1][1][12:15]])
    params[2] = SamplingParams(temperature=0, max_tokens=38, ignore_eos=True)  # reaches max_model_len
    params[3] = SamplingParams(temperature=0, max_tokens=30, min_tokens=11, stop_token_ids=[reference[3][0][2]])
    params[6] = SamplingParams(temperature=0, max_tokens=30)  # may end at EOS
    return params


def test_stops_inside_the_round_in_front_of_a_queued_one(tokenizer) -> None:
    """Every request runs at once: rows that stop in a round are still in the round queued behind it, which
    computes them for nothing; the outputs equal the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]
    params = stop_params(tokenizer, prompts)
    sync, asynchronous, counts = generate_both(tokenizer, prompts, params, num_kv_blocks=200, **STOPS)
    assert asynchronous == sync
    assert counts["continued"] > 2 and counts["dead"] > 0
    assert sync[0][2:] == ("stop", params[0].stop_token_ids[0]) and sync[1][2] == "stop"
    assert sync[2][2] == "length"


@pytest.mark.parametrize("num_kv_blocks", [80, 24])  # 24 blocks of 4 tokens: sequences are preempted
def test_equals_sync_with_a_backlog_preemption_and_prefix_hits(num_kv_blocks: int, tokenizer) -> None:
    """More requests than places (a round is queued only while the batch is full and no row leaves it), few
    blocks, a repeated prompt served from the prefix cache, a seeded sampled request taking single steps."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]
    prompts.append(prompts[4])  # a prefix-cache hit once the first one's blocks are cached
    params = stop_params(tokenizer, prompts)
    params[5] = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
    engine = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=4, **STOPS)
    sync, asynchronous, counts = generate_both(tokenizer, prompts, params, **engine)
    assert asynchronous == sync
    assert counts["continued"] > 0 and counts["num_prompt_tokens_cached"] > 0
    assert counts["num_preemptions"] > 0 or num_kv_blocks == 80


@pytest.mark.parametrize("finished_only", [True, False], ids=["whole rounds", "rounds by step"])
def test_abort_while_its_round_is_in_flight(finished_only: bool, tokenizer) -> None:
    """A request aborted between the step that queued its next round and the step that reads it (or, read a step
    at a time, while its round is being read): it reports nothing more, its blocks are freed, and the others go
    on as if it had never been there."""
    model = tiny_model("llama")
    prompts = ragged_prompts(4, seed=5)[:3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(async_scheduling: bool, abort_at: int | None) -> dict[str, list[int]]:
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, async_scheduling=async_scheduling)
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        tokens: dict[str, list[int]] = {}
        steps, aborted = 0, False
        while engine.has_unfinished_requests():
            if steps == abort_at:  # the round that would give "1" its next tokens
                assert engine._in_flight is not None or engine._reading is not None
                engine.abort_request("1")
                aborted = True
            for output in engine.step(finished_only=finished_only and async_scheduling):
                assert not (aborted and output.request_id == "1")
                tokens[output.request_id] = output.outputs[0].token_ids
            steps += 1
        assert_idle(llm)
        return tokens

    reference = run(False, None)
    aborted = run(True, 4)
    assert aborted["0"] == reference["0"] and aborted["2"] == reference["2"]
    if not finished_only:  # its tokens until the abort
        assert aborted["1"] == reference["1"][: len(aborted["1"])] and len(aborted["1"]) < 40


def test_nothing_left_in_flight_when_every_row_stopped(tokenizer) -> None:
    """A round queued behind one in which every row stops is dropped unread: the engine is idle at once."""
    model = tiny_model("llama")
    prompt = ragged_prompts(4, seed=2)[4]
    reference = hf_greedy(model, prompt, 20)
    stop = reference[9]
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request(
        "a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference[: reference.index(stop) + 1]
    assert engine._in_flight is None and engine.step() == []
    assert_idle(llm)


def _seqs(lengths: list[int], max_tokens: list[int], bm: BlockManager) -> list[Sequence]:
    seqs = []
    for i, (length, limit) in enumerate(zip(lengths, max_tokens)):
        request = Request(str(i), None, [5] * 4, SamplingParams(temperature=0, max_tokens=limit))
        seq = Sequence(i, 0, request, [5] * length, 4, arrival=i, status=SequenceStatus.RUNNING)
        seq.num_computed_tokens = length - 1
        request.seqs = [seq]
        assert bm.allocate_slots(i, 0, length) == []
        seqs.append(seq)
    return seqs


def test_plan_continuation() -> None:
    """Rows ending at their length limit in the round in flight are left out; the others get slots after that
    round's; no continuation where a slot needs a block that is not free."""
    bm = BlockManager(64, 4)
    seqs = _seqs([6, 6, 6], [3, 10, 30], bm)  # 2 tokens out so far: max_tokens leave 1, 8 and 28
    assert plan_continuation(seqs, [1, 4, 4], 4, 100, bm) == ([1, 2], [4, 4])
    assert len(bm.get_block_table(2)) * 4 >= 6 - 1 + 4 + 4  # slots up to the continuation's last token
    assert plan_continuation(seqs, [1, 4, 4], 4, 12, bm) == ([1, 2], [2, 2])  # max_model_len 12
    assert plan_continuation(seqs[:1], [1], 4, 100, bm) is None  # nothing left to run
    full = BlockManager(2, 4)
    seq = _seqs([6], [30], full)  # 8 slots: the round in flight fills up to slot 5 + its steps
    assert plan_continuation(seq, [2], 4, 100, full) == ([0], [1])  # slot 7 is the last its blocks hold
    assert plan_continuation(seq, [3], 4, 100, full) is None  # slot 8 needs a third block


def test_config_and_server_flag() -> None:
    with pytest.raises(FieldError, match="async_scheduling must be True or False"):
        EngineConfig.from_kwargs("m", async_scheduling="yes")
    with pytest.raises(FieldError, match="async_scheduling needs tensor_parallel_size=1"):
        EngineConfig.from_kwargs("m", async_scheduling=True, tensor_parallel_size=2)
    assert parse_args(["m", "--async-scheduling"])[1]["async_scheduling"] is True
    assert parse_args(["m", "--no-async-scheduling"])[1]["async_scheduling"] is False
    assert "async_scheduling" not in parse_args(["m"])[1]
    from paged_backend.engine.engine_setup import async_scheduling

    gpu, cpu = torch.device("cuda"), torch.device("cpu")  # compared by type only: no GPU needed
    unset = dict(async_scheduling=None)  # the default (the suite may run with it forced on)
    for steps in (1, 8):  # single steps are queued ahead too
        assert async_scheduling(EngineConfig.from_kwargs("m", num_scheduler_steps=steps, **unset), gpu)
        assert not async_scheduling(EngineConfig.from_kwargs("m", num_scheduler_steps=steps, **unset), cpu)
    assert not async_scheduling(EngineConfig.from_kwargs("m", tensor_parallel_size=2, **unset), gpu)
    assert async_scheduling(EngineConfig.from_kwargs("m", async_scheduling=True), cpu)


@pytest.mark.skipif(
    os.environ.get("PAGED_BACKEND_TEST_ASYNC_SCHEDULING") == "1", reason="the suite runs with it forced on"
)
def test_off_by_default_on_cpu(tokenizer) -> None:
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=32)
    assert llm.llm_engine.async_scheduling is False


@pytest.mark.parametrize("failing", ["queue", "read"])
def test_a_failed_queued_round_or_read_is_redone(failing: str, tokenizer, caplog) -> None:
    """Queueing a round behind another fails once: the next step is a normal one. Reading a round fails once:
    its requests are redone alone, as after any failed step. Either way every output is exactly HF's."""
    model = tiny_model("llama")
    prompts = ragged_prompts(4, seed=13)[:4]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, async_scheduling=True)
    executor = llm.llm_engine.executor
    launch, failures = executor.execute_model_async, []

    class FailingRead:
        def get_output(self):
            failures.append("read")
            raise RuntimeError("boom")

    def flaky(scheduler_output):
        continues = scheduler_output.batch.prev_rows is not None
        if continues and not failures and failing == "queue":
            failures.append("queue")
            raise RuntimeError("boom")
        pending = launch(scheduler_output)
        return FailingRead() if continues and not failures and failing == "read" else pending

    executor.execute_model_async = flaky  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert failures == [failing]
    messages = [record.getMessage() for record in caplog.records if "boom" in record.getMessage()]
    step_failed = any(m.startswith("a step of") for m in messages)  # its requests redone alone
    assert messages and step_failed == (failing == "read")
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 24)
    assert_idle(llm)


def test_a_failure_reading_a_queued_round_spares_requests_that_ended_before_it(tokenizer) -> None:
    """Request "A" stops in a round while the round behind it is queued; a new request reuses the id "A"; then
    reading the queued round fails. Only the request still in that round ("B") fails: not the old "A" (its
    output was made) and not the new one."""
    model = tiny_model("llama")
    prompt_a, prompt_b = ragged_prompts(4, seed=3)[4], ragged_prompts(4, seed=3)[6]
    stop = hf_greedy(model, prompt_a, 6)[3]
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=64, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request(
        "A", {"prompt_token_ids": prompt_a}, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    )
    engine.add_request(
        "B", {"prompt_token_ids": prompt_b}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    while "A" in engine.requests:  # rounds read whole: the round behind A's last one is queued
        engine.step(finished_only=True)
    assert engine._in_flight is not None and any(seq.request.request_id == "A" for seq in engine._in_flight[0].seqs)
    engine.add_request(
        "A", {"prompt_token_ids": prompt_b}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    process, calls = engine.output_processor.process_tokens, []

    def failing_once(updates):
        if not calls:
            calls.append(True)
            raise RuntimeError("boom")
        return process(updates)

    engine.output_processor.process_tokens = failing_once  # type: ignore[method-assign]
    with pytest.raises(StepError) as raised:
        engine.step(finished_only=True)
    assert raised.value.request_ids == ["B"]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step(finished_only=True)})
    assert list(outputs) == ["A"] and outputs["A"].outputs[0].token_ids == hf_greedy(model, prompt_b, 5)
    assert_idle(llm)


@pytest.mark.parametrize("finished_only", [True, False], ids=["whole rounds", "rounds by step"])
def test_a_weight_change_drops_the_round_queued_with_the_old_weights(finished_only: bool, tokenizer) -> None:
    """Weights changed in place between steps while a round is queued: that round was computed with the old
    weights, so it is dropped and its tokens computed again — the outputs equal the synchronous engine's with the
    same change at the same step. Read a step at a time, a step hands out one token a row, as the synchronous
    engine's single steps do: the change comes at the same token."""
    from tests.conftest import fresh_model

    prompts = ragged_prompts(4, seed=9)[3:6]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(async_scheduling: bool, num_scheduler_steps: int = 8) -> list[list[int]]:
        model = fresh_model(tokenizer)
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, async_scheduling=async_scheduling,
                  num_scheduler_steps=num_scheduler_steps)  # fmt: skip
        engine = llm.llm_engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        tokens: dict[str, list[int]] = {}
        for step in range(200):
            if not engine.has_unfinished_requests():
                break
            if step == 3:
                assert engine._in_flight is not None or engine._reading is not None or not async_scheduling
                with torch.no_grad():
                    model.lm_head.weight.mul_(-1.0)  # in place, as an optimizer step would
            outputs = engine.step(finished_only=finished_only)
            tokens.update({o.request_id: o.outputs[0].token_ids for o in outputs})
        assert_idle(llm)
        return [tokens[str(i)] for i in range(len(prompts))]

    assert run(True) == run(False, 8 if finished_only else 1)


def test_forked_samples_in_queued_rounds(tokenizer) -> None:
    """n=2 greedy samples fork from their first one's blocks (copy-on-write) and then decode in rounds queued
    behind rounds: both equal HF's greedy output."""
    model = tiny_model("llama")
    prompts = ragged_prompts(4, seed=4)[3:6]
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=64, async_scheduling=True)
    continued = count_continuations(llm)
    params = SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(model, prompt, 20)
        assert [c.token_ids for c in output.outputs] == [expected, expected]
    assert continued[0] > 0
    assert_idle(llm)


def count_queued_steps(llm: LLM) -> list[int]:
    """How many single steps were launched before the step in front of them had made its outputs (``[n]``)."""
    engine, count = llm.llm_engine, [0]
    queue = engine._queue_following

    def counting():
        queued = queue()
        count[0] += queued is not None
        return queued

    engine._queue_following = counting  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("num_kv_blocks", [80, 24])  # 24 blocks of 4 tokens: sequences are preempted
def test_single_steps_queued_ahead_equal_sync(num_kv_blocks: int, tokenizer) -> None:
    """Without rounds, each step is launched as soon as the one in front of it has counted its tokens, before
    its text and outputs are made: stop strings and stop tokens found then leave a queued row computed for
    nothing. With a backlog, preemption, prefix hits, a seeded sampled request, n=2 samples forking from a
    queued prefill and prompt logprobs, every output equals the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]
    prompts.append(prompts[4])  # a prefix-cache hit once the first one's blocks are cached
    params = stop_params(tokenizer, prompts)
    params[5] = SamplingParams(temperature=0.8, seed=3, max_tokens=12)
    params[7] = SamplingParams(temperature=0, max_tokens=10, n=2, prompt_logprobs=1, ignore_eos=True)
    engine = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=6, **{**STOPS, "num_scheduler_steps": 1})
    results, queued, dead = [], [0], [0]
    for async_scheduling in (False, True):
        llm = LLM(tiny_model("llama"), tokenizer=tokenizer, async_scheduling=async_scheduling, **engine)
        queued, dead = count_queued_steps(llm), count_dead_rows(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(summary([o]), [s.token_ids for s in o.outputs], o.prompt_logprobs) for o in outs])
        assert_idle(llm)
    assert results[1] == results[0]
    assert queued[0] > 10 and dead[0] > 0  # steps went ahead, and some rows stopped in front of theirs


def test_a_request_aborted_while_its_queued_prefill_runs_forks_no_samples(tokenizer) -> None:
    """n=2: its other sample forks when the first one's prefill is read. Aborted while that prefill step is
    queued, the request leaves nothing behind: no fork, no blocks, the engine idle."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64,
              num_scheduler_steps=1, async_scheduling=True)  # fmt: skip
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # "a" prefills and samples; "b" is admitted into the step queued behind it
    engine.add_request("b", {"prompt_token_ids": [8, 9, 10, 11, 12]}, SamplingParams(max_tokens=8, n=2))
    engine.step()
    assert engine._in_flight is not None and any(s.request.request_id == "b" for s in engine._in_flight[0].seqs)
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.scheduler.has_unfinished_seqs()
    assert_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_launch_fails_its_step_as_without_queueing(async_scheduling: bool, tokenizer) -> None:
    """The fourth launch raises. Queued behind the third step, it fails when the engine reads it: the same
    request fails with the same error as when the engine launches each step itself."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64,
              num_scheduler_steps=1, async_scheduling=async_scheduling)  # fmt: skip
    runner = llm.llm_engine.executor.model_runner
    launch, calls = runner.execute_model_async, []

    def failing(scheduler_output):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return launch(scheduler_output)

    runner.execute_model_async = failing  # type: ignore[method-assign]
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=10))
    with pytest.raises(StepError, match="boom") as raised:
        while engine.has_unfinished_requests():
            engine.step()
    assert raised.value.request_ids == ["a"] and len(calls) == 4
    assert_idle(llm)
