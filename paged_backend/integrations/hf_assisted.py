"""HF's assisted decoding on the engine: the ``speculative_config`` a patched ``generate`` call's
``prompt_lookup_num_tokens`` or ``assistant_model`` stands for (integrations/hf.py builds the engine with it);
whether the call runs on the engine at all is ``hf_args.assisted_reason``'s."""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

# HF's prompt lookup matches n-grams of up to ``max_matching_ngram_size`` tokens, 2 when unset, down to one
HF_PROMPT_LOOKUP_MAX = 2
# HF's assistant proposes up to ``num_assistant_tokens`` a step (20 when unset) but stops at its first token under
# ``assistant_confidence_threshold`` (0.4), and its "heuristic" schedules change that number from step to step; the
# engine's draft model proposes a fixed k: the number an assistant names under a constant schedule, else vLLM's usual
# k for a draft model
ADAPTIVE_ASSISTANT_K = 5


def assisted_speculation(config: GenerationConfig, assistant: Any) -> dict[str, Any] | None:
    """The engine's ``speculative_config`` for a call's assisted decoding, HF's settings in vLLM's names (checked
    when the engine is built), in HF's order: prompt lookup of ``prompt_lookup_num_tokens`` tokens, else the
    ``assistant_model`` as a draft model (the ``num_assistant_tokens`` it names under a constant schedule, else
    ``ADAPTIVE_ASSISTANT_K``); None when the call is not assisted."""
    if config.prompt_lookup_num_tokens is not None:
        top = config.max_matching_ngram_size or HF_PROMPT_LOOKUP_MAX
        k = config.prompt_lookup_num_tokens
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": top}
    if assistant is not None:
        settings = assistant.generation_config
        named = getattr(settings, "num_assistant_tokens", None)
        constant = getattr(settings, "num_assistant_tokens_schedule", None) in (None, "constant")
        k = named if named is not None and constant else ADAPTIVE_ASSISTANT_K
        return {"method": "draft_model", "model": assistant, "num_speculative_tokens": k}
    return None
