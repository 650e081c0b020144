"""The LlamaIndex adapter on a tiny model: complete / chat in all four forms, metadata, a query engine over a
vector index whose retrieved context reaches the engine, and async calls sharing engine steps."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.embeddings import MockEmbedding  # noqa: E402
from llama_index.core.llms import ChatMessage, ImageBlock, TextBlock  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402

from paged_backend import LLM, SamplingParams  # noqa: E402
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
