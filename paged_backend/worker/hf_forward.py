"""The user's HF model run on one flattened step: ``[1, T]`` token ids (or their embeddings), their positions and
our attention metadata (the attention function reads it from the forward's kwargs), no HF cache."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from paged_backend.worker.attention import AttentionMetadata
from paged_backend.worker.step_inputs import EmbedsPieces


def takes_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether the model's ``forward`` computes only the kept rows' logits (``logits_to_keep``)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def hf_forward(
    model: PreTrainedModel,
    keeps: bool,  # takes_logits_to_keep(model), found once
    input_ids: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    metadata: AttentionMetadata,
    logits_indices: torch.Tensor,  # [N]
    prompt_embeds: EmbedsPieces = (),
) -> torch.Tensor:  # [N, V]
    """The logits of the rows ``logits_indices``; ``prompt_embeds`` replace those tokens' embeddings."""
    kwargs: dict[str, object] = {"logits_to_keep": logits_indices} if keeps else {}
    if prompt_embeds:  # the tokens' embeddings, with the prompt embeddings' rows in place of theirs
        embeds = model.get_input_embeddings()(input_ids)
        for offset, piece in prompt_embeds:
            embeds[offset : offset + piece.shape[0]] = piece.to(embeds.device)
        kwargs["inputs_embeds"] = embeds[None]
    else:
        kwargs["input_ids"] = input_ids[None]
    out = model(position_ids=positions[None], use_cache=False, attn_metadata=metadata, **kwargs)
    logits = out.logits[0]
    return logits if keeps else logits[logits_indices]
