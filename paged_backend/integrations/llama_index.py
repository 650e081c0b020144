"""A LlamaIndex LLM over the paged engine: ``PagedBackendLLM``. Install with the ``[llama-index]`` extra.

Its fields mirror ``HuggingFaceLLM``'s (``context_window``, ``max_new_tokens``, ``generate_kwargs``,
``system_prompt``, ``query_wrapper_prompt``, ``messages_to_prompt``, ``completion_to_prompt``,
``is_chat_model``); chat goes through the tokenizer's chat template unless ``messages_to_prompt`` is given.
Unlike LlamaIndex's ``Vllm``: every call streams, async calls await the engine instead of blocking the event
loop, and concurrent calls (a query engine's async fan-out, several threads) share the engine's steps.
Built from ``backend=`` (an existing ``LLM``, shareable with other adapters) or ``model=`` (loaded on first use).

It is a ``FunctionCallingLLM``: ``chat_with_tools`` / ``predict_and_call`` and the function-calling agents work,
the tools shown to the chat template; a required call (``tool_required=True`` or ``tool_choice=<name>``) is held
by a grammar, otherwise ``tool_call_parser`` reads the model's text (see ``paged_backend/tool_calls``). Calls
come back as ``ToolCallBlock``s of the message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.prompts.base import PromptTemplate
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from paged_backend.integrations.engine_client import EngineClient, usage
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams, StructuredOutputsParams
from paged_backend.tool_calls import ToolCallReader, resolve_parser, tool_request

if TYPE_CHECKING:
    from llama_index.core.tools import BaseTool

Model = TypeVar("Model", bound=BaseModel)

_GENERATE_KWARGS = set(SamplingParams.__dataclass_fields__) - {"max_tokens", "n", "best_of"}
_TOOL_KWARGS = ("tools", "tool_choice", "parallel_tool_calls")


class PagedBackendLLM(FunctionCallingLLM):
    """LlamaIndex's LLM interface (complete, chat, their streaming and async forms) on the paged engine."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    backend: Any = Field(default=None, exclude=True, description="an LLM to run on, shareable")
    model_name: str | None = Field(default=None, alias="model", description="path or hub id, loaded on first use")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="engine arguments for that LLM")
    context_window: int = Field(default=3900, gt=0, description="tokens of context; clamped to max_model_len")
    max_new_tokens: int = Field(default=256, gt=0, description="tokens to generate per call")
    generate_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="SamplingParams fields: temperature, top_p, top_k, stop, seed, ..."
    )
    is_chat_model: bool = Field(default=False, description="whether query engines should call chat")
    tool_call_parser: str | None = Field(
        default=None,
        description="hermes, llama3_json or mistral: reads calls the model chose to make; None: the one whose "
        "marker the chat template uses",
    )

    _client: EngineClient = PrivateAttr()

    @field_validator("query_wrapper_prompt", mode="before")
    @classmethod
    def _template(cls, value: Any) -> Any:
        """A plain string with ``{query_str}`` works, as in ``HuggingFaceLLM``."""
        return PromptTemplate(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> PagedBackendLLM:
        unknown = sorted(set(self.generate_kwargs) - _GENERATE_KWARGS)
        if unknown:
            raise ValueError(f"generate_kwargs {unknown} are not sampling fields; allowed: {sorted(_GENERATE_KWARGS)}")
        self._client = EngineClient(self.backend, self.model_name, self.engine_kwargs, prefix="li-")
        if self.query_wrapper_prompt is None:
            self.query_wrapper_prompt = PromptTemplate("{query_str}")
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PagedBackendLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """``context_window`` is clamped to the engine's ``max_model_len`` (which needs the engine: LlamaIndex
        reads metadata when it builds prompts, i.e. when the model is about to be used)."""
        max_model_len = self._client.llm.llm_engine.max_model_len
        return LLMMetadata(
            context_window=min(self.context_window, max_model_len),
            num_output=self.max_new_tokens,
            model_name=self._client.name,
            is_chat_model=self.is_chat_model,
            is_function_calling_model=True,
        )

    # ------------------------------------------------------------------ prompts and parameters
    def _params(self, kwargs: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(kwargs) - _GENERATE_KWARGS - {"max_new_tokens"})
        if unknown:
            raise TypeError(f"unknown keyword arguments {unknown}; sampling arguments are {sorted(_GENERATE_KWARGS)}")
        values = {**self.generate_kwargs, **kwargs}
        return SamplingParams(max_tokens=values.pop("max_new_tokens", self.max_new_tokens), **values)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        """As ``HuggingFaceLLM``: the query wrapper, then ``completion_to_prompt`` or the system prompt."""
        if formatted:
            return prompt
        assert self.query_wrapper_prompt is not None, "_check() sets a query wrapper"
        full = self.query_wrapper_prompt.format(query_str=prompt)
        if self.completion_to_prompt not in (None, default_completion_to_prompt):  # LlamaIndex's default: none
            return self.completion_to_prompt(full)
        return f"{self.system_prompt} {full}" if self.system_prompt else full

    def _chat_prompt(self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None = None) -> Any:
        if self.messages_to_prompt not in (None, generic_messages_to_prompt):  # else the model's own template
            return self.messages_to_prompt(messages)
        conversation = [_turn(m) for m in messages]
        if self.system_prompt and not any(m["role"] == "system" for m in conversation):
            conversation.insert(0, {"role": "system", "content": self.system_prompt})
        return self._client.chat_prompt(conversation, **({"tools": tools} if tools else {}))

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[Any, SamplingParams, ToolCallReader]:
        """The prompt (with the tools ``_prepare_chat_with_tools`` put in ``kwargs``), the sampling parameters
        (a forced call's grammar among them) and how the output is read for calls."""
        kwargs = dict(kwargs)
        tools, mode = kwargs.pop("tools", None), kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", True)
        prompt = self._chat_prompt(messages, tools)
        template = getattr(self._client.llm.get_tokenizer(), "chat_template", None)
        forced, reader = tool_request(tools, mode, parallel, lambda: resolve_parser(self.tool_call_parser, template))
        if forced is not None:
            kwargs["structured_outputs"] = forced
        return prompt, self._params(kwargs), reader

    @staticmethod
    def _response(out: RequestOutput, delta: str | None = None) -> CompletionResponse:
        c = out.outputs[0]
        prompt_tokens, completion_tokens = usage(out)
        raw = {"finish_reason": c.finish_reason, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return CompletionResponse(text=c.text, delta=delta, raw=raw)

    @staticmethod
    def _chat(response: CompletionResponse, reader: ToolCallReader | None = None) -> ChatResponse:
        """With tools, a finished response's text split into content and ``ToolCallBlock``s."""
        raw = response.raw or {}
        if reader is None or not reader.active or raw.get("finish_reason") is None:
            message = ChatMessage(role="assistant", content=response.text)
            return ChatResponse(message=message, delta=response.delta, raw=response.raw)
        content, calls = reader.split(response.text)
        blocks: list[Any] = [TextBlock(text=content)] if content else []
        blocks += [
            ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=json.loads(c.arguments)) for c in calls
        ]
        raw = {**raw, "finish_reason": reader.finish_reason(bool(calls), raw["finish_reason"])}
        return ChatResponse(message=ChatMessage(role="assistant", blocks=blocks), delta=response.delta, raw=raw)

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        (out,) = self._client.run_sync([self._completion_prompt(prompt, formatted)], self._params(kwargs))
        return self._response(out)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self._client.stream_sync(self._completion_prompt(prompt, formatted), self._params(kwargs))
        return (self._response(out, delta) for delta, out in stream if delta or out.finished)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        (out,) = await self._client.run_async([self._completion_prompt(prompt, formatted)], self._params(kwargs))
        return self._response(out)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        stream = self._client.stream_async(self._completion_prompt(prompt, formatted), self._params(kwargs))

        async def gen() -> CompletionResponseAsyncGen:
            async for delta, out in stream:
                if delta or out.finished:
                    yield self._response(out, delta)

        return gen()

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, params, reader = self._chat_request(messages, kwargs)
        (out,) = self._client.run_sync([prompt], params)
        return self._chat(self._response(out), reader)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, params, reader = self._chat_request(messages, kwargs)
        held = _HeldChat(self, reader)
        stream = self._client.stream_sync(prompt, params)
        return (held.response(delta, out) for delta, out in stream if delta or out.finished)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        # may load the model; renders the template
        prompt, params, reader = await asyncio.to_thread(self._chat_request, messages, kwargs)
        (out,) = await self._client.run_async([prompt], params)
        return self._chat(self._response(out), reader)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, params, reader = await asyncio.to_thread(self._chat_request, messages, kwargs)
        held = _HeldChat(self, reader)
        stream = self._client.stream_async(prompt, params)

        async def gen() -> ChatResponseAsyncGen:
            async for delta, out in stream:
                if delta or out.finished:
                    yield held.response(delta, out)

        return gen()

    # ------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat``'s arguments: the history and the user's message, the tools in OpenAI's form, and the mode
        (``tool_choice`` a tool's name; else ``"required"`` when ``tool_required``, else ``"auto"``)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role="user", content=user_msg) if isinstance(user_msg, str) else user_msg)
        specs = [tool.metadata.to_openai_tool() for tool in tools]
        names = [spec["function"]["name"] for spec in specs]
        if tool_choice is not None and tool_choice not in names:
            raise ValueError(f"tool_choice must be one of the tools {names}, got {tool_choice!r}")
        mode = tool_choice or ("required" if tool_required else "auto")
        return {"messages": messages, "tools": specs or None, "tool_choice": mode,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}  # fmt: skip

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = [
            ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name, tool_kwargs=_kwargs(b.tool_kwargs))
            for b in response.message.blocks
            if isinstance(b, ToolCallBlock)
        ]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none: {response.message.content!r}")
        return calls

    # ------------------------------------------------------------------ structured
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """``output_cls`` from the model, its JSON held to the class's schema by the engine's grammar (not by
        prompting and parsing): the result always validates."""
        kwargs = _structured(output_cls, llm_kwargs)
        if self.metadata.is_chat_model:
            text = self.chat(self._get_messages(prompt, **prompt_args), **kwargs).message.content
        else:
            text = self.complete(self._get_prompt(prompt, **prompt_args), formatted=True, **kwargs).text
        return output_cls.model_validate_json(text or "")

    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        kwargs = _structured(output_cls, llm_kwargs)
        if self.metadata.is_chat_model:
            text = (await self.achat(self._get_messages(prompt, **prompt_args), **kwargs)).message.content
        else:
            text = (await self.acomplete(self._get_prompt(prompt, **prompt_args), formatted=True, **kwargs)).text
        return output_cls.model_validate_json(text or "")

    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model, None, None]:
        """The object once its JSON is complete (one item: partial objects of a grammar-held output add little)."""
        yield self.structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)


