"""Tool calling through the official ``openai`` client: ``tool_choice`` ``"required"`` and a named function held
by a grammar (the calls always parse), ``"auto"`` read by ``--tool-call-parser hermes`` (the model's text made
to be a call, or not, by a regex), whole and streamed; tools and earlier calls reach the chat template."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_server import KEY, NAME, serving  # noqa: E402

# A Hermes-style template: the tools in a system turn, earlier calls as <tool_call> JSON.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools: {{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def client(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=1024, max_model_len=512)
    args = ServerArgs(
        model="tiny-path", served_model_name=NAME, api_key=KEY, chat_template=TEMPLATE,
        enable_auto_tool_choice=True, tool_call_parser="hermes",
    )  # fmt: skip
    with serving(llm, args) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ask(client, max_tokens: int = 60, **kwargs):
    return client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=max_tokens, **kwargs)


def post(client, path: str, body: dict) -> dict:
    """A request to the server's own (non-OpenAI) endpoints."""
    url = str(client.base_url).removesuffix("/v1/") + path
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).json()


def test_a_named_function_is_always_called(client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chat = ask(client, tool_choice=choice, temperature=1.0, seed=3, n=3)
    for c in chat.choices:
        assert c.message.content is None and c.finish_reason == "stop"  # forced: OpenAI's finish reason
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_a_forced_calls_arguments_stream_piece_by_piece_and_a_cut_call_is_never_content(client) -> None:
    """As OpenAI streams ``function.arguments``: the call's id and name first, then its arguments in several
    pieces that add up to the whole response's (greedy, so both runs write the same). Cut by ``max_tokens``,
    neither form returns the call's JSON as content."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    (whole,) = ask(client, tool_choice=choice, temperature=0).choices
    (call,) = whole.message.tool_calls
    pieces = [
        delta
        for chunk in ask(client, tool_choice=choice, temperature=0, stream=True)
        for delta in chunk.choices[0].delta.tool_calls or []
    ]
    assert pieces[0].id.startswith("chatcmpl-tool-")
    assert pieces[0].function.name == "get_weather" and all(p.id is None for p in pieces[1:])
    assert len([p for p in pieces if p.function.arguments]) >= 2
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    for stream in (False, True):
        cut = ask(client, max_tokens=2, tool_choice="required", temperature=0, stream=stream)
        if stream:
            chunks = list(cut)
            assert not any(c.choices[0].delta.content for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            (cut_choice,) = cut.choices
            assert cut_choice.message.content is None and not cut_choice.message.tool_calls
            assert cut_choice.finish_reason == "length"


def test_required_calls_one_of_the_tools_whole_and_streamed(client) -> None:
    """Exactly one call (parallel_tool_calls false) of one of the tools; streamed with the same seed, the deltas
    add up to the same call and no delta carries its JSON as content."""
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 5}
    (choice,) = ask(client, **kwargs).choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    name, arguments = call.function.name, json.loads(call.function.arguments)
    assert name in ("get_weather", "get_time")
    assert arguments == {} if name == "get_time" else arguments["city"] in ("Paris", "Oslo")
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, stream=True, **kwargs):
        (delta_choice,) = chunk.choices
        assert not delta_choice.delta.content  # the call's JSON is never streamed as content
        for delta in delta_choice.delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = delta_choice.finish_reason or finish
    assert finish == "tool_calls" and list(streamed.values()) == [{"name": name, "arguments": call.function.arguments}]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_call(client, stream: bool) -> None:
    """The hermes parser reads what the model wrote: a call (its text forced by a regex), or plain text."""
    for regex, called in ((HERMES_CALL, True), ("Sunny all day", False)):
        kwargs = {"temperature": 0, "max_tokens": 120, "extra_body": {"structured_outputs": {"regex": regex}}}
        if not stream:
            (choice,) = ask(client, **kwargs).choices
            content, calls, finish = choice.message.content, choice.message.tool_calls or [], choice.finish_reason
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        else:
            content, calls, finish = "", [], None
            for chunk in ask(client, stream=True, **kwargs):
                (choice,) = chunk.choices
                content += choice.delta.content or ""
                calls += [(d.function.name, json.loads(d.function.arguments)) for d in choice.delta.tool_calls or []]
                finish = choice.finish_reason or finish
            content = content or None
        if called:
            assert content is None and finish == "tool_calls"
            assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1]["city"] in ("Paris", "Oslo")
        else:
            assert (content, calls, finish) == ("Sunny all day", [], "stop")


def test_tools_and_earlier_calls_reach_the_template(client) -> None:
    """The tools make the prompt longer; an earlier call's arguments reach the template as a JSON object."""
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    with_tools = ask(client, max_tokens=1, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    turn = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    chat = client.chat.completions.create(model=NAME, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=1)
    tokens = post(client, "/tokenize", {"model": NAME, "messages": turn})["tokens"]
    text = post(client, "/detokenize", {"model": NAME, "tokens": tokens})["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|tool|>sunny" in text and chat.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_a_400_naming_the_field(client) -> None:
    for kwargs, param in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, **kwargs)
        assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tool_choice="required", max_tokens=5)
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_instructors_create_partial_sees_the_arguments_grow(client) -> None:
    """instructor's partial streaming (its TOOLS mode: a named function forced) parses the streamed ``arguments``
    as they arrive: several partial objects, each a prefix of the next, the last the whole validated answer."""
    instructor = pytest.importorskip("instructor")

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: Literal["Paris", "Oslo"]
        days: int = Field(ge=1, le=7)
        unit: Literal["celsius", "fahrenheit"]

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = [
        p.model_dump()
        for p in patched.chat.completions.create_partial(
            model=NAME, messages=MESSAGES, response_model=Forecast, max_tokens=60, temperature=0, max_retries=0
        )
    ]
    distinct = [p for i, p in enumerate(partials) if i == 0 or p != partials[i - 1]]
    assert len(distinct) >= 3, partials  # the fields fill in one by one, not all in one delta
    final = Forecast.model_validate(distinct[-1])
    assert final.city in ("Paris", "Oslo") and 1 <= final.days <= 7
    for earlier, later in zip(distinct, distinct[1:]):
        assert all(later[k] == v for k, v in earlier.items() if v is not None and not isinstance(v, str))


def test_required_takes_a_pydantic_schema_with_defs(client) -> None:
    """A tool whose parameters refer to their own ``$defs`` (a Pydantic model with a nested one) is accepted under
    ``"required"`` as under a named tool, and the call holds the schema."""
    from pydantic import BaseModel

    class Place(BaseModel):
        city: Literal["Paris", "Oslo"]

    class Trip(BaseModel):
        start: Place
        end: Place

    schema = Trip.model_json_schema()
    assert "$defs" in schema
    tools = [{"type": "function", "function": {"name": "plan", "parameters": schema}}]
    for choice in ("required", {"type": "function", "function": {"name": "plan"}}):
        chat = client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=80, temperature=0
        )
        (call,) = chat.choices[0].message.tool_calls
        assert call.function.name == "plan"
        Trip.model_validate_json(call.function.arguments)
