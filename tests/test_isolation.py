"""No input can take the engine down: bad requests fail when added; when a step raises, the request that makes
steps fail fails alone, its neighbours are redone; and only an error of the device itself stops the engine loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend import LLM, SamplingParams
from paged_backend.engine.engine_loop import EngineDeadError, RequestFailedError
from paged_backend.engine.llm_engine import StepError
from paged_backend.sampling_params import MAX_FLOAT32, MAX_INT64
from tests.conftest import assert_idle, before_each_step, hf_greedy, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def make_llm(tokenizer, **kwargs) -> LLM:
    kwargs = {"block_size": 4, "num_kv_blocks": 64, "max_model_len": 64, **kwargs}
    return LLM(tiny_model("llama"), tokenizer=tokenizer, **kwargs)


def fail_when(llm: LLM, request_id: str, error: Exception, times: int = 1) -> list[list[str]]:
    """Make the executor raise ``error`` in the first ``times`` steps that run ``request_id`` (any request: "*");
    returns the request ids of every step it ran, failed or not, with each failed step's marked by a "!" entry."""
    steps: list[list[str]] = []
    failures = [0]

    def fail(scheduler_output):
        ids = sorted({seq.request.request_id for seq in scheduler_output.seqs})
        steps.append(ids)
        if (request_id in ids or request_id == "*") and failures[0] < times:
            failures[0] += 1
            steps[-1] = [*ids, "!"]
            raise error

    before_each_step(llm.llm_engine.executor, fail)
    return steps


def run_all(llm: LLM) -> tuple[dict[str, list[int]], list[str]]:
    """Step until done: each finished request's tokens, and the ids of those that failed."""
    engine, finished, failed = llm.llm_engine, {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        except StepError as error:
            failed += error.request_ids
    return finished, failed


def add_all(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> None:
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": prompt}, params)


def test_a_passing_fault_costs_its_batch_a_recompute(tokenizer) -> None:
    """A forward of three requests fails once: none fails; each is redone alone (the culprit is unknown), then
    they batch again, and every output is exactly HF's."""
    llm = make_llm(tokenizer)
    steps = fail_when(llm, "*", ValueError("boom"))
    add_all(llm, PROMPTS)
    finished, failed = run_all(llm)
    assert failed == [] and steps[0] == ["0", "1", "2", "!"]
    assert all(len(ids) == 1 for ids in steps[1:4]), steps  # one at a time, until each has sampled
    assert any(len(ids) > 1 for ids in steps[4:]), steps  # then together again
    for i, prompt in enumerate(PROMPTS):
        assert finished[str(i)] == hf_greedy(tiny_model("llama"), prompt, 6)
    assert_idle(llm)


def test_a_request_that_makes_steps_fail_fails_alone(tokenizer) -> None:
    """Every step that runs request 1 fails: it fails (once it is alone in a failing step); its neighbours of the
    first failed step are redone and finish exactly."""
    llm = make_llm(tokenizer)
    fail_when(llm, "1", ValueError("boom"), times=10**9)
    add_all(llm, PROMPTS)
    finished, failed = run_all(llm)
    assert failed == ["1"]
    for i in (0, 2):
        assert finished[str(i)] == hf_greedy(tiny_model("llama"), PROMPTS[i], 6)
    assert_idle(llm)


def test_a_fault_that_persists_fails_every_request_and_ends(tokenizer) -> None:
    """Every step fails: each request fails by its second failed step at most; nothing loops, nothing is held."""
    llm = make_llm(tokenizer)
    steps = fail_when(llm, "*", RuntimeError("out of memory, say"), times=10**9)
    add_all(llm, PROMPTS)
    finished, failed = run_all(llm)
    assert finished == {} and sorted(failed) == ["0", "1", "2"] and len(steps) <= 2 * len(PROMPTS)
    assert_idle(llm)


def test_direct_generate_raises_the_step_error_and_leaves_nothing_behind(tokenizer) -> None:
    llm = make_llm(tokenizer)
    fail_when(llm, "1", RuntimeError("boom"), times=10**9)  # LLM.generate numbers its requests 0, 1, ...
    with pytest.raises(StepError, match="boom") as info:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert info.value.request_ids == ["1"]
    assert llm.llm_engine.requests == {}
    assert_idle(llm)


def neighbours_finish_as_alone(llm: LLM, requests: list, queues: list, failed: str) -> None:
    """Every request on the loop but ``failed`` ends with HF's greedy tokens; then the loop is alive and idle."""
    loop = llm.engine_loop
    for (name, prompt), queue in zip(requests, queues):
        if name != failed:
            (*_, final) = loop.stream_sync(name, queue)
            assert final.outputs[0].token_ids == hf_greedy(tiny_model("llama"), prompt["prompt_token_ids"], 6)
    assert loop.alive
    loop.call_sync(lambda engine: None)  # let the loop finish its bookkeeping
    assert_idle(llm)
    loop.shutdown()


def test_on_the_loop_only_the_failing_request_fails(tokenizer) -> None:
    llm = make_llm(tokenizer)
    loop = llm.engine_loop
    fail_when(llm, "b", RuntimeError("boom"), times=10**9)
    requests = [(name, {"prompt_token_ids": p}) for name, p in zip("abc", PROMPTS)]
    queues = loop.add_sync(requests, GREEDY)
    with pytest.raises(RequestFailedError, match="request b failed: RuntimeError\\('boom'\\)"):
        list(loop.stream_sync("b", queues[1]))
    neighbours_finish_as_alone(llm, requests, queues, failed="b")


_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("CUDA error: an illegal memory access was encountered"), id="cuda-error-text"),
        pytest.param(
            _ACCELERATOR_ERROR("device lost") if _ACCELERATOR_ERROR else None,
            id="AcceleratorError",
            marks=pytest.mark.skipif(_ACCELERATOR_ERROR is None, reason="torch.AcceleratorError came in torch 2.8"),
        ),
    ],
)
def test_a_device_error_stops_the_loop_loudly(tokenizer, error: Exception) -> None:
    llm = make_llm(tokenizer)
    loop = llm.engine_loop
    fail_when(llm, "a", error)
    (queue,) = loop.add_sync([("a", {"prompt_token_ids": PROMPTS[0]})], GREEDY)
    with pytest.raises(EngineDeadError):
        list(loop.stream_sync("a", queue))
    loop.thread.join(timeout=10)
    assert not loop.alive
    with pytest.raises(EngineDeadError):
        loop.add_sync([("b", {"prompt_token_ids": PROMPTS[1]})], GREEDY)


