"""Data parallelism on a local Ray instance: two replicas of a tiny Llama (each a Ray actor with its own engine)
behind the OpenAI server. Every route answers through the front end as one engine answers; a shared prefix keeps to
one replica; a replica killed mid-run loses no non-streamed request, ends the streams it carried with an error event
and ``[DONE]``, and rejoins once Ray has restarted it. One Ray session for the module, shut down at its end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from paged_backend import LLM, SamplingParams  # noqa: E402
from paged_backend.entrypoints.data_parallel import DataParallelLLM  # noqa: E402
from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402
from tests.test_server import serving  # noqa: E402

NAME = "tiny"
ENGINE = dict(block_size=4, num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("dp-llama")
    build_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """One engine in this process: what every replica must answer."""
    llm = LLM(checkpoint, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def replicas(checkpoint):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # not another test's cluster
    try:
        llm = DataParallelLLM(checkpoint, data_parallel_size=2, **ENGINE)
        try:
            yield llm
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def base(replicas):
    with serving(replicas, ServerArgs(model="tiny-path", served_model_name=NAME)) as url:
        yield url


def admitted(llm: DataParallelLLM) -> list[int]:
    """Prompt tokens each replica has admitted so far."""
    return [r["stats"]["num_prompt_tokens_admitted"] for r in llm.stats()["replicas"]]


def greedy(reference: LLM, prompt: str, max_tokens: int) -> str:
    return (
        reference.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_every_route_answers_through_the_front_end(base, replicas, reference) -> None:
    prompt = "the quick brown fox jumps over"
    expected = greedy(reference, prompt, 6)
    with httpx.Client(base_url=base, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [NAME]
        assert client.get(f"/v1/models/{NAME}").json()["max_model_len"] == 256
        body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        events = sse_data(client.post("/v1/completions", json={**body, "stream": True}).text)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
        two = client.post("/v1/completions", json={**body, "prompt": [prompt, prompt + " again"]}).json()
        assert two["choices"][0]["text"] == expected and len(two["choices"]) == 2
        chat = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
        whole = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        events = sse_data(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == whole
        response = client.post("/v1/responses", json={"model": NAME, "input": "hello", "max_output_tokens": 5})
        assert response.status_code == 200 and response.json()["output"][0]["content"][0]["text"]
        messages = {"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
        message = client.post("/v1/messages", json=messages)
        assert message.status_code == 200 and message.json()["type"] == "message"
        tokens = client.post("/tokenize", json={"model": NAME, "prompt": prompt}).json()["tokens"]
        assert client.post("/detokenize", json={"model": NAME, "tokens": tokens}).json()["prompt"].endswith(prompt)
        bad = client.post("/v1/completions", json={**body, "temperature": -1})
        assert bad.status_code == 400  # a replica's ValueError, as one engine's
        health = client.get("/health").json()
        assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["running", "running"]
        metrics = client.get("/metrics").text
        assert 'paged_backend:replica_up{model_name="tiny",replica="1",state="running"} 1.0' in metrics
        long = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as response:
            next(response.iter_lines())  # the client leaves mid-stream: its replica aborts the request
    assert_idle(replicas)


def assert_idle(llm: DataParallelLLM, patience_s: float = 30.0) -> None:
    """Every replica's blocks free and nothing queued (an abort reaches its replica a moment later)."""
    deadline = time.monotonic() + patience_s
    while True:
        stats = llm.stats()
        idle = stats["num_free_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == stats["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle and not llm.replica_set.tickets, stats


def test_a_shared_prefix_keeps_to_one_replica(replicas) -> None:
    """Requests sharing their first blocks go where the first went; another prefix goes to the other replica."""
    system = list(range(10, 42))  # 8 blocks of 4 tokens
    other = list(range(100, 132))
    before = admitted(replicas)
    params = SamplingParams(temperature=0, max_tokens=2)
    replicas.generate([{"prompt_token_ids": system + [200 + i]} for i in range(6)], params)
    first = [a - b for a, b in zip(admitted(replicas), before)]
    assert sorted(first)[0] == 0 and sorted(first)[1] > 0  # all six on one replica
    replicas.generate([{"prompt_token_ids": other + [300 + i]} for i in range(6)], params)
    second = [a - b for a, b in zip(admitted(replicas), before)]
    assert all(second)  # the new prefix went to the idle replica's cache
    replicas.generate([{"prompt_token_ids": system + [400 + i]} for i in range(6)], params)
    third = [a - b for a, b in zip(admitted(replicas), before)]
    assert [t - s > 0 for t, s in zip(third, second)] == [f > 0 for f in first]  # back to the first replica
    assert_idle(replicas)


def test_a_killed_replica_loses_no_whole_request_and_rejoins(base, replicas, reference) -> None:
    """The replica carrying a stream is killed while it also runs whole requests: every whole request still gets
    one engine's greedy answer (run again on the other replica), the stream ends with an error event and
    ``[DONE]``, and the replica comes back and takes requests."""
    prompts = [[50 + 7 * i, 51, 52, 53, 54 + i] for i in range(10)]  # first blocks all differ: spread by load
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate([{"prompt_token_ids": p} for p in prompts], params)]
    tickets = replicas.replica_set.tickets
    events: list[str] = []
    started = threading.Event()

    def streamed() -> None:
        body = {"model": NAME, "prompt": [9, 8, 7], "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    started.set()

    def whole(prompt: list[int]) -> str:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    stream_thread = threading.Thread(target=streamed)
    stream_thread.start()
    assert started.wait(30)
    victim = next(t.replica for t in list(tickets.values()) if t.stream)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(whole, p) for p in prompts]
        deadline = time.monotonic() + 60
        while sum(t.replica == victim and not t.stream and t.generator is not None for t in list(tickets.values())) < 3:
            assert time.monotonic() < deadline, "the whole requests never reached the stream's replica"
            time.sleep(0.01)
        time.sleep(0.1)  # their first tokens are out
        os.kill(replicas.replica_set.replicas.items[victim].pid, signal.SIGKILL)
        texts = [f.result() for f in futures]
    stream_thread.join(timeout=60)
    assert texts == expected
    assert replicas.replica_set.num_resumed >= 3  # running on the victim when it died, then on the other replica
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert f"replica {victim} died" in error["message"] and error["code"] == 500
    deadline = time.monotonic() + 180
    while (health := httpx.get(f"{base}/health", timeout=10).json())["replicas"][victim]["restarts"] < 1:
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    assert health["status"] == "ok" and health["replicas"][victim]["state"] == "running"
    assert 'paged_backend:request_retries_total{model_name="tiny"}' in httpx.get(f"{base}/metrics").text
    before = admitted(replicas)
    replicas.generate([{"prompt_token_ids": [60 + 9 * i, 1, 2, 3, 4]} for i in range(4)], SamplingParams(max_tokens=2))
    assert admitted(replicas)[victim] > before[victim]  # the restarted replica takes requests again
    assert_idle(replicas)


def test_replicas_stats_add_up_counters_and_each_position_of_the_taken_proposals() -> None:
    from paged_backend.entrypoints.data_parallel.replicas import summed_stats

    def replica(drafts: int, per_pos: list[int]) -> dict:
        return {"block_size": 16, "kv_waste_fraction": 0.5, "num_prompt_tokens_cached": 1,
                "num_prompt_tokens_admitted": 4, "spec_decode_num_drafts": drafts,
                "spec_decode_num_accepted_tokens_per_pos": per_pos}  # fmt: skip

    older = replica(2, [])
    del older["spec_decode_num_accepted_tokens_per_pos"]  # a replica whose stats lack the positions adds none
    total = summed_stats([replica(3, [3, 2, 0]), replica(5, [4, 1, 1, 1]), older], [])
    assert total["spec_decode_num_drafts"] == 10 and total["prefix_cache_hit_rate"] == 0.25
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [7, 3, 1, 1]
    assert summed_stats([], [])["spec_decode_num_accepted_tokens_per_pos"] == []
