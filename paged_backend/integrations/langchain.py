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
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
)
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ValidationInfo, field_validator

from paged_backend.integrations.langchain_base import PagedBackendFields, batch_together, finish_info, usage_metadata
from paged_backend.integrations.langchain_llm import PagedBackendLLM
from paged_backend.integrations.langchain_messages import (
    OutputStream,
    conversation,
    lc_tool_call_chunks,
    lc_tool_calls,
    split_output,
    tool_mode,
)
from paged_backend.outputs import RequestOutput
from paged_backend.reasoning import REASONING_PARSERS
from paged_backend.sampling_params import SamplingParams, StructuredOutputsParams
from paged_backend.tool_calls import TOOL_CALL_PARSERS, ToolCallReader, resolve_parser, tool_request


class ChatPagedBackend(PagedBackendFields, BaseChatModel):
    """A LangChain chat model on the paged engine: messages go through the tokenizer's chat template."""

    model_config = PagedBackendFields.model_config  # LangChain's own config would let unknown fields through

    tool_call_parser: str | None = None
    """How the model writes tool calls, read under ``tool_choice="auto"``: ``"hermes"`` (Hermes, Qwen),
    ``"llama3_json"`` (Llama 3.1+), ``"mistral"`` (vLLM's parsers); None: the one whose marker the chat template
    uses."""
    reasoning_parser: str | None = None
    """A thinking model's ``<think>...</think>`` into ``additional_kwargs["reasoning_content"]``:
    ``"deepseek_r1"`` or ``"qwen3"`` (vLLM's parsers)."""

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str | None, info: ValidationInfo) -> str | None:
        allowed = TOOL_CALL_PARSERS if info.field_name == "tool_call_parser" else REASONING_PARSERS
        if value is not None and value not in allowed:
            raise ValueError(f"{info.field_name} must be one of {list(allowed)} or None, got {value!r}")
        return value

    @property
    def _llm_type(self) -> str:
        return "paged-backend-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self.ls_params("chat", stop, kwargs)

    def _prepare(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], SamplingParams, ToolCallReader]:
        """The call's engine prompt, sampling parameters and how its outputs are read for tool calls (the tools
        bound by ``bind_tools`` reach the chat template; a forced call is a grammar)."""
        kwargs = dict(kwargs)
        tools, mode = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", True)
        prompt = self._client.chat_prompt(conversation(messages), **({"tools": tools} if tools else {}))
        template = getattr(self.llm.get_tokenizer(), "chat_template", None)
        forced, reader = tool_request(tools, mode, parallel, lambda: resolve_parser(self.tool_call_parser, template))
        if forced is not None:
            if kwargs.get("structured_outputs") is not None:
                raise ValueError(f"tool_choice {mode!r} and with_structured_output both set the output format")
            kwargs["structured_outputs"] = forced
        return prompt, self.sampling_params(stop, kwargs), reader

    def _result(self, out: RequestOutput, reader: ToolCallReader) -> ChatResult:
        usage = usage_metadata(out)
        generations = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            reasoning, content, calls = split_output(c.text, self.reasoning_parser, reader)
            info = {**finish_info(c), "finish_reason": reader.finish_reason(bool(calls), c.finish_reason)}
            message = AIMessage(
                content=content,
                additional_kwargs={"reasoning_content": reasoning} if reasoning else {},
                tool_calls=lc_tool_calls(calls),
                usage_metadata=usage,
                response_metadata={"model_name": self.served_name, **info},
            )
            generations.append(ChatGeneration(message=message, generation_info=info))
        return ChatResult(generations=generations, llm_output={"token_usage": usage, "model_name": self.served_name})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt, params, reader = self._prepare(messages, stop, kwargs)
        (out,) = self._client.run_sync([prompt], params, self.timeout)
        return self._result(out, reader)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # may load the model; renders the template
        prompt, params, reader = await asyncio.to_thread(self._prepare, messages, stop, kwargs)
        (out,) = await self._client.run_async([prompt], params, self.timeout)
        return self._result(out, reader)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """Tools for the model (shown to the chat template as OpenAI tools). ``tool_choice``: ``"auto"`` (the
        default: the model decides; ``tool_call_parser`` reads its text), ``"any"`` / ``"required"`` / True (a
        grammar holds one or more calls), a tool's name (that tool, by grammar), ``"none"``.
        ``parallel_tool_calls=False``: one call at most. A grammar holds forced calls, so ``strict`` changes
        nothing."""
        formatted = [convert_to_openai_tool(tool, strict=strict) for tool in tools]
        mode = tool_mode(tool_choice, [t["function"]["name"] for t in formatted])
        bound: dict[str, Any] = {"tools": formatted, "tool_choice": mode}
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(**bound, **kwargs)

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
        parsed into it. ``method="json_schema"``, and ``"function_calling"`` the same way (the grammar a forced
        tool call's arguments get); ``"json_mode"``: any JSON object,
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

    def _chunk(self, delta: str, out: RequestOutput, stream: OutputStream) -> ChatGenerationChunk | None:
        """The chunk of a stream's new text (its thinking as ``reasoning_content``; with tools, text that may
        begin a call held back, the calls whole in the last chunk's ``tool_call_chunks``). None: nothing yet."""
        reasoning, content, calls = stream.feed(delta, final=out.finished)
        extra = {"reasoning_content": reasoning} if reasoning else {}
        if not out.finished:
            if not (content or reasoning):
                return None
            return ChatGenerationChunk(message=AIMessageChunk(content=content, additional_kwargs=extra))
        c = out.outputs[0]
        info = {**finish_info(c), "finish_reason": stream.reader.finish_reason(bool(calls), c.finish_reason)}
        message = AIMessageChunk(
            content=content,
            additional_kwargs=extra,
            tool_call_chunks=lc_tool_call_chunks(calls),
            usage_metadata=usage_metadata(out),
            response_metadata={"model_name": self.served_name, **info},
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info=info)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, params, reader = self._prepare(messages, stop, kwargs)
        stream = OutputStream(reader, self.reasoning_parser)
        for delta, out in self._client.stream_sync(prompt, params, self.timeout):
            chunk = self._chunk(delta, out, stream)
            if chunk is not None:
                if run_manager is not None and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        prompt, params, reader = await asyncio.to_thread(self._prepare, messages, stop, kwargs)
        stream = OutputStream(reader, self.reasoning_parser)
        async for delta, out in self._client.stream_async(prompt, params, self.timeout):
            chunk = self._chunk(delta, out, stream)
            if chunk is not None:
                if run_manager is not None and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def batch(
        self,
        inputs: list[Any],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        configs = batch_together(inputs, config, self.llm.llm_engine.config.scheduler_config.max_num_seqs)
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)


__all__ = ["ChatPagedBackend", "PagedBackendLLM"]
