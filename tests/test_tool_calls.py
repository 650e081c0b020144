"""Tool-call parsers (hermes, llama3_json, mistral), whole and streamed in any cut, and the forced formats'
grammars and parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_backend.config import FieldError
from paged_backend.entrypoints.openai.tools import ToolFields, tool_reader
from paged_backend.tool_calls import (
    ForcedCallStreamer,
    ToolCallReader,
    ToolCallStreamer,
    forced_tool_format,
    parse_forced_tool_calls,
    parse_tool_calls,
)

WEATHER = {"city": "Paris", "unit": "°C"}
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
    '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
    '{"name": "get_time", "parameters": {}}'
)
MISTRAL = (
    'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
    '{"name": "get_time", "arguments": {}}]'
)
CASES = [("hermes", HERMES, "Let me check."), ("llama3_json", LLAMA, None), ("mistral", MISTRAL, "Let me check.")]


@pytest.mark.parametrize(("parser", "text", "content"), CASES)
def test_two_calls_and_their_content(parser: str, text: str, content: str | None) -> None:
    found, calls = parse_tool_calls(parser, text)
    assert found == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert calls[0].to_openai()["function"] == {"name": "get_weather", "arguments": calls[0].arguments}


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "no calls here"),
        ("hermes", "<tool_call>{not json}</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
        ("llama3_json", 'The answer is {"name": "f"}'),  # a call is the whole output
        ("llama3_json", '{"name": "f", "parameters": {}} and more'),
        ("llama3_json", "{}"),
        ("mistral", "[TOOL_CALLS] not a list"),
        ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),
    ],
)
def test_text_that_is_no_call_stays_content(parser: str, text: str) -> None:
    assert parse_tool_calls(parser, text) == (text, [])


def test_an_unclosed_hermes_call_at_the_end_still_counts() -> None:
    """The model stopped (EOS) before ``</tool_call>``: the call is whole, as vLLM reads it."""
    content, calls = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


@pytest.mark.parametrize(("parser", "text", "content"), CASES)
def test_an_output_cut_by_max_tokens_keeps_the_calls_that_completed(parser: str, text: str, content: str | None):
    """Cut inside its second call, an output gives its first call under ``cut`` (whole and streamed), never the
    call's text as content; without ``cut`` such text is no call, and stays content."""
    second = text.index("get_time") + 3  # inside the second call's JSON
    partial = text[:second]
    found, calls = parse_tool_calls(parser, partial, cut=True)
    assert found == content and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER)]
    if parser != "hermes":  # a hermes call without its end tag counts when the output ends (EOS)
        assert parse_tool_calls(parser, partial) == (partial, [])
    streamer = ToolCallStreamer(parser)
    sent, _ = streamer.feed(partial[:20])
    rest, streamed = streamer.feed(partial[20:], final=True, cut=True)
    assert (sent + rest).strip() == (content or "") and [c.name for c in streamed] == ["get_weather"]
    in_first = text.index("Paris")  # cut inside the first call: no call completed, nothing of it as content
    assert parse_tool_calls(parser, text[:in_first], cut=True) == (content, [])


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("pythonic", "x")


