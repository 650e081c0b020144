"""paged_backend: paged KV cache and continuous batching under Hugging Face causal LMs, with vLLM's API.

Importing the package is light: the engine (torch, transformers) loads on first use of ``LLM``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paged_backend.lora.request import LoRARequest
from paged_backend.outputs import CompletionOutput, Logprob, RequestOutput
from paged_backend.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from paged_backend.engine.llm_engine import LLMEngine
    from paged_backend.entrypoints.llm import LLM, PagedGenerationBackend
    from paged_backend.integrations.hf import patch, patched, unpatch
    from paged_backend.worker.trainer_forward import batch_invariant_forward, pack_sequences

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "PagedGenerationBackend",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "patch",
    "unpatch",
    "patched",
    "batch_invariant_forward",
    "pack_sequences",
]

_LAZY = {
    "LLM": "paged_backend.entrypoints.llm",
    "PagedGenerationBackend": "paged_backend.entrypoints.llm",
    "LLMEngine": "paged_backend.engine.llm_engine",
    "patch": "paged_backend.integrations.hf",
    "unpatch": "paged_backend.integrations.hf",
    "patched": "paged_backend.integrations.hf",
    "batch_invariant_forward": "paged_backend.worker.trainer_forward",
    "pack_sequences": "paged_backend.worker.trainer_forward",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paged_backend' has no attribute {name!r}")
