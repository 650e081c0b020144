"""Memory given back: every way of letting go of an engine — ``LLM.shutdown()``, leaving ``with LLM(...)``,
``del llm`` (with and without its engine-loop thread started), ``unpatch``, leaving ``patched()`` — leaves the
engine unreachable (a weak reference to it dies), so its KV cache and everything else it holds are freed; the
user's model keeps working."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.engine.engine_loop import EngineDeadError
from paged_backend.integrations.hf import patch, patched, unpatch
from tests.conftest import fresh_model, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = {"prompt_token_ids": [1, 5, 9, 13]}


def gone(ref: weakref.ref, seconds: float = 10.0) -> bool:
    """Whether ``ref`` dies within ``seconds`` (an engine loop thread ends after its current step)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if ref() is None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def engine_ref(llm: LLM) -> weakref.ref:
    return weakref.ref(llm.llm_engine)


def small_llm(tokenizer) -> LLM:
    return LLM(fresh_model(tokenizer), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64)


def test_shutdown_drops_the_engine_and_refuses_later_calls(tokenizer) -> None:
    llm = small_llm(tokenizer)
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    ref = engine_ref(llm)
    llm.shutdown()
    assert gone(ref)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.shutdown()  # a second call does nothing


def test_a_with_block_and_a_started_engine_loop(tokenizer) -> None:
    """Leaving the block stops the loop thread (a waiting async caller gets EngineDeadError) and drops the engine."""
    with small_llm(tokenizer) as llm:
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        loop = llm.engine_loop  # the thread that steps the engine for async callers
        ref, thread = engine_ref(llm), loop.thread
    assert not thread.is_alive()
    with pytest.raises(EngineDeadError):
        asyncio.run(loop.call(lambda engine: None))
    del loop  # this test's own reference (the loop object holds its engine)
    assert gone(ref)


@pytest.mark.parametrize("start_loop", [False, True])
def test_del_llm_frees_the_engine(tokenizer, start_loop: bool) -> None:
    llm = small_llm(tokenizer)
    if start_loop:
        llm.engine_loop.call_sync(lambda engine: None)  # the loop's thread holds the engine
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    ref = engine_ref(llm)
    del llm
    assert gone(ref)


@pytest.mark.parametrize(
    "release",
    [lambda model, handle: unpatch(model), lambda model, handle: handle.close()],
    ids=["unpatch", "close"],
)
def test_unpatch_frees_the_engine(tokenizer, release: Callable) -> None:
    model = fresh_model(tokenizer)
    handle = patch(model, tokenizer, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)
    ids = torch.tensor([[1, 5, 9, 13]])
    expected = hf_greedy(model, [1, 5, 9, 13], 4)
    assert model.generate(ids, max_new_tokens=4, do_sample=False)[0, 4:].tolist() == expected
    ref = weakref.ref(handle.engine)
    release(model, handle)
    assert gone(ref)
    assert hf_greedy(model, [1, 5, 9, 13], 4) == expected  # the user's model still works, unchanged


def test_each_patched_block_leaves_no_engine(tokenizer) -> None:
    model = fresh_model(tokenizer)
    refs = []
    for _ in range(3):
        with patched(model, tokenizer, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64) as handle:
            model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=2, do_sample=False)
            refs.append(weakref.ref(handle.engine))
        assert gone(refs[-1])
    assert "generate" not in model.__dict__


@pytest.mark.parametrize(("free_gib", "expected_gib"), [(100.0, 80.0), (50.0, 39.0), (5.0, -6.0)])
def test_the_kv_cache_gets_no_more_than_the_device_has_free(
    monkeypatch: pytest.MonkeyPatch, free_gib: float, expected_gib: float
) -> None:
    """The KV budget is ``gpu_memory_utilization`` of the device less the weights and activation peak, but never
    more than the device has free beside the peak's activations and half the fraction's slack: memory the
    process holds elsewhere (a caller's tensors, allocator segments that cannot be released) is not there for
    the cache. Simulated device: 100 GiB at 0.9, a 10 GiB peak of which 4 GiB is held now (so 6 GiB of
    activations), 5 GiB of slack kept; with 5 GiB free nothing fits."""
    from paged_backend.config import EngineConfig
    from paged_backend.worker import profiler

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: type("P", (), {"total_memory": 100 * gib}))
    monkeypatch.setattr(profiler, "profile_peak_memory", lambda *_: 10 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (int(free_gib * gib), 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _: 4 * gib)
    config = EngineConfig.from_kwargs("m", gpu_memory_utilization=0.9)
    blocks = profiler.gpu_blocks_that_fit(None, config, torch.device("cuda"), gib // 4)  # type: ignore[arg-type]
    assert blocks == int(expected_gib * 4)
