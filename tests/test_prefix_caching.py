"""Prefix caching in the engine: cached blocks are reused, their prefill skipped, and greedy output still equals
HF ``generate`` token for token (on, off, under preemption and eviction, across turns)."""

from __future__ import annotations

import random

import pytest

from paged_backend import LLM, SamplingParams
from tests.conftest import EOS, assert_idle, hf_greedy, tiny_model

BS = 4
PREFIX = [7 + i for i in range(3 * BS)]  # three full blocks shared by every prompt below


def prompts_with_prefix(num: int, seed: int = 0) -> list[list[int]]:
    """PREFIX + a suffix whose first token differs from every other prompt's, so each shares exactly PREFIX."""
    rng = random.Random(seed)
    return [PREFIX + [100 + i] + [rng.randrange(3, 500) for _ in range(rng.randint(0, 9))] for i in range(num)]


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_is_reused_and_output_unchanged(tokenizer, arch: str) -> None:
    """The first prompt fills the cache; the next five each reuse PREFIX's three blocks. Greedy output equals HF
    and the engine with caching off; the hit rate is exactly the reused prompt tokens over all prompt tokens."""
    model = tiny_model(arch)
    prompts = prompts_with_prefix(6)
    results = {}
    for caching in (True, False):
        llm = LLM(model, tokenizer=tokenizer, block_size=BS, num_kv_blocks=128, enable_prefix_caching=caching)
        results[caching] = generate(llm, prompts[:1], 8) + generate(llm, prompts[1:], 8)
        stats = llm.stats()
        total = sum(map(len, prompts))
        assert stats["prefix_cache_hit_rate"] == pytest.approx(5 * len(PREFIX) / total if caching else 0.0)
        assert (stats["num_cached_blocks"] > 0) == caching
        assert_idle(llm)
    assert results[True] == results[False]
    for prompt, out in zip(prompts, results[True]):
        assert out == hf_greedy(model, prompt, 8)


def test_prefix_cache_under_preemption_and_eviction(tokenizer) -> None:
    """A cache too small for the batch: sequences are preempted and cached blocks evicted while others reuse
    them; output still equals HF and every block comes back."""
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, block_size=BS, num_kv_blocks=16, max_num_batched_tokens=8, max_model_len=48)
    prompts = prompts_with_prefix(8, seed=1)
    outs = generate(llm, prompts, 12)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(model, prompt, 12)
    assert_idle(llm)


def test_next_turn_reuses_the_generated_blocks(tokenizer) -> None:
    """A follow-up prompt made of the first turn's prompt and answer reuses every block the first turn filled,
    generated tokens included (multi-step decoding registers them too)."""
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, block_size=BS, num_kv_blocks=128)
    first = prompts_with_prefix(1)[0]
    answer = generate(llm, [first], 12)[0]
    assert len(answer) == 12 and EOS not in answer  # a full-length answer, so the arithmetic below holds
    follow_up = first + answer + [123, 45]
    before = llm.llm_engine.scheduler.num_prompt_tokens_cached
    assert generate(llm, [follow_up], 6)[0] == hf_greedy(model, follow_up, 6)
    # The first turn computed its prompt and all but its last sampled token; full blocks of those are cached.
    computed = len(first) + len(answer) - 1
    assert llm.llm_engine.scheduler.num_prompt_tokens_cached - before == computed // BS * BS
    assert_idle(llm)
