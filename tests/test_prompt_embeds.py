"""Prompts given as embeddings (vLLM's ``{"prompt_embeds": tensor}`` with ``enable_prompt_embeds=True``): greedy
output equals HF ``generate(inputs_embeds=...)``, beside token prompts, under chunked prefill and preemption, and
the placeholder ids such a prompt holds never reach the prefix cache or the sampler's penalties."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import assert_idle, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def embeddings(model: torch.nn.Module, prompt: list[int], seed: int) -> torch.Tensor:
    """The prompt's token embeddings, moved off the vocabulary a little (no token has them)."""
    weight = model.get_input_embeddings().weight.detach()
    noise = torch.randn(len(prompt), weight.shape[1], generator=torch.Generator().manual_seed(seed))
    return weight[prompt] + 0.05 * noise


def hf_greedy(model: torch.nn.Module, embeds: torch.Tensor, max_new_tokens: int = 24) -> list[int]:
    mask = torch.ones(1, embeds.shape[0], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            inputs_embeds=embeds[None],
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0].tolist()


@pytest.mark.parametrize(
    "arch,engine_kwargs",
    [
        ("llama", {}),
        ("gpt2", {}),
        ("qwen2", {}),
        ("llama", {"max_num_batched_tokens": 4, "max_num_seqs": 4}),  # prompts split into chunks
        (
            "llama",
            {"num_kv_blocks": 12, "preemption_mode": "recompute", "max_model_len": 40},
        ),  # prefilled again after preemption
    ],
    ids=["llama", "gpt2", "qwen2", "chunked", "preempted"],
)
def test_embedding_prompts_equal_hf(arch: str, engine_kwargs: dict) -> None:
    model = tiny_model(arch)
    llm = LLM(model, enable_prompt_embeds=True, block_size=4, **{"max_model_len": 64, **engine_kwargs})
    embeds = [embeddings(model, p, i) for i, p in enumerate(PROMPTS)]
    prompts = [{"prompt_embeds": e} for e in embeds] + [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, e in zip(outs, embeds):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, e)
        assert out.prompt_token_ids == []
    for out, p in zip(outs[len(PROMPTS) :], PROMPTS):
        assert out.prompt_token_ids == p
        assert list(out.outputs[0].token_ids) == hf_greedy(model, model.get_input_embeddings().weight.detach()[p])
    if "num_kv_blocks" in engine_kwargs:
        assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)


def test_placeholder_ids_stay_out_of_the_prefix_cache_and_penalties() -> None:
    """An embedding prompt holds placeholder ids (zeros): a token prompt of zeros after it finds nothing cached,
    and neither a repetition penalty nor a logits processor sees them as the prompt's tokens."""
    model = tiny_model("llama")
    llm = LLM(model, enable_prompt_embeds=True, block_size=4, max_model_len=64)
    embeds = embeddings(model, [0] * 9, 0)
    llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    zeros = {"prompt_token_ids": [0] * 9}
    (out,) = llm.generate(zeros, GREEDY, use_tqdm=False)
    assert llm.stats()["num_prompt_tokens_cached"] == 0
    assert list(out.outputs[0].token_ids) == hf_greedy(model, model.get_input_embeddings().weight.detach()[[0] * 9])
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)
    (out,) = llm.generate({"prompt_embeds": embeds}, penalised, use_tqdm=False)
    with torch.no_grad():  # HF's input_ids hold only the new tokens: its penalty sees those
        hf = model.generate(
            inputs_embeds=embeds[None],
            attention_mask=torch.ones(1, 9, dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert list(out.outputs[0].token_ids) == hf[0].tolist()
    seen: list[list[int]] = []

    def record(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(prompt)
        return logits

    recorded = SamplingParams(temperature=0, max_tokens=2, logits_processors=[record])
    llm.generate({"prompt_embeds": embeds}, recorded, use_tqdm=False)
    assert seen == [[], []]


def test_bad_embedding_prompts_are_named(tokenizer) -> None:
    model = tiny_model("llama")
    hidden = model.config.hidden_size
    with pytest.raises(ValueError, match=r"prompt_embeds need LLM\(\.\.\., enable_prompt_embeds=True\)"):
        LLM(model, max_model_len=64).generate({"prompt_embeds": torch.zeros(3, hidden)}, GREEDY, use_tqdm=False)
    llm = LLM(model, enable_prompt_embeds=True, max_model_len=64)
    for bad in (torch.zeros(3, hidden + 1), torch.zeros(0, hidden), torch.zeros(3, hidden, dtype=torch.long)):
        with pytest.raises(ValueError, match="prompt_embeds must"):
            llm.generate({"prompt_embeds": bad}, GREEDY, use_tqdm=False)
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
    with pytest.raises(ValueError, match="prompt_logprobs need the prompt's tokens"):
        llm.generate({"prompt_embeds": torch.zeros(3, hidden)}, scored, use_tqdm=False)
    from paged_backend import StructuredOutputsParams

    gated = LLM(model, tokenizer=tokenizer, enable_prompt_embeds=True, reasoning_parser="qwen3", max_model_len=64)
    regex = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="prompt_embeds cannot take structured_outputs under a reasoning_parser"):
        gated.generate({"prompt_embeds": torch.zeros(3, hidden)}, regex, use_tqdm=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds needs tensor_parallel_size=1"):
        LLM(model, enable_prompt_embeds=True, tensor_parallel_size=2)
    assert_idle(llm)
