"""TRL's ``GRPOTrainer`` generating its rollouts on the engine: the policy's ``generate`` is patched
(``paged_backend.patch``), TRL calls it on the model it trains, and each step's rollouts come from that step's
weights — the engine reads the parameters the optimizer updates in place."""

from __future__ import annotations

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import paged_backend  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from tests.conftest import fresh_model  # noqa: E402


def test_grpo_rollouts_run_on_the_engine_with_each_steps_weights(tmp_path) -> None:
    tokenizer = build_tiny_tokenizer()  # its own: TRL pads on the left
    tokenizer.padding_side = "left"
    model = fresh_model(tokenizer)
    handle = paged_backend.patch(model, tokenizer, fallback="error", device="cpu", block_size=4, max_model_len=128)
    patched = model.generate
    calls: list[bool] = []

    def checked_generate(*args, **kwargs):  # type: ignore[no-untyped-def]
        """TRL's sampled rollouts on the engine; beside them, the same prompts greedy on the engine and on HF's
        own generate: equal only if the engine reads the weights of this moment."""
        out = patched(*args, **kwargs)
        config = copy.deepcopy(kwargs["generation_config"])
        config.do_sample = False
        inputs = {"input_ids": kwargs["input_ids"], "attention_mask": kwargs["attention_mask"]}
        calls.append(
            torch.equal(
                patched(**inputs, generation_config=config), handle.original(**inputs, generation_config=config)
            )
        )
        return out

    model.generate = checked_generate  # what TRL calls on the model it unwraps
    before = [p.detach().clone() for p in model.parameters()]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=3, learning_rate=3e-2, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, bf16=False,
    )  # fmt: skip
    # Prompts of several KV blocks, repeated every step: the prefix cache holds them from the step before, under
    # the weights of then, which the engine must not reuse.
    prompts = ["The paged cache keeps the prompt in blocks", "Paged attention reads blocks of keys and values"]
    dataset = datasets.Dataset.from_dict({"prompt": prompts * 6})
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    assert len(calls) == 3 and all(calls), calls  # every step generated on the engine, from its own weights
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the steps changed them
    assert handle.engine.stats()["num_generated_tokens"] > 0
    paged_backend.unpatch(model)
