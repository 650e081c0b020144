"""Token in, token out: a multi-turn rollout appends the environment's tokens to the exact ids sampled so far
(``LLM.generate``'s ``outputs[i].token_ids`` and ``{"prompt_token_ids": ...}``; the server's vLLM field
``return_token_ids``). The sampled turn here decodes to text that encodes to other ids, so a next turn built from
the text would not continue from what was sampled."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import hf_greedy, tiny_model  # noqa: E402
from tests.test_server import serving  # noqa: E402

NAME = "tiny"
PROMPT = "The paged cache keeps"
ENV = " the tool answered 42."  # the environment's turn, appended as its own tokens
TURN = 8


def retokenized(tokenizer, ids: list[int]) -> list[int]:
    return list(tokenizer(tokenizer.decode(ids), add_special_tokens=False).input_ids)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=TURN, ignore_eos=True)


def a_turn_text_would_change(llm: LLM, tokenizer, prompt_ids: list[int]) -> tuple[int, list[int]]:
    """The first seed (of 0, 1, ...) whose sampled turn does not survive decode -> encode, and that turn."""
    for seed in range(20):
        out = llm.generate({"prompt_token_ids": prompt_ids}, sampled(seed), use_tqdm=False)[0].outputs[0]
        if retokenized(tokenizer, list(out.token_ids)) != list(out.token_ids):
            return seed, list(out.token_ids)
    raise AssertionError("no sampled turn changes under decode -> encode")


@pytest.fixture(scope="module")
def llm(tokenizer) -> Iterator[LLM]:
    engine = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, max_model_len=128)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(llm) -> Iterator[str]:
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME)) as url:
        yield url


def test_llm_continues_from_the_sampled_ids_not_their_text(llm, tokenizer) -> None:
    prompt_ids = list(tokenizer(PROMPT).input_ids)
    _, turn = a_turn_text_would_change(llm, tokenizer, prompt_ids)
    env = list(tokenizer(ENV, add_special_tokens=False).input_ids)
    history = prompt_ids + turn + env
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": history}, greedy, use_tqdm=False)
    assert out.prompt_token_ids == history  # the engine ran exactly these ids
    assert list(out.outputs[0].token_ids) == hf_greedy(tiny_model("llama"), history, 6)
    from_text = list(tokenizer(tokenizer.decode(prompt_ids + turn, skip_special_tokens=True) + ENV).input_ids)
    assert from_text != history  # what re-tokenizing the conversation would have run instead


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json={"model": NAME, **body}, timeout=60)


def events(base: str, path: str, body: dict) -> list[dict]:
    lines = post(base, path, {**body, "stream": True}).text.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_the_server_returns_and_takes_the_exact_ids(llm, base, tokenizer) -> None:
    prompt_ids = list(tokenizer(PROMPT).input_ids)
    seed, turn = a_turn_text_would_change(llm, tokenizer, prompt_ids)
    body = {"prompt": PROMPT, "max_tokens": TURN, "seed": seed, "ignore_eos": True, "return_token_ids": True}
    (choice,) = post(base, "/v1/completions", {**body, "logprobs": 0, "return_tokens_as_token_ids": True}).json()[
        "choices"
    ]
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == turn
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == turn
    chunks = [c["choices"][0] for c in events(base, "/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == turn

    history = prompt_ids + turn + list(tokenizer(ENV, add_special_tokens=False).input_ids)
    nxt = {"prompt": history, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    (choice,) = post(base, "/v1/completions", nxt).json()["choices"]
    assert choice["prompt_token_ids"] == history
    assert choice["token_ids"] == hf_greedy(tiny_model("llama"), history, 6)
    assert "token_ids" not in post(base, "/v1/completions", {**nxt, "return_token_ids": False}).json()["choices"][0]

    bad = post(base, "/v1/completions", {**nxt, "return_token_ids": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_ids"


def test_chat_returns_the_prompts_ids_on_the_response_and_the_sampled_ones_per_choice(llm, base) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    expected = llm.chat(messages, sampled(3), use_tqdm=False)[0]
    body = {"messages": messages, "max_tokens": TURN, "seed": 3, "ignore_eos": True, "return_token_ids": True}
    whole = post(base, "/v1/chat/completions", body).json()
    assert whole["prompt_token_ids"] == expected.prompt_token_ids
    assert whole["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
    chunks = events(base, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == expected.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks[1:] for choice in c["choices"] for t in choice["token_ids"]]
    assert streamed == list(expected.outputs[0].token_ids)
    plain = post(base, "/v1/chat/completions", {**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
