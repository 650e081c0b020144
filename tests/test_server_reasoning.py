"""Reasoning parsers (``--reasoning-parser``) and ``chat_template_kwargs``: a thinking model's ``<think>...</think>``
goes to ``reasoning_content``, whole or streamed (the deltas concatenate to the whole message's parts, wherever
the pieces cut the tags), and extra template variables reach the chat template."""

from __future__ import annotations

import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.reasoning import ReasoningSplitter, split_reasoning  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_server import KEY, NAME, serving  # noqa: E402

TEXTS = [
    "<think>\nhmm ok</think>\n\nHello <think> world",
    "I think so.</think>\n\nThe answer",
    "  <think>a</think>b",
    "plain text only",
    "<thi",
    "<think>never closed",
    "</think>x",
    "a</thi",
]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_streamed_pieces_split_as_the_whole_does(parser: str) -> None:
    for text in TEXTS:
        whole = split_reasoning(parser, text)
        for cut in range(1, 8):
            splitter, reasoning, content = ReasoningSplitter(parser), "", ""
            pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
            for k, piece in enumerate(pieces):
                r, c = splitter.feed(piece, final=k == len(pieces) - 1)
                reasoning, content = reasoning + r, content + c
            assert (reasoning or None, content) == whole, (text, cut)


def test_what_each_parser_calls_reasoning() -> None:
    assert split_reasoning("qwen3", "<think>plan</think>answer") == ("plan", "answer")
    assert split_reasoning("qwen3", "no thinking") == (None, "no thinking")  # enable_thinking: false
    assert split_reasoning("deepseek_r1", "plan</think>answer") == ("plan", "answer")  # the template opened it
    assert split_reasoning("deepseek_r1", "<think>plan</think>answer") == ("plan", "answer")
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningSplitter("r2")


TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{{ (flavour | default(''))[:40] }}"


@pytest.fixture(scope="module")
def client(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=512, max_model_len=256)
    args = ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY, reasoning_parser="qwen3",
                      chat_template=TEMPLATE)  # fmt: skip
    with serving(llm, args) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_reasoning_content_whole_and_streamed(client) -> None:
    """The output is held by a regex to thinking then an answer: the message splits them, and so do the deltas."""
    pattern = r"<think>[a-z]{3,6}</think>[a-z]{2,8}"
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "think"}], max_tokens=40, temperature=1.0, seed=4,
                  extra_body={"structured_outputs": {"regex": pattern}})  # fmt: skip
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{3,6}", reasoning) and re.fullmatch("[a-z]{2,8}", message.content)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert (streamed_reasoning, "".join(d.content or "" for d in deltas)) == (reasoning, message.content)


def test_chat_template_kwargs_reach_the_template(client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    extra = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"flavour": "more words"}}
    )
    assert extra.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="the tokenizer's special tokens") as info:
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": {"bos_token": "<evil>"}}
        )
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_a_template_error_that_chat_template_kwargs_cause_names_them(client) -> None:
    """The template slices ``flavour``: a number there fails the template, and the 400 blames the variables,
    not the messages (which render without them)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"flavour": 5}})  # fmt: skip
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "chat template failed" in info.value.body["message"]  # type: ignore[index]