@pytest.mark.parametrize(("parser", "text", "content"), [*CASES, ("hermes", "plain <tool text", None)])
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_a_stream_in_any_cut_gives_the_whole_parse(parser: str, text: str, content: str | None, cuts) -> None:
    """Content is passed on only where no call can begin; the calls come whole at the end."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamer, sent, calls = ToolCallStreamer(parser), [], []
    for i, piece in enumerate(pieces):
        content_piece, new = streamer.feed(piece, final=i == len(pieces) - 1)
        sent.append(content_piece)
        calls += new
    whole_content, whole_calls = parse_tool_calls(parser, text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    if whole_calls:
        assert "".join(sent).strip() == (whole_content or "")
    else:
        assert "".join(sent) == text


def test_forced_formats_and_their_parse() -> None:
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "get_time": None}
    named = forced_tool_format(tools, "get_weather")
    assert named.json == tools["get_weather"]
    assert forced_tool_format(tools, "get_time").json == {"type": "object"}
    required = forced_tool_format(tools, "required", parallel=False).json
    assert isinstance(required, dict) and required["minItems"] == 1 and required["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert "maxItems" not in forced_tool_format(tools, "required").json  # type: ignore[operator]
    (call,) = parse_forced_tool_calls("get_weather", '{"city": "Oslo"}')
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    calls = parse_forced_tool_calls("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                    '"parameters": {"city": "Oslo"}}]')  # fmt: skip
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert parse_forced_tool_calls("required", '[{"name": "get_ti') == []  # cut short by max_tokens
    assert parse_forced_tool_calls("get_weather", "[1]") == []


REQUIRED = (
    '[{"name":"add","parameters":{"a":7,"b":{"x":"}]\\"{"}}},{"name":"get_time","parameters":{}},'
    '{"name":"add","parameters":{"a":1,"b":2}}]'
)
CALLS = ('{"name":"add","parameters":{"a":7,"b":{"x":"}]\\"{"}}}', '{"name":"get_time","parameters":{}}',
         '{"name":"add","parameters":{"a":1,"b":2}}')  # fmt: skip
CALL_ENDS = [REQUIRED.index(call) + len(call) for call in CALLS]  # where each call's object closes


SPACED = json.dumps(  # the same calls as json.dumps writes them, with blanks after ":" and ","
    [{"name": "add", "parameters": {"a": 7, "b": {"x": '}]"{'}}}, {"name": "get_time", "parameters": {}}]
)


@pytest.mark.parametrize("written", [REQUIRED, SPACED])
@given(cut=st.floats(0, 1), sizes=st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_a_forced_list_cut_anywhere_streams_and_parses_its_whole_calls(written: str, cut: float, sizes) -> None:
    """A "required" output cut at any point (max_tokens), fed in pieces of any size: the whole response holds
    exactly the calls that completed, and the stream announced each call once, with its name, then its arguments
    piece by piece, adding up to the whole call's arguments (the text the model wrote)."""
    text = written[: round(cut * len(written))]
    stream = ForcedCallStreamer("required")
    pieces, at = [], 0
    for size in sizes * (len(text) // sum(sizes) + 1):
        if at >= len(text):
            break
        pieces += stream.feed_deltas(text[at : at + size])
        at += size
    pieces += stream.feed_deltas("", final=True)
    streamed: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.id is not None:
            assert piece.index not in streamed and piece.name is not None
            streamed[piece.index] = [piece.name, ""]
        streamed[piece.index][1] += piece.arguments
    whole = parse_forced_tool_calls("required", text)
    for i, call in enumerate(whole):
        assert streamed[i] == [call.name, call.arguments]
        json.loads(call.arguments)
    assert len(whole) <= len(streamed) <= len(whole) + 1  # the one being written when the output stopped
    if written == REQUIRED:
        assert len(whole) == sum(len(text) >= end for end in CALL_ENDS)


def test_a_named_call_streams_its_arguments_from_the_first_piece() -> None:
    stream = ForcedCallStreamer("get_weather")
    first = stream.feed_deltas("")
    assert [(p.index, p.name, p.arguments) for p in first] == [(0, "get_weather", "")] and first[0].id
    pieces = stream.feed_deltas('{"ci') + stream.feed_deltas('ty":"Oslo"}', final=True)
    assert [p.to_openai() for p in pieces] == [
        {"index": 0, "function": {"arguments": '{"ci'}},
        {"index": 0, "function": {"arguments": 'ty":"Oslo"}'}},
    ]
    assert parse_forced_tool_calls("get_weather", '{"city":"Oslo"}')[0].arguments == '{"city":"Oslo"}'
    assert parse_forced_tool_calls("get_weather", '{"city":"Os') == []  # cut short: no whole call


def test_forced_calls_are_never_content() -> None:
    content, calls = ToolCallReader("required").split('[{"name":"get_time","parameters":{}},{"name":"get_ti')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert ToolCallReader("get_weather").split('{"ci') == (None, [])


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, None),
        ({"tool_choice": "none"}, None),
        ({"tools": [tool("f")]}, "auto"),
        ({"tools": [tool("f")], "tool_choice": "none"}, "none"),
        ({"tools": [tool("f")], "tool_choice": "required"}, "required"),
        ({"tools": [tool("f"), tool("g")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "g"),
    ],
)
def test_tool_mode(fields: dict, mode: str | None) -> None:
    assert ToolFields.model_validate(fields).tool_mode() == mode


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not one of"),
    ],
)
def test_bad_tool_choice_is_named(fields: dict, message: str) -> None:
    with pytest.raises(FieldError, match=message) as info:
        ToolFields.model_validate(fields).tool_mode()
    assert info.value.field == "tool_choice"


def test_auto_needs_the_servers_parser() -> None:
    body = ToolFields.model_validate({"tools": [tool("f")]})
    with pytest.raises(FieldError, match="--enable-auto-tool-choice") as info:
        tool_reader(body, None, False)
    assert info.value.field == "tool_choice"
    with pytest.raises(FieldError):
        tool_reader(body, "hermes", False)
    assert tool_reader(body, "hermes", True) == ToolCallReader("auto", "hermes")
    assert tool_reader(ToolFields.model_validate({}), None, False).streamer() is None


@pytest.mark.parametrize("levels", [65, 5000])
def test_model_output_nested_too_deep_is_no_call_and_no_crash(levels: int) -> None:
    """The model's own output can nest past the parser's recursion (a recursive schema, a regex): each parser
    reads it as no call, whole or streamed, instead of raising RecursionError."""
    deep = "[" * levels + "]" * levels
    hermes = '<tool_call>{"name": "f", "arguments": {"a": ' + deep + "}}</tool_call>"
    assert parse_tool_calls("hermes", hermes) == (hermes, [])
    assert parse_tool_calls("mistral", "[TOOL_CALLS]" + deep)[1] == []
    assert parse_tool_calls("llama3_json", '{"name": "f", "parameters": {"a": ' + deep + "}}")[1] == []
    assert parse_forced_tool_calls("f", '{"a": ' + deep + "}") == []
    assert parse_forced_tool_calls("required", '[{"name": "f", "parameters": {"a": ' + deep + "}}]") == []
    streamer = ToolCallStreamer("hermes")
    assert streamer.feed(hermes[:40]) == ("", []) and streamer.feed(hermes[40:], final=True) == (hermes, [])


def test_a_required_list_refuses_tool_schemas_it_cannot_hoist() -> None:
    """A tool's ``$defs`` that is not an object, or parameters nested past the bound, are a FieldError naming
    ``tools`` (never a TypeError or a RecursionError from the hoisting walk)."""
    from paged_backend.config import FieldError

    deep: dict = {"type": "object"}
    for _ in range(500):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema in ({"type": "object", "$defs": None}, {"type": "object", "definitions": []}, deep):
        with pytest.raises(FieldError) as info:
            forced_tool_format({"f": schema}, "required")
        assert info.value.field == "tools"
