"""``POST /v1/responses``: OpenAI's Responses API on the chat path (``responses_api.py`` turns the request into a
chat request; this turns the chat completion, or its chunks, into a response object, or its events).

Output items: the thinking (``--reasoning-parser``) as a ``reasoning`` item, the text as a ``message`` with one
``output_text`` part, each tool call as a ``function_call`` item (``call_id`` is the chat call's id). A response
cut by ``max_output_tokens`` is ``incomplete`` (``incomplete_details.reason: "max_output_tokens"``). Streamed, the
events are OpenAI's: ``response.created`` and ``response.in_progress``, then per item ``response.output_item.added``,
its deltas (``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.reasoning_text.delta``), their ``.done`` events and ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``) with the whole response and its usage.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from paged_backend.entrypoints.openai.responses_api import ResponsesRequest
from paged_backend.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat

# chat request fields -> the Responses request's own, for a 400's ``param``
_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, body: ResponsesRequest) -> Any:
        run = await self.chat.start_as(body.chat_request, _FIELDS)
        response = ResponseBuilder(body, _id("resp"), int(time.time()))
        if body.stream:
            return self.chat.server.streaming(self._events(run, response), run.rid, 1)
        chat = await self.chat.whole(run)
        (choice,) = chat["choices"]
        return response.whole(_items(choice["message"]), choice["finish_reason"], chat["usage"])

    async def _events(self, run: ChatRun, response: ResponseBuilder) -> AsyncIterator[str]:
        events = EventWriter()
        yield events("response.created", response=response.whole([], None, None))
        yield events("response.in_progress", response=response.whole([], None, None))
        finish, usage = None, None
        async for chunk in self.chat.chunks(run):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    for event in events.piece("reasoning", delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    for event in events.piece("message", delta["content"]):
                        yield event
                for call in delta.get("tool_calls") or []:
                    for event in events.call(call):
                        yield event
        for event in events.close():
            yield event
        yield events(response.final_event(finish), response=response.whole(events.items, finish, usage))


class ResponseBuilder:
    """The response object, around the items and usage of the chat completion that ran it."""

    def __init__(self, body: ResponsesRequest, rid: str, created: int) -> None:
        self.body, self.rid, self.created = body, rid, created

    def final_event(self, finish: str | None) -> str:
        return "response.incomplete" if finish == "length" else "response.completed"

    def whole(self, items: list[dict[str, Any]], finish: str | None, usage: dict[str, int] | None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None else None
        status = "in_progress" if usage is None else "incomplete" if finish == "length" else "completed"
        tool_choice = body.tool_choice if isinstance(body.tool_choice, str | None) else body.tool_choice.model_dump()
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": items,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,  # nothing is kept
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice or ("auto" if body.tools else "none"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }  # fmt: skip


def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message's reasoning, text and calls as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(_call_item(_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class EventWriter:
    """The stream's events, numbered; it tracks the item being written (one at a time, as the chat stream's
    deltas come) and the items done."""

    def __init__(self) -> None:
        self.numbers = itertools.count()
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # kind, id, text (or arguments), and a call's call_id / name

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def piece(self, kind: str, text: str) -> list[str]:
        """Text of a message or of the thinking: its item opened first if it is not the one being written."""
        events = []
        if self.open is None or self.open["kind"] != kind:
            events += self.close()
            item_id = _id("msg" if kind == "message" else "rs")
            self.open = {"kind": kind, "id": item_id, "text": ""}
            added = (
                _message_item(item_id, "", "in_progress")
                if kind == "message"
                else _reasoning_item(item_id, "", "in_progress")
            )
            events.append(self("response.output_item.added", output_index=len(self.items), item=added))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append(self("response.content_part.added", **self._at(), part=part))
        self.open["text"] += text
        if kind == "message":
            return [*events, self("response.output_text.delta", **self._at(), delta=text, logprobs=[])]
        return [*events, self("response.reasoning_text.delta", **self._at(), delta=text)]

    def call(self, call: dict[str, Any]) -> list[str]:
        """A piece of a tool call's delta: its first piece (with an id) opens a ``function_call`` item."""
        events = []
        function = call.get("function") or {}
        if call.get("id") is not None:
            events += self.close()
            self.open = {"kind": "call", "id": _id("fc"), "text": "", "call_id": call["id"], "name": function["name"]}
            added = _call_item(self.open["id"], call["id"], function["name"], "", "in_progress")
            events.append(self("response.output_item.added", output_index=len(self.items), item=added))
        arguments = function.get("arguments") or ""
        if arguments and self.open is not None:
            self.open["text"] += arguments
            events.append(
                self(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"],
                    output_index=len(self.items),
                    delta=arguments,
                )
            )
        return events

    def close(self) -> list[str]:
        """The ``.done`` events of the item being written, which joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, text = len(self.items), item["text"]
        events = []
        if item["kind"] == "message":
            done = _message_item(item["id"], text)
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self("response.output_text.done", **at, text=text, logprobs=[]))
            events.append(self("response.content_part.done", **at, part=done["content"][0]))
        elif item["kind"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self("response.reasoning_text.done", **at, text=text))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            events.append(
                self("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=text)
            )
        events.append(self("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return events

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
