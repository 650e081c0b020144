"""``SamplingParams(prompt_logprobs=k)``: every prompt token's log probability under the model given the tokens
before it (with its rank and the top k), equal to HF's own forward — under chunked prefill, preemption, prefix
cache hits and several samples — and ``max_tokens=0`` scores without generating."""

from __future__ import annotations

import pickle

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import assert_idle, hf_greedy, tiny_model

MODEL = "llama"


def hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """[L - 1, V]: log_softmax of HF's logits at positions 0 .. L - 2 (each predicts the next prompt token)."""
    with torch.no_grad():
        logits = tiny_model(MODEL)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(out, prompt: list[int], k: int) -> None:
    expected = hf_prompt_logprobs(prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        row, token = expected[i], prompt[i + 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}
        for tid in top:
            assert entry[tid].logprob == pytest.approx(row[tid].item(), abs=1e-4)


PROMPTS = [[5 + (i * 11 + j * 7) % 400 for j in range(n)] for i, n in enumerate([2, 9, 23, 40])]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 8, "max_num_seqs": 8},  # prompts prefill in chunks of 8 tokens or fewer
        {"num_kv_blocks": 16, "max_num_batched_tokens": 8},  # preempted, some mid-prefill: prefilled again
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_hf(tokenizer, engine_kwargs) -> None:
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        check(out, prompt, 3)
        expected = hf_greedy(tiny_model(MODEL), prompt, 20)  # the sampled tokens are untouched
        assert out.outputs[0].token_ids[: len(expected)] == expected
    if "num_kv_blocks" in engine_kwargs:
        assert llm.stats()["num_preemptions"] > 0
    if "max_num_batched_tokens" in engine_kwargs:
        assert llm.stats()["num_chunked_prefill_steps"] > 0
    assert_idle(llm)


def test_a_cached_prefix_still_gets_its_logprobs(tokenizer) -> None:
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64)
    prompt = PROMPTS[3]
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)  # caches its blocks
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    check(out, prompt, 0)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])  # k=0: the actual token alone


def test_max_tokens_0_scores_without_generating(tokenizer) -> None:
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1, n=2, temperature=1.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        check(out, prompt, 1)
        assert [c.token_ids for c in out.outputs] == [[], []] and {c.finish_reason for c in out.outputs} == {"length"}
    assert_idle(llm)
    with pytest.raises(ValueError, match="max_tokens must be an integer in \\[1, "):
        SamplingParams(max_tokens=0)


def test_decoded_tokens_and_streamed_outputs(tokenizer) -> None:
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=3, prompt_logprobs=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert all(out.prompt_logprobs is outputs[-1].prompt_logprobs for out in outputs)  # built once
    entry = outputs[-1].prompt_logprobs[1]
    token = PROMPTS[2][1]
    assert entry[token].decoded_token == tokenizer.decode([token])


def test_prompt_logprobs_read_as_a_list(tokenizer) -> None:
    """The arrays behind ``prompt_logprobs`` read as vLLM's list: indexing (negative too), slices, iteration,
    equality with the list it stands for, pickling (with decoded tokens)."""
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64)
    prompt = PROMPTS[2]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)
    entries = out.prompt_logprobs
    assert entries is not None
    as_list = list(entries)
    assert len(as_list) == len(entries) == len(prompt) and as_list[0] is None
    assert entries == as_list and entries[:] == as_list and entries[-1] == as_list[-1] and entries[1:3] == as_list[1:3]
    assert entries[-len(prompt)] is None
    with pytest.raises(IndexError, match="prompt_logprobs index"):
        entries[len(prompt)]
    restored = pickle.loads(pickle.dumps(entries))
    assert restored == as_list and restored[1][prompt[1]].decoded_token == tokenizer.decode([prompt[1]])


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_a_one_token_prompt_has_only_the_first_entry(tokenizer, max_tokens: int) -> None:
    llm = LLM(tiny_model(MODEL), tokenizer=tokenizer, block_size=4, max_model_len=64)
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=2, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [7]}, params, use_tqdm=False)
    assert out.prompt_logprobs == [None] and len(out.outputs[0].token_ids) == max_tokens
    assert_idle(llm)
