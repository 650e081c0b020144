"""A round of verifying steps run back to back on the device, each looking up its own proposals (prompt lookup,
spec_decode/device_lookup.py) in the token ids the steps before it left: core/lookup_round.py plans them.

A verifying step whose proposals the host looks up waits for the step before it to be read, then for the lookup
and the launch: on a small model that wait is longer than the forward. Here every row keeps its token ids on the
device (``history``, ``lens``): a step's inputs are the row's last token and the lookup's ``k`` proposal slots,
at the positions after it; the greedy token of every position is taken while the proposals match, then one of
the model's own (exactly what the host's verifying step takes, worker/rejection_sampler.py), and the taken tokens
are written on (worker/lookup_step.py). Every row runs ``k + 1`` tokens a step whatever its lookup found (a fixed
shape: the verifying steps' CUDA graphs, around which worker/lookup_graphs.py captures the rest of the step);
slots a lookup left empty are verified for nothing, and their KV, like a rejected proposal's, lies past the row's
length, written over later. A round queued behind another continues its device state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paged_backend.core.scheduler_output import LookupRound, ModelRunnerOutput, ScheduledBatch
from paged_backend.worker.attention import AttentionMetadata
from paged_backend.worker.lookup_step import LookupInputs, take_tokens, token_rows
from paged_backend.worker.step_inputs import block_table_array, queued_copy

if TYPE_CHECKING:
    from paged_backend.worker.model_runner import ModelRunner


class LookupRounds:
    """A model runner's lookup rounds, and its rows' token ids on the device after the last one queued
    (``[B, C]``, their counts ``[B]``), which a round queued behind it continues: in the verifying steps' CUDA
    graphs (worker/lookup_graphs.py, which then holds them) where they hold the batch, else eagerly."""

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None
        self.lens: torch.Tensor | None = None
        self.on_graphs = False  # the last round's rows are in the runner's LookupGraphs

    def launch(self, runner: ModelRunner, batch: ScheduledBatch) -> PendingLookupRound:
        """Queue ``batch``'s round (``batch.lookup_round``) from its token ids, or from where the round before
        left its rows."""
        plan = batch.lookup_round
        assert plan is not None
        device, graphs = runner.device, runner.lookup_graphs
        tables = queued_copy(torch.from_numpy(block_table_array(batch.block_tables)), device)
        on_graphs = graphs is not None and graphs.holds(
            batch.num_seqs, plan.num_speculative_tokens, plan.ngram_sizes, plan.capacity
        )
        if plan.history is None and on_graphs != self.on_graphs:
            raise RuntimeError("a lookup round continues the round before, but no round of its rows was queued")
        self.on_graphs = on_graphs
        if graphs is not None and on_graphs:
            size = graphs.start(plan.history, plan.max_lens, tables)
            return PendingLookupRound([graphs.step(size, batch.num_seqs) for _ in range(plan.num_steps)])
        if plan.history is not None:
            rows = token_rows(plan.history, batch.num_seqs)
            self.history = torch.zeros(batch.num_seqs, plan.capacity, dtype=torch.long, device=device)
            self.history[:, : rows.shape[1]].copy_(queued_copy(rows, device))
            self.lens = queued_copy(torch.tensor([len(ids) for ids in plan.history], dtype=torch.long), device)
        history, lens = self.history, self.lens
        if history is None or lens is None or lens.shape[0] != batch.num_seqs:
            raise RuntimeError("a lookup round continues the round before, but no round of its rows was queued")
        max_lens = queued_copy(torch.tensor(plan.max_lens, dtype=torch.long), device)
        return PendingLookupRound([verify_step(runner, plan, history, lens, tables, max_lens) for _ in
                                   range(plan.num_steps)])  # fmt: skip


def verify_step(
    runner: ModelRunner,
    plan: LookupRound,
    history: torch.Tensor,
    lens: torch.Tensor,
    tables: torch.Tensor,
    max_lens: torch.Tensor,
) -> torch.Tensor:
    """One step of the round, eagerly: lookup, forward, the taken tokens written on (``history`` and ``lens`` in
    place); its record (``take_tokens``)."""
    k = plan.num_speculative_tokens
    inputs = LookupInputs(history, lens, max_lens, tables, plan.ngram_sizes, k, runner.block_size)
    logits = forward_rows(runner, inputs.ids, inputs.positions, inputs.slots, lens + k, tables)
    tokens, logprobs = (t.view(inputs.ids.shape) for t in runner.sampler.greedy(logits))
    return take_tokens(inputs.proposals, inputs.proposed, tokens, logprobs, history, lens)


def forward_rows(
    runner: ModelRunner,
    ids: torch.Tensor,  # [B, q] on the device, as positions and slots
    positions: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,  # [B]
    tables: torch.Tensor,  # [B, W] int32
) -> torch.Tensor:
    """Every token's logits ``[B * q, V]``: the verifying steps' CUDA graph where one holds the batch, else the
    model's forward (padded as ``ModelRunner.run`` pads: the compiled layer saw no dimension of size 1)."""
    num_seqs, q_len = ids.shape
    graphs = runner.verify_graphs
    if graphs is not None and graphs.q_len == q_len and num_seqs <= graphs.max_size:
        with runner.switch:
            return graphs.run_rows(ids.reshape(-1), positions.reshape(-1), slots.reshape(-1), context_lens, tables)
    count = num_seqs * q_len
    device = ids.device
    cu = torch.arange(0, count + 1, q_len, dtype=torch.int32, device=device)
    ids, positions, slots = ids.reshape(-1), positions.reshape(-1), slots.reshape(-1)
    if runner.regions is not None and tables.shape[1] < 2:  # the compiled layer saw tables two blocks wide or more
        tables = torch.cat([tables, tables.new_zeros(num_seqs, 1)], dim=1)
    if runner.regions is not None and num_seqs < 2:  # a padding sequence: one token, no slot, no context
        zero = torch.zeros(1, dtype=torch.long, device=device)
        ids, positions, slots = torch.cat([ids, zero]), torch.cat([positions, zero]), torch.cat([slots, zero - 1])
        cu = torch.cat([cu, cu[-1:] + 1])
        context_lens = torch.cat([context_lens, zero])
        tables = torch.cat([tables, tables.new_zeros(1, tables.shape[1])])
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        cu_seqlens_q=cu,
        context_lens=context_lens,
        exact=runner.batch_invariant,
        twin_plans={} if device.type == "cpu" else None,
    )
    return runner.forward_device(ids, positions, metadata, torch.arange(count, device=device))


