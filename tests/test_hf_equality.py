"""Greedy output equals HF ``model.generate`` token for token, per prompt, across architectures."""

from __future__ import annotations

import pytest

from paged_backend import LLM, SamplingParams
from tests.conftest import EOS, assert_idle, before_each_step, hf_greedy, ragged_prompts, tiny_model
from tests.fixtures.tiny_models import TINY_CONFIGS

ARCHS = sorted(TINY_CONFIGS)
MAX_TOKENS = [5, 12, 9, 16, 3, 10, 7, 14]


def _check(llm: LLM, model, prompts: list[list[int]]) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS[: len(prompts)]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, max_tokens, output in zip(prompts, MAX_TOKENS, outputs):
        expected = hf_greedy(model, prompt, max_tokens)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert output.outputs[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert_idle(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch: str, tokenizer) -> None:
    model = tiny_model(arch)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256)
    _check(llm, model, ragged_prompts(4, seed=1))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_with_preemption_and_chunked_prefill(arch: str, tokenizer) -> None:
    model = tiny_model(arch)
    llm = LLM(
        model,
        tokenizer=tokenizer,
        block_size=4,
        num_kv_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=6,
        num_scheduler_steps=1,  # one scheduling round per token, so decodes run out of blocks and preempt
    )
    _check(llm, model, ragged_prompts(4, seed=2))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_chunked_prefill_steps"] > 0, stats


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_hf_with_capped_prefill_chunks(arch: str, tokenizer) -> None:
    """long_prefill_token_threshold: every prompt goes in chunks of at most 3 tokens beside the decodes."""
    model = tiny_model(arch)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=256, long_prefill_token_threshold=3)
    _check(llm, model, ragged_prompts(4, seed=6))
    assert llm.stats()["num_chunked_prefill_steps"] > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "qwen2"])
def test_greedy_matches_hf_with_multi_step_decoding(arch: str, tokenizer, monkeypatch) -> None:
    """Decode steps run 8 at a time on the device: sequences that finish (EOS, max_tokens, max_model_len) in
    the middle of a run drop the rest, and sequences that cannot get blocks for 8 more tokens take one step."""
    model = tiny_model(arch)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=24, max_model_len=40, num_scheduler_steps=8)
    engine = llm.llm_engine
    runs = []

    def record_rounds(scheduler_output):
        if scheduler_output.batch.num_steps is not None:
            runs.append(scheduler_output.batch.num_steps)

    before_each_step(engine.executor, record_rounds, monkeypatch)
    prompts = ragged_prompts(4, seed=5)
    max_tokens = [3, 9, 17, 30, 5, 12, 20, 25]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens],
        use_tqdm=False,
    )
    for prompt, n, out in zip(prompts, max_tokens, outs):
        expected = hf_greedy(model, prompt, min(n, 40 - len(prompt)))
        assert out.outputs[0].token_ids == expected
    assert any(max(n) == 8 for n in runs) and any(min(n) < max(n) for n in runs)
    assert_idle(llm)


def test_block_size_16_several_blocks(tokenizer) -> None:
    model = tiny_model("llama")
    llm = LLM(model, tokenizer=tokenizer, block_size=16, num_kv_blocks=64)
    _check(llm, model, ragged_prompts(16, seed=3))


def test_multi_step_equals_single_step_with_stops(tokenizer) -> None:
    """Stop tokens, stop strings and max_model_len reached in the middle of a multi-step round give the same
    tokens, text and finish reasons as one step per round."""
    model = tiny_model("llama")
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=7)]

    def generate(num_scheduler_steps: int, params: list[SamplingParams]):
        llm = LLM(
            model,
            tokenizer=tokenizer,
            block_size=4,
            num_kv_blocks=80,
            max_model_len=40,
            num_scheduler_steps=num_scheduler_steps,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        return [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs
        ]

    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in prompts]
    reference = generate(1, plain)
    stop_token = reference[0][0][6]
    stop_string = reference[1][1][5:8]
    params = list(plain)
    params[0] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])
    params[1] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_string])
    params[2] = SamplingParams(temperature=0, max_tokens=38, ignore_eos=True)  # a 4-token prompt: hits max_model_len
    single, multi = generate(1, params), generate(8, params)
    assert multi == single
    assert single[0][2:] == ("stop", stop_token) and single[1][2:] == ("stop", stop_string)
    assert single[2][2] == "length" and len(single[2][0]) == 36
