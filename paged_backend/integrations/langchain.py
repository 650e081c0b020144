"""LangChain models over the paged engine: ``ChatPagedBackend`` (a chat model) and ``PagedBackendLLM`` (a text
completion model). Install with the ``[langchain]`` extra.

What they fix relative to LangChain's ``VLLM`` class: ``stop`` from the constructor and from the call are both
honoured; all ``n`` generations come back; tokens stream (sync and async); async calls await the engine instead
of blocking the event loop; the inputs of a ``batch`` reach the engine together and share its steps.

Both are built from ``backend=`` (an existing ``LLM``, which many adapters may share) or ``model=`` (a path or
hub id; the engine is created on first use, never in ``__init__``, with ``engine_kwargs``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from paged_backend.integrations.engine_client import EngineClient, usage
from paged_backend.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from paged_backend.entrypoints.llm import LLM

_ROLES = ((HumanMessage, "user"), (AIMessage, "assistant"), (SystemMessage, "system"), (ToolMessage, "tool"))
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


def _usage(out: RequestOutput) -> UsageMetadata:
    prompt, completion = usage(out)
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}


def _info(c: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _batch_together(
    inputs: Sequence[Any], config: RunnableConfig | Sequence[RunnableConfig] | None, limit: int
) -> list[RunnableConfig]:
    """LangChain runs a batch on a thread pool sized by the CPU count; as many threads as inputs (up to the
    engine's ``max_num_seqs``, what one step can hold) let them reach the engine together (each call only waits
    on its request)."""
    configs = get_config_list(config, len(inputs))
    if all(c.get("max_concurrency") is None for c in configs):
        configs = [{**c, "max_concurrency": max(1, min(len(inputs), limit))} for c in configs]
    return configs


class ChatPagedBackend(PagedBackendFields, BaseChatModel):
    """A LangChain chat model on the paged engine: messages go through the tokenizer's chat template."""

    model_config = PagedBackendFields.model_config  # LangChain's own config would let unknown fields through

    @property
    def _llm_type(self) -> str:
        return "paged-backend-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self.ls_params("chat", stop, kwargs)

    def _prompt(self, messages: list[BaseMessage]) -> dict[str, Any]:
        conversation = [{"role": _role(m), "content": _text(m.content)} for m in messages]
        return self._client.chat_prompt(conversation)

    def _result(self, out: RequestOutput) -> ChatResult:
        usage = _usage(out)
        generations = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            metadata = {"model_name": self.served_name, **_info(c)}
            message = AIMessage(content=c.text, usage_metadata=usage, response_metadata=metadata)
            generations.append(ChatGeneration(message=message, generation_info=_info(c)))
        return ChatResult(generations=generations, llm_output={"token_usage": usage, "model_name": self.served_name})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        params = self.sampling_params(stop, kwargs)
        (out,) = self._client.run_sync([self._prompt(messages)], params, self.timeout)
        return self._result(out)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        params = self.sampling_params(stop, kwargs)
        prompt = await asyncio.to_thread(self._prompt, messages)  # may load the model; renders the template
        (out,) = await self._client.run_async([prompt], params, self.timeout)
        return self._result(out)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, Any]:
        """Outputs held to ``schema`` (a Pydantic class, a TypedDict or a JSON schema) by the engine's grammar,
        parsed into it. ``method="json_schema"``, and ``"function_calling"`` the same way until tool calls exist
        here (the parsed result is what a tool call's arguments would give); ``"json_mode"``: any JSON object,
        parsed as a dict. The grammar always holds, so ``strict`` changes nothing."""
        if kwargs:
            raise TypeError(f"with_structured_output got unexpected keyword arguments {sorted(kwargs)}")
        if method in ("json_schema", "function_calling"):
            if schema is None:
                raise ValueError(f"method={method!r} needs a schema")
            structured = StructuredOutputsParams(json=convert_to_json_schema(schema))
        elif method == "json_mode":
            structured = StructuredOutputsParams(json_object=True)
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        model = self.bind(
            structured_outputs=structured,
            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
        )
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=schema)
            if isinstance(schema, type) and is_basemodel_subclass(schema)
            else JsonOutputParser()
        )
        if not include_raw:
            return model | parser
        parsed = RunnablePassthrough.assign(parsed=lambda d: parser.invoke(d["raw"]), parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=model) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    def _chunk(self, delta: str, out: RequestOutput) -> ChatGenerationChunk:
        c = out.outputs[0]
        if not out.finished:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta))
        message = AIMessageChunk(
            content=delta,
            usage_metadata=_usage(out),
            response_metadata={"model_name": self.served_name, **_info(c)},
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info=_info(c))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        params = self.sampling_params(stop, kwargs)
        for delta, out in self._client.stream_sync(self._prompt(messages), params, self.timeout):
            if delta or out.finished:
                chunk = self._chunk(delta, out)
                if run_manager is not None and delta:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        params = self.sampling_params(stop, kwargs)
        prompt = await asyncio.to_thread(self._prompt, messages)
        async for delta, out in self._client.stream_async(prompt, params, self.timeout):
            if delta or out.finished:
                chunk = self._chunk(delta, out)
                if run_manager is not None and delta:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        configs = _batch_together(inputs, config, self.llm.llm_engine.config.scheduler_config.max_num_seqs)
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)


