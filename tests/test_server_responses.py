"""``POST /v1/responses`` (OpenAI's Responses API) through the official ``openai`` client: it runs the chat path,
so greedy outputs equal ``/v1/chat/completions`` on the same conversation; function tools and JSON schemas are
held by the grammar; streamed, the events are OpenAI's and add up to the whole response."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_server import KEY, NAME, serving  # noqa: E402

DIGIT = {"type": "integer", "enum": list(range(10))}  # short arguments: a random model's numbers run long
ADD = {
    "type": "object",
    "properties": {"a": DIGIT, "b": DIGIT},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD}


def validated(events: list) -> list:
    """The SDK builds stream events without validating them: each is validated here against its OpenAI type."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    return [adapter.validate_python(e.model_dump(mode="json", by_alias=True)) for e in events]


@pytest.fixture(scope="module")
def client(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=1024, max_model_len=256)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_text_equals_chat_on_the_same_conversation(client) -> None:
    """``instructions`` and input items (messages, an earlier call and its output) become the chat messages."""
    items = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
    ]
    response = client.responses.create(
        model=NAME, instructions="Be brief.", input=items, max_output_tokens=8, temperature=0, tools=[TOOL],
        tool_choice="none",
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}], tool_choice="none",
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 8
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.id.startswith("resp_") and response.object == "response" and response.model == NAME


def test_a_forced_function_call_whole_and_streamed(client) -> None:
    kwargs = {"model": NAME, "input": "add 2 and 3", "tools": [TOOL], "temperature": 0, "max_output_tokens": 60}
    whole = client.responses.create(tool_choice={"type": "function", "name": "add"}, **kwargs)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("chatcmpl-tool-")
    assert set(json.loads(call.arguments)) == {"a", "b"} and whole.status == "completed"
    openai.types.responses.Response.model_validate(whole.model_dump(mode="json", by_alias=True))
    events = validated(
        list(client.responses.create(tool_choice={"type": "function", "name": "add"}, stream=True, **kwargs))
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) >= 2 and "".join(pieces) == events[-3].arguments == call.arguments  # greedy: the same call
    final = events[-1].response
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "add", call.arguments)]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_holds_the_text(client) -> None:
    fmt = {"type": "json_schema", "name": "sum", "schema": ADD, "strict": True}
    response = client.responses.create(
        model=NAME, input="two numbers", text={"format": fmt}, temperature=0, max_output_tokens=80
    )
    value = json.loads(response.output_text)
    assert set(value) == {"a", "b"} and all(isinstance(v, int) for v in value.values())
    openai.types.responses.Response.model_validate(response.model_dump(mode="json", by_alias=True))
    stream = client.responses.create(
        model=NAME, input="two numbers", text={"format": fmt}, temperature=0, max_output_tokens=80, stream=True
    )
    text = "".join(e.delta for e in validated(list(stream)) if e.type == "response.output_text.delta")
    assert text == response.output_text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ],
)
def test_bad_requests_are_400s_naming_the_field(client, extra: dict, param: str) -> None:
    body = {"model": NAME, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/responses", body=body, cast_to=object)
    assert error.value.body["param"].split(".")[0] == param, error.value.body


def test_an_unknown_model_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError, match=f"served: `{NAME}`"):
        client.responses.create(model="other", input="hi")


def test_a_reasoning_parsers_thinking_streams_as_a_reasoning_item() -> None:
    """The chat stream's ``reasoning_content`` deltas (``--reasoning-parser``) open a ``reasoning`` item before the
    message: each event is one the openai SDK reads, the deltas add up to each item's text, and the items done
    equal the ones a whole response builds from the same message."""
    from pydantic import TypeAdapter

    from paged_backend.entrypoints.openai.serving_responses import EventWriter, _items

    events = EventWriter()
    written = [
        *events.piece("reasoning", "Two "),
        *events.piece("reasoning", "plus three."),
        *events.piece("message", "5"),
    ]
    written += events.close()
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    parsed = [adapter.validate_json(e.split("data: ", 1)[1]) for e in written]
    assert [e.type for e in parsed] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    reasoning, message = (e.item for e in parsed if e.type == "response.output_item.done")
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two plus three."
    assert message.type == "message" and message.content[0].text == "5"
    whole = _items({"reasoning_content": "Two plus three.", "content": "5"})
    strip = lambda items: [{k: v for k, v in item.items() if k != "id"} for item in items]  # noqa: E731
    assert strip(whole) == strip(events.items)
