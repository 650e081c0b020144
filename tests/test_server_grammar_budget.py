"""The server's output grammars under a budget: caps checked before any compile (400 naming the field and the flag),
compiles in worker processes killed past ``--grammar-compile-timeout`` or when their requester leaves, and a
bounded compile queue (429)."""

from __future__ import annotations

import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from paged_backend.entrypoints.openai.cli_args import ServerArgs  # noqa: E402
from paged_backend.structured_output.grammar_budget import GrammarBudget  # noqa: E402
from tests.test_server import KEY, NAME, serving, tiny_llm  # noqa: E402

# compiles under a 1 s budget, raced against requests 0.3 s later: with no other xdist worker running a test
pytestmark = pytest.mark.exclusive

HEADERS = {"Authorization": f"Bearer {KEY}"}
BUDGET = GrammarBudget(
    max_bytes=1_000_000, max_choices=100_000, max_regex_length=100, compile_timeout_s=1.0, compile_workers=1,
    max_queued_compiles=0,
)  # fmt: skip


def enum_schema(values: int, tag: str = "") -> dict:
    """A schema whose compile takes long with many values (seconds at 30,000 with the tiny tokenizer)."""
    return {"type": "object", "properties": {"x": {"enum": [f"{tag}value{i}" for i in range(values)]}}}


@pytest.fixture(scope="module")
def served(tokenizer):
    llm = tiny_llm(tokenizer)
    with serving(llm, ServerArgs(model="tiny-path", served_model_name=NAME, api_key=KEY, grammar_budget=BUDGET)) as url:
        yield llm, url


def post(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 4, **body},
                      headers=HEADERS, timeout=timeout)  # fmt: skip


def compile_pool(llm):
    return llm._engine_loop.grammars.lanes[1]  # the large grammars' lane


@pytest.mark.parametrize(
    ("body", "param", "flag"),
    [
        ({"guided_json": {"type": "string", "pattern": "a" * 1_000_001}}, "guided_json", "--max-grammar-bytes"),
        ({"guided_choice": [str(i) for i in range(100_001)]}, "guided_choice", "--max-grammar-choices"),
        ({"structured_outputs": {"json": {"enum": list(range(100_001))}}}, "structured_outputs",
         "--max-grammar-choices"),
        ({"guided_regex": "a" * 101}, "guided_regex", "--max-grammar-regex-length"),
        ({"guided_json": {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "(a|b)" * 21}}}},
         "guided_json", "--max-grammar-regex-length"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "patternProperties": {"^k" + "[0-9]" * 30: {"type": "integer"}}}}}},
         "response_format", "--max-grammar-regex-length"),
    ],
)  # fmt: skip
def test_a_grammar_over_a_cap_is_a_400_before_any_compile(served, body: dict, param: str, flag: str) -> None:
    _, url = served
    start = time.perf_counter()
    reply = post(url, body)
    assert reply.status_code == 400 and flag in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"] == param and time.perf_counter() - start < 5


def test_a_compile_past_the_time_budget_fails_its_request_only(served) -> None:
    """The slow compile's worker is killed and replaced: its request gets a 400 naming the flag, a stream beside
    it finishes, and the next structured request compiles on the fresh worker."""
    _, url = served
    beside: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: beside.append(post(url, {"max_tokens": 40, "ignore_eos": True})))
    thread.start()
    reply = post(url, {"guided_json": enum_schema(40_000, "slow")})
    thread.join()
    assert reply.status_code == 400 and "--grammar-compile-timeout" in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"] == "guided_json"
    assert beside[0].status_code == 200 and beside[0].json()["usage"]["completion_tokens"] == 40
    small = post(url, {"guided_choice": ["yes", "no"]})
    assert small.status_code == 200 and small.json()["choices"][0]["text"] in ("yes", "no")


def test_a_compile_whose_requester_leaves_is_killed(served) -> None:
    llm, url = served
    post(url, {"guided_json": enum_schema(300, "warm")})  # the large grammars' lane has a worker, and it is ready
    pool = compile_pool(llm)
    (worker,) = pool.idle
    with pytest.raises(httpx.ReadTimeout):
        post(url, {"guided_json": enum_schema(40_000, "gone")}, timeout=0.3)
    deadline = time.monotonic() + 1.0
    while (pool.busy or worker.process.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.busy == 0 and not worker.process.is_alive()


def test_compiles_past_the_queue_bound_get_a_429(served) -> None:
    """One worker for large grammars and no queue: a large compile while another runs is refused at once, and a
    small one beside them compiles on its own lane."""
    _, url = served
    first: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: first.append(post(url, {"guided_json": enum_schema(40_000, "q")})))
    thread.start()
    time.sleep(0.3)
    second = post(url, {"guided_json": enum_schema(300, "other")})
    small = post(url, {"guided_json": enum_schema(10, "small")})
    thread.join()
    assert second.status_code == 429, second.text
    assert small.status_code == 200, small.text
    assert first[0].status_code == 400  # past the time budget


def test_a_worker_that_dies_costs_one_request_a_503_and_the_next_gets_a_fresh_one(served) -> None:
    import os
    import signal

    llm, url = served
    post(url, {"guided_json": enum_schema(300, "alive")})  # a ready worker in the large grammars' lane
    pool = compile_pool(llm)
    (idle,) = pool.idle
    os.kill(idle.process.pid, signal.SIGKILL)  # dies while idle: found dead, replaced
    idle.process.join(5)
    assert post(url, {"guided_json": enum_schema(300, "after idle death")}).status_code == 200
    (worker,) = pool.idle
    dying: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: dying.append(post(url, {"guided_json": enum_schema(40_000, "dies")})))
    thread.start()
    time.sleep(0.3)
    os.kill(worker.process.pid, signal.SIGKILL)  # dies mid-compile
    thread.join()
    assert dying[0].status_code == 503, dying[0].text
    assert post(url, {"guided_json": enum_schema(300, "after")}).status_code == 200


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_the_server_side_of_a_compile_runs_below_the_engine_s_priority(served) -> None:
    """Reading a large grammar back takes a core for a second or more: its threads yield to the engine's."""
    import os

    from paged_backend.structured_output.compile_pool import WORKER_NICENESS
    from paged_backend.structured_output.grammar_budget import SMALL_NICENESS

    llm, url = served
    post(url, {"guided_json": enum_schema(300, "nice")})  # the lanes' threads have started
    post(url, {"guided_json": enum_schema(3, "nice")})
    pool = compile_pool(llm)

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    engine_thread = llm._engine_loop.thread.native_id
    assert pool.threads.submit(priority).result() == min(19, priority() + WORKER_NICENESS)
    small = llm._engine_loop.grammars.lanes[0]  # small grammars, which a request waits on, at a higher priority
    assert small.threads.submit(priority).result() == min(19, priority() + SMALL_NICENESS) < WORKER_NICENESS
    assert os.getpriority(os.PRIO_PROCESS, engine_thread) == priority()  # the engine's thread kept its own
