"""Preemption by swapping: a request's blocks go to CPU swap space and come back; greedy output still equals HF
``generate`` and the recompute mode, for one and for forked samples."""

from __future__ import annotations

import copy
import functools
import threading
import time

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.core.block_manager import BlockManager
from paged_backend.kernels.cache_write import head_major, new_kv_cache
from paged_backend.worker import cache_engine
from tests.conftest import assert_idle, hf_greedy, ragged_prompts, tiny_model

BS = 4


def tight_llm(model, tokenizer, mode: str, caching: bool = False, **overrides) -> LLM:
    """16 blocks of 4 tokens and 8 tokens a step by default: the ragged batch below cannot all stay resident."""
    args = dict(num_kv_blocks=16, max_num_batched_tokens=8, max_model_len=48, swap_space=0.01) | overrides
    return LLM(
        model,
        tokenizer=tokenizer,
        block_size=BS,
        preemption_mode=mode,
        enable_prefix_caching=caching,
        **args,
    )


@pytest.mark.parametrize(("arch", "caching"), [("llama", False), ("mistral", True)])
def test_swapped_requests_resume_exactly(tokenizer, arch: str, caching: bool) -> None:
    model = tiny_model(arch)
    prompts = ragged_prompts(BS)
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = {}
    for mode in ("swap", "recompute"):
        llm = tight_llm(model, tokenizer, mode, caching)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[mode] = [list(o.outputs[0].token_ids) for o in outs]
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert (stats["num_swapped_out"] > 0) == (mode == "swap")
        assert_idle(llm)
    assert outputs["swap"] == outputs["recompute"]
    for prompt, out in zip(prompts, outputs["swap"]):
        assert out == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_head_major_caches_swap_and_resume_exactly(tokenizer, monkeypatch, kv_cache_dtype: str) -> None:
    """The engine with its caches stored head-major, as on a GPU (here on the CPU, read by the twins): swapped
    blocks come back where they were, and greedy output equals the token-major engine's (and, unquantized, HF's)."""
    model = tiny_model("mistral")
    prompts = ragged_prompts(BS)
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = {}
    for layout in ("token-major", "head-major"):
        if layout == "head-major":
            monkeypatch.setattr(cache_engine, "new_kv_cache", functools.partial(new_kv_cache, head_major=True))
        llm = tight_llm(model, tokenizer, "swap", caching=True, kv_cache_dtype=kv_cache_dtype)
        caches = llm.llm_engine.executor.model_runner.cache_engine.kv_caches
        assert all(head_major(k) == (layout == "head-major") for k, _ in caches)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[layout] = [list(o.outputs[0].token_ids) for o in outs]
        assert llm.stats()["num_swapped_out"] > 0
        assert_idle(llm)
    assert outputs["head-major"] == outputs["token-major"]
    if kv_cache_dtype == "auto":
        assert outputs["head-major"] == [hf_greedy(model, prompt, 12) for prompt in prompts]


def test_forked_samples_swap_together(tokenizer) -> None:
    """n=2 greedy samples share their prompt blocks; swapped out and in as one request, both still equal HF."""
    model = tiny_model("llama")
    llm = tight_llm(model, tokenizer, "swap")
    prompts = ragged_prompts(BS)[4:]
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["num_swapped_out"] > 0
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(model, prompt, 12)
        assert [list(c.token_ids) for c in out.outputs] == [expected, expected]
    assert_idle(llm)


def test_block_manager_swaps_shared_blocks_once() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    bm.allocate_slots(0, 0, 6)
    bm.fork(0, 1)
    bm.allocate_slots(1, 6, 1)  # the child copies the partial block: 3 distinct blocks
    assert bm.can_swap_out([0, 1])
    out = bm.swap_out([0, 1])
    assert len(out) == 3 and bm.num_free_blocks == 6 and len(bm.cpu_free_block_ids) == 1
    assert bm.num_blocks_to_swap_in([0, 1]) == 3
    back = bm.swap_in([0, 1])
    assert sorted(c for c, _ in back) == sorted(c for _, c in out)
    assert bm.get_block_table(0)[0] == bm.get_block_table(1)[0]  # still shared
    assert bm.blocks[bm.get_block_table(0)[0]].ref_count == 2
    bm.free(0)
    bm.swap_out([1])
    bm.free(1)  # a swapped sequence that is aborted gives its CPU blocks back
    assert bm.num_free_blocks == 6 and len(bm.cpu_free_block_ids) == 4


def test_preemption_mode_is_validated(tokenizer) -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(tiny_model("llama"), tokenizer=tokenizer, preemption_mode="spill")
    with pytest.raises(ValueError, match="swap_space > 0"):
        LLM(tiny_model("llama"), tokenizer=tokenizer, preemption_mode="swap", swap_space=0)


