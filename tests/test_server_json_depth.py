"""JSON nested deeper than the bound (``json_limits.MAX_JSON_DEPTH``), wherever a request carries it, in the body
or as text inside one of its strings: a 400 naming the field, never a 500 from a RecursionError."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.json_limits import MAX_JSON_DEPTH  # noqa: E402
from tests.test_server import KEY, NAME, serving, tiny_llm  # noqa: E402

HEADERS = {"Authorization": f"Bearer {KEY}"}
ARGUMENTS = "messages.1.tool_calls.0.function.arguments"
ABYSS = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit
JUST_TOO_DEEP = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)


@pytest.fixture(scope="module")
def base(tokenizer):
    with serving(tiny_llm(tokenizer), ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as url:
        yield url


def called(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]


def answer(base: str, path: str, body: dict) -> tuple[int, str | None]:
    reply = httpx.post(base + path, json={"model": NAME, **body}, headers=HEADERS, timeout=60)
    return reply.status_code, reply.json()["error"].get("param")


@pytest.mark.parametrize("text", [ABYSS, JUST_TOO_DEEP])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", lambda t: {"messages": called(t), "max_tokens": 1}, ARGUMENTS),
        ("/tokenize", lambda t: {"messages": called(t)}, ARGUMENTS),
        ("/v1/chat/completions", lambda t: {"messages": called("{}")[:1], "guided_json": t}, "guided_json"),
        ("/v1/completions", lambda t: {"prompt": "x", "structured_outputs": {"json": t}}, "structured_outputs.json"),
    ],
)  # fmt: skip
def test_json_too_deep_inside_a_string_is_a_400_naming_it(base, text: str, path: str, body, param: str) -> None:
    assert answer(base, path, body(text)) == (400, param)


def nested_schema(levels: int) -> dict:
    """An object schema whose JSON nests ``1 + 2 * levels`` deep (each level an object and its properties)."""
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_object_too_deep_is_a_400_and_the_deepest_allowed_runs(base) -> None:
    levels = (MAX_JSON_DEPTH - 1) // 2
    too_deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(levels + 1)}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert answer(base, "/v1/chat/completions", {**chat, "response_format": too_deep}) == (400, "response_format")
    deepest = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": nested_schema(levels)}}
    reply = httpx.post(base + "/v1/completions", json={"model": NAME, **deepest}, headers=HEADERS, timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_body_nested_past_the_parsers_recursion_is_a_400(base) -> None:
    body = f'{{"model": "{NAME}", "prompt": {ABYSS}}}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize"):
        reply = httpx.post(base + path, content=body, headers={**HEADERS, "content-type": "application/json"})
        assert reply.status_code == 400, (path, reply.text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_the_model_nests_past_the_bound_is_a_well_formed_answer(base, stream: bool) -> None:
    """A named tool whose schema only closes arrays inside arrays: the grammar makes the model open brackets until
    ``max_tokens``. The answer is a 200 (whole: no call, finish ``length``; streamed: no call, ``[DONE]``)."""
    recursive = {"type": "array", "minItems": 1, "items": {"$ref": "#"}}
    tool = {"type": "function", "function": {"name": "nest", "parameters": recursive}}
    body = {
        "messages": [{"role": "user", "content": "nest"}], "tools": [tool], "max_tokens": 100, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "nest"}}, "stream": stream,
    }  # fmt: skip
    reply = httpx.post(base + "/v1/chat/completions", json={"model": NAME, **body}, headers=HEADERS, timeout=120)
    assert reply.status_code == 200, reply.text
    if not stream:
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
        return
    lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in reply.text.replace(" ", "")
