"""Scoring through ``/v1/completions`` as evaluation harnesses ask for it: ``echo`` with ``logprobs`` returns the
prompt's tokens and their logprobs (OpenAI's legacy format) before the completion's, ``max_tokens: 0`` scores
only, vLLM's ``prompt_logprobs`` and ``return_tokens_as_token_ids``; the values are HF's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from paged_backend import LLM  # noqa: E402
from paged_backend.entrypoints.openai.api_server import build_app  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

PROMPT = [5, 87, 301, 42, 9, 150, 77]


@pytest.fixture(scope="module")
def client(tokenizer):
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, block_size=4, num_kv_blocks=256, max_model_len=64)
    with TestClient(build_app(llm, ServerArgs(model="tiny"))) as test_client:
        yield test_client


def hf_logprobs() -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(tiny_model("llama")(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def complete(client, **fields: object) -> dict:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(client, tokenizer) -> None:
    choice = complete(client, echo=True, logprobs=2, max_tokens=0)
    logprobs, expected = choice["logprobs"], hf_logprobs()
    assert choice["finish_reason"] == "length" and choice["text"] == tokenizer.decode(PROMPT)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in PROMPT]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, token in enumerate(PROMPT[1:], 1):
        assert logprobs["token_logprobs"][i] == pytest.approx(expected[i - 1, token].item(), abs=1e-4)
        assert len(logprobs["top_logprobs"][i]) in (2, 3)  # the top 2, and the actual token when not among them
    pieces = logprobs["tokens"]
    assert logprobs["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


def test_echo_then_the_completions_tokens(client) -> None:
    choice = complete(client, echo=True, logprobs=1, max_tokens=3, temperature=0)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3
    greedy = hf_logprobs()[-1].max().item()  # the first generated token is the argmax after the prompt
    assert logprobs["token_logprobs"][len(PROMPT)] == pytest.approx(greedy, abs=1e-4)
    offsets, pieces = logprobs["text_offset"], logprobs["tokens"]
    assert all(offsets[i + 1] == offsets[i] + len(pieces[i]) for i in range(len(pieces) - 1))


def test_streamed_echo_carries_the_prompts_logprobs_first(client) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= len(PROMPT)
    streamed = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"])
    assert streamed == len(PROMPT) + 2


def test_vllms_prompt_logprobs_and_tokens_as_ids(client) -> None:
    choice = complete(client, prompt_logprobs=1, logprobs=1, max_tokens=1, return_tokens_as_token_ids=True)
    prompt_logprobs, expected = choice["prompt_logprobs"], hf_logprobs()
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for i, token in enumerate(PROMPT[1:], 1):
        entry = prompt_logprobs[i][str(token)]
        assert entry["logprob"] == pytest.approx(expected[i - 1, token].item(), abs=1e-4)
        assert entry["rank"] >= 1
    assert all(token.startswith("token_id:") for token in choice["logprobs"]["tokens"])
    assert all(key.startswith("token_id:") for key in choice["logprobs"]["top_logprobs"][0])


def test_max_tokens_0_without_scoring_is_a_400(client) -> None:
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_tokenize_and_detokenize_as_vllm(client, tokenizer) -> None:
    text = "Hello world! How are you today?"
    response = client.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer(text).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = client.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(body["tokens"])}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    refused = client.post("/detokenize", json={"tokens": [10**6]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    unknown = client.post("/tokenize", json={"model": "other", "prompt": text})
    assert unknown.status_code == 404


def test_unknown_fields_are_ignored_with_one_warning(client, caplog) -> None:
    """lm-eval and other clients send fields of other servers (num_beams, max_new_tokens, version)."""
    with caplog.at_level("WARNING", logger="paged_backend.entrypoints.openai.api_server"):
        complete(client, max_tokens=1, num_beams=1, version="x")
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: ['num_beams', 'version']"]
    bad = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": "5", "x": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # known fields stay strict


def test_chat_content_as_text_parts(client, tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    as_parts = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    as_text = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello\nworld"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    refused = client.post("/tokenize", json={"messages": [{"role": "user", "content": image}]})
    assert refused.status_code == 400
