"""TRL's ``GRPOTrainer`` with the engine as its vLLM generation backend: TRL's vLLM path, and with it its
importance-sampling correction (``vllm_importance_sampling_correction``), which only that path has, runs on the
engine over the policy being trained: no weight copy, no second model in memory.

The correction multiplies each token's loss by exp(trainer's logprob - sampler's logprob), the "old" logprob coming
from a no-grad forward of the trainer over the finished rollout. With ``batch_invariant=True`` those no-grad
logprobs are computed the way the engine's sampler computed the sampled ones: the model's own forward under
``batch_invariant_forward``, each sequence without its padding (packed into one forward), and ``log_softmax`` of the
fp32 logits divided by the temperature. In the model's own dtype the two are then equal bit for bit (on a GPU too:
there the forward runs the engine's kernels) and the ratio is exactly 1 for every token, so the correction may be
switched off (``docs/guides/rl.md`` says when). The gradient pass keeps TRL's fused LM head (tiled products, an
online log-sum-exp: last bits apart from the old logprobs, which only PPO's clipped ratio sees) and its gradient
checkpointing, whose recomputation runs outside any mode.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from paged_backend.entrypoints.llm import LLM
from paged_backend.sampling_params import SamplingParams
from paged_backend.worker.trainer_forward import batch_invariant_forward, pack_sequences

if TYPE_CHECKING:
    from trl import GRPOTrainer

RolloutBatch = tuple[list[list[int]], list[list[int]], list[list[list[float]]], list[list[list[int]]]]


class EngineGeneration:
    """What TRL's ``VLLMGeneration`` is to the trainer (``trainer.vllm_generation``): TRL calls ``sync_weights``
    before a step's rollouts and ``generate`` for them, as in its colocate mode (one sample a prompt, the prompts
    already repeated ``num_generations`` times)."""

    def __init__(self, trainer: GRPOTrainer, llm: LLM) -> None:
        self.trainer = trainer
        self.llm = llm

    def sync_weights(self) -> None:
        """Nothing to copy: the engine reads the policy's parameters where the optimizer updates them, and drops
        cached prefixes computed with older values itself."""

    def sampling_params(self) -> SamplingParams:
        """TRL's generation settings, as its colocate mode gives them to vLLM."""
        t = self.trainer
        kwargs: dict[str, Any] = getattr(t.args, "generation_kwargs", None) or {}  # GRPOConfig's
        return SamplingParams(
            **{
                "n": 1,
                "temperature": t.temperature,
                "top_p": t.top_p,
                "top_k": t.top_k,
                "min_p": 0.0 if t.min_p is None else t.min_p,
                "repetition_penalty": t.repetition_penalty,
                "max_tokens": t.max_completion_length,
                "logprobs": 0,
                **kwargs,
            }
        )

    def generate(
        self,
        prompts: list[list[int]],
        images: list[Any] | None = None,
        num_generations: int = 1,
        profiler: contextlib.AbstractContextManager[Any] | None = None,
    ) -> RolloutBatch:
        """Prompt ids, completion ids, and per completion token the sampled token's logprob and id (one each: TRL's
        ``logprobs=0``)."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("images: the engine's TRL backend generates from text prompts only")
        params = self.sampling_params()
        with profiler if profiler is not None else contextlib.nullcontext():
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        samples = [c for out in outputs for c in out.outputs]
        logprobs = [[[entry[t].logprob] for entry, t in zip(c.logprobs or [], c.token_ids)] for c in samples]
        return (
            [list(out.prompt_token_ids) for out in outputs],
            [list(c.token_ids) for c in samples],
            logprobs,
            [[[t] for t in c.token_ids] for c in samples],
        )


def parity_logprobs(
    trainer: GRPOTrainer,
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]: prompts padded on the left, completions on the right
    attention_mask: torch.Tensor,  # [B, L]
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    **features: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """``GRPOTrainer._get_per_token_logps_and_entropies`` as the engine's sampler computes logprobs: each row with
    its left padding dropped (positions from 0 at its first token, as the engine's), the rows packed into one
    forward under ``batch_invariant_forward`` (each token gets the bits it has alone); the last
    ``logits_to_keep`` tokens' logprobs (and entropies). Right padding is computed and left to TRL's completion
    mask (a causal model's earlier positions never see it)."""
    present = sorted(name for name, value in features.items() if value is not None)
    if compute_aux_loss or present:
        raise ValueError(f"the engine's TRL parity forward runs text-only dense models; got {present or 'aux loss'}")
    divisor = torch.tensor([trainer.temperature], dtype=torch.float32, device=input_ids.device)
    starts = attention_mask.int().argmax(-1).tolist()
    rows = [ids[start:] for ids, start in zip(input_ids, starts)]
    size = batch_size or len(rows)
    logps, entropies = [], []
    with batch_invariant_forward(trainer.accelerator.unwrap_model(model)):
        for first in range(0, len(rows), size):  # TRL's batches: one packed forward each
            chunk = rows[first : first + size]
            logits = model(**pack_sequences(chunk)).logits[0]
            edge = 0
            for row in chunk:
                end = edge + len(row) - 1  # the row's last token predicts nothing
                kept = logits[max(edge, end - logits_to_keep) : end].float()  # (the cast is elementwise)
                log_probs = (kept / divisor).log_softmax(-1)
                logps.append(log_probs.gather(1, row[1:][-logits_to_keep:, None])[:, 0])
                if compute_entropy:
                    entropies.append(-(log_probs.exp() * log_probs).sum(-1))
                edge += len(row)
    return torch.stack(logps), torch.stack(entropies) if compute_entropy else None, None


def use_paged_backend(trainer: GRPOTrainer, **engine_kwargs: Any) -> LLM:
    """Make ``trainer`` (built with ``use_vllm=False``: no vLLM is needed) generate its rollouts on an engine over
    its own policy, through TRL's vLLM path: its importance-sampling settings (``vllm_importance_sampling_*``)
    then apply to the engine's logprobs. ``engine_kwargs`` are ``LLM``'s (``batch_invariant=True``: parity, see
    above); the engine reports the logprobs TRL asks vLLM for (``logprobs_mode="processed_logprobs"``). Returns
    the ``LLM``; ``shutdown()`` it after training."""
    if trainer.tools or trainer.environment_factories is not None:
        raise ValueError("tools: TRL's tool-calling rollouts are not run on the engine's TRL backend")
    if "logprobs_mode" in engine_kwargs:
        raise ValueError("logprobs_mode: TRL's correction needs 'processed_logprobs', which this sets itself")
    policy = trainer.accelerator.unwrap_model(trainer.model)
    llm = LLM(policy, tokenizer=trainer.processing_class, logprobs_mode="processed_logprobs", **engine_kwargs)
    trainer.vllm_generation = EngineGeneration(trainer, llm)  # type: ignore[assignment]  # TRL calls it by duck type
    trainer.use_vllm = True  # TRL's branch for a vLLM backend: its generate, its logprobs, its correction
    trainer._last_loaded_step = -1  # TRL's own first value (it calls sync_weights when the step changes)
    if llm.llm_engine.config.model_config.batch_invariant:
        own = trainer._get_per_token_logps_and_entropies
        parity = functools.partial(_parity_without_grad, trainer, own)
        trainer._get_per_token_logps_and_entropies = parity  # type: ignore[method-assign]
    return llm


def _parity_without_grad(
    trainer: GRPOTrainer, own: Callable[..., Any], model: torch.nn.Module, *args: Any, **kwargs: Any
) -> Any:
    """The no-grad logprobs (the old policy's, a reference model's) by ``parity_logprobs``; the gradient pass by
    TRL's own method."""
    if torch.is_grad_enabled():
        return own(model, *args, **kwargs)
    return parity_logprobs(trainer, model, *args, **kwargs)
