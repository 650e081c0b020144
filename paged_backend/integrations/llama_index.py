"""A LlamaIndex LLM over the paged engine: ``PagedBackendLLM``. Install with the ``[llama-index]`` extra.

Its fields mirror ``HuggingFaceLLM``'s (``context_window``, ``max_new_tokens``, ``generate_kwargs``,
``system_prompt``, ``query_wrapper_prompt``, ``messages_to_prompt``, ``completion_to_prompt``,
``is_chat_model``); chat goes through the tokenizer's chat template unless ``messages_to_prompt`` is given.
Unlike LlamaIndex's ``Vllm``: every call streams, async calls await the engine instead of blocking the event
loop, and concurrent calls (a query engine's async fan-out, several threads) share the engine's steps.
Built from ``backend=`` (an existing ``LLM``, shareable with other adapters) or ``model=`` (loaded on first use).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

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
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.prompts.base import PromptTemplate
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from paged_backend.integrations.engine_client import EngineClient, usage
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams, StructuredOutputsParams

Model = TypeVar("Model", bound=BaseModel)

_GENERATE_KWARGS = set(SamplingParams.__dataclass_fields__) - {"max_tokens", "n", "best_of"}


class PagedBackendLLM(CustomLLM):
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

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> Any:
        if self.messages_to_prompt not in (None, generic_messages_to_prompt):  # else the model's own template
            return self.messages_to_prompt(messages)
        conversation = []
        for m in messages:
            other = next((type(b).__name__ for b in m.blocks if not isinstance(b, TextBlock)), None)
            if other is not None:
                raise ValueError(f"only text content is supported, got a {other} in a {m.role.value} message")
            conversation.append({"role": m.role.value, "content": m.content or ""})
        if self.system_prompt and not any(m["role"] == "system" for m in conversation):
            conversation.insert(0, {"role": "system", "content": self.system_prompt})
        return self._client.chat_prompt(conversation)

    @staticmethod
    def _response(out: RequestOutput, delta: str | None = None) -> CompletionResponse:
        c = out.outputs[0]
        prompt_tokens, completion_tokens = usage(out)
        raw = {"finish_reason": c.finish_reason, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return CompletionResponse(text=c.text, delta=delta, raw=raw)

    @staticmethod
    def _chat(response: CompletionResponse) -> ChatResponse:
        message = ChatMessage(role="assistant", content=response.text)
        return ChatResponse(message=message, delta=response.delta, raw=response.raw)

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
        (out,) = self._client.run_sync([self._chat_prompt(messages)], self._params(kwargs))
        return self._chat(self._response(out))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self._client.stream_sync(self._chat_prompt(messages), self._params(kwargs))
        return (self._chat(self._response(out, delta)) for delta, out in stream if delta or out.finished)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt = await asyncio.to_thread(self._chat_prompt, messages)  # may load the model; renders the template
        (out,) = await self._client.run_async([prompt], self._params(kwargs))
        return self._chat(self._response(out))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        stream = self._client.stream_async(prompt, self._params(kwargs))

        async def gen() -> ChatResponseAsyncGen:
            async for delta, out in stream:
                if delta or out.finished:
                    yield self._chat(self._response(out, delta))

        return gen()

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


def _structured(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    schema = output_cls.model_json_schema()
    return {**(llm_kwargs or {}), "structured_outputs": StructuredOutputsParams(json=schema)}
