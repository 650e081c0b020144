"""Grammar compiles in worker processes, each of which can be abandoned.

A compile inside xgrammar cannot be interrupted, so the only way to give one up (its time budget spent, its
requester gone) is to end the process running it: each worker is a process of its own, killed and replaced when
its compile is abandoned. Workers run at a lower CPU priority (``nice``) and compile on one thread each, so
compiles take the cores the engine and the event loop leave. The server's side of a compile runs on threads of
the pool's priority too: they wait on the pipe and turn the answer back into a grammar, which for a large enum
is large and takes a core for a while (the GIL released), time the engine's thread must not share at equal
weight. At most ``workers`` compiles run and ``max_queued`` more wait; past that ``CompileQueueFull``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

from paged_backend.config import FieldError

if TYPE_CHECKING:
    import xgrammar

    from paged_backend.structured_output.grammar import GrammarKey

logger = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_NICENESS = 10  # the default: large grammars' workers take the cores the engine leaves
_READY_TIMEOUT_S = 120.0  # a worker's start, the fork server's own included (it imports xgrammar and torch)


class CompileQueueFull(RuntimeError):
    """More grammar compiles wait than the pool's queue holds (the server answers 429)."""


class CompileUnavailable(RuntimeError):
    """No worker could run the compile: the server is shutting down, or the worker ended before it answered
    (the server answers 503; the next compile gets a fresh worker)."""


class CompileTimeout(FieldError):
    """A compile ran past the pool's time budget and was abandoned."""


def _serve(conn: Connection, tokenizer_info: str, niceness: int) -> None:
    """A worker's loop: compile each key sent, answer with the grammar serialized or xgrammar's refusal."""
    os.nice(niceness)
    import xgrammar as xgr

    from paged_backend.structured_output.grammar import build

    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json(tokenizer_info), max_threads=1, cache_enabled=False
    )
    try:
        conn.send(("ready", ""))
    except OSError:  # the server went away while this worker started
        return
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = ("ok", build(compiler, key).serialize_json())
        except (RuntimeError, ValueError) as exc:
            answer = ("error", str(exc))
        try:
            conn.send(answer)
        except OSError:  # the server went away meanwhile
            return


