"""The OpenAI server with the official ``openai`` client: uvicorn on 127.0.0.1 in a thread, a tiny model."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

KEY = "secret"
NAME = "tiny"


@contextlib.contextmanager
def serving(llm: LLM, args: ServerArgs) -> Iterator[str]:
    """uvicorn on a free port of 127.0.0.1, in a thread; yields the base URL."""
    instance = uvicorn.Server(uvicorn.Config(build_app(llm, args), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not instance.started and time.time() < deadline:
        time.sleep(0.05)
    port = instance.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        instance.should_exit = True
        thread.join(timeout=10)


def tiny_llm(tokenizer) -> LLM:
    return LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=128)


@pytest.fixture(scope="module")
def server(tokenizer):
    llm = tiny_llm(tokenizer)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY)) as base:
        yield llm, base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_completion_equals_the_engine_and_streams_the_same_text(server, client) -> None:
    llm, _ = server
    expected = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    result = client.completions.create(model=NAME, prompt="Hello world", max_tokens=12, temperature=0)
    assert result.choices[0].text == expected.outputs[0].text
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="Hello world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_several_prompts_n_and_echo(client) -> None:
    result = client.completions.create(
        model=NAME, prompt=["a b", "c d"], max_tokens=5, temperature=1.0, n=2, seed=3, echo=True
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert all(c.text.startswith("a b") for c in result.choices[:2])
    tokens = client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2)
    logprobs = tokens.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)


def test_chat_and_streaming_chat(client) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    result = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert result.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == result.choices[0].message.content


def test_logit_bias_is_honoured_in_completions_and_chat(server, client) -> None:
    """OpenAI's ``logit_bias`` (token id strings -> [-100, 100]): +100 makes greedy output that token, -100
    removes the token greedy decoding chose; a bias out of range or a key that is no token id is a 400 naming
    the field."""
    tokenizer = server[0].get_tokenizer()
    forced = client.completions.create(
        model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, logit_bias={"100": 100},
        extra_body={"return_tokens_as_token_ids": True}, logprobs=0,
    )  # fmt: skip
    assert forced.choices[0].logprobs.tokens == ["token_id:100"] * 4
    free = client.completions.create(
        model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    free_first = free.choices[0].logprobs.tokens[0]  # the unbiased first token, as token_id:N
    assert free_first != "token_id:100"
    barred = client.completions.create(
        model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0,
        logit_bias={free_first.removeprefix("token_id:"): -100}, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert free_first not in barred.choices[0].logprobs.tokens
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logit_bias={"100": 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == tokenizer.decode([100] * 3)
    for bias in ({"5": 101}, {"5": -100.5}, {"five": 1}, {"5": "1"}):
        with pytest.raises(openai.BadRequestError, match="logit_bias") as error:
            client.completions.create(model=NAME, prompt="x", max_tokens=2, logit_bias=bias)
        assert error.value.body["param"].startswith("logit_bias"), error.value.body
    with pytest.raises(openai.BadRequestError, match=r"logit_bias's token ids must be in \[0, 512\)"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, logit_bias={"512": 1})


def test_a_model_is_retrieved_by_its_name(client) -> None:
    """OpenAI's ``models.retrieve``: the served name, or the --model it was loaded from, gives the card; another
    name is a 404 naming what is served."""
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.model_dump()["max_model_len"] == 128
    assert client.models.retrieve("tiny-path").id == NAME
    with pytest.raises(openai.NotFoundError, match=f"served: `{NAME}`"):
        client.models.retrieve("org/other")


def test_error_bodies(server, client) -> None:
    with pytest.raises(openai.NotFoundError, match=f"The model `other` does not exist; served: `{NAME}`"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=NAME, prompt="x", max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=2)
    # token ids past max_model_len without max_tokens: refused by the server, before the engine sees them
    with pytest.raises(openai.BadRequestError, match="the prompt has 200 tokens") as too_long:
        client.completions.create(model=NAME, prompt=[5] * 200)
    assert too_long.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match=r"requested 1000000003 tokens \(3 in the prompt"):
        client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="prompt: must be a string"):
        client.completions.create(model=NAME, prompt=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"temperature": "hot"})
    # an unknown top-level field is ignored (with a logged warning), as vLLM does
    client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"unknown_field": 1})
    wrong = openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    response = httpx.post(
        server[1] + "/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 400 and "error" in response.json()
    assert httpx.get(server[1] + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [NAME]


def test_disconnected_stream_frees_its_blocks(server, client) -> None:
    llm, _ = server
    stream = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=100, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        stats = llm.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        time.sleep(0.05)
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_kv_blocks"]
    text = httpx.get(server[1] + "/metrics").text
    assert f'paged_backend:num_requests_running{{model_name="{NAME}"}} 0.0' in text
    assert f'paged_backend:kv_cache_usage_perc{{model_name="{NAME}"}} 0.0' in text
    assert "paged_backend:time_to_first_token_seconds_count" in text
    generated = [line for line in text.splitlines() if line.startswith("paged_backend:generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) > 0


def test_concurrent_async_streams_and_disconnects(server) -> None:
    """64 async streaming clients each get exactly their 8 tokens while 16 more leave after their first chunk;
    afterwards nothing runs and every block is free."""
    import asyncio

    llm, base = server
    extra = {"ignore_eos": True}

    async def main() -> list[int | None]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def full(i: int) -> int:
            stream = await client.completions.create(
                model=NAME,
                prompt=f"client {i}",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            chunks = [chunk async for chunk in stream]
            return chunks[-1].usage.completion_tokens

        async def leave(i: int) -> None:
            stream = await client.completions.create(
                model=NAME, prompt=f"leaver {i}", max_tokens=100, temperature=0, stream=True, extra_body=extra
            )
            async for _ in stream:
                break
            await stream.close()

        results = await asyncio.gather(*[full(i) for i in range(64)], *[leave(i) for i in range(16)])
        await client.close()
        return results[:64]

    assert asyncio.run(main()) == [8] * 64
    deadline = time.time() + 15
    while time.time() < deadline and llm.stats()["num_running"]:
        time.sleep(0.05)
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]


def gate_steps(llm: LLM, fail: bool = False) -> tuple[threading.Event, threading.Event]:
    """Hold every engine step until ``release`` is set (then raise, when ``fail``); ``entered`` tells when the
    first step has begun, i.e. when the request that triggered it is queued."""
    engine, entered, release = llm.llm_engine, threading.Event(), threading.Event()
    step = engine.step

    def held_step(*args, **kwargs):
        entered.set()
        release.wait(timeout=30)
        if fail:
            raise RuntimeError("device lost")
        return step(*args, **kwargs)

    engine.step = held_step
    return entered, release


def test_full_waiting_queue_answers_429(tokenizer) -> None:
    llm = tiny_llm(tokenizer)
    entered, release = gate_steps(llm)
    with serving(llm, ServerArgs(model="tiny", max_waiting_requests=1)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        first: list = []
        worker = threading.Thread(
            target=lambda: first.append(client.completions.create(model="tiny", prompt="a b", max_tokens=3))
        )
        worker.start()
        assert entered.wait(timeout=30)  # the first request waits in the scheduler; its step is held
        with pytest.raises(openai.RateLimitError, match="max_waiting_requests") as caught:
            client.completions.create(model="tiny", prompt="c d", max_tokens=3)
        assert caught.value.body["code"] == 429
        release.set()
        worker.join(timeout=30)
        assert first and first[0].usage.completion_tokens == 3


def test_dead_engine_answers_503(tokenizer) -> None:
    llm = tiny_llm(tokenizer)
    _, release = gate_steps(llm, fail=True)
    release.set()
    with serving(llm, ServerArgs(model="tiny")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="device lost") as caught:
            client.completions.create(model="tiny", prompt="a b", max_tokens=3)  # the step fails under it
        assert caught.value.status_code == 503
        assert httpx.get(base + "/health").status_code == 503
        with pytest.raises(openai.InternalServerError, match="not running"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_stream_whose_engine_dies_ends_with_an_error_event(tokenizer) -> None:
    llm = tiny_llm(tokenizer)
    _, release = gate_steps(llm, fail=True)
    release.set()
    with serving(llm, ServerArgs(model="tiny")) as base:
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 3, "stream": True}
        response = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200  # sent before the engine failed
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "device lost" in error["message"]


def test_langchain_chat_openai_against_the_server(server, client) -> None:
    """LangChain's ChatOpenAI, pointed at the server, gets the server's own greedy text, whole and streamed."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        base_url=server[1] + "/v1", api_key=KEY, model=NAME, temperature=0, max_tokens=10, max_retries=0
    )
    messages = [{"role": "user", "content": "Hello there"}]
    expected = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert expected.choices[0].message.content  # something to compare
    reply = chat.invoke([("user", "Hello there")])
    assert reply.content == expected.choices[0].message.content
    assert reply.usage_metadata["output_tokens"] == expected.usage.completion_tokens
    assert "".join(chunk.content for chunk in chat.stream([("user", "Hello there")])) == reply.content


