"""``POST /v1/messages``: Anthropic's Messages API on the chat path (``anthropic_api.py`` turns the request into a
chat request; this turns the chat completion, or its chunks, into a message, or Anthropic's events).

Content blocks: the thinking (``--reasoning-parser``) as a ``thinking`` block, the text as a ``text`` block, each
tool call as a ``tool_use`` block (its arguments parsed into ``input``). ``stop_reason``: ``max_tokens`` when
cut, ``stop_sequence`` (with ``stop_sequence``) when a stop string ended it, ``tool_use`` when the model called,
else ``end_turn``. Streamed: ``message_start``, per block
``content_block_start``, its ``content_block_delta``s (``text_delta``, ``input_json_delta``, ``thinking_delta``)
and ``content_block_stop``, then ``message_delta`` (the stop reason and output tokens) and ``message_stop``; a
failure midway is an ``error`` event. Errors are Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}`` (``anthropic_errors``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from paged_backend import json_limits
from paged_backend.engine.engine_loop import EngineDeadError, RequestFailedError
from paged_backend.entrypoints.openai.anthropic_api import MessagesRequest
from paged_backend.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat

# chat request fields -> the Messages request's own, for a 400's ``param``
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config"}
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def _stop(called: bool, finish: str | None, stop_reason: object) -> dict[str, Any]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` (the chat choice's ``stop_reason`` is the stop string
    that ended it, if one did)."""
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "tool_use" if called else "end_turn", "stop_sequence": None}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's ``input`` (a call cut short has none whole: ``{}``)."""
    try:
        value = json_limits.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, body: MessagesRequest) -> Any:
        run = await self.chat.start_as(body.chat_request, _FIELDS)
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return self.chat.server.streaming(self._events(run, mid, body.model), run.rid, 1)
        whole = await self.chat.whole(run)
        (choice,) = whole["choices"]
        message = choice["message"]
        blocks = []
        if message.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            blocks.append(
                {"type": "tool_use", "id": call["id"], "name": function["name"], "input": _input(function["arguments"])}
            )
        usage = whole["usage"]
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": blocks,
            **_stop(bool(message.get("tool_calls")), choice["finish_reason"], choice.get("stop_reason")),
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
        }

    async def _events(self, run: ChatRun, mid: str, model: str) -> AsyncIterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

        message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "model": model}
        message |= {"content": [], "stop_reason": None, "stop_sequence": None}
        message["usage"] = {"input_tokens": 0, "output_tokens": 0}
        yield event("message_start", message=message)
        blocks = BlockWriter(event)
        finish, usage, called, stop_reason = None, None, False, None
        try:
            async for chunk in self.chat.chunks(run):
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
                    stop_reason = choice.get("stop_reason", stop_reason)
                    delta = choice["delta"]
                    if delta.get("reasoning_content"):
                        yield blocks.piece(
                            "thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                        )
                    if delta.get("content"):
                        yield blocks.piece("text", {"type": "text_delta", "text": delta["content"]})
                    for call in delta.get("tool_calls") or []:
                        called = True
                        yield blocks.call(call)
        except (RequestFailedError, EngineDeadError) as exc:
            status = 500 if isinstance(exc, RequestFailedError) else 503
            yield f"event: error\ndata: {json.dumps(anthropic_error(status, str(exc)))}\n\n"
            return
        yield blocks.close()
        counts = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]} if usage else {}
        delta = _stop(called, finish, stop_reason)
        yield event("message_delta", delta=delta, usage=counts)  # the prompt's tokens too: only now are they known
        yield event("message_stop")


class BlockWriter:
    """The content blocks of a stream, one open at a time: a delta of another kind (or a new call) closes it."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.index = -1
        self.kind: str | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> str:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + self.event("content_block_start", index=self.index, content_block=block)

    def piece(self, kind: str, delta: dict[str, Any]) -> str:
        events = ""
        if self.kind != kind:
            empty = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events = self._open(kind, empty)
        return events + self.event("content_block_delta", index=self.index, delta=delta)

    def call(self, call: dict[str, Any]) -> str:
        events = ""
        function = call.get("function") or {}
        if call.get("id") is not None:
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            events = self._open("tool_use", block)
        if function.get("arguments") and self.kind == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events += self.event("content_block_delta", index=self.index, delta=delta)
        return events

    def close(self) -> str:
        if self.kind is None:
            return ""
        self.kind = None
        return self.event("content_block_stop", index=self.index)