def _lower_priority(niceness: int) -> None:
    """Lower the calling thread's priority (Linux sets ``nice`` per thread; elsewhere it would be the process's)."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def _context() -> Any:
    """Workers fork from a server process of their own (``forkserver``), started once, that has imported xgrammar
    (and the torch it imports) and this process's main module: a new worker is then a fork, not a fresh
    interpreter's seconds of imports (which would run before it lowers its priority), and never a fork of this
    process, which holds CUDA and threads. Each worker runs its main module's body again (multiprocessing does),
    which finds every import it makes already done."""
    context = multiprocessing.get_context("forkserver")
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    preload = ["xgrammar", __name__, *([main] if main and not main.endswith("__main__") else [])]
    context.set_forkserver_preload(preload)
    return context


class _Worker:
    def __init__(self, tokenizer_info: str, niceness: int) -> None:
        context = _context()
        self.conn, child = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child, tokenizer_info, niceness), name="paged-backend-grammar", daemon=True
        )
        self.process.start()
        child.close()
        self.ready = False
        self.killed = False

    def run(self, key: GrammarKey) -> tuple[str, str]:
        """Send ``key`` and wait for the answer (on a thread: blocks until it comes or the worker is killed)."""
        self.conn.send(key)
        status, payload = self.conn.recv()
        return str(status), str(payload)

    def wait_ready(self) -> None:
        if not self.ready:
            if not self.conn.poll(_READY_TIMEOUT_S):
                raise RuntimeError(f"a grammar compile worker did not start within {_READY_TIMEOUT_S:g} s")
            self.conn.recv()
            self.ready = True

    def kill(self) -> None:
        """SIGKILL, then reaped on a thread of its own: a process that held a large compile's memory can take a
        second to go, which the event loop must not wait for. Its end of the pipe closes only once it is gone, so
        a thread still reading from it gets the end of the stream, never a closed descriptor under its read."""
        if not self.killed:  # once: a worker killed by ``close`` is killed again by the compile it was running
            self.killed = True
            self.process.kill()
            threading.Thread(target=self._reap, name="paged-backend-grammar-reaper", daemon=True).start()

    def _reap(self) -> None:
        self.process.join(60)
        self.conn.close()


class CompilePool:
    """``workers`` compile processes, started at once; one killed (or found dead) is replaced by the next compile
    that needs it, on a thread (a start is a fork, but its data is pickled)."""

    def __init__(
        self,
        tokenizer_info: xgrammar.TokenizerInfo,
        workers: int,
        timeout_s: float,
        max_queued: int,
        niceness: int = WORKER_NICENESS,
    ) -> None:
        self.tokenizer_info: str = tokenizer_info.serialize_json()
        self.workers, self.timeout_s, self.max_queued, self.niceness = workers, timeout_s, max_queued, niceness
        self.idle: list[_Worker | None] = [
            _Worker(self.tokenizer_info, niceness) for _ in range(workers)
        ]  # None: to start
        self.started = {worker for worker in self.idle if worker is not None}  # idle or busy: what ``close`` kills
        self.pending = 0  # compiles running or waiting for a worker
        self.slots: asyncio.Semaphore | None = None  # made on the event loop that first compiles
        self.closed = False
        # a thread per running compile (each waits on its worker's pipe) and as many reading grammars back
        self.threads = ThreadPoolExecutor(
            2 * workers, "paged-backend-grammar", initializer=_lower_priority, initargs=(niceness,)
        )

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    @property
    def busy(self) -> int:
        """Compiles running now."""
        return self.workers - len(self.idle)

    async def compile(self, key: GrammarKey, tokenizer_info: xgrammar.TokenizerInfo) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``key`` (``tokenizer_info``: the engine's, which the grammar is read back
        with); xgrammar's refusal as ``refusal``'s FieldError, ``CompileTimeout`` past the budget, and a
        cancelled caller kills the worker that ran its compile."""
        from paged_backend.structured_output.grammar import refusal, xgrammar_module

        if self.pending >= self.workers + self.max_queued:
            raise CompileQueueFull(f"{self.pending} grammar compiles are running or waiting; try again later")
        self.slots = self.slots or asyncio.Semaphore(self.workers)
        self.pending += 1
        try:
            async with self.slots:
                status, payload = await self._run(key)
        finally:
            self.pending -= 1
        if status == "error":
            raise refusal(key[0], payload)
        return await self._off_loop(xgrammar_module().CompiledGrammar.deserialize_json, payload, tokenizer_info)

    async def _run(self, key: GrammarKey) -> tuple[str, str]:
        if self.closed:
            raise CompileUnavailable("the server is shutting down")
        worker = self.idle.pop()
        done = False
        try:
            if worker is None or worker.process.exitcode is not None:  # killed before, or died while idle
                if worker is not None:
                    worker.kill()
                    self.started.discard(worker)
                worker = await asyncio.to_thread(_Worker, self.tokenizer_info, self.niceness)
                self.started.add(worker)
            await self._off_loop(worker.wait_ready)
            answer = await asyncio.wait_for(self._off_loop(worker.run, key), self.timeout_s)
            done = True
            return answer
        except asyncio.TimeoutError:
            kind = key[0]
            logger.warning("a %s grammar of %d characters compiled past %g s: its worker is killed", kind, len(key[1]),
                           self.timeout_s)  # fmt: skip
            raise CompileTimeout(
                f"structured_outputs.{kind}",
                f"structured_outputs.{kind} took longer than {self.timeout_s:g} s to compile (the server's "
                "--grammar-compile-timeout); a smaller schema, fewer choices or a simpler pattern compiles faster",
            ) from None
        except (EOFError, OSError):  # after TimeoutError, an OSError too
            raise CompileUnavailable("the grammar compile worker ended before it answered; try again") from None
        finally:
            if done:
                self.idle.append(worker)
            else:  # abandoned (timed out, cancelled, or the worker died): its process goes, the next compile forks
                if worker is not None:
                    worker.kill()
                    self.started.discard(worker)
                self.idle.append(None)

    def close(self) -> None:
        """Kill every worker, busy or not: nothing waits on a compile to stop."""
        self.closed = True
        for worker in self.started:
            worker.kill()
        self.idle, self.started = [], set()
        self.threads.shutdown(wait=False)
