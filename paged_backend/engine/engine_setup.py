"""What an engine is built from, besides its config: the executor (one worker or a tensor-parallel group), the
model's EOS ids, its input embedding when prompts may be embeddings, and whether steps schedule ahead."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig
from paged_backend.distributed.tp_executor import TPExecutor
from paged_backend.model_loader import load_model
from paged_backend.worker.worker import Executor, Worker


def make_executor(config: EngineConfig, model: str | PreTrainedModel) -> Executor:
    """One ``Worker`` on one device, or a tensor-parallel group whose workers each load their shard."""
    if config.parallel_config.tensor_parallel_size == 1:
        return Worker(*load_model(config, model))
    if not isinstance(model, str):
        raise ValueError(
            "tensor_parallel_size > 1 loads the model in every worker process: pass model as a path or hub id"
        )
    return TPExecutor.start(config, model)


def async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """On where asked; by default on a single GPU (a CPU would compute a queued round before it could read the
    one before it) whenever rounds run."""
    asked = config.scheduler_config.async_scheduling
    rounds = config.scheduler_config.num_scheduler_steps > 1
    if asked is None:
        return rounds and device.type == "cuda" and config.parallel_config.tensor_parallel_size == 1
    return asked


def input_embedding(config: EngineConfig, model: PreTrainedModel) -> torch.nn.Embedding | None:
    """The model's input embedding, when prompts may be embeddings."""
    if not config.model_config.enable_prompt_embeds:
        return None
    embedding = model.get_input_embeddings()
    return embedding if isinstance(embedding, torch.nn.Embedding) else None


def eos_token_ids(model: PreTrainedModel, tokenizer: object) -> frozenset[int]:
    """The generation config's and the tokenizer's EOS ids together."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return frozenset(ids)
