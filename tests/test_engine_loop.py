"""The server's engine loop with a scripted engine: handlers never block the event loop on a step in progress,
adds are all or none, a full queue and a dead engine raise their own errors."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from paged_backend.engine.engine_loop import EngineDeadError, EngineLoop, QueueFullError
from paged_backend.outputs import CompletionOutput, RequestOutput
from paged_backend.sampling_params import SamplingParams

# steps held for a while, sleeps that let threads queue their adds: timed with no other xdist worker running a test
pytestmark = pytest.mark.exclusive

PARAMS = SamplingParams(max_tokens=1)


class ScriptedEngine:
    """Each step finishes every request with one token; ``gate`` (when set up) holds a step until released."""

    def __init__(self, fail_step: bool = False) -> None:
        self.requests: dict[str, list[int]] = {}
        self.device = torch.device("cpu")
        self.scheduler = SimpleNamespace(waiting=[])
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()
        self.fail_step = fail_step
        self.aborted: list[str] = []
        self.steps = 0
        self.finish = True

    def add_request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("prompt_token_ids must not be empty")
        self.requests[request_id] = prompt["prompt_token_ids"]

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.requests)}

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        self.steps += 1
        self.in_step.set()
        if self.gate is not None:
            self.gate.wait(timeout=30)
        if self.fail_step:
            raise RuntimeError("device lost")
        outputs = [
            RequestOutput(rid, None, ids, [CompletionOutput(0, "x", [7], 0.0, None, "length")], self.finish)
            for rid, ids in self.requests.items()
        ]
        if self.finish:
            self.requests.clear()
        else:
            time.sleep(0.01)  # a step takes a while
        return outputs


async def collect(loop: EngineLoop, request_id: str, queue: asyncio.Queue) -> list[RequestOutput]:
    return [out async for out in loop.stream(request_id, queue)]


def test_event_loop_stays_responsive_while_a_step_runs() -> None:
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    loop = EngineLoop(engine)

    async def main() -> None:
        (first,) = await loop.add([("a", {"prompt_token_ids": [1, 2]})], PARAMS)
        assert await asyncio.to_thread(engine.in_step.wait, 10)  # the step now holds the engine
        release = threading.Timer(3.0, engine.gate.set)
        release.start()
        second = asyncio.create_task(loop.add([("b", {"prompt_token_ids": [3]})], PARAMS))
        started = time.perf_counter()
        await asyncio.sleep(0.05)
        stats = asyncio.create_task(loop.stats())
        await asyncio.sleep(0.05)
        # The event loop ran both sleeps while the step held the engine; the add waits for the step to end.
        assert time.perf_counter() - started < 1.5
        assert not second.done() and not stats.done()
        (queue_b,) = await second
        assert [o.request_id for o in await collect(loop, "a", first)] == ["a"]
        assert [o.outputs[0].token_ids for o in await collect(loop, "b", queue_b)] == [[7]]
        assert (await stats)["num_running"] >= 0
        release.cancel()

    asyncio.run(main())
    loop.shutdown()


def test_add_is_all_or_none_and_a_full_queue_raises() -> None:
    engine = ScriptedEngine()
    loop = EngineLoop(engine, max_waiting_requests=2)

    async def main() -> None:
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await loop.add([("ok", {"prompt_token_ids": [1]}), ("bad", {"prompt_token_ids": []})], PARAMS)
        assert "ok" in engine.aborted and not engine.requests
        engine.scheduler.waiting = ["w1", "w2"]
        with pytest.raises(QueueFullError, match="max_waiting_requests"):
            await loop.add([("late", {"prompt_token_ids": [1]})], PARAMS)
        assert "late" not in engine.requests

    asyncio.run(main())
    loop.shutdown()


def test_a_failing_step_fails_its_streams_and_every_later_call() -> None:
    engine = ScriptedEngine(fail_step=True)
    loop = EngineLoop(engine)

    async def main() -> None:
        (queue,) = await loop.add([("a", {"prompt_token_ids": [1]})], PARAMS)
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(loop, "a", queue)
        loop.thread.join(timeout=10)
        assert not loop.alive
        with pytest.raises(EngineDeadError):
            await loop.add([("b", {"prompt_token_ids": [1]})], PARAMS)
        assert (await loop.stats())["num_running"] == 0  # aborted when the loop stopped; read directly now

    asyncio.run(main())


def test_abort_from_a_cancelled_add_leaves_nothing() -> None:
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    loop = EngineLoop(engine)

    async def main() -> None:
        await loop.add([("a", {"prompt_token_ids": [1]})], PARAMS)
        assert await asyncio.to_thread(engine.in_step.wait, 10)
        task = asyncio.create_task(loop.add([("b", {"prompt_token_ids": [1]})], PARAMS))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left while its add waited for the step
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.gate.set()
        for _ in range(200):
            if "b" in engine.aborted and not engine.requests:
                break
            await asyncio.sleep(0.02)
        assert "b" in engine.aborted and not engine.requests

    asyncio.run(main())
    loop.shutdown()


def test_threads_share_steps_and_a_closed_event_loop_does_not_stop_the_engine() -> None:
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    loop = EngineLoop(engine)
    results: dict[str, list[int]] = {}

    def worker(name: str) -> None:
        (queue,) = loop.add_sync([(name, {"prompt_token_ids": [1]})], PARAMS)
        results[name] = [o.outputs[0].token_ids[0] for o in loop.stream_sync(name, queue)]

    first = threading.Thread(target=worker, args=("t0",))
    first.start()
    assert engine.in_step.wait(10)  # t0's step is held: the next three wait for it and then share one step
    others = [threading.Thread(target=worker, args=(f"t{i}",)) for i in (1, 2, 3)]
    for t in others:
        t.start()
    time.sleep(0.2)
    engine.gate.set()
    for t in [first, *others]:
        t.join(timeout=10)
    assert results == {f"t{i}": [7] for i in range(4)}
    assert engine.steps == 2  # t0's, then one for t1..t3 together

    async def leave_early() -> None:  # a caller whose event loop closes with its request still running
        engine.gate.clear()
        await loop.add([("orphan", {"prompt_token_ids": [1]})], PARAMS)

    engine.in_step.clear()
    asyncio.run(leave_early())
    assert engine.in_step.wait(10)
    engine.gate.set()
    for _ in range(200):
        if "orphan" in engine.aborted or not engine.requests:
            break
        time.sleep(0.02)
    assert loop.alive  # delivering to the closed loop dropped that request, not the engine
    (queue,) = loop.add_sync([("after", {"prompt_token_ids": [2]})], PARAMS)
    assert [o.finished for o in loop.stream_sync("after", queue)] == [True]
    loop.shutdown()


def test_shutdown_fails_waiting_streams_and_aborts_their_requests() -> None:
    engine = ScriptedEngine()
    engine.gate = threading.Event()
    loop = EngineLoop(engine)
    (queue,) = loop.add_sync([("a", {"prompt_token_ids": [1]})], PARAMS)
    assert engine.in_step.wait(10)
    stopper = threading.Thread(target=loop.shutdown)
    stopper.start()
    time.sleep(0.05)
    engine.gate.set()  # the step in progress ends; the loop stops after it
    stopper.join(timeout=10)
    # the step finished "a" before the loop stopped, so it got its output; a request added now is refused
    assert [o.finished for o in loop.stream_sync("a", queue)] == [True]
    with pytest.raises(EngineDeadError):
        loop.add_sync([("b", {"prompt_token_ids": [1]})], PARAMS)

    engine = ScriptedEngine()
    engine.finish = False  # its requests never finish: one is still running when the loop stops
    loop = EngineLoop(engine)
    (queue,) = loop.add_sync([("running", {"prompt_token_ids": [1]})], PARAMS)
    outputs = loop.stream_sync("running", queue)
    assert next(outputs).finished is False
    loop.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        for _ in outputs:  # the outputs of the steps before the shutdown, then the error
            pass
    assert "running" in engine.aborted and not engine.requests


def test_the_queue_limit_counts_every_prompt_of_a_request() -> None:
    loop = EngineLoop(ScriptedEngine(), max_waiting_requests=3)

    async def main() -> None:
        with pytest.raises(QueueFullError, match="0 requests are waiting and 4 more"):
            await loop.add([(f"r{i}", {"prompt_token_ids": [1]}) for i in range(4)], PARAMS)

    asyncio.run(main())
    loop.shutdown()