class _HeldChat:
    """A chat stream's responses: with tools, text that may begin a call is held back from the deltas, and the
    last response carries the calls."""

    def __init__(self, llm: PagedBackendLLM, reader: ToolCallReader) -> None:
        self.llm, self.reader, self.tools, self.content = llm, reader, reader.streamer(), ""

    def response(self, delta: str, out: RequestOutput) -> ChatResponse:
        if self.tools is None:
            return self.llm._chat(self.llm._response(out, delta))
        piece, _ = self.tools.feed(delta, final=out.finished)
        self.content += piece
        if out.finished:  # the whole text, split into content and calls
            return self.llm._chat(self.llm._response(out, piece), self.reader)
        return ChatResponse(message=ChatMessage(role="assistant", content=self.content), delta=piece)


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: text, an assistant's tool calls, a tool result's call id."""
    turn: dict[str, Any] = {"role": message.role.value, "content": ""}
    calls = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            turn["content"] += block.text
        elif isinstance(block, ToolCallBlock):
            function = {"name": block.tool_name, "arguments": block.tool_kwargs}
            calls.append({"id": block.tool_call_id, "type": "function", "function": function})
        else:
            raise ValueError(
                f"only text content is supported, got a {type(block).__name__} in a {turn['role']} message"
            )
    if calls:
        turn["tool_calls"] = calls
    if "tool_call_id" in message.additional_kwargs:
        turn["tool_call_id"] = message.additional_kwargs["tool_call_id"]
    return turn


def _kwargs(value: dict[str, Any] | str) -> dict[str, Any]:
    """A call block's arguments as a dict (a block may hold them as JSON text)."""
    parsed = json.loads(value) if isinstance(value, str) else value
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {value!r}")
    return parsed


def _structured(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    schema = output_cls.model_json_schema()
    return {**(llm_kwargs or {}), "structured_outputs": StructuredOutputsParams(json=schema)}
