"""Live training weights: the engine runs the user's parameters in place, so after ``optimizer.step()`` the next
``generate`` uses the new weights (with the layers compiled and sibling projections packed, as on a GPU) and
equals HF ``generate`` on the updated model; a parameter replaced instead of updated stops the next step with an
error naming it."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams
from tests.conftest import capturing_backend, fresh_model, hf_greedy, ragged_prompts
from tests.fixtures.tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def compiled_llm(model, tokenizer) -> LLM:
    """The engine with its decoder layers compiled and q/k/v, gate/up packed (dynamo only, so it runs here)."""
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128)
    runner = llm.llm_engine.executor.model_runner
    runner.compile(capturing_backend([]))
    assert runner.regions is not None and runner.regions.num_fused_groups > 0
    return llm


def train_step(model, optimizer, seed: int) -> None:
    """One AdamW step of language modelling on a random batch (in place, as trainers do)."""
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randint(3, model.config.vocab_size, (4, 12), generator=generator)
    model.train()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("fused", [False, True])  # a fused step bumps no version counter: the step hook sees it
def test_generate_follows_each_optimizer_step(tokenizer, fused: bool) -> None:
    model = fresh_model(tokenizer)
    llm = compiled_llm(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, fused=fused)
    prompts = [*ragged_prompts(4, seed=3), list(range(3, 40))]  # the last fills cached blocks
    previous = None
    for step in range(3):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        tokens = [out.outputs[0].token_ids for out in outs]
        assert tokens == [hf_greedy(model, p, 8) for p in prompts], f"after {step} optimizer steps"
        assert tokens != previous  # the step changed the weights the engine reads
        previous = tokens
        train_step(model, optimizer, seed=step)


def test_a_replaced_parameter_is_an_error_naming_it(tokenizer) -> None:
    model = fresh_model(tokenizer)
    llm = compiled_llm(model, tokenizer)
    llm.generate({"prompt_token_ids": [1, 5, 9]}, GREEDY, use_tqdm=False)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new tensors: packed views and graphs would read the old ones
    with pytest.raises(Exception, match=r"parameter model\.\S+ was replaced .*assign=True"):
        llm.generate({"prompt_token_ids": [1, 5, 9]}, GREEDY, use_tqdm=False)


def test_writes_through_data_need_reset_prefix_cache(tokenizer) -> None:
    """A write through ``.data`` leaves no trace in the tensor's version: the cached prefixes of the old weights
    would be reused until ``reset_prefix_cache()``."""
    model = fresh_model(tokenizer)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128)
    prompt = list(range(3, 40))  # fills cached blocks
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    with torch.no_grad():
        for param in model.parameters():
            param.data.mul_(1.5)
    llm.reset_prefix_cache()
    (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)
    assert llm.stats().get("num_prompt_tokens_cached", 0) == 0


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_logprobs_match_the_trainers_forward(tokenizer, mode: str) -> None:
    """An RL trainer scores the finished sequences with its own forward: each sampled token's reported logprob
    equals it (fp32 on CPU) — the model's own distribution by default (vLLM's "raw_logprobs"), or, with
    ``logprobs_mode="processed_logprobs"``, the tempered one the token was drawn from (as TRL divides its logits
    by the temperature)."""
    model = fresh_model(tokenizer)
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128, logprobs_mode=mode)
    prompts = ragged_prompts(4, seed=7)
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=10, logprobs=0)
    temperature = 1.0 if mode == "raw_logprobs" else 0.7
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        sample = out.outputs[0]
        ours = torch.tensor([entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(sample.token_ids)])).logits[0, len(prompt) - 1 : -1]
        theirs = torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(sample.token_ids)[:, None])
        torch.testing.assert_close(ours, theirs[:, 0], atol=1e-4, rtol=0)  # paged vs dense attention: ~2e-5
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(model, tokenizer=tokenizer, logprobs_mode="raw_logits")


def test_a_model_made_under_inference_mode_runs(tokenizer) -> None:
    """Its parameters are inference tensors, which keep no version counter: the in-place check skips them."""
    with torch.inference_mode():
        model = build_tiny_model("llama", vocab_size=len(tokenizer))
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=64, max_model_len=128)
    assert all(param.is_inference() for param in model.parameters())
    (out,) = llm.generate({"prompt_token_ids": [1, 5, 9]}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(model, [1, 5, 9], 8)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # GPT-2's dropout layers are live in train mode
def test_a_model_left_in_train_mode_generates_as_in_eval_mode(tokenizer, arch: str) -> None:
    """A trainer leaves its policy in train mode between steps: the engine's steps still run as inference (no
    dropout: HF ``generate``'s output in eval mode), the compiled layers are not traced again for the flag, and
    the model is left in train mode."""
    model = fresh_model(tokenizer, arch).eval()
    prompts = ragged_prompts(4, seed=5)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    graphs: list = []
    llm = LLM(model, tokenizer=tokenizer, block_size=4, num_kv_blocks=128, max_model_len=128)
    llm.llm_engine.executor.model_runner.compile(capturing_backend(graphs))
    traced = len(graphs)
    model.train()
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outs] == expected
    assert len(graphs) == traced
    assert all(m.training for m in model.modules())


def test_the_train_mode_switch_reaches_a_torchscript_module() -> None:
    """The step's eval mode reaches every module of a model left in train mode, a TorchScript one too (whose
    flag lives in the compiled module: set through its own ``__setattr__``, not the instance's ``__dict__``);
    on leaving, every flag is back."""
    from paged_backend.worker.attention import PagedAttentionSwitch

    model = build_tiny_model("llama", vocab_size=512)
    model.model.add_module("scripted", torch.jit.script(torch.nn.Dropout(0.5)))
    switch = PagedAttentionSwitch(model, kv_caches=[])
    model.train()
    ones = torch.ones(1000)
    assert bool((model.model.scripted(ones) == 0).any())  # dropout live in train mode
    with switch:
        assert not any(m.training for m in model.modules())
        assert torch.equal(model.model.scripted(ones), ones)
    assert all(m.training for m in model.modules())


def test_weight_updates_sees_in_place_writes_optimizer_steps_and_replaced_parameters(tokenizer) -> None:
    """The engine's watch over the weights (engine/weight_updates.py) lists the parameters once, so a parameter
    registered later on one of the model's modules must still count, and one on another model must not."""
    from paged_backend.engine.weight_updates import WeightUpdates

    model, other = fresh_model(tokenizer), fresh_model(tokenizer)
    watch = WeightUpdates(model)
    assert not watch.changed()
    other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())
    assert not watch.changed()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert watch.changed() and not watch.changed()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new tensors, their version counters fresh
    assert watch.changed() and not watch.changed()
    with torch.no_grad():  # the new tensors are the ones watched now
        model.lm_head.weight.mul_(2.0)
    assert watch.changed()
    torch.optim.AdamW(model.parameters(), fused=False).step()  # no gradients: the step writes nothing
    assert watch.changed() and not watch.changed()
