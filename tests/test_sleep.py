"""Sleep mode (vLLM's ``llm.sleep()`` / ``llm.wake_up()``): the KV cache's memory is given back and the weights
stay; requests are refused while asleep; after waking, greedy output equals HF ``generate`` again (no cached
prefix survives: its KV was freed)."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams
from tests.conftest import fresh_model, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = list(range(3, 40))  # fills cached blocks


@pytest.mark.parametrize("through_loop", [False, True])
def test_sleep_frees_the_cache_and_wake_up_restores_it(tokenizer, through_loop: bool) -> None:
    model = fresh_model(tokenizer)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=128)
    if through_loop:
        llm.engine_loop.call_sync(lambda engine: None)  # sleep and wake go between the loop's steps
    expected = hf_greedy(model, PROMPT, 8)
    assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    cache = llm.llm_engine.executor.model_runner.cache_engine
    llm.sleep()
    assert cache.released and all(t.untyped_storage().nbytes() == 0 for kv in cache.kv_caches for t in kv)
    with pytest.raises(Exception, match="asleep"):
        llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    llm.sleep()  # asleep already: nothing to do
    llm.wake_up()
    assert not cache.released
    cached_before = llm.stats()["num_prompt_tokens_cached"]
    assert llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert llm.stats()["num_prompt_tokens_cached"] == cached_before  # the freed KV was not reused


def test_only_an_idle_engine_sleeps_and_only_at_level_1(tokenizer) -> None:
    llm = LLM(fresh_model(tokenizer), tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=128)
    llm.llm_engine.add_request("r", {"prompt_token_ids": PROMPT}, GREEDY)
    with pytest.raises(RuntimeError, match="requests in flight"):
        llm.sleep()
    llm.llm_engine.abort_request("r")
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=2)
    llm.sleep()
    llm.wake_up()
