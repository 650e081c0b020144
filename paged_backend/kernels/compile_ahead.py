"""Triton kernels compiled ahead, several at once, before the CUDA graphs' warm-ups need them.

The int4 kernels are specialized per launch shape (rows in a GEMV program, split of K, the packed row stride of
each fused projection), so the graphs' buckets need a dozen or more of them, and each first launch compiles for
seconds (Triton's MLIR passes), one after another: on a fresh machine that, not the capture, was most of an int4
engine's start. Under ``compiling_ahead`` a kernel launched through ``launch`` hands its compile to a thread
pool instead (the passes release the GIL, so they run side by side) and launches nothing; a pass of forwards over
every bucket under it (``worker/cuda_graphs.capture_buckets``) submits them all, whatever outputs it computes are
garbage, and the real warm-ups then find every kernel in Triton's cache. Compiles of one specialization are
submitted once: Triton specializes an integer on being 1 or a multiple of 16 and a pointer on 16-byte alignment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Protocol

import torch


class Compilable(Protocol):
    """A Triton kernel: launched as ``kernel[grid](*args, **constexprs)``, compiled alone by ``warmup``."""

    def __getitem__(self, grid: Any) -> Callable[..., object]: ...

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> object: ...


class _Ahead:
    def __init__(self, pool: ThreadPoolExecutor, device: torch.device) -> None:
        self.pool, self.device = pool, device
        self.compiles: dict[tuple[Any, ...], Future[object]] = {}

    def submit(self, kernel: Compilable, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        key = (id(kernel), *map(_specialized, args), *sorted(kwargs.items()))
        if key not in self.compiles:
            self.compiles[key] = self.pool.submit(self._compile, kernel, grid, args, kwargs)

    def _compile(self, kernel: Compilable, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        if self.device.type != "cuda":
            return kernel.warmup(*args, grid=grid, **kwargs)
        with torch.cuda.device(self.device):  # the engine's, which a new thread's current device need not be
            return kernel.warmup(*args, grid=grid, **kwargs)


def _specialized(arg: Any) -> Any:
    """What of ``arg`` a compiled specialization depends on."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return 1 if arg == 1 else 16 if arg % 16 == 0 else 0
    return arg


_ACTIVE: ContextVar[_Ahead | None] = ContextVar("compile_ahead", default=None)


def deferring() -> bool:
    """Whether launches are compiles only (their outputs are not computed)."""
    return _ACTIVE.get() is not None


def launch(kernel: Compilable, grid: Any) -> Callable[..., object]:
    """``kernel[grid]``, or under ``compiling_ahead`` a call that submits its compile and launches nothing."""
    ahead = _ACTIVE.get()
    if ahead is None:
        return kernel[grid]
    return lambda *args, **kwargs: ahead.submit(kernel, grid, args, kwargs)


@contextlib.contextmanager
def compiling_ahead(device: torch.device, workers: int | None = None) -> Iterator[_Ahead]:
    """Launches through ``launch`` inside are compiles in a pool of ``workers`` threads (one a core by default);
    on leaving, every compile has finished (the first failure raised). Yields the pool's submissions
    (``compiles``: none when nothing run inside takes part)."""
    if device.type == "cuda" and device.index is None:  # a pool thread's current device is the first one
        device = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        ahead = _Ahead(pool, device)
        token = _ACTIVE.set(ahead)
        try:
            yield ahead
        finally:
            _ACTIVE.reset(token)
        for compiled in ahead.compiles.values():
            compiled.result()
