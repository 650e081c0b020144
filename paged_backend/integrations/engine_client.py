"""What every framework adapter needs from the engine, framework-free: the ``LLM`` (given, or built on first use),
and requests run to completion or streamed, from a thread or from a coroutine, through the ``LLM``'s engine loop
(so requests from every adapter sharing that ``LLM`` batch together)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_backend.entrypoints.llm import LLM


class EngineClient:
    def __init__(self, backend: LLM | None, model: str | None, engine_kwargs: dict[str, Any], prefix: str) -> None:
        if backend is None and not model:
            raise ValueError("give backend=<an LLM> or model=<a path or hub id>")
        self.backend = backend
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.prefix = prefix
        self.built: LLM | None = None  # the LLM built from ``model``, once used
        self.lock = threading.Lock()

    @property
    def llm(self) -> LLM:
        """``backend``, or the ``LLM`` built from ``model`` on first use (never at construction)."""
        if self.backend is not None:
            return self.backend
        with self.lock:
            if self.built is None:
                from paged_backend.entrypoints.llm import LLM

                assert self.model is not None, "__init__ takes backend or model"
                self.built = LLM(self.model, **self.engine_kwargs)
            return self.built

    @property
    def name(self) -> str:
        if self.model:
            return self.model
        return str(self.llm.llm_engine.config.model_config.model)  # no model: the backend given

    async def llm_async(self) -> LLM:
        """``llm`` from a coroutine: a model still to be loaded loads on a worker thread, not the event loop."""
        if self.backend is not None or self.built is not None:
            return self.llm
        return await asyncio.to_thread(lambda: self.llm)

    def run_sync(self, prompts: list[Any], params: SamplingParams, timeout: float | None = None) -> list[RequestOutput]:
        """Every prompt in one engine call; the final output of each. Past ``timeout`` seconds they are aborted
        and TimeoutError is raised."""
        return self.llm.run_on_loop(prompts, params, timeout=timeout, prefix=self.prefix)

    async def run_async(
        self, prompts: list[Any], params: SamplingParams, timeout: float | None = None
    ) -> list[RequestOutput]:
        """``run_sync`` for a coroutine: awaits the engine, never blocks the event loop. Cancelled, or past its
        timeout, it aborts the requests."""
        llm = await self.llm_async()
        loop = llm.engine_loop
        requests = [(llm.next_request_id(self.prefix), p) for p in prompts]
        queues = await loop.add(requests, params, stream=False)
        deadline = _deadline(timeout)
        finals: list[RequestOutput] = []
        try:
            for (request_id, _), queue in zip(requests, queues):
                async for out in loop.stream(request_id, queue, deadline):
                    final = out
                finals.append(final)
        except BaseException:
            for request_id, _ in requests[len(finals) :]:
                loop.abort(request_id)
            raise
        return finals

    def stream_sync(
        self, prompt: Any, params: SamplingParams, timeout: float | None = None
    ) -> Iterator[tuple[str, RequestOutput]]:
        """(new text, cumulative output) of one request with one generation, as the engine produces them."""
        _single(params)
        loop = self.llm.engine_loop
        request_id = self.llm.next_request_id(self.prefix)
        (queue,) = loop.add_sync([(request_id, prompt)], params)
        sent = 0
        for out in loop.stream_sync(request_id, queue, _deadline(timeout)):
            text = out.outputs[0].text
            yield text[sent:], out
            sent = len(text)

    async def stream_async(
        self, prompt: Any, params: SamplingParams, timeout: float | None = None
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        _single(params)
        llm = await self.llm_async()
        loop = llm.engine_loop
        request_id = llm.next_request_id(self.prefix)
        (queue,) = await loop.add([(request_id, prompt)], params)
        sent = 0
        async for out in loop.stream(request_id, queue, _deadline(timeout)):
            text = out.outputs[0].text
            yield text[sent:], out
            sent = len(text)

    def chat_prompt(self, conversation: list[dict[str, Any]], **template_kwargs: Any) -> dict[str, Any]:
        """A conversation through the tokenizer's chat template (``template_kwargs``: more variables, such as
        ``tools``), as an engine prompt (text and its token ids)."""
        tokenizer = self.llm.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template: pass tokenizer=... to the LLM")
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _single(params: SamplingParams) -> None:
    if params.n != 1 or (params.best_of or 1) != 1:
        raise ValueError(f"streaming returns one generation: n and best_of must be 1, got n={params.n}")


def usage(out: RequestOutput) -> tuple[int, int]:
    """(prompt tokens, generated tokens over all of the request's generations)."""
    return len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
