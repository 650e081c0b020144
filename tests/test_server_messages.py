"""``POST /v1/messages`` (Anthropic's Messages API) through the official ``anthropic`` client: it runs the chat
path, so greedy text equals ``/v1/chat/completions`` on the same conversation; a tool round trip (``tool_use``
then ``tool_result``) whole and streamed; errors in Anthropic's shape, ``x-api-key`` as the key."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_server import KEY, NAME, serving  # noqa: E402

DIGIT = {"type": "integer", "enum": list(range(10))}  # short arguments: a random model's numbers run long
ADD = {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"], "additionalProperties": False}
TOOL = {"name": "add", "description": "Add two integers", "input_schema": ADD}
GREEDY = {"extra_body": {"temperature": 0}}  # Anthropic's newest SDK has no temperature argument


def raw_events(client, **kwargs) -> list:
    """The stream's raw events, each validated against its Anthropic type (the SDK builds them unvalidated)."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    return [adapter.validate_python(e.model_dump(mode="json")) for e in client.messages.create(stream=True, **kwargs)]


@pytest.fixture(scope="module")
def base(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=1024, max_model_len=256)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def test_text_equals_chat_and_streams_the_same(base, client) -> None:
    kwargs = {"model": NAME, "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    message = client.messages.create(**kwargs, **GREEDY)
    chat = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=NAME, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )  # fmt: skip
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.id.startswith("msg_")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    with client.messages.stream(**kwargs, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "input_json")]  # the SDK's own helper events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start", *["content_block_delta"] * (len(kinds) - 5), "content_block_stop"]
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    anthropic.types.Message.model_validate(message.model_dump(mode="json"))
    assert [e.type for e in raw_events(client, **kwargs, **GREEDY)] == kinds


def test_a_tool_round_trip_whole_and_streamed(client) -> None:
    """The model's forced call comes as a tool_use block; the result goes back as a tool_result block."""
    ask = {"role": "user", "content": "What is 2 plus 3?"}
    kwargs = {"model": NAME, "max_tokens": 120, "tools": [TOOL], **GREEDY}
    forced = {"type": "tool", "name": "add"}
    message = client.messages.create(messages=[ask], tool_choice=forced, **kwargs)
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "add" and set(use.input) == {"a", "b"}
    assert message.stop_reason == "tool_use"
    with client.messages.stream(messages=[ask], tool_choice=forced, **kwargs) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert len(deltas) >= 2 and json.loads("".join(deltas)) == use.input  # greedy: the same call, in pieces
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"
    anthropic.types.Message.model_validate(message.model_dump(mode="json"))
    raw = raw_events(client, messages=[ask], tool_choice=forced, **kwargs)
    assert [e.delta.partial_json for e in raw if e.type == "content_block_delta"] == deltas
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}
    turn = {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]}
    reply = client.messages.create(messages=[ask, turn, answer], tool_choice={"type": "none"}, **kwargs)
    assert reply.content and reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")


def test_a_json_schema_holds_the_text(client) -> None:
    message = client.messages.create(
        model=NAME, max_tokens=80, messages=[{"role": "user", "content": "two digits"}],
        output_config={"format": {"type": "json_schema", "schema": ADD}}, **GREEDY,
    )  # fmt: skip
    value = json.loads(message.content[0].text)
    assert set(value) == {"a", "b"} and all(v in range(10) for v in value.values())


def test_errors_come_in_anthropics_shape(base, client) -> None:
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "not_found_error"
    assert f"served: `{NAME}`" in error.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as error:
        wrong.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert error.value.body["error"]["type"] == "authentication_error"
    for body, field in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({"tool_choice": {"type": "tool", "name": "add"}}, "tool_choice"),  # without tools
    ):
        request = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **body}
        with pytest.raises(anthropic.BadRequestError) as error:
            client.post("/v1/messages", body=request, cast_to=object)
        assert error.value.body["error"]["type"] == "invalid_request_error"
        assert field in error.value.body["error"]["message"], error.value.body


def test_a_stop_sequence_is_named_as_the_reason(base, client) -> None:
    """The stop string that ended the text is Anthropic's ``stop_sequence`` (and vLLM's chat ``stop_reason``)."""
    ask = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], **GREEDY}
    free = client.messages.create(max_tokens=12, **ask).content[0].text
    stop = free[3:6]  # a string the greedy text writes, so it stops there
    message = client.messages.create(max_tokens=12, stop_sequences=[stop], **ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert stop not in message.content[0].text and free.startswith(message.content[0].text)
    with client.messages.stream(max_tokens=12, stop_sequences=[stop], **ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    chat = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=NAME, max_tokens=12, temperature=0, stop=[stop], messages=[{"role": "user", "content": "Hi"}]
    )
    assert chat.choices[0].model_extra["stop_reason"] == stop and chat.choices[0].finish_reason == "stop"
