"""What an engine is built from, besides its config: the executor (one worker, with speculative decoding's draft
model when there is one, or a tensor-parallel group), the model's EOS ids, its input embedding when prompts may
be embeddings, and whether steps schedule ahead."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from paged_backend.config import EngineConfig, FieldError
from paged_backend.core.block_manager import BlockManager
from paged_backend.core.scheduler import Scheduler
from paged_backend.distributed.tp_executor import TPExecutor
from paged_backend.model_loader import load_model
from paged_backend.model_loader.hf import resolve_device
from paged_backend.worker.attention import check_model_supported
from paged_backend.worker.compile import start_compile_workers
from paged_backend.worker.worker import Executor, Worker


def make_executor(config: EngineConfig, model: str | PreTrainedModel) -> Executor:
    """One ``Worker`` on one device, or a tensor-parallel group whose workers each load their shard."""
    if config.parallel_config.tensor_parallel_size == 1:
        start_compile_workers(config, resolve_device(config, None if isinstance(model, str) else model))
        target, device = load_model(config, model)
        return Worker(target, device, draft_model=load_draft_model(config, target, device))
    if not isinstance(model, str):
        raise ValueError(
            "tensor_parallel_size > 1 loads the model in every worker process: pass model as a path or hub id"
        )
    return TPExecutor.start(config, model)


def async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """On where asked; by default on a single GPU (a CPU would compute a queued step before it could read the one
    before it)."""
    asked = config.scheduler_config.async_scheduling
    if asked is None:
        return device.type == "cuda" and config.parallel_config.tensor_parallel_size == 1
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


def make_scheduler(config: EngineConfig, num_blocks: int, num_swap_blocks: int) -> Scheduler:
    """The scheduler over a block manager of ``num_blocks`` (and ``num_swap_blocks`` in CPU memory)."""
    block_manager = BlockManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.cache_config.enable_prefix_caching,
        num_cpu_blocks=num_swap_blocks,
    )
    return Scheduler(config, block_manager)


def load_draft_model(config: EngineConfig, target: PreTrainedModel, device: torch.device) -> PreTrainedModel | None:
    """With ``speculative_config`` method ``draft_model``: its model (loaded from a path in the target's dtype,
    or the model given) on the engine's device, which must share the target's vocabulary and run through our
    attention."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from transformers import AutoModelForCausalLM

    draft = spec.model
    if isinstance(draft, str):
        draft = AutoModelForCausalLM.from_pretrained(draft, dtype=target.dtype)
    if not isinstance(draft, PreTrainedModel):
        raise FieldError("speculative_config.model", "speculative_config.model must be a path or an HF causal LM")
    draft_config = draft.config
    vocab, target_vocab = draft_config.get_text_config().vocab_size, target.config.get_text_config().vocab_size
    if vocab != target_vocab:
        raise FieldError(
            "speculative_config.model",
            f"the draft model's vocabulary ({vocab} tokens) must be the target's ({target_vocab}): one tokenizer",
        )
    check_model_supported(draft, draft_config)
    torch.nn.Module.to(draft, device)  # transformers wraps ``to`` in a signature mypy cannot read
    return draft
