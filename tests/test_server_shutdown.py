"""SIGTERM and Ctrl-C on a real ``python -m paged_backend.entrypoints.openai.api_server`` process: streams in
flight end (finished, or with an error event once ``--shutdown-timeout`` has passed), the process exits 0 and
stderr holds no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.conftest import save_tiny_checkpoint  # noqa: E402
from tests.fixtures.server_process import ServerProcess  # noqa: E402

# exits timed from the signal: with no other xdist worker running a test (tests/conftest.py)
pytestmark = pytest.mark.exclusive

MAX_LEN = 512  # the tiny model's own limit: streams of ~500 tokens, far longer than the shutdown timeout
LIMITS = ("--max-model-len", str(MAX_LEN), "--num-kv-blocks", "2048")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runtime") / "model"
    save_tiny_checkpoint(path)
    return path


async def open_streams(base: str, count: int) -> tuple[list[asyncio.Task[list[str]]], Any]:
    """``count`` long streams, returned once each has had its first event."""
    client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=count + 8))
    started: set[int] = set()

    async def one(i: int) -> list[str]:
        body = {"model": "m", "prompt": f"stream {i}", "max_tokens": MAX_LEN - 16, "stream": True, "ignore_eos": True}
        events = []
        async with client.stream("POST", base + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.add(i)
        return events

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    while len(started) < count:
        ended = [task for task in tasks if task.done()]
        assert not ended, f"a stream ended before its first event: {ended[0].result()!r}"
        await asyncio.sleep(0.02)
    return tasks, client


def test_sigterm_under_32_streams_ends_each_and_exits_0(checkpoint) -> None:
    """In-flight streams get --shutdown-timeout to finish, then end with an error event and [DONE]; new
    connections are refused meanwhile; the process joins the engine thread and exits 0, without a traceback."""
    grace = 1.0
    server = ServerProcess(checkpoint, *LIMITS, "--served-model-name", "m", "--shutdown-timeout", str(grace))

    async def main() -> tuple[list[Any], float]:
        tasks, client = await open_streams(server.base, 32)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        return results, sent

    results, sent = asyncio.run(main())
    assert server.wait(60) == 0, server.stderr[-3000:]
    assert "Traceback" not in server.stderr, server.stderr[-3000:]
    if "OMP_NUM_THREADS" not in server.env:  # one core left to the HTTP side (launch.engine_cpu_threads)
        cores = len(os.sched_getaffinity(0))
        assert f"the engine computes on {max(1, cores - 1)} threads" in server.stderr, server.stderr[-3000:]
    endings = []
    for events in results:
        assert not isinstance(events, BaseException), events
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        endings.append(last["error"]["code"] if "error" in last else last["choices"][0]["finish_reason"])
    assert set(endings) <= {503, "length"} and 503 in endings, endings  # aborted at the deadline, or finished
    finished = server.logged_at("Finished server process")  # after the app's shutdown: the engine thread joined
    assert finished is not None and finished - sent < grace + 2.0, (finished - sent, server.stderr[-2000:])


def test_a_second_signal_stops_at_once(checkpoint) -> None:
    server = ServerProcess(checkpoint, *LIMITS, "--served-model-name", "m", "--shutdown-timeout", "60")

    async def main() -> float:
        tasks, client = await open_streams(server.base, 8)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        await asyncio.gather(*tasks, return_exceptions=True)  # their connections are closed
        await client.aclose()
        return sent

    sent = asyncio.run(main())
    assert server.wait(60) == 0, server.stderr[-3000:]
    assert "Traceback" not in server.stderr, server.stderr[-3000:]
    finished = server.logged_at("Finished server process")
    # not the 60 s of the timeout (about 0.1 s when measured; 10 s leaves a loaded machine room)
    assert finished is not None and finished - sent < 10.0, server.stderr[-2000:]


def test_sigterm_while_a_grammar_compiles_exits_at_once(checkpoint) -> None:
    """A compile runs in a worker process that nothing can interrupt but a kill: shutdown kills it rather than
    wait for it (a compile given 600 s here), and exits 0 without a traceback."""
    flags = ("--max-grammar-choices", "1000000", "--max-grammar-bytes", "100000000", "--grammar-compile-timeout", "600")
    server = ServerProcess(checkpoint, *LIMITS, "--served-model-name", "m", *flags)
    schema = {"type": "object", "properties": {"x": {"enum": [f"value{i}" for i in range(200_000)]}}}
    body = {"model": "m", "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": schema}}

    async def main() -> float:
        async with httpx.AsyncClient(timeout=120) as client:
            request = asyncio.create_task(client.post(server.base + "/v1/completions", json=body))
            await asyncio.sleep(2.0)  # the compile under way
            assert not request.done(), request.result().text
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(request, return_exceptions=True)
            return sent

    sent = asyncio.run(main())
    assert server.wait(60) == 0, server.stderr[-3000:]
    finished = server.logged_at("Finished server process")
    assert finished is not None and finished - sent < 10.0, server.stderr[-2000:]
