"""``POST /v1/completions``: a prompt (text, token ids, or a list of either) in, OpenAI's text completion out, whole
or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from paged_backend.entrypoints.openai.errors import APIError
from paged_backend.entrypoints.openai.logprobs import (
    completion_logprobs,
    echoed_prompt_logprobs,
    text_length,
    vllm_prompt_logprobs,
)
from paged_backend.entrypoints.openai.protocol import CompletionRequest
from paged_backend.entrypoints.openai.streams import merge, sse
from paged_backend.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from paged_backend.entrypoints.openai.api_server import OpenAIServer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServingCompletion:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def create_completion(self, body: CompletionRequest) -> Any:
        try:
            params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self.server.start(
            body.prompts(), params, rid, body.max_tokens, body.model, body.output_format_field(), bool(body.stream)
        )
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            return self.server.streaming(self._stream_completions(body, streams, base), rid, len(streams))
        outputs = await self.server.collect(streams, rid)
        tokenization = self.server.tokenization
        if tokenization is not None and (body.echo or body.prompt_logprobs is not None):
            # a scored prompt's entries (a dict and decoded tokens each), off the event loop
            choices = await tokenization.run(lambda: self._choices(body, outputs))
        else:
            choices = self._choices(body, outputs)
        return {**base, "choices": choices, "usage": usage(outputs)}

    def _choices(self, body: CompletionRequest, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
        choices = []
        for i, out in enumerate(outputs):
            echo = (out.prompt or self.server.decode(out.prompt_token_ids)) if body.echo else ""
            for c in out.outputs:
                choice = {
                    "index": i * body.n + c.index,
                    "text": echo + c.text,
                    "logprobs": self._logprobs(body, out, c, echo, 0, 0),
                    "finish_reason": c.finish_reason,
                }
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs or [])
                if body.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        return choices

    def _logprobs(
        self, body: CompletionRequest, out: RequestOutput, c: CompletionOutput, echo: str, start: int, offset: int
    ) -> dict[str, Any] | None:
        """The choice's logprobs from token ``start`` on (``offset``: where their text begins): with ``echo``
        (non-empty only in a response's or stream's first piece), the prompt's first, then the completion's."""
        if body.logprobs is None:
            return None
        decode, as_ids = self.server.decode, body.return_tokens_as_token_ids
        if not echo:
            return completion_logprobs(c, decode, start, offset, as_ids)
        prompt = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], decode, as_ids)
        completion = completion_logprobs(c, decode, start, len(echo), as_ids)
        return {key: prompt[key] + completion[key] for key in prompt}

    async def _stream_completions(
        self, body: CompletionRequest, streams: list[AsyncIterator[RequestOutput]], base: dict[str, Any]
    ) -> AsyncIterator[str]:
        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (request, sample) -> (characters, tokens) sent
        offsets: dict[tuple[int, int], int] = {}  # where the next token's text starts (as in the whole response)
        finals: dict[int, RequestOutput] = {}
        opened: set[tuple[int, int]] = set()  # choices with a chunk sent
        async for i, out in merge(streams):
            for c in out.outputs:
                key = (i, c.index)
                echo = ""
                if body.echo and key not in opened:  # with the choice's first chunk
                    echo = out.prompt or self.server.decode(out.prompt_token_ids)
                chars, tokens = sent.get(key, (0, 0))
                delta = echo + c.text[chars:]
                sent[key] = (len(c.text), len(c.token_ids))
                if delta or c.finish_reason or len(c.token_ids) > tokens:
                    logprobs = self._logprobs(body, out, c, echo, tokens, offsets.get(key, 0))
                    if logprobs is not None:
                        offsets[key] = len(echo) + offsets.get(key, 0) + text_length(c, self.server.decode, tokens)
                    choice = {
                        "index": i * body.n + c.index,
                        "text": delta,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                    if body.prompt_logprobs is not None and key not in opened:  # the choice's first chunk
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs or [])
                    if body.return_token_ids:  # as vLLM: the prompt's ids in the choice's first chunk
                        if key not in opened:
                            choice["prompt_token_ids"] = list(out.prompt_token_ids)
                        choice["token_ids"] = list(c.token_ids[tokens:])
                    opened.add(key)
                    yield sse({**base, "choices": [choice]})
            if out.finished:
                finals[i] = out
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
        yield "data: [DONE]\n\n"


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