def test_preempted_copy_on_write_is_undone_before_swapping(tokenizer) -> None:
    """A request's sample gets a copy-on-write block, then its sibling finds no block and the request is
    preempted in the same step: the copy never happens, so the table must point at the shared source again
    before the blocks go to swap space (else an unwritten block is swapped out and back)."""
    model = tiny_model("llama")
    first, second = [11 + 7 * i for i in range(18)], [401, 323, 440, 157, 218, 262, 429]
    llm = tight_llm(
        model,
        tokenizer,
        "swap",
        num_kv_blocks=8,
        max_model_len=32,
        max_num_batched_tokens=64,
        swap_space=0.001,
        num_scheduler_steps=1,
        async_scheduling=False,  # the steps below in this order: no step queued behind another
    )
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    engine.add_request("b", {"prompt_token_ids": second}, SamplingParams(temperature=0, max_tokens=4, n=3))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert llm.stats()["num_swapped_out"] > 0
    assert list(done["a"].outputs[0].token_ids) == hf_greedy(model, first, 3)
    assert [list(c.token_ids) for c in done["b"].outputs] == [hf_greedy(model, second, 4)] * 3
    assert_idle(llm)


def test_request_too_big_to_swap_back_recomputes(tokenizer) -> None:
    """n=3 samples that together outgrow the whole cache: swapping the request out would leave nothing to run
    and nothing that fits; it recomputes instead, its samples one by one, and finishes."""
    model = tiny_model("llama")
    prompt = [401, 323, 440, 157, 218, 262, 429]
    llm = tight_llm(
        model, tokenizer, "swap", num_kv_blocks=6, max_model_len=24, max_num_batched_tokens=8192, swap_space=0.001
    )
    params = SamplingParams(temperature=0, max_tokens=12, n=3)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [hf_greedy(model, prompt, 12)] * 3
    assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)


def test_forked_samples_respect_max_num_seqs(tokenizer) -> None:
    """Two n=3 requests under max_num_seqs=4: the second waits, since the first's samples will fork in."""
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_num_seqs=4)
    engine = llm.llm_engine
    for i in range(2):
        engine.add_request(f"r{i}", {"prompt_token_ids": [5 + i, 6, 7, 8, 9]}, SamplingParams(n=3, max_tokens=6))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert_idle(llm)


def test_swap_space_is_allocated_off_the_starting_thread_and_its_failure_stops_the_start(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own thread compiles while another pins the swap space; a failed allocation is not left for
    the first preemption to find."""
    threads: list[str] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    llm = tight_llm(tiny_model("llama"), tokenizer, "swap")
    caches = llm.llm_engine.executor.model_runner.cache_engine.swap_space.caches()
    assert len(caches) == tiny_model("llama").config.num_hidden_layers and caches[0][0].shape[1:3] == (BS, 2)
    assert threads.count("swap-space") == 2 * len(caches)

    def failing_empty(*args, **kwargs):
        if threading.current_thread().name == "swap-space":
            raise MemoryError("no pinned memory left")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match="allocating the swap space failed: no pinned memory left"):
        tight_llm(tiny_model("llama"), tokenizer, "swap")


def test_a_start_that_fails_after_the_swap_space_began_waits_for_it(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread goes on pinning memory past an engine start that failed (a later capture would meet it)."""
    from paged_backend.worker.worker import Worker

    empty = torch.empty

    def slow_empty(*args, **kwargs):
        if threading.current_thread().name == "swap-space":
            time.sleep(0.05)
        return empty(*args, **kwargs)

    def failing_runners(*args, **kwargs) -> None:
        raise ValueError("a check after the cache was made")

    monkeypatch.setattr(torch, "empty", slow_empty)
    monkeypatch.setattr(Worker, "_make_runners", failing_runners)
    with pytest.raises(ValueError, match="a check after the cache was made"):
        tight_llm(tiny_model("llama"), tokenizer, "swap")
    assert not [t for t in threading.enumerate() if t.name == "swap-space"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and CUDA graphs need a GPU")
def test_the_swap_space_is_pinned_before_any_graph_is_captured(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_backend.worker.model_runner import ModelRunner

    seen: list[tuple[bool, bool]] = []
    capture = ModelRunner.capture_graphs

    def checked_capture(self) -> None:
        swapping = any(t.name == "swap-space" for t in threading.enumerate())
        seen.append((swapping, self.cache_engine.swap_space.caches()[0][0].is_pinned()))
        capture(self)

    monkeypatch.setattr(ModelRunner, "capture_graphs", checked_capture)
    model = copy.deepcopy(tiny_model("llama")).cuda()  # the shared model stays on the CPU
    LLM(model, tokenizer=tokenizer, block_size=BS, num_kv_blocks=16, max_model_len=48,
        swap_space=0.01, preemption_mode="swap")  # fmt: skip
    assert seen and seen[0] == (False, True)
