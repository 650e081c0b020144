"""``POST /v1/chat/completions``: messages through the chat template, OpenAI's chat completion out, whole or
streamed as server-sent events (a stream starts with the assistant role)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from paged_backend.entrypoints.openai.errors import APIError
from paged_backend.entrypoints.openai.logprobs import chat_logprobs
from paged_backend.entrypoints.openai.protocol import ChatCompletionRequest
from paged_backend.entrypoints.openai.reasoning import ReasoningSplitter, split_reasoning
from paged_backend.entrypoints.openai.serving_completion import usage
from paged_backend.entrypoints.openai.streams import merge, sse
from paged_backend.outputs import RequestOutput

if TYPE_CHECKING:
    from paged_backend.entrypoints.openai.api_server import OpenAIServer


class OpenAIServingChat:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def create_chat_completion(self, body: ChatCompletionRequest) -> Any:
        tokenization = self.server.tokenization
        if tokenization is None:
            raise APIError(400, "chat needs a tokenizer", "invalid_request_error")
        messages = [m.for_template() for m in body.messages]
        try:
            template_kwargs = body.template_kwargs()
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        try:
            text = await tokenization.render_chat(messages, self.server.chat_template, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"chat template failed: {exc}", "invalid_request_error", "messages") from exc
        requested = body.max_completion_tokens or body.max_tokens
        self.server.check_length_bound(text, requested, "messages")
        ids = await tokenization.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, self.server.max_model_len - len(ids))
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        try:
            params = body.model_copy(update={"max_tokens": max_tokens}).sampling_params(max_tokens, top)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self.server.start(
            [{"prompt": text, "prompt_token_ids": ids}], params, rid, requested, body.model, body.output_format_field()
        )
        base = {"id": rid, "created": created, "model": body.model}
        if body.stream:
            return self.server.streaming(self._stream_chat(body, streams[0], base), rid, 1)
        (final,) = await self.server.collect(streams, rid)
        choices = [
            {
                "index": c.index,
                "message": self._message(c.text),
                "logprobs": chat_logprobs(c, self.server.decode, body.top_logprobs or 0) if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in final.outputs
        ]
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}

    def _message(self, text: str) -> dict[str, Any]:
        """The assistant message; with ``--reasoning-parser``, its thinking in ``reasoning_content``."""
        parser = self.server.args.reasoning_parser
        if parser is None:
            return {"role": "assistant", "content": text}
        reasoning, content = split_reasoning(parser, text)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning}

    async def _stream_chat(
        self, body: ChatCompletionRequest, stream: AsyncIterator[RequestOutput], base: dict[str, Any]
    ) -> AsyncIterator[str]:
        base = {**base, "object": "chat.completion.chunk"}
        for j in range(body.n):
            delta = {"role": "assistant", "content": ""}
            yield sse({**base, "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": None}]})
        sent: dict[int, tuple[int, int]] = {}  # sample -> (characters, tokens) sent
        parser = self.server.args.reasoning_parser
        splitters = {j: ReasoningSplitter(parser) for j in range(body.n)} if parser is not None else {}
        final = None
        async for _, out in merge([stream]):
            for c in out.outputs:
                chars, tokens = sent.get(c.index, (0, 0))
                delta_text = c.text[chars:]
                sent[c.index] = (len(c.text), len(c.token_ids))
                if delta_text or c.finish_reason or len(c.token_ids) > tokens:
                    choice = {
                        "index": c.index,
                        "delta": self._delta(splitters.get(c.index), delta_text, c.finish_reason is not None),
                        "logprobs": (
                            chat_logprobs(c, self.server.decode, body.top_logprobs or 0, tokens)
                            if body.logprobs
                            else None
                        ),
                        "finish_reason": c.finish_reason,
                    }
                    yield sse({**base, "choices": [choice]})
            final = out
        if body.stream_options is not None and body.stream_options.include_usage and final is not None:
            yield sse({**base, "choices": [], "usage": usage([final])})
        yield "data: [DONE]\n\n"

    @staticmethod
    def _delta(splitter: ReasoningSplitter | None, text: str, last: bool) -> dict[str, str]:
        """A stream's delta: new content, and with a reasoning parser new ``reasoning_content``."""
        if splitter is None:
            return {"content": text} if text else {}
        reasoning, content = splitter.feed(text, final=last)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        return {**delta, "content": content} if content else delta
