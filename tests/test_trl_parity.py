"""TRL's ``GRPOTrainer`` on the engine through TRL's vLLM path (``paged_backend.integrations.trl``): with parity on
(``batch_invariant=True``), TRL's importance-sampling correction compares the engine's sampled logprobs with the
trainer's own and finds them equal, a ratio of exactly 1.0 for every token; without parity they differ."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from paged_backend.integrations.trl import use_paged_backend  # noqa: E402
from tests.conftest import fresh_model  # noqa: E402

# prompts of different lengths: TRL pads the shorter ones on the left
PROMPTS = ["The paged cache keeps the prompt", "Paged attention reads blocks of keys and values"]


def grpo_ratios(tmp_path, batch_invariant: bool, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """Two GRPO steps with the engine as TRL's generation backend, the policy in ``dtype``; what each step's
    scoring handed the loss."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.padding_side = "left"
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=2, learning_rate=3e-2, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
        vllm_importance_sampling_mode="token_truncate", logging_steps=1,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=fresh_model(tokenizer).to(dtype),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 4}),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="logprobs_mode: TRL's correction needs 'processed_logprobs'"):
        use_paged_backend(trainer, logprobs_mode="raw_logprobs")
    llm = use_paged_backend(trainer, batch_invariant=batch_invariant, block_size=4, max_model_len=64)
    scored: list[dict[str, torch.Tensor]] = []
    score = trainer._generate_and_score_completions

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = score(*args, **kwargs)
        scored.append(out)
        return out

    trainer._generate_and_score_completions = recorded
    trainer.train()
    assert llm.stats()["num_generated_tokens"] > 0
    llm.shutdown()
    return scored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grpo_importance_ratio_is_exactly_one_under_parity(tmp_path, dtype: torch.dtype) -> None:
    steps = grpo_ratios(tmp_path, batch_invariant=True, dtype=dtype)
    assert len(steps) == 2
    for out in steps:
        mask = out["completion_mask"].bool()
        assert bool(mask.any()) and bool((out["prompt_mask"] == 0).any())  # some left padding was dropped
        assert torch.equal(out["old_per_token_logps"][mask], out["sampling_per_token_logps"][mask])
        assert bool((out["importance_sampling_ratio"][mask] == 1.0).all())


def test_without_parity_the_ratio_is_not_exactly_one(tmp_path) -> None:
    """The same run on the default engine, the trainer on TRL's own fused LM head: close, not equal (fp32: within
    about 1e-5 of 1)."""
    steps = grpo_ratios(tmp_path, batch_invariant=False)
    ratios = torch.cat([out["importance_sampling_ratio"][out["completion_mask"].bool()] for out in steps])
    assert bool((ratios != 1.0).any())
    assert float((ratios - 1).abs().max()) < 1e-3
