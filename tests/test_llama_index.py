"""The LlamaIndex adapter on a tiny model: complete / chat in all four forms, metadata, a query engine over a
vector index whose retrieved context reaches the engine, and async calls sharing engine steps."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Literal

import pytest
from pydantic import BaseModel

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ToolCallBlock  # noqa: E402
from llama_index.core.embeddings import MockEmbedding  # noqa: E402
from llama_index.core.llms import ChatMessage, ImageBlock, TextBlock  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

from paged_backend import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from paged_backend.integrations.llama_index import PagedBackendLLM  # noqa: E402
from tests.conftest import peak_in_flight, save_tiny_checkpoint  # noqa: E402
from tests.fixtures.schemas import Cache  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402


@functools.cache
def shared_llm() -> LLM:
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("llama", vocab_size=len(tokenizer))
    model.config.max_position_embeddings = 2048  # LlamaIndex's prompt helper pads prompts by 500 tokens
    return LLM(model, tokenizer=tokenizer, block_size=8, num_kv_blocks=2048, max_model_len=2048)


def adapter(**kwargs: Any) -> PagedBackendLLM:
    kwargs = {"max_new_tokens": 12, "generate_kwargs": {"temperature": 0}, **kwargs}
    return PagedBackendLLM(backend=shared_llm(), **kwargs)


def greedy(prompt: Any, max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return shared_llm().generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_complete_in_all_four_forms() -> None:
    llm = adapter()
    expected = greedy("Hello world")
    assert expected and llm.complete("Hello world").text == expected
    deltas = [r.delta for r in llm.stream_complete("Hello world")]
    assert "".join(deltas) == expected

    async def both() -> tuple[str, str]:
        whole = (await llm.acomplete("Hello world")).text
        stream = await llm.astream_complete("Hello world")
        return whole, "".join([r.delta async for r in stream])

    assert asyncio.run(both()) == (expected, expected)
    wrapped = adapter(system_prompt="Be brief.", query_wrapper_prompt="Q: {query_str}\nA:")
    assert wrapped.complete("Hello").text == greedy("Be brief. Q: Hello\nA:")


def test_chat_uses_the_chat_template_in_all_four_forms() -> None:
    llm = adapter(is_chat_model=True)
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="hello")]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = shared_llm().chat(conversation, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    expected = expected[0].outputs[0].text
    assert llm.chat(messages).message.content == expected
    assert "".join(r.delta for r in llm.stream_chat(messages)) == expected

    async def both() -> tuple[str, str]:
        whole = (await llm.achat(messages)).message.content
        stream = await llm.astream_chat(messages)
        return whole, "".join([r.delta async for r in stream])

    assert asyncio.run(both()) == (expected, expected)


def test_metadata_and_bad_arguments() -> None:
    metadata = adapter(context_window=100_000).metadata
    assert metadata.context_window == 2048 and metadata.num_output == 12  # clamped to max_model_len
    assert adapter(context_window=300).metadata.context_window == 300
    with pytest.raises(ValueError, match="beams"):
        adapter(generate_kwargs={"beams": 2})
    with pytest.raises(ValueError, match="backend=<an LLM> or model="):
        PagedBackendLLM()
    with pytest.raises(TypeError, match="unknown keyword arguments"):
        adapter().complete("x", beams=2)
    image = ChatMessage(role="user", blocks=[TextBlock(text="what is in"), ImageBlock(url="http://example.com/a.png")])
    with pytest.raises(ValueError, match="only text content is supported, got a ImageBlock"):
        adapter(is_chat_model=True).chat([image])


def test_query_engine_sends_the_retrieved_context_to_the_engine() -> None:
    llm = adapter(max_new_tokens=8)
    engine = shared_llm().llm_engine
    seen: list[str] = []
    add_request = engine.add_request

    def recording_add_request(request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(prompt if isinstance(prompt, str) else prompt.get("prompt", ""))
        return add_request(request_id, prompt, *args, **kwargs)

    engine.add_request = recording_add_request
    try:
        docs = [Document(text="The paged cache stores keys in blocks of sixteen tokens."), Document(text="Zebras.")]
        index = VectorStoreIndex.from_documents(docs, embed_model=MockEmbedding(embed_dim=8))
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=1)
        response = query_engine.query("How big is a block?")
        retrieved = response.source_nodes[0].node.get_content()
        assert retrieved in seen[-1] and "How big is a block?" in seen[-1]
        assert response.response == greedy(seen[-1], 8)

        streaming = index.as_query_engine(llm=llm, similarity_top_k=1, streaming=True)
        streamed = streaming.query("How big is a block?")
        assert "".join(streamed.response_gen) == response.response

        assert asyncio.run(query_engine.aquery("How big is a block?")).response == response.response
    finally:
        engine.add_request = add_request


def test_concurrent_async_calls_share_steps() -> None:
    llm = adapter(max_new_tokens=20)

    async def many() -> list[str]:
        return [r.text for r in await asyncio.gather(*(llm.acomplete(f"question {i}") for i in range(6)))]

    with peak_in_flight(shared_llm().llm_engine, hold_until=6) as seen:
        texts = asyncio.run(many())
    assert texts == [greedy(f"question {i}", 20) for i in range(6)]
    assert seen["peak"] == 6  # the six awaited calls ran together


def test_built_lazily_from_a_model_path(tmp_path) -> None:
    save_tiny_checkpoint(tmp_path)
    llm = PagedBackendLLM(
        model=str(tmp_path),
        engine_kwargs={"block_size": 4, "num_kv_blocks": 64, "max_model_len": 128},
        max_new_tokens=4,
    )
    assert llm._client.built is None
    assert isinstance(llm.complete("hi").text, str) and llm._client.built is not None


@pytest.mark.parametrize("is_chat_model", [False, True], ids=["completion", "chat"])
def test_structured_predict_is_held_to_the_schema(is_chat_model: bool) -> None:
    """structured_predict, its async and streamed forms: the grammar, not prompting, makes the object (sampled
    with a seed and room to end: a random model wanders in JSON's optional whitespace)."""
    llm = adapter(max_new_tokens=300, generate_kwargs={"temperature": 1.0, "seed": 1}, is_chat_model=is_chat_model)
    prompt = PromptTemplate("Describe the {thing} as JSON.")
    assert isinstance(llm.structured_predict(Cache, prompt, thing="cache"), Cache)
    assert isinstance(asyncio.run(llm.astructured_predict(Cache, prompt, thing="cache")), Cache)
    (streamed,) = list(llm.stream_structured_predict(Cache, prompt, thing="cache"))
    assert isinstance(streamed, Cache)
    assert isinstance(llm.structured_predict(Cache, prompt, llm_kwargs={"seed": 7}, thing="cache"), Cache)


class WeatherArgs(BaseModel):
    city: Literal["Paris", "Oslo"]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def weather_tool() -> FunctionTool:
    return FunctionTool.from_defaults(fn=get_weather, fn_schema=WeatherArgs)


def test_function_calling_forced_whole_and_streamed() -> None:
    """A required call (tool_required, or tool_choice naming the tool) is held by a grammar: the response's
    ToolCallBlock parses into a ToolSelection, and predict_and_call runs the tool; streamed, no delta shows the
    call's JSON."""
    llm = adapter(max_new_tokens=120, generate_kwargs={"temperature": 1.0, "seed": 4})
    assert llm.metadata.is_function_calling_model
    tool = weather_tool()
    response = llm.chat_with_tools([tool], user_msg="weather?", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "get_weather" and call.tool_kwargs["city"] in ("Paris", "Oslo") and call.tool_id
    assert response.raw["finish_reason"] == "tool_calls" and not response.message.content
    named = llm.chat_with_tools([tool], user_msg="weather?", tool_choice="get_weather")
    assert llm.get_tool_calls_from_response(named)[0].tool_name == "get_weather"
    assert llm.predict_and_call([tool], user_msg="weather?", tool_required=True).response.startswith("sunny in ")
    responses = list(llm.stream_chat_with_tools([tool], user_msg="weather?", tool_required=True))
    assert all(not r.delta for r in responses[:-1]) and llm.get_tool_calls_from_response(responses[-1])
    with pytest.raises(ValueError, match="tool_choice must be one of the tools"):
        llm.chat_with_tools([tool], user_msg="weather?", tool_choice="nope")


def test_function_calling_auto_reads_the_models_text() -> None:
    """Not required: the hermes parser reads a call out of the text (made one by a regex), or leaves text."""
    llm = adapter(max_new_tokens=120, tool_call_parser="hermes")
    tool = weather_tool()
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    called = llm.chat_with_tools([tool], user_msg="weather?", structured_outputs=StructuredOutputsParams(regex=regex))
    (call,) = llm.get_tool_calls_from_response(called)
    assert (call.tool_name, call.tool_kwargs) == ("get_weather", {"city": "Paris"})
    plain = llm.chat_with_tools([tool], user_msg="weather?", structured_outputs=StructuredOutputsParams(regex="Hi"))
    assert plain.message.content == "Hi" and llm.get_tool_calls_from_response(plain, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(plain)
    with pytest.raises(ValueError, match="tool_call_parser"):  # the tiny template shows no tool-call marker
        adapter().chat_with_tools([tool], user_msg="weather?")


def test_tool_histories_reach_the_template() -> None:
    """An assistant message's ToolCallBlocks (arguments as objects) and a tool message's call id."""
    tokenizer = shared_llm().get_tokenizer()
    seen: list[list[dict]] = []
    original = tokenizer.apply_chat_template

    def spy(conversation, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(conversation)
        return original(conversation, **kwargs)

    history = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage(
            role="assistant",
            blocks=[ToolCallBlock(tool_call_id="c1", tool_name="get_weather", tool_kwargs={"city": "Oslo"})],
        ),  # fmt: skip
        ChatMessage(role="tool", content="sunny", additional_kwargs={"tool_call_id": "c1"}),
    ]
    tokenizer.apply_chat_template = spy
    try:
        adapter(max_new_tokens=1).chat(history)
    finally:
        del tokenizer.apply_chat_template
    _, assistant, tool = seen[-1]
    assert assistant["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
