"""A prompt's first tokens given as keys and values (``{"prompt_token_ids": ..., "prompt_kv": ...}``: HF's
``past_key_values``, imported into the request's blocks, not recomputed): greedy output equals HF ``generate``
continuing from the same cache — also a cache that is not what the model computes, under chunked prefill and
preemption by recompute (which imports it again); its blocks never enter the prefix cache; bad values fail."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import EOS, assert_idle, ragged_prompts, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10)


def hf_cache_of(model, tokens: list[int], scale: float = 1.0):
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    for layer in cache.layers:
        layer.values.mul_(scale)
    return cache


def as_prompt_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


def hf_continuation(model, prompt: list[int], cache, max_new_tokens: int = 10) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            past_key_values=copy.deepcopy(cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=EOS,
        )
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}, {"num_kv_blocks": 24}],
    ids=["plain", "chunked", "preempted"],
)
def test_greedy_equals_hf_continuing_from_the_cache(arch: str, engine: dict, tokenizer) -> None:
    model = tiny_model(arch)
    prompts = [p for p in ragged_prompts(4, seed=8) if len(p) > 3]
    caches = [hf_cache_of(model, p[: len(p) // 2 + 1], scale=1.0 + (i % 2)) for i, p in enumerate(prompts)]
    llm = LLM(model, tokenizer=tokenizer, **{"block_size": 4, "num_kv_blocks": 128, "max_model_len": 64, **engine})
    outputs = llm.generate(
        [{"prompt_token_ids": p, "prompt_kv": as_prompt_kv(c)} for p, c in zip(prompts, caches)], GREEDY, use_tqdm=False
    )
    for prompt, cache, output in zip(prompts, caches, outputs):
        assert output.outputs[0].token_ids == hf_continuation(model, prompt, cache)
    if "num_kv_blocks" in engine:
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["num_cached_blocks"] == 0  # brought KV never enters the prefix cache
    assert_idle(llm)


def test_bad_prompt_kv_fails_naming_it(tokenizer) -> None:
    model = tiny_model("llama")
    prompt = ragged_prompts(4, seed=8)[4]
    kv = as_prompt_kv(hf_cache_of(model, prompt[:5]))
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=64)
    cases = [
        ({"prompt_token_ids": prompt, "prompt_kv": kv[:1]}, "prompt_kv must be 2 .keys, values. pairs"),
        ({"prompt_token_ids": prompt, "prompt_kv": [(k[:, :1], v) for k, v in kv]}, "tensors \\[tokens, 2, 16\\]"),
        ({"prompt_token_ids": prompt[:5], "prompt_kv": kv}, "must cover 1 to 4 of the prompt's 5 tokens"),
        ({"prompt": "a b c d e f g", "prompt_kv": kv}, "prompt_kv goes with prompt_token_ids"),
    ]
    for prompt_dict, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_request("r", prompt_dict, GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs need the logits"):
        llm.llm_engine.add_request(
            "r", {"prompt_token_ids": prompt, "prompt_kv": kv}, SamplingParams(prompt_logprobs=1)
        )
    assert not llm.llm_engine.has_unfinished_requests()
