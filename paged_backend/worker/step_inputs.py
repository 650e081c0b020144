"""One step's flattened inputs, built on the host, and the padding that keeps shapes inside CUDA-graph buckets.

A padding sequence has one token at slot -1 (nothing is written) and a context of 0 (nothing is read), so its
output row is zeros and it changes no real sequence's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from paged_backend.core.scheduler_output import ScheduledBatch, SchedulerOutput
from paged_backend.worker.attention import AttentionMetadata


def queued_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued without waiting for the device (from pinned memory on a GPU)."""
    return (tensor.pin_memory() if device.type == "cuda" else tensor).to(device, non_blocking=True)


@dataclass
class StepInputs:
    """Host tensors of one step (``int64`` except where noted)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T], -1 = padding
    block_tables: torch.Tensor  # [B, W] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [N] rows of the sequences that sample

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    def to(self, device: torch.device, exact: bool = False) -> DeviceInputs:
        def to(tensor: torch.Tensor) -> torch.Tensor:
            return queued_copy(tensor, device)

        metadata = AttentionMetadata(
            slot_mapping=to(self.slot_mapping),
            block_tables=to(self.block_tables),
            cu_seqlens_q=to(self.cu_seqlens_q),
            context_lens=to(self.context_lens),
            exact=exact,
            twin_plans={} if device.type == "cpu" else None,  # a step's own tensors: its plan holds for every layer
        )
        return DeviceInputs(to(self.input_ids), to(self.positions), metadata, to(self.logits_indices))


@dataclass
class DeviceInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N]


def build_step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    """Flatten the scheduled rows: positions, the cache slot of every new token, each row's context length."""
    num_new = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)  # [B]
    starts = np.asarray(batch.num_computed_tokens, dtype=np.int64)  # [B]
    cu = np.zeros(len(num_new) + 1, dtype=np.int64)
    np.cumsum(num_new, out=cu[1:])
    block_tables = block_table_array(batch.block_tables)  # [B, W]
    owner = np.repeat(np.arange(len(num_new)), num_new)  # [T]
    positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[owner] + starts[owner]  # [T]
    slot_mapping = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepInputs(
        input_ids=torch.tensor(batch.input_token_ids, dtype=torch.long),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        block_tables=torch.from_numpy(block_tables),
        cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
        context_lens=torch.from_numpy(starts + num_new),
        logits_indices=torch.from_numpy(_logits_indices(batch, cu)),
    )


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """The rows' block tables as one ``[B, W]`` int32 array, each padded with zeros to the longest."""
    array = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        array[i, : len(t)] = t
    return array


def _logits_indices(batch: ScheduledBatch, cu: np.ndarray) -> np.ndarray:
    """The flat rows whose logits the step returns: the prompt-logprob rows' positions first, then each sampling
    row's last token (a row with d proposed tokens: its last d + 1)."""
    sampling = cu[1:][np.asarray(batch.sampling_rows, dtype=np.int64)] - 1
    if batch.draft_token_ids is not None:
        ends, drafts = sampling, batch.draft_token_ids
        sampling = np.concatenate(
            [np.arange(end - len(drafts[row]), end + 1) for row, end in zip(batch.sampling_rows, ends)]
        ).astype(np.int64)
    if not batch.prompt_logprob_rows:
        return sampling
    prompt = [np.arange(cu[row], cu[row] + count) for row, count in batch.prompt_logprob_rows]
    return np.concatenate([*prompt, sampling]).astype(np.int64)