def test_sampling_params_changed_after_construction_are_checked_when_added(tokenizer) -> None:
    llm = make_llm(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=3)
    params.max_tokens = -5
    with pytest.raises(ValueError, match="max_tokens must be an integer in \\[1, "):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    params.max_tokens, params.top_k = 3, 2**63
    with pytest.raises(ValueError, match="top_k") as info:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert info.value.field == "top_k"  # type: ignore[attr-defined]
    assert_idle(llm)


def test_a_request_keeps_the_parameters_it_was_added_with(tokenizer) -> None:
    llm = make_llm(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.llm_engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    params.max_tokens = 40  # too late: the engine holds its own copy
    finals = []
    while llm.llm_engine.has_unfinished_requests():
        finals += [o for o in llm.llm_engine.step() if o.finished]
    assert len(finals[0].outputs[0].token_ids) == 3


def test_largest_top_k_runs(tokenizer) -> None:
    """The top_k that killed the engine (2**63, past int64) is refused; the largest that fits runs."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    llm = make_llm(tokenizer)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(top_k=MAX_INT64, seed=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16


def _extreme_params() -> st.SearchStrategy[SamplingParams]:
    """Every numeric field at or near its bounds."""
    n = st.sampled_from([1, 2])
    return n.flatmap(
        lambda n: st.builds(
            SamplingParams,
            n=st.just(n),
            temperature=st.sampled_from([0.0, 1e-6, 1.0, 1e30, MAX_FLOAT32]),
            top_p=st.sampled_from([1e-30, 0.5, 1.0]),
            top_k=st.sampled_from([-1, 0, 1, 511, 512, 10**6, MAX_INT64]),
            min_p=st.sampled_from([0.0, 0.5, 1.0]),
            presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
            frequency_penalty=st.sampled_from([-2.0, 2.0]),
            repetition_penalty=st.sampled_from([1e-30, 1.0, 1e30]),
            seed=st.sampled_from([None, 0, MAX_INT64 + 1 - n]),
            stop_token_ids=st.sampled_from([[], [0, 511]]),
            max_tokens=st.integers(1, 4),
            min_tokens=st.integers(0, 1),
            logprobs=st.sampled_from([None, 0, 20]),
        ).filter(lambda p: p.min_tokens <= (p.max_tokens or 0) and not (p.greedy and p.n > 1))
    )


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(_extreme_params(), min_size=1, max_size=6))
def test_extreme_sampling_params_never_break_a_step(tokenizer, batch: list[SamplingParams]) -> None:
    llm = _shared_llm(tokenizer)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(batch))]
    outs = llm.generate(prompts, batch, use_tqdm=False)
    for params, out in zip(batch, outs):
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            assert 1 <= len(sample.token_ids) <= params.max_tokens
            assert all(0 <= t < 512 for t in sample.token_ids)
    assert_idle(llm)


_LLMS: dict[str, LLM] = {}


def _shared_llm(tokenizer) -> LLM:
    if "llm" not in _LLMS:
        _LLMS["llm"] = make_llm(tokenizer, num_kv_blocks=128)
    return _LLMS["llm"]


@pytest.mark.parametrize("fail_at", [4, 10, 16])
def test_a_failed_step_amid_swaps_leaves_the_others_exact(tokenizer, fail_at: int) -> None:
    """Preemption by swap in a small cache: the failed step's requests (and those whose blocks it swapped) are
    redone; every request still equals HF greedy, and no block is left held."""
    prompts = [[3 + (i * 7 + j) % 500 for j in range(10 + i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = make_llm(tokenizer, num_kv_blocks=16, preemption_mode="swap", swap_space=0.01)
    engine, executor = llm.llm_engine, llm.llm_engine.executor
    calls, swaps = [0], [0]

    def fail(scheduler_output):
        calls[0] += 1
        swaps[0] += bool(scheduler_output.batch.blocks_to_swap_out or scheduler_output.batch.blocks_to_swap_in)
        if calls[0] == fail_at:
            raise RuntimeError("boom")

    before_each_step(executor, fail)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        except StepError as error:
            failed += error.request_ids
    assert swaps[0] and sorted([*failed, *finished], key=int) == [str(i) for i in range(6)]
    for request_id, out in finished.items():
        assert out.outputs[0].token_ids == hf_greedy(tiny_model("llama"), prompts[int(request_id)], 20)
    assert_idle(llm)


def test_a_failed_swap_in_offers_no_block_to_the_prefix_cache(tokenizer) -> None:
    """Every step that swaps sequences back in fails before its copies run: the blocks it swapped into hold
    whatever was there (here: noise), and must not become prefix-cache hits for a later request, whether their
    requests are redone or (at their second failure) aborted."""
    prompts = [[3 + (i * 7 + j) % 500 for j in range(10 + i)] for i in range(6)]
    llm = make_llm(tokenizer, num_kv_blocks=16, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=True)
    engine, executor = llm.llm_engine, llm.llm_engine.executor
    swapped = []

    def fail(scheduler_output):
        moves = scheduler_output.batch.blocks_to_swap_in
        if moves:  # every swap-in fails: the first time its requests are redone, the second time they fail
            swapped.extend([*seq.token_ids[: seq.num_computed_tokens], 7] for seq in scheduler_output.swapped_seqs)
            targets = [dst for _, dst in moves]
            for k, v in executor.model_runner.cache_engine.kv_caches:
                k[targets], v[targets] = torch.randn_like(k[targets]), torch.randn_like(v[targets])
            raise RuntimeError("boom")

    before_each_step(executor, fail)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20))
    _, failed = run_all(llm)
    assert swapped and failed
    continuations = swapped
    outs = llm.generate([{"prompt_token_ids": p} for p in continuations], GREEDY, use_tqdm=False)
    for prompt, out in zip(continuations, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model("llama"), prompt, 6)
    assert_idle(llm)


def test_a_request_that_finished_in_a_failed_step_still_fails(tokenizer, monkeypatch) -> None:
    """A failure after the forward, while outputs are made: a request that finished in that step (already off
    the engine's list) is reported failed too, never left without an answer."""
    import paged_backend.engine.output_processor as output_processor

    llm = make_llm(tokenizer)
    original = output_processor.make_request_output

    def make_request_output(request, *args, **kwargs):
        if request.request_id == "1" and request.finished:
            raise RuntimeError("boom")
        return original(request, *args, **kwargs)

    monkeypatch.setattr(output_processor, "make_request_output", make_request_output)
    add_all(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finished, failed = run_all(llm)
    assert "1" in failed and "1" not in finished
    assert_idle(llm)


def test_a_logits_processor_that_returns_nan_fails_its_request_naming_it(tokenizer) -> None:
    """Sampling from NaN logits would pick an arbitrary token (a <pad>, empty text): the request fails instead,
    the error naming the processor, and its neighbours finish as if alone."""
    llm = make_llm(tokenizer)
    loop = llm.engine_loop

    def poison(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits * float("nan") if len(output_ids) == 2 else logits

    bad = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[poison])
    requests = [(name, {"prompt_token_ids": p}) for name, p in zip("abc", PROMPTS)]
    queues = loop.add_sync(requests, [GREEDY, bad, GREEDY])
    with pytest.raises(RequestFailedError, match="the logits processor .*poison returned NaN logits"):
        list(loop.stream_sync("b", queues[1]))
    neighbours_finish_as_alone(llm, requests, queues, failed="b")
