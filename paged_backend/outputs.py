"""Request outputs with vLLM's class and field names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_backend.logprobs import Logprob, PromptLogprob

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One sampled completion of a request.

    ``cumulative_logprob`` is always a float: the sum of the sampled tokens' log probabilities under the
    distribution they were actually drawn from. ``logprobs`` holds per-token dicts only when requested.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    # Raw next-token logits [V] (fp32, CPU) of each generated token, only for requests added with keep_logits
    # (HF's output_logits / output_scores through paged_backend.patch); not part of vLLM's API.
    logits: list[Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one request so far (cumulative; ``finished`` once every sample ended)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Sequence[PromptLogprob] | None = None  # [None, {token: Logprob}, ...] when asked
    lora_request: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
