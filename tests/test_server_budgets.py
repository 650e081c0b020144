"""What one request may cost everyone else, refused up front: the logprob entries a response could hold
(``--max-logprob-entries``, counted from the request before any work) and stop strings' total length."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.sampling_params import MAX_STOP_CHARS  # noqa: E402
from tests.test_server import KEY, NAME, serving, tiny_llm  # noqa: E402

HEADERS = {"Authorization": f"Bearer {KEY}"}
BUDGET = 5000


@pytest.fixture(scope="module")
def base(tokenizer):
    args = ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY, max_logprob_entries=BUDGET)
    with serving(tiny_llm(tokenizer), args) as url:
        yield url


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json={"model": NAME, **body}, headers=HEADERS, timeout=60)


def test_prompt_logprobs_past_the_budget_are_a_400_before_any_work(base) -> None:
    """64 prompts of 100 ids with 20 alternatives: 134,400 entries, refused; one prompt of them runs."""
    prompts = [[5 + i % 7] * 100 for i in range(64)]
    reply = post(base, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 20})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs", reply.text
    assert "134400 logprob entries" in reply.json()["error"]["message"] and "--max-logprob-entries" in reply.text
    one = post(base, "/v1/completions", {"prompt": prompts[:1], "max_tokens": 1, "prompt_logprobs": 20})
    assert one.status_code == 200 and len(one.json()["choices"][0]["prompt_logprobs"]) == 100


def test_sampled_logprobs_count_every_sample_and_the_default_length(base) -> None:
    """Each sample's tokens count, up to ``max_tokens`` or, unset, what the engine would run to: completions'
    default of 16 tokens, chat's ``max_model_len`` (128)."""
    completion = {"prompt": [5, 6], "logprobs": 20, "n": 2}
    assert post(base, "/v1/completions", {**completion, "max_tokens": 120}).status_code == 400  # 2 x 120 x 21
    assert post(base, "/v1/completions", completion).status_code == 200  # 2 x 16 x 21 = 672
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20, "n": 4}
    reply = post(base, "/v1/chat/completions", chat)  # 4 x (128 - prompt) x 21
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs", reply.text
    assert post(base, "/v1/chat/completions", {**chat, "max_tokens": 10}).status_code == 200


def test_stop_strings_past_their_total_length_are_a_400(base) -> None:
    stops = ["a" * (MAX_STOP_CHARS // 2), "b" * (MAX_STOP_CHARS // 2 + 1)]
    reply = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": stops})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stop", reply.text


def test_suffix_is_refused_not_dropped(base) -> None:
    reply = post(base, "/v1/completions", {"prompt": "def f(", "suffix": "return 1", "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "suffix", reply.text
    assert "suffix is not supported" in reply.json()["error"]["message"]
    assert post(base, "/v1/completions", {"prompt": "x", "suffix": None, "max_tokens": 1}).status_code == 200


def test_many_unknown_fields_make_one_short_warning(base, caplog) -> None:
    fields = {f"unknown_{i}_" + "k" * 200: i for i in range(1000)}
    with caplog.at_level("WARNING", logger="paged_backend.entrypoints.openai.api_server"):
        assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1, **fields}).status_code == 200
    (record,) = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert len(record.getMessage()) < 2000 and "and 984 more" in record.getMessage()


def read_response(sock) -> str:
    """One HTTP response: its head, then the Content-Length bytes of its body (which may come in segments of
    their own: one ``recv`` can return the head alone)."""
    data = b""
    while True:
        head, end, body = data.partition(b"\r\n\r\n")
        lengths = [
            int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
        ]
        if end and len(body) >= sum(lengths):
            return data.decode()
        chunk = sock.recv(4096)
        if not chunk:  # closed before the whole response
            return data.decode()
        data += chunk


@pytest.mark.exclusive  # the 408 is timed: with no other xdist worker running a test (tests/conftest.py)
def test_a_body_that_stalls_is_a_408(tokenizer) -> None:
    """A client that sends part of its body and then nothing: answered 408 after --body-read-timeout, not held."""
    import socket
    import time
    from urllib.parse import urlparse

    args = ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY, body_read_timeout=0.5)
    with serving(tiny_llm(tokenizer), args) as url:
        address = urlparse(url)
        with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            )
            sock.sendall(head.encode() + b'{"model": ')
            start = time.monotonic()
            answer = read_response(sock)
        assert answer.startswith("HTTP/1.1 408") and "--body-read-timeout" in answer, answer
        assert time.monotonic() - start < 5
