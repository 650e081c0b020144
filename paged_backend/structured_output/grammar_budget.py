"""What one request's output grammar may cost a server: caps checked before anything compiles, then a compile in
a worker process under a time budget (``compile_pool.py``), whose result joins the engine's compiled grammars.

The caps bound what makes compiles slow or large: the text of a schema, pattern or grammar (``max_bytes``), the
values its enums and choices list (``max_choices``: an enum of thousands of strings compiles for seconds), and
a regex's length (``max_regex_length``: repetition counts and alternations multiply its automaton). A request
over one is refused with a 400 naming the field, the cap and the server flag that sets it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_backend.config import FieldError, check_float, check_int
from paged_backend.sampling_params import StructuredOutputsParams
from paged_backend.structured_output.grammar import grammar_key

if TYPE_CHECKING:
    from paged_backend.structured_output.compile_pool import CompilePool
    from paged_backend.structured_output.grammar import GrammarCompiler


SMALL_BYTES = 16 * 1024  # a grammar this small, with few enum or choice values, compiles in milliseconds
SMALL_CHOICES = 256
# A request waits on its small grammar's few milliseconds of compile: that lane runs between the engine's priority
# (nice 0) and the large lane's, so a large compile on the same core does not halve it.
SMALL_NICENESS = 5


def default_compile_workers() -> int:
    """A quarter of the cores this process may use, 1 to 4: compiles never take most of the machine."""
    return min(4, max(1, len(os.sched_getaffinity(0)) // 4))


@dataclass(frozen=True)
class GrammarBudget:
    max_bytes: int = 256 * 1024
    max_choices: int = 8192
    max_regex_length: int = 4096
    compile_timeout_s: float = 20.0
    compile_workers: int = field(default_factory=default_compile_workers)
    max_queued_compiles: int = 64

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "max_regex_length", "compile_workers"):
            check_int(name, getattr(self, name), 1)
        check_int("max_queued_compiles", self.max_queued_compiles, 0)
        check_float("compile_timeout_s", self.compile_timeout_s, 0.0, 86400.0, low_open=True)

    def check(self, params: StructuredOutputsParams) -> tuple[int, int]:
        """``params``' size in bytes and its enum or choice values, or a FieldError naming
        ``structured_outputs.<kind>`` if they pass a cap."""
        kind = params.kind
        if kind == "json_object":
            return 0, 0
        name = f"structured_outputs.{kind}"
        value: Any = getattr(params, kind)
        text = grammar_key(params)[1]  # the text the compile reads (written once per params)
        size = len(text.encode())
        if size > self.max_bytes:
            raise FieldError(name, f"{name} is {size} bytes; this server compiles at most {self.max_bytes} "
                                   "(--max-grammar-bytes)")  # fmt: skip
        choices, pattern = schema_counts(value) if kind == "json" else (len(value) if kind == "choice" else 0, 0)
        if choices > self.max_choices:
            raise FieldError(name, f"{name} lists {choices} enum or choice values; this server compiles at most "
                                   f"{self.max_choices} (--max-grammar-choices)")  # fmt: skip
        regex = len(text) if kind == "regex" else pattern
        if regex > self.max_regex_length:
            what = "is" if kind == "regex" else "has a `pattern` (or `patternProperties` key)"
            raise FieldError(name, f"{name} {what} {regex} characters long; this server compiles at most "
                                   f"{self.max_regex_length} (--max-grammar-regex-length)")  # fmt: skip
        return size, choices


def schema_counts(schema: Any) -> tuple[int, int]:
    """How many values the ``enum`` lists of a JSON schema (text or object) hold together, and the length of its
    longest regular expression (a ``pattern``, or a ``patternProperties`` key), walked iteratively."""
    if isinstance(schema, str):
        schema = json.loads(schema)  # already checked to parse, and to nest no deeper than json_limits allows
    count, longest, stack = 0, 0, [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            enum, pattern, keyed = item.get("enum"), item.get("pattern"), item.get("patternProperties")
            count += len(enum) if isinstance(enum, list) else 0
            longest = max(longest, len(pattern) if isinstance(pattern, str) else 0)
            longest = max(longest, *map(len, keyed)) if isinstance(keyed, dict) and keyed else longest
            stack.extend(v for k, v in item.items() if k != "enum")
        elif isinstance(item, list):
            stack.extend(item)
    return count, longest


class GrammarService:
    """The server's way to a request's grammars: caps, then the engine's compiled grammar or a compile in a worker
    process. Two lanes of workers: one for small grammars (``SMALL_BYTES``, ``SMALL_CHOICES``), which compile in
    milliseconds, at a higher priority than the rest (``SMALL_NICENESS``), and ``compile_workers`` for the rest, so
    a small schema never waits behind a large one.
    ``compiler`` builds the engine's ``GrammarCompiler``; ``start`` makes it and the workers on a thread, so
    that the first structured request does not wait for processes to start."""

    def __init__(self, budget: GrammarBudget, compiler: Callable[[], GrammarCompiler]) -> None:
        self.budget = budget
        self._compiler_factory = compiler
        self._made: asyncio.Future[tuple[GrammarCompiler, CompilePool, CompilePool]] | None = None
        self.lanes: tuple[CompilePool, CompilePool] | None = None  # small, large
        self.closed = False

    def start(self) -> None:
        """Begin making the compiler and the workers (on the running event loop's executor)."""
        if self._made is None:
            self._made = asyncio.ensure_future(asyncio.to_thread(self._make))

    def _make(self) -> tuple[GrammarCompiler, CompilePool, CompilePool]:
        from paged_backend.structured_output.compile_pool import CompilePool

        compiler, budget = self._compiler_factory(), self.budget
        timeout, queued = budget.compile_timeout_s, budget.max_queued_compiles
        small = CompilePool(compiler.info, 1, timeout, queued, niceness=SMALL_NICENESS)
        large = CompilePool(compiler.info, budget.compile_workers, timeout, queued)
        self.lanes = (small, large)
        if self.closed:  # closed while they started
            self.close()
        return compiler, small, large

    async def prepare(self, grammars: list[StructuredOutputsParams]) -> None:
        """Check and compile each grammar (in a worker process) unless the engine has it: the engine's own
        compile, when it adds the request, then finds it."""
        from paged_backend.structured_output.grammar import grammar_key

        # on a thread: a large schema's walk and its text take milliseconds the event loop must not wait
        sizes = await asyncio.to_thread(lambda: [self.budget.check(params) for params in grammars])
        keys = [grammar_key(params) for params in grammars]  # made by the check
        if self.closed:
            raise RuntimeError("the server is shutting down")
        made = self._made
        if made is not None and made.done() and (made.cancelled() or made.exception() is not None):
            self._made = None  # the last start failed: try again rather than fail every request after it
        self.start()
        assert self._made is not None
        compiler, small, large = await asyncio.shield(self._made)
        for key, (size, choices) in zip(keys, sizes):
            if compiler.kept(key) is None:
                lane = small if size <= SMALL_BYTES and choices <= SMALL_CHOICES else large
                compiler.store(key, await lane.compile(key, compiler.info))

    def close(self) -> None:
        """Kill every compile worker (a shutdown never waits on a compile)."""
        self.closed = True
        for pool in self.lanes or ():
            pool.close()