class PendingLookupRound:
    """A queued lookup round's steps, copied to pinned host memory behind its last step on a GPU."""

    def __init__(self, records: list[torch.Tensor]) -> None:  # each step's ``take_tokens`` record [B, 2 (k + 1) + 2]
        self.num_steps = len(records)
        both = torch.stack(records)  # [R, B, 2 (k + 1) + 2]
        on_gpu = both.device.type == "cuda"
        self.host = torch.empty(both.shape, dtype=both.dtype, pin_memory=on_gpu)
        self.host.copy_(both, non_blocking=on_gpu)
        self.event: torch.cuda.Event | None = None
        if on_gpu:
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(both.device))

    def wait_for_last_steps(self) -> None:
        return None

    def get_output(self) -> ModelRunnerOutput:
        """Each row's taken tokens over the round's steps in order, their logprobs, and per step the proposals
        the lookup made and how many were taken."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host.tolist()  # [R][B][2 (k + 1) + 2]
        width = (len(host[0][0]) - 2) // 2
        sampled, logprobs, counts = [], [], []
        for row in range(len(host[0])):
            steps = [host[step][row] for step in range(self.num_steps)]
            row_counts = [(int(s[-2]), int(s[-1])) for s in steps]
            sampled.append([int(t) for s, (_, n) in zip(steps, row_counts) for t in s[: n + 1]])
            logprobs.append([p for s, (_, n) in zip(steps, row_counts) for p in s[width : width + n + 1]])
            counts.append(row_counts)
        return ModelRunnerOutput(sampled, logprobs, lookup_counts=counts)
