"""``POST /v1/chat/completions``: messages (and tools) through the chat template, OpenAI's chat completion out,
whole or streamed as server-sent events (a stream starts with the assistant role). Each choice's text is split
into reasoning (``--reasoning-parser``), content and tool calls (``tools.py``), in that order."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from paged_backend.config import FieldError
from paged_backend.entrypoints.openai.errors import APIError
from paged_backend.entrypoints.openai.logprobs import chat_logprobs
from paged_backend.entrypoints.openai.protocol import ChatCompletionRequest
from paged_backend.entrypoints.openai.serving_completion import usage
from paged_backend.entrypoints.openai.streams import merge, sse
from paged_backend.entrypoints.openai.tools import tool_call_deltas, tool_reader
from paged_backend.outputs import RequestOutput
from paged_backend.reasoning import ReasoningSplitter, split_reasoning
from paged_backend.tool_calls import ForcedCallStreamer, ToolCallReader, ToolStream

if TYPE_CHECKING:
    from paged_backend.entrypoints.openai.api_server import OpenAIServer


@dataclass(frozen=True)
class ChatRun:
    """A chat request queued on the engine: its body, how its text is read for calls, its output streams."""

    body: ChatCompletionRequest
    tools: ToolCallReader
    streams: list[AsyncIterator[RequestOutput]]
    base: dict[str, Any]  # id, created, model
    rid: str
    prompt_token_ids: list[int]  # the rendered conversation's


class OpenAIServingChat:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def create_chat_completion(self, body: ChatCompletionRequest) -> Any:
        run = await self.start(body)
        if body.stream:
            return self.server.streaming(self._sse(run), run.rid, 1)
        return await self.whole(run)

    async def start_as(self, chat_request: Callable[[], dict[str, Any]], fields: Mapping[str, str]) -> ChatRun:
        """Run another API's request (Responses, Anthropic's Messages) as the chat request ``chat_request()``
        translates it to; a 400's ``param`` is named as that API names its fields (``fields``: chat's name -> its)."""

        def named(field: str) -> str:
            return fields.get(field, field)

        try:
            body = ChatCompletionRequest.model_validate(chat_request())
        except FieldError as exc:
            raise APIError(400, str(exc), "invalid_request_error", named(exc.field)) from exc
        except ValidationError as exc:
            error = exc.errors()[0]
            where = [named(str(error["loc"][0])), *map(str, error["loc"][1:])]
            raise APIError(400, f"{'.'.join(where)}: {error['msg']}", "invalid_request_error", where[0]) from exc
        try:
            return await self.start(body)
        except APIError as exc:
            exc.param = named(exc.param) if exc.param else exc.param
            raise

    async def start(self, body: ChatCompletionRequest) -> ChatRun:
        """Template, tokenize, check and queue the request (the Responses endpoint runs its requests through
        here too)."""
        tokenization = self.server.tokenization
        if tokenization is None:
            raise APIError(400, "chat needs a tokenizer", "invalid_request_error")
        messages = [m.for_template() for m in body.messages]
        args = self.server.args
        try:
            template_kwargs = body.template_kwargs()
            tools = tool_reader(body, args.tool_call_parser, args.enable_auto_tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error") from exc
        if body.tools:
            template_kwargs["tools"] = body.template_tools()
        try:
            text = await tokenization.render_chat(messages, self.server.chat_template, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            param = await self._template_culprit(messages, template_kwargs, body.chat_template_kwargs)
            raise APIError(400, f"chat template failed: {exc}", "invalid_request_error", param) from exc
        requested = body.max_completion_tokens or body.max_tokens
        self.server.limits.check_text(text, requested, "messages")
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
            [{"prompt": text, "prompt_token_ids": ids}],
            params,
            rid,
            requested,
            body.model,
            body.output_format_field(),
            stream=bool(body.stream),
        )
        return ChatRun(body, tools, streams, {"id": rid, "created": created, "model": body.model}, rid, ids)

    async def _template_culprit(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], extra: dict[str, Any] | None
    ) -> str:
        """The field a failed chat template blames: ``chat_template_kwargs`` when the template renders without
        them (a second render, made only once one has failed), else ``messages``."""
        tokenization = self.server.tokenization
        if not extra or tokenization is None:
            return "messages"
        without = {name: value for name, value in template_kwargs.items() if name not in extra}
        try:
            await tokenization.render_chat(messages, self.server.chat_template, **without)
        except Exception:  # noqa: BLE001 - it fails without them too: the messages
            return "messages"
        return "chat_template_kwargs"

    async def whole(self, run: ChatRun) -> dict[str, Any]:
        """The chat completion, once every choice has finished."""
        body, tools, base = run.body, run.tools, run.base
        (final,) = await self.server.collect(run.streams, run.rid)
        choices = []
        for c in final.outputs:
            message, finish_reason = self._message(c.text, tools, c.finish_reason)
            logprobs = chat_logprobs(c, self.server.decode, body.top_logprobs or 0) if body.logprobs else None
            choice = {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append({**choice, "stop_reason": c.stop_reason})
        response = {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}
        if body.return_token_ids:  # as vLLM: the prompt's ids on the response, the sampled ones per choice
            response["prompt_token_ids"] = list(final.prompt_token_ids)
        return response

    def _message(
        self, text: str, tools: ToolCallReader, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The assistant message and its finish reason: with ``--reasoning-parser`` its thinking in
        ``reasoning_content``, with tools its calls in ``tool_calls``."""
        message: dict[str, Any] = {"role": "assistant"}
        parser = self.server.args.reasoning_parser
        if parser is not None:
            message["reasoning_content"], text = split_reasoning(parser, text)
        content, calls = tools.split(text, cut=finish_reason == "length")
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, tools.finish_reason(bool(calls), finish_reason)

    async def _sse(self, run: ChatRun) -> AsyncIterator[str]:
        async for chunk in self.chunks(run):
            yield sse(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self, run: ChatRun) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks, as they come (the usage chunk last when asked for)."""
        body, tools, stream = run.body, run.tools, run.streams[0]
        base = {**run.base, "object": "chat.completion.chunk"}
        for j in range(body.n):
            delta = {"role": "assistant", "content": ""}
            first = {**base, "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": None}]}
            if body.return_token_ids:  # as vLLM: on each choice's first chunk
                first["prompt_token_ids"] = run.prompt_token_ids
            yield first
        sent: dict[int, tuple[int, int]] = {}  # sample -> (characters, tokens) sent
        parser = self.server.args.reasoning_parser
        splitters = {j: ReasoningSplitter(parser) for j in range(body.n)} if parser is not None else {}
        tool_streams = {j: tools.streamer() for j in range(body.n)}
        num_calls: dict[int, int] = {}  # sample -> tool calls sent
        final = None
        async for _, out in merge([stream]):
            for c in out.outputs:
                chars, tokens = sent.get(c.index, (0, 0))
                delta_text = c.text[chars:]
                sent[c.index] = (len(c.text), len(c.token_ids))
                if delta_text or c.finish_reason or len(c.token_ids) > tokens:
                    last = c.finish_reason is not None
                    delta = self._delta(splitters.get(c.index), delta_text, last)
                    cut = c.finish_reason == "length"
                    calls = self._stream_tools(tool_streams[c.index], delta, last, num_calls.get(c.index, 0), cut)
                    num_calls[c.index] = num_calls.get(c.index, 0) + calls
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": (
                            chat_logprobs(c, self.server.decode, body.top_logprobs or 0, tokens)
                            if body.logprobs
                            else None
                        ),
                        "finish_reason": tools.finish_reason(num_calls[c.index] > 0, c.finish_reason),
                    }
                    if body.return_token_ids:
                        choice["token_ids"] = list(c.token_ids[tokens:])
                    if last:
                        choice["stop_reason"] = c.stop_reason
                    yield {**base, "choices": [choice]}
            final = out
        if body.stream_options is not None and body.stream_options.include_usage and final is not None:
            yield {**base, "choices": [], "usage": usage([final])}

    @staticmethod
    def _stream_tools(stream: ToolStream | None, delta: dict[str, Any], last: bool, sent: int, cut: bool) -> int:
        """Passes the delta's content through the choice's tool-call stream and returns how many calls it
        began. A forced call's arguments go out piece by piece as they are written; under ``"auto"`` content that
        may begin a call is held, and the parser's calls come whole in one ``delta.tool_calls``."""
        if stream is None:
            return 0
        if isinstance(stream, ForcedCallStreamer):
            pieces = stream.feed_deltas(delta.pop("content", ""), final=last)
            if pieces:
                delta["tool_calls"] = [piece.to_openai() for piece in pieces]
            return sum(piece.id is not None for piece in pieces)
        content, calls = stream.feed(delta.pop("content", ""), final=last, cut=cut)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = tool_call_deltas(calls, sent)
        return len(calls)

    @staticmethod
    def _delta(splitter: ReasoningSplitter | None, text: str, last: bool) -> dict[str, Any]:
        """A stream's delta: new content, and with a reasoning parser new ``reasoning_content``."""
        if splitter is None:
            return {"content": text} if text else {}
        reasoning, content = splitter.feed(text, final=last)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        return {**delta, "content": content} if content else delta
