"""A verifying step's inputs in the shape its CUDA graphs were captured for: every row ``q_len`` tokens.

Speculative decoding's rows have 1 + d tokens (d ≤ k proposals; a row without any is a plain decode of one).
A graph is captured for rows of exactly k + 1 tokens, so each row is padded at its end: pad tokens write no KV
(slot -1), and the row's context counts them, so its real tokens keep their positions (the attention places a
row's i-th query at ``context - q_len + i``) and, causal, never see a pad. Every position's logits come back;
``keep`` picks the ones the step asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from paged_backend.worker.step_inputs import StepInputs


def pad_rows(
    inputs: StepInputs, q_len: int, block_size: int, max_blocks: int
) -> tuple[StepInputs, torch.Tensor] | None:
    """``inputs`` with every row padded to ``q_len`` tokens, and the padded logits rows that are the original
    ``logits_indices``; None when a row is longer than ``q_len`` (a prefill chunk) or its pads would reach past
    ``max_blocks`` blocks (the graphs' block tables)."""
    cu = inputs.cu_seqlens_q.numpy().astype(np.int64)
    lens = np.diff(cu)  # [B]
    if lens.max(initial=0) > q_len:
        return None
    num_seqs = len(lens)
    context = inputs.context_lens.numpy().astype(np.int64) + (q_len - lens)  # [B]
    if num_seqs and (int(context.max()) - 1) // block_size >= max_blocks:
        return None
    owner = np.repeat(np.arange(num_seqs), lens)  # [T] the row of each real token
    offset = np.arange(int(cu[-1])) - cu[owner]  # [T] its place in the row
    flat = owner * q_len + offset  # [T] where it goes in the padded layout
    total = num_seqs * q_len
    ids = np.zeros(total, dtype=np.int64)
    ids[flat] = inputs.input_ids.numpy()
    slots = np.full(total, -1, dtype=np.int64)
    slots[flat] = inputs.slot_mapping.numpy()
    # positions: the real tokens' own, each pad the row's last (a model with learned positions has no row past
    # the context's end)
    first = inputs.positions.numpy()[cu[:-1].clip(max=max(int(cu[-1]) - 1, 0))] if num_seqs else np.zeros(0)
    steps = np.minimum(np.arange(q_len)[None, :], (lens - 1)[:, None])  # [B, q_len]
    positions = (first[:, None] + steps).reshape(-1)
    keep = torch.from_numpy(flat[inputs.logits_indices.numpy()])
    padded = StepInputs(
        input_ids=torch.from_numpy(ids),
        positions=torch.from_numpy(positions.astype(np.int64)),
        slot_mapping=torch.from_numpy(slots),
        block_tables=inputs.block_tables,
        cu_seqlens_q=torch.arange(0, total + 1, q_len, dtype=torch.int32),
        context_lens=torch.from_numpy(context),
        logits_indices=torch.arange(total),
    )
    return padded, keep