class PagedBackendLLM(PagedBackendFields, BaseLLM):
    """A LangChain text-completion model on the paged engine: a batch's prompts go to the engine in one call."""

    model_config = PagedBackendFields.model_config

    @property
    def _llm_type(self) -> str:
        return "paged-backend"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self.ls_params("llm", stop, kwargs)

    def _llm_result(self, outs: list[RequestOutput]) -> LLMResult:
        generations = [
            [Generation(text=c.text, generation_info=_info(c)) for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in outs
        ]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for o in outs:
            u = _usage(o)
            usage["prompt_tokens"] += u["input_tokens"]
            usage["completion_tokens"] += u["output_tokens"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return LLMResult(generations=generations, llm_output={"token_usage": usage, "model_name": self.served_name})

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:  # LangChain's convention: stream each prompt through the callbacks
            generations = []
            for prompt in prompts:
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text = "".join(c.text for c in chunks)
                generations.append([Generation(text=text, generation_info=chunks[-1].generation_info)])
            return LLMResult(generations=generations, llm_output={"model_name": self.served_name})
        params = self.sampling_params(stop, kwargs)
        return self._llm_result(self._client.run_sync(list(prompts), params, self.timeout))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        params = self.sampling_params(stop, kwargs)
        return self._llm_result(await self._client.run_async(list(prompts), params, self.timeout))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for delta, out in self._client.stream_sync(prompt, self.sampling_params(stop, kwargs), self.timeout):
            if delta or out.finished:
                chunk = GenerationChunk(text=delta, generation_info=_info(out.outputs[0]) if out.finished else None)
                if run_manager is not None and delta:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for delta, out in self._client.stream_async(prompt, self.sampling_params(stop, kwargs), self.timeout):
            if delta or out.finished:
                chunk = GenerationChunk(text=delta, generation_info=_info(out.outputs[0]) if out.finished else None)
                if run_manager is not None and delta:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk


def _role(message: BaseMessage) -> str:
    """The chat-template role of a message, chunks included (an aggregated stream is an ``AIMessageChunk``)."""
    if isinstance(message, ChatMessage):
        return message.role
    for cls, role in _ROLES:
        if isinstance(message, cls):
            return role
    raise ValueError(f"message type {message.type!r} is not supported: use Human, AI, System, Tool or ChatMessage")


def _text(content: str | list[Any]) -> str:
    """A message's text: a string, or the text blocks of a content list (other blocks are refused)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"only text content is supported, got a {kind!r} block")
    return "".join(parts)
