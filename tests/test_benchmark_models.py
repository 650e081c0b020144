"""``benchmarks/spec_verify.py``'s weights: every token decides the next by far more than bf16 rounds, so that a
replayed greedy continuation stays the model's under a verifying step's kernels as under a decode step's (on
normal(0, 0.02) weights of the 8B shape it left the path after 1.2 tokens a step)."""

from __future__ import annotations

import torch

import benchmarks.spec_verify as spec_verify


def test_decisive_weights_follow_their_permutation_by_a_wide_margin(monkeypatch) -> None:
    small = dict(spec_verify.SHAPES["8b"], hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4000)  # fmt: skip
    monkeypatch.setitem(spec_verify.SHAPES, "small", small)
    model = spec_verify.build("small", device="cpu")
    prompt = torch.randint(1, 4000, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
        logits = model(out).logits[0, -17:-1].float()
    top = logits.topk(2).values
    assert (top[:, 0] - top[:, 1]).min() > 50 * top[:, 0].abs().max() * 2**-8  # 50 bf16 roundings of the top
    order = torch.randperm(4000, generator=torch.Generator().manual_seed(0))
    follower = torch.empty_like(order)
    follower[order] = torch.arange(4000)  # the head row order[j] is embedding row t's for j = follower[t]
    tokens = out[0, 47:].tolist()
    assert all(follower[a].item() == b for a, b in zip(tokens, tokens[1:], strict=False))
