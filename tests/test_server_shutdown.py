"""SIGTERM and Ctrl-C on a real ``python -m paged_backend.entrypoints.openai.api_server`` process: streams in
flight end (finished, or with an error event once ``--shutdown-timeout`` has passed), the process exits 0 and
stderr holds no traceback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.conftest import save_tiny_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_LEN = 512  # the tiny model's own limit: streams of ~500 tokens, far longer than the shutdown timeout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runtime") / "model"
    save_tiny_checkpoint(path)
    return path


class ServerProcess:
    """``python -m paged_backend.entrypoints.openai.api_server`` on a free port; stderr read line by line, each
    line with the time it arrived."""

    def __init__(self, model: Path, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "paged_backend.entrypoints.openai.api_server", "--model", str(model)]
        command += ["--port", str(self.port), "--max-model-len", str(MAX_LEN), "--num-kv-blocks", "2048", *flags]
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.base = f"http://127.0.0.1:{self.port}"
        give_up = time.monotonic() + 300  # only stops a server that never starts
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited {self.proc.returncode}: {self.stderr[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        pytest.fail("the server did not start")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def logged_at(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(10)


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
    server = ServerProcess(checkpoint, "--served-model-name", "m", "--shutdown-timeout", str(grace))

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
    server = ServerProcess(checkpoint, "--served-model-name", "m", "--shutdown-timeout", "60")

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