def pad_step_inputs(inputs: StepInputs, num_pad_seqs: int, min_logits: int = 0, min_width: int = 0) -> StepInputs:
    """Append ``num_pad_seqs`` padding sequences of one token; repeat the last logit row up to ``min_logits``
    rows (the caller keeps only the first N); widen the block tables with unused columns to ``min_width``."""
    tables = inputs.block_tables
    if tables.shape[1] < min_width:
        tables = torch.cat([tables, tables.new_zeros(tables.shape[0], min_width - tables.shape[1])], dim=1)
    if num_pad_seqs == 0 and inputs.logits_indices.shape[0] >= min_logits:
        return replace(inputs, block_tables=tables)
    t = inputs.num_tokens
    pad_tokens = torch.zeros(num_pad_seqs, dtype=torch.long)
    logits = inputs.logits_indices
    if logits.shape[0] < min_logits:
        last = logits[-1:] if logits.shape[0] else torch.tensor([t + num_pad_seqs - 1])
        logits = torch.cat([logits, last.expand(min_logits - logits.shape[0])])
    return replace(
        inputs,
        input_ids=torch.cat([inputs.input_ids, pad_tokens]),
        positions=torch.cat([inputs.positions, pad_tokens]),
        slot_mapping=torch.cat([inputs.slot_mapping, torch.full((num_pad_seqs,), -1, dtype=torch.long)]),
        block_tables=torch.cat([tables, tables.new_zeros(num_pad_seqs, tables.shape[1])]),
        cu_seqlens_q=torch.cat([inputs.cu_seqlens_q, torch.arange(t + 1, t + num_pad_seqs + 1, dtype=torch.int32)]),
        context_lens=torch.cat([inputs.context_lens, torch.zeros(num_pad_seqs, dtype=torch.long)]),
        logits_indices=logits,
    )


def advance_decode_inputs(inputs: StepInputs, k: int, num_steps: np.ndarray, block_size: int) -> StepInputs:
    """The inputs of the ``k``-th of several decode steps run back to back from ``inputs`` (step 0). Sequence
    ``i`` takes ``num_steps[i]`` of them; past that its row repeats its last step with slot -1 (nothing written)
    and its output is dropped. Input ids are left as they are: the runner feeds the previous step's sampled
    tokens on the device."""
    offset = torch.from_numpy(np.minimum(k, num_steps - 1))  # [B]
    positions = inputs.positions + offset
    tables = inputs.block_tables.numpy()
    pos = positions.numpy()
    slots = tables[np.arange(len(pos)), pos // block_size].astype(np.int64) * block_size + pos % block_size
    slots[k >= num_steps] = -1
    return replace(
        inputs,
        positions=positions,
        slot_mapping=torch.from_numpy(slots),
        context_lens=inputs.context_lens + offset,
    )


def round_steps(inputs: StepInputs, num_steps: list[int], block_size: int, pin: bool) -> list[StepInputs]:
    """The inputs of a multi-step round's ``max(num_steps)`` forwards: ``inputs`` (step 0), then each later
    step's (``advance_decode_inputs``). ``pin``: the tables in pinned memory, so that every step's copy of them
    is queued, not waited for."""
    if pin:
        inputs = replace(inputs, block_tables=inputs.block_tables.pin_memory())
    per_row = np.asarray(num_steps, dtype=np.int64)
    return [inputs] + [advance_decode_inputs(inputs, k, per_row, block_size) for k in range(1, max(num_steps))]


EmbedsPieces = Sequence[tuple[int, torch.Tensor]]  # (flat token offset, [n, hidden] embeddings) of a step


def prompt_embeds_pieces(scheduler_output: SchedulerOutput) -> list[tuple[int, torch.Tensor]]:
    """Where the step's tokens come from prompt embeddings: each row's scheduled positions that fall inside its
    request's ``prompt_embeds``, as (offset in the flattened batch, their embeddings)."""
    batch, pieces, offset = scheduler_output.batch, [], 0
    for row, seq in enumerate(scheduler_output.seqs):
        count, start = batch.num_scheduled_tokens[row], batch.num_computed_tokens[row]
        embeds = seq.request.prompt_embeds
        if embeds is not None and start < embeds.shape[0]:
            pieces.append((offset, embeds[start : start + count]))
        offset += count
    return pieces


_WARMUP_Q_LENS = [4, 2, 1]
_WARMUP_CONTEXT_LENS = [4, 2, 1]
_WARMUP_LOGITS_INDICES = [3, 6]
_WARMUP_WIDTH = 5


def warmup_inputs() -> StepInputs:
    """The batch the decoder layer is compiled on (worker/model_runner.py): every dimension above 1, the block
    tables' width too (dynamo specialises on a size of 1). Its slots are -1: it writes no cache."""
    q_lens = _WARMUP_Q_LENS
    num_tokens = sum(q_lens)
    return StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.long),
        positions=torch.cat([torch.arange(n) for n in q_lens]),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long),  # writes nothing
        block_tables=torch.zeros(len(q_lens), _WARMUP_WIDTH, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        context_lens=torch.tensor(_WARMUP_CONTEXT_LENS),
        logits_indices=torch.tensor(_WARMUP_LOGITS_INDICES),
    )
