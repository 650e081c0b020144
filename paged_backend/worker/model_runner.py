"""Flattens one scheduled step into a single ``[1, T]`` forward of the user's HF model and returns the logits
of every sequence that samples this step."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from paged_backend.attention import AttentionMetadata, PagedAttentionSwitch
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.engine.sequence import Sequence
from paged_backend.worker.cache_engine import CacheEngine


class ModelRunner:
    def __init__(self, model: PreTrainedModel, cache_engine: CacheEngine, device: torch.device) -> None:
        self.model = model
        self.cache_engine = cache_engine
        self.device = device
        self.block_size = cache_engine.block_size
        self.switch = PagedAttentionSwitch(model)
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def prepare_inputs(
        self, sched: SchedulerOutput, block_manager: BlockManager
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """Build ``input_ids [T]``, ``position_ids [T]``, the attention metadata, the logit rows to keep [N]
        and the sequences those rows belong to (those whose step reaches their last known token)."""
        tokens: list[int] = []
        positions: list[int] = []
        seq_of_token: list[int] = []
        cu_seqlens_q = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            seq_of_token += [i] * n
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            context_lens.append(end)
            tables.append(block_manager.get_block_table(seq.seq_id))
            if end == len(seq.token_ids):
                logits_indices.append(cu_seqlens_q[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # [B, W]
        pos = torch.tensor(positions, dtype=torch.long)  # [T]
        owner = torch.tensor(seq_of_token, dtype=torch.long)  # [T]
        slot_mapping = block_tables[owner, pos // self.block_size].long() * self.block_size + pos % self.block_size
        to = dict(device=self.device, non_blocking=True)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(**to),
            block_tables=block_tables.to(**to),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32).to(**to),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(**to),
            kv_caches=self.cache_engine.kv_caches,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long).to(**to)
        return (
            input_ids,
            pos.to(**to),
            metadata,
            torch.tensor(logits_indices, dtype=torch.long).to(**to),
            sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_manager: BlockManager) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits ``[N, V]`` for the ``N`` sequences that sample."""
        self.cache_engine.copy_blocks(sched.block_copies)
        input_ids, positions, metadata, logits_indices, sample_seqs = self.prepare_inputs(sched, block_manager)
        return self.forward(input_ids, positions, metadata, logits_indices), sample_seqs

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N]
    ) -> torch.Tensor:  # [N, V]
        kwargs = {"logits_to_keep": logits_indices} if self.takes_logits_to_keep else {}
        with self.switch:
            out = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                attn_metadata=metadata,
                **kwargs,
            )
        logits = out.logits[0]
        return logits if self.takes_logits_to_keep else logits[logits_indices]
