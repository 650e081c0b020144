"""``PagedBackendLLM``: a LangChain text-completion model on the paged engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from paged_backend.integrations.langchain_base import PagedBackendFields, finish_info, usage_metadata
from paged_backend.outputs import RequestOutput


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
            [Generation(text=c.text, generation_info=finish_info(c)) for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in outs
        ]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for o in outs:
            u = usage_metadata(o)
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
                info = finish_info(out.outputs[0]) if out.finished else None
                chunk = GenerationChunk(text=delta, generation_info=info)
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
                info = finish_info(out.outputs[0]) if out.finished else None
                chunk = GenerationChunk(text=delta, generation_info=info)
                if run_manager is not None and delta:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
