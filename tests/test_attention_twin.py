"""The torch twin of paged attention (kernels/attention_twin.py) against attention written out one sequence at a
time, and the CPU engine's reuse of a step's plan across its layers."""

from __future__ import annotations

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import attention_twin, ops
from paged_backend.kernels.attention_twin import paged_attention_torch, twin_plan
from tests.fixtures.tiny_models import build_tiny_model
from tests.test_kernels import make_batch

Q_LENS = [1, 33, 7, 1, 16, 1]  # decodes, a fresh prompt, chunks over a cached prefix
PREFIX = [40, 0, 9, 15, 16, 3]


def dense_attention(batch: dict, scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Each sequence's context read through its block table, token by token, then plain softmax attention."""
    query, k_cache, v_cache = batch["query"].float(), batch["k_cache"].float(), batch["v_cache"].float()
    block_size, per_kv = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = torch.empty_like(query)
    starts = batch["cu_seqlens_q"].tolist()
    for i, ctx in enumerate(batch["context_lens"].tolist()):
        table = batch["block_tables"][i].tolist()
        keys = torch.stack([k_cache[table[p // block_size], p % block_size] for p in range(ctx)])  # [C, Hkv, D]
        values = torch.stack([v_cache[table[p // block_size], p % block_size] for p in range(ctx)])
        keys, values = keys.repeat_interleave(per_kv, 1), values.repeat_interleave(per_kv, 1)  # [C, H, D]
        q = query[starts[i] : starts[i + 1]]  # [Q, H, D]
        scores = torch.einsum("qhd,chd->hqc", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q.shape[0], ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqc,chd->qhd", probs, values)
    return out


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (5, None), (None, 7.5), (17, 20.0)])
def test_the_twin_equals_attention_written_out(sliding_window: int | None, softcap: float | None) -> None:
    batch = make_batch(Q_LENS, PREFIX, 8, 2, 64, torch.float32, 16, seed=3)
    batch = {k: v.cpu() for k, v in batch.items()}
    scale = 64**-0.5
    ref = dense_attention(batch, scale, sliding_window, softcap)
    out = paged_attention_torch(**batch, scale=scale, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plan = twin_plan(batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], 16, sliding_window)
    reused = paged_attention_torch(**batch, scale=scale, sliding_window=sliding_window, softcap=softcap, plan=plan)
    assert torch.equal(reused, out)
    other = twin_plan(batch["block_tables"], batch["cu_seqlens_q"], batch["context_lens"], 16, 2)  # a given plan
    with_other = paged_attention_torch(**batch, scale=scale, sliding_window=sliding_window, softcap=softcap, plan=other)
    assert not torch.allclose(with_other, out)  # is the one used, whatever the window argument says


def test_the_cpu_engine_plans_once_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a step reads the same plan: one ``twin_plan`` a step (one window here), not one a layer."""
    calls, steps = [0], []  # each step's plans, kept alive so that no two steps' share an id
    plan, attend = ops.twin_plan, ops.paged_attention

    def counted_plan(*args: object) -> object:
        calls[0] += 1
        return plan(*args)  # type: ignore[arg-type]

    def seen_attention(*args: object, **kwargs: object) -> torch.Tensor:
        if not any(kwargs["twin_plans"] is seen for seen in steps):
            steps.append(kwargs["twin_plans"])
        return attend(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "twin_plan", counted_plan)
    monkeypatch.setattr(attention_twin, "twin_plan", counted_plan)  # a plan the twin would make itself counts too
    monkeypatch.setattr("paged_backend.worker.attention.paged_attention", seen_attention)
    model = build_tiny_model("llama", num_hidden_layers=3)
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_model_len=64)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 9)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(steps) >= 6 and calls[0] == len(steps)
