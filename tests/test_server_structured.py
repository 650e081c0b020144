"""The server's output formats, through the official ``openai`` client: ``response_format`` (``json_schema``,
``json_object``; ``client.chat.completions.parse`` with a Pydantic model), vLLM's ``structured_outputs`` and its
older ``guided_*`` fields; two formats at once, or one that does not compile, are a 400 naming the field."""

from __future__ import annotations

import json
import re
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")


from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.fixtures.schemas import Cache  # noqa: E402
from tests.test_server import KEY, NAME, serving  # noqa: E402

MESSAGES = [{"role": "user", "content": "Describe the cache as JSON."}]


@pytest.fixture(scope="module")
def served(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=1024, max_model_len=512)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as base:
        yield llm, openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def client(served):
    return served[1]


# JSON with optional whitespace (what response_format asks for): a random model may wander in it for a while,
# hence sampling and a generous max_tokens.
def test_parse_with_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model=NAME, messages=MESSAGES, response_format=Cache, max_tokens=400, temperature=1.0, seed=1
    )
    assert isinstance(completion.choices[0].message.parsed, Cache)


def test_json_object_and_vllm_fields(client) -> None:
    chat = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
    )  # fmt: skip
    text = chat.choices[0].message.content
    assert text.startswith("{") and (chat.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    regex = client.completions.create(
        model=NAME, prompt="code:", max_tokens=20, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )  # fmt: skip
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) for c in regex.choices)
    choice = client.completions.create(
        model=NAME, prompt="pick:", max_tokens=10, temperature=0, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in ("left", "right")
    schema = Cache.model_json_schema()
    guided = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=400, temperature=1.0, seed=1, extra_body={"guided_json": schema}
    )
    Cache.model_validate_json(guided.choices[0].message.content)


def test_formats_stream_as_they_complete(client) -> None:
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=400, temperature=1.0, seed=1, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "cache", "schema": Cache.model_json_schema()}},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Cache.model_validate_json(text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[0-9", "structured_outputs": {"regex": "a"}}, "guided_regex"),
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_grammar": "root ::= root"}, "guided_grammar"),  # no output satisfies it
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json"),
    ],
)
def test_bad_formats_are_a_400_naming_the_field(client, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_a_new_schema_compiles_in_a_worker_process(served) -> None:
    """The first compile of a schema runs in a compile worker process (the server's grammar service); the engine's
    compiler only keeps the result, so its own compile, when the request is added, finds it."""
    from paged_backend.sampling_params import StructuredOutputsParams
    from paged_backend.structured_output.grammar import grammar_key

    llm, client = served
    compiler = llm.llm_engine.input_processor.grammar_compiler()
    threads: list[str] = []
    original = compiler.compiler.compile_grammar

    def compile_grammar(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    compiler.compiler.compile_grammar = compile_grammar  # type: ignore[method-assign]
    try:
        schema = {"type": "object", "properties": {"fresh": {"type": "boolean"}}, "required": ["fresh"]}
        client.completions.create(model=NAME, prompt="x", max_tokens=30, extra_body={"guided_json": schema})
    finally:
        compiler.compiler.compile_grammar = original  # type: ignore[method-assign]
    assert threads == [] and compiler.kept(grammar_key(StructuredOutputsParams(json=schema))) is not None
