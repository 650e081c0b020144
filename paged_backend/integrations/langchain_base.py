"""What both LangChain classes share: their fields (sampling, stop strings, the engine or the model to load),
the engine access, usage and finish metadata, and batches that reach the engine together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.language_models import LangSmithParams
from langchain_core.messages import UsageMetadata
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from paged_backend.integrations.engine_client import EngineClient, usage
from paged_backend.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.entrypoints.llm import LLM

_SAMPLING: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
_SAMPLING += ("repetition_penalty", "seed", "max_tokens", "n")


class PagedBackendFields(BaseModel):
    """Fields and engine access shared by both LangChain classes."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    backend: Any = Field(default=None, exclude=True)
    """An ``LLM`` to run on (shared with other adapters); or leave it None and give ``model``."""
    model_name: str | None = Field(default=None, alias="model")
    """Path or hub id of the model, loaded on first use (ignored for loading when ``backend`` is given)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """vLLM engine arguments for the lazily built ``LLM`` (``block_size``, ``max_model_len``, ...)."""
    temperature: float | None = None
    max_tokens: int | None = 512
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings, always applied; a call's own ``stop`` adds to them."""
    timeout: float | None = None
    """Seconds a call may take; a call still running then is aborted with a TimeoutError."""
    streaming: bool = False
    """Make ``invoke`` stream through the callbacks (LangChain's convention)."""

    _client: EngineClient = PrivateAttr()

    @model_validator(mode="after")
    def _needs_a_model(self) -> PagedBackendFields:
        self._client = EngineClient(self.backend, self.model_name, self.engine_kwargs, prefix="lc-")
        return self

    @property
    def llm(self) -> LLM:
        """The ``LLM``: ``backend``, or the one built from ``model`` on first use."""
        return self._client.llm

    @property
    def served_name(self) -> str:
        return self._client.name

    def sampling_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        """The instance's sampling fields, overridden by a call's keyword arguments; stop strings from both."""
        unknown = sorted(set(kwargs) - set(_SAMPLING) - {"model", "structured_outputs"})
        if unknown:
            raise TypeError(f"unknown keyword arguments {unknown}; sampling arguments are {list(_SAMPLING)}")
        if kwargs.get("model", self.served_name) != self.served_name:
            raise ValueError(f"this model serves {self.served_name!r}; model={kwargs['model']!r} cannot be switched to")
        values = {name: kwargs.get(name, getattr(self, name)) for name in _SAMPLING}
        stops = list(dict.fromkeys([*(self.stop or []), *(stop or [])]))
        values["structured_outputs"] = kwargs.get("structured_outputs")
        return SamplingParams(**{k: v for k, v in values.items() if v is not None}, stop=stops or None)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.served_name, **{k: getattr(self, k) for k in _SAMPLING}, "stop": self.stop}

    def ls_params(
        self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="paged_backend",
            ls_model_name=kwargs.get("model", self.served_name),
            ls_model_type=model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stops := [*(self.stop or []), *(stop or [])]:
            params["ls_stop"] = stops
        return params


def usage_metadata(out: RequestOutput) -> UsageMetadata:
    prompt, completion = usage(out)
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}


def finish_info(c: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def batch_together(
    inputs: Sequence[Any], config: RunnableConfig | Sequence[RunnableConfig] | None, limit: int
) -> list[RunnableConfig]:
    """LangChain runs a batch on a thread pool sized by the CPU count; as many threads as inputs (up to the
    engine's ``max_num_seqs``, what one step can hold) let them reach the engine together (each call only waits
    on its request)."""
    configs = get_config_list(config, len(inputs))
    if all(c.get("max_concurrency") is None for c in configs):
        configs = [{**c, "max_concurrency": max(1, min(len(inputs), limit))} for c in configs]
    return configs