def test_streamed_logprobs_equal_the_whole_response(client) -> None:
    whole = client.completions.create(model=NAME, prompt="Hello world", max_tokens=9, temperature=0, logprobs=2)
    chunks = client.completions.create(
        model=NAME, prompt="Hello world", max_tokens=9, temperature=0, logprobs=2, stream=True
    )
    tokens, token_logprobs, top, offsets = [], [], [], []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
            token_logprobs += chunk.choices[0].logprobs.token_logprobs
            top += chunk.choices[0].logprobs.top_logprobs
    assert len(tokens) == 9
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset
    # the second run's prompt comes from the prefix cache: equal up to float rounding
    assert token_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert [list(t) for t in top] == [list(t) for t in whole.choices[0].logprobs.top_logprobs]
    for mine, theirs in zip(top, whole.choices[0].logprobs.top_logprobs):
        assert mine == pytest.approx(theirs, abs=1e-4)

    messages = [{"role": "user", "content": "Hello there"}]
    kwargs = dict(model=NAME, messages=messages, max_tokens=9, temperature=0, logprobs=True, top_logprobs=2)
    whole_chat = client.chat.completions.create(**kwargs)
    streamed = [
        entry
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content
    ]
    assert len(streamed) == whole_chat.usage.completion_tokens
    expected = whole_chat.choices[0].logprobs.content
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in expected
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
